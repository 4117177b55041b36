"""The GGML encoders (float rows -> packed blocks, as ggml's reference quantizers write them).

* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16 (and F32): byte for byte equal to gguf-py's
  ``gguf.quants.quantize``, which follows ggml's reference quantizers operation for operation.
* The K-quants (gguf-py has no encoder for them): the round trip through gguf-py's dequantization is
  as accurate as the format allows (bounds below), every block's float16 scales are finite, encoding
  is deterministic. Byte-for-byte equality with llama.cpp's own quantizers is checked by
  ``scripts/check_ggml_encoders.py``, which compiles them (it needs a llama.cpp source tree).
"""

import gguf
import mlx.core as mx
import numpy as np
import pytest

from metalnn import ggml
from metalnn.ggml.base import seq_sum

EXACT = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32"]
KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]

#: Root-mean-square error of ``dequantize(encode(x))`` on rows of standard normal values, as a
#: fraction of the rows' standard deviation. A uniform grid of step ``D`` leaves an RMS error of
#: ``D / sqrt(12) = 0.289 D``; the step each format reaches on normal values gives the expected figure,
#: and the bound is the figure measured on 256 rows of 4096 values (seed 1, in parentheses) plus
#: about 5% (the test's 48 rows move the figure by well under 1%):
#:
#: * Q8_0: ``D = amax / 127``, amax of 32 normal values about 2.5: 0.0057 (0.00535).
#: * Q4_0: ``D = amax / 8``: 0.090 (0.0859). Q5_0: ``amax / 16``: 0.045 (0.0426).
#: * Q4_1: ``D = range / 15``, the range of 32 normal values about 4.1: 0.079 (0.0782).
#:   Q5_1: ``range / 31``: 0.038 (0.0378).
#: * Q4_K: Q4_1's grid over 32 values, its scale and minimum 6-bit multiples of float16 block scales
#:   (a relative error under 1/126), and a weighted search of 22 grids that clips the extremes:
#:   below Q4_1's 0.079 (0.0713), bound 0.075.
#: * Q5_K: likewise below Q5_1's 0.038 (0.0361), bound 0.038.
#: * Q6_K: symmetric 6-bit grid over 16 values, ``D ~ amax / 32`` with amax of 16 about 2.0: 0.018
#:   (0.0177), bound 0.0186.
#: * Q3_K: symmetric 3-bit grid (-4..3) over 16 values, ``D ~ amax / 4``: 0.15 (0.1508), bound 0.158.
#: * Q2_K: affine 2-bit grid over 16 values, ``D ~ range / 3`` with a range about 3.5: 0.34 before the
#:   search that clips outliers (0.2963), bound 0.311.
#: * F16: 11 significant bits (0.00021), bound 0.00023; BF16: 8 (0.00166), bound 0.00175.
RMSE_BOUND = {"Q8_0": 0.0057, "Q4_0": 0.090, "Q5_0": 0.045, "Q4_1": 0.082, "Q5_1": 0.040,
              "Q4_K": 0.075, "Q5_K": 0.038, "Q6_K": 0.0186, "Q3_K": 0.158, "Q2_K": 0.311,
              "F16": 0.00023, "BF16": 0.00175}

#: byte offsets of the float16 scale fields of each K-quant block
SCALE_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def awkward_rows(rng, cols=1024):
    """Rows that reach the encoders' corners: normal values of widely different scales, a zero row,
    constant rows, rows with zero / constant / outlier blocks, values on a coarse grid (ties)."""
    rows = [rng.normal(size=cols) * s for s in (1.0, 0.02, 1e-3, 1e-5, 300.0)]
    rows += [np.zeros(cols), np.full(cols, 0.75), np.full(cols, -2.5e-3),
             np.abs(rng.normal(size=cols)), -np.abs(rng.normal(size=cols)) - 1,
             np.round(rng.normal(size=cols) * 4) / 4, rng.standard_t(2, size=cols)]
    mixed = rng.normal(size=cols)
    mixed[:32] = 0
    mixed[64:96] = 1.5
    mixed[300] = 400.0
    mixed[512:768] = 0
    mixed[800:816] *= 1e-6
    rows.append(mixed)
    return np.stack(rows).astype(np.float32)


def gguf_dequantize(qtype, data):
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])


@pytest.mark.parametrize("qtype", EXACT)
def test_encoders_equal_gguf_py_byte_for_byte(qtype):
    rng = np.random.default_rng(sum(map(ord, qtype)))
    x = np.concatenate([awkward_rows(rng), (rng.normal(size=(8, 1024)) * 1e30).astype(np.float32),
                        (rng.normal(size=(8, 1024)) * 1e-30).astype(np.float32)])
    got = ggml.get_type(qtype).encode(x)
    with np.errstate(over="ignore"):  # gguf-py casts 1e30-sized scales to float16: infinity, as ggml
        want = gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(got, want.view(np.uint8).reshape(got.shape))


@pytest.mark.parametrize("qtype", sorted(RMSE_BOUND))
def test_round_trip_error_is_within_the_formats_bound(qtype):
    rng = np.random.default_rng(1)
    scale = rng.lognormal(-2, 1, size=(48, 1)).astype(np.float32)
    x = rng.normal(size=(48, 4096)).astype(np.float32) * scale
    back = gguf_dequantize(qtype, ggml.get_type(qtype).encode(x))
    rmse = np.sqrt(np.mean(((back - x) / scale) ** 2))
    assert rmse <= RMSE_BOUND[qtype], f"{qtype}: relative RMSE {rmse:.5f} > {RMSE_BOUND[qtype]}"


def test_k_quants_beat_the_legacy_types_of_as_many_bits():
    """Q4_K (4.5 bits a value) and Q5_K (5.5) fit better than Q4_1 (5) and Q5_1 (6): the search over
    grids, not only the format, is at work."""
    x = np.random.default_rng(2).normal(size=(32, 4096)).astype(np.float32)

    def rmse(qtype):
        return np.sqrt(np.mean((gguf_dequantize(qtype, ggml.get_type(qtype).encode(x)) - x) ** 2))

    assert rmse("Q4_K") < 0.95 * rmse("Q4_1")
    assert rmse("Q5_K") < 0.98 * rmse("Q5_1")


@pytest.mark.parametrize("qtype", KQUANTS)
def test_k_quant_blocks_have_finite_scales_and_decode_sensibly(qtype):
    cls = ggml.get_type(qtype)
    rng = np.random.default_rng(3)
    x = np.concatenate([awkward_rows(rng), rng.normal(size=(4, 1024)).astype(np.float32) * 1e4])
    data = cls.encode(x)
    blocks = data.reshape(-1, cls.type_size)
    for offset in SCALE_FIELDS[qtype]:
        assert np.isfinite(blocks[:, offset:offset + 2].copy().view(np.float16)).all()
    back = gguf_dequantize(qtype, data)
    assert np.isfinite(back).all()
    np.testing.assert_array_equal(back[5], 0.0)  # the zero row
    for row in range(len(x)):  # every row: error well under the row's spread
        spread = np.abs(x[row]).max()
        if row == 3:
            # values of 1e-5: the block scale d = (sub-block scale) / 63 is below float16's smallest
            # step (6e-8), so the format cannot hold them (llama.cpp writes the same bytes)
            continue
        if spread:
            assert np.abs(back[row] - x[row]).max() <= 0.75 * spread, (qtype, row)


@pytest.mark.parametrize("qtype", KQUANTS + EXACT)
def test_encode_is_deterministic_and_blockwise(qtype):
    """The same bytes again, on any number of threads, and row by row as for the whole matrix."""
    cls = ggml.get_type(qtype)
    x = awkward_rows(np.random.default_rng(4), cols=2048)[:12]
    first = cls.encode(x, threads=1)
    np.testing.assert_array_equal(cls.encode(x, threads=3), first)
    np.testing.assert_array_equal(np.stack([cls.encode(row) for row in x]), first)
    np.testing.assert_array_equal(cls.encode(x.reshape(2, -1, 2048)), first.reshape(2, -1, first.shape[-1]))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1", "F16", "BF16", "F32"])
def test_encoding_a_decoded_row_gives_the_same_bytes(qtype):
    """Where ggml's algorithm guarantees it. Q4_0 / Q5_0: the decoded value of largest magnitude is
    exactly ``-8 d`` (``-16 d``), so the new ``d`` is the stored one and every ``q`` comes back (off by
    a relative 2**-23 before a truncation half a step away). Q8_0: the largest magnitude is ``127 d``,
    a product exact in float32. Q4_1 / Q5_1: the new ``d`` is the stored one to float32 rounding of
    ``15 d + m`` (``31 d + m``), which float16 rounds back while the block's range is not tiny next to
    its minimum (true of the zero-mean rows here; a block of values ``1000 +- 0.01`` would not keep
    its ``d``). The floats: exact. The K-quants are left out: their search weighs values by their own
    magnitude and can settle on another grid for the decoded values (measured on normal rows: Q4_K
    99.9% of blocks the same, Q2_K 99.1%, Q5_K 93%, Q6_K 82%, Q3_K 54%)."""
    cls = ggml.get_type(qtype)
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(size=(16, 1024)) * rng.lognormal(-3, 2, size=(16, 1)),
                        np.zeros((1, 1024))]).astype(np.float32)
    first = cls.encode(x)
    again = cls.encode(gguf_dequantize(qtype, first))
    np.testing.assert_array_equal(again, first)


@pytest.mark.parametrize("qtype", KQUANTS + EXACT)
def test_metalnn_decodes_its_own_encoding_as_gguf_py_does(qtype):
    cls = ggml.get_type(qtype)
    data = cls.encode(awkward_rows(np.random.default_rng(6), cols=512))
    got = np.array(cls.decode(mx.array(data)))
    want = gguf_dequantize(qtype, data).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_encode_takes_mlx_arrays_and_any_float_dtype():
    x = np.random.default_rng(7).normal(size=(3, 256)).astype(np.float32)
    want = ggml.get_type("Q4_K").encode(x)
    np.testing.assert_array_equal(ggml.get_type("Q4_K").encode(mx.array(x)), want)
    np.testing.assert_array_equal(ggml.get_type("Q4_K").encode(x.astype(np.float64)), want)
    as_bf16 = mx.array(x).astype(mx.bfloat16)
    np.testing.assert_array_equal(ggml.get_type("Q8_0").encode(as_bf16),
                                  ggml.get_type("Q8_0").encode(np.array(as_bf16.astype(mx.float32))))
    assert ggml.get_type("Q6_K").encode(x[0]).shape == (210,)


def test_encode_errors_are_clear():
    q4k = ggml.get_type("Q4_K")
    with pytest.raises(ValueError, match="Q4_K.encode: 100 values per row is not a whole number of 256-"):
        q4k.encode(np.zeros((2, 100), np.float32))
    with pytest.raises(TypeError, match="Q4_K.encode: values must be floating point, got int32"):
        q4k.encode(np.zeros((2, 256), np.int32))
    with pytest.raises(TypeError, match="must be floating point"):
        q4k.encode(mx.zeros((2, 256), dtype=mx.int32))
    bad = np.zeros((2, 256), np.float32)
    bad[1, 7] = np.nan
    with pytest.raises(ValueError, match="Q4_K.encode: the values hold NaN or infinity"):
        q4k.encode(bad)
    bad[1, 7] = np.inf
    with pytest.raises(ValueError, match="NaN or infinity"):
        ggml.get_type("Q8_0").encode(bad)
    # the float types store what they are given
    assert ggml.get_type("F16").encode(bad)[1, 14:16].view(np.float16)[0] == np.inf
    with pytest.raises(NotImplementedError, match="IQ2_XXS: no encoder .*Q4_K.*Q8_0"):
        ggml.get_type("IQ2_XXS").encode(np.zeros(256, np.float32))
    assert set(ggml.base.encodable_types()) == set(KQUANTS + EXACT)


def test_sums_add_one_term_after_another():
    """The encoders' sums must round as ggml's ``s += t`` loops do, not pairwise."""
    rng = np.random.default_rng(8)
    terms = (rng.normal(size=(32, 4096)) * rng.lognormal(0, 6, size=(32, 1))).astype(np.float32)
    for start in (None, 0.0):
        total = terms[0].copy() if start is None else np.zeros(4096, np.float32)
        for t in terms[1:] if start is None else terms:
            total += t
        np.testing.assert_array_equal(seq_sum(terms, start).view(np.uint32), total.view(np.uint32))
        strided = seq_sum(terms[:, ::2], start)  # not contiguous: the explicit loop
        np.testing.assert_array_equal(strided.view(np.uint32), total[::2].view(np.uint32))
