"""Random valid GGML blocks for the tests: random quantized bytes with finite random scales, for every
type of `metalnn.ggml` (shared by the decoder, layer, reader and kernel tests)."""

import numpy as np

from metalnn import ggml

FLOAT_TYPES = {"F32", "F16", "BF16"}


def random_blocks(qtype, n_blocks, rng):
    """``uint8 [n_blocks, type_size]``: random bytes, with every float16 scale field replaced by a finite
    value of either sign (ggml files hold finite scales; NaN or inf would make "equal" meaningless)."""
    cls = ggml.get_type(qtype)
    if qtype in FLOAT_TYPES:
        dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.float32}[qtype]
        vals = rng.normal(size=n_blocks).astype(dtype)
        raw = vals.view(np.uint8).reshape(n_blocks, -1)
        return raw[:, 2:] if qtype == "BF16" else raw
    data = rng.integers(0, 256, size=(n_blocks, cls.type_size), dtype=np.uint8)
    for offset in SCALE_FIELDS.get(qtype, ()):
        d = (rng.normal(size=n_blocks) * 0.05).astype(np.float16)
        data[:, offset:offset + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    for offset in E8M0_FIELDS.get(qtype, ()):
        data[:, offset] = rng.integers(118, 131, size=n_blocks)  # shared scales 2^-10 .. 2^2
    if qtype in SPLIT_SCALES:
        SPLIT_SCALES[qtype](data, rng)
    return data


#: byte offsets of the float16 fields of each type's block
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,)}
SCALE_FIELDS.update({"IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
                     "IQ1_S": (0,)})
#: byte offsets of the E8M0 shared exponents (a power of two; random ones would overflow the values)
E8M0_FIELDS = {"MXFP4": (0,)}


def _iq1m_finite_scale(data, rng):
    """IQ1_M has no float16 field: its ``d`` is the top nibbles of the four u16 ``scales`` at byte 48
    (nibble ``m`` of ``d`` in bits 12-15 of ``scales[m]``). Put a finite random ``d`` there, keeping the
    3-bit sub-scales below it random."""
    scales = data[:, 48:56].copy().view(np.uint16)
    d = (rng.normal(size=len(data)) * 0.05).astype(np.float16).view(np.uint16)
    for m in range(4):
        scales[:, m] = (scales[:, m] & 0x0FFF) | (((d >> (4 * m)) & 0xF) << 12)
    data[:, 48:56] = scales.view(np.uint8)


#: types whose float16 scale is split across other fields: a function that writes a finite one in place
SPLIT_SCALES = {"IQ1_M": _iq1m_finite_scale}
