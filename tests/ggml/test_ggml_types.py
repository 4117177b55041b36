"""Every GGML type's decoder against gguf-py's NumPy dequantization (``gguf.quants.dequantize``), on
random valid blocks: random quantized bytes, and finite random half-precision scales. Bit-exact: both
follow ggml's reference formulas in float32, operation for operation, so any difference is a bug."""

import gguf
import mlx.core as mx
import numpy as np
import pytest

from metalnn import ggml
from ggml_blocks import random_blocks  # noqa: F401  (also imported from here by other tests)

@pytest.mark.parametrize("qtype", sorted(ggml.TYPES))
def test_decode_is_bit_exact_with_gguf_py(qtype):
    rng = np.random.default_rng(sum(map(ord, qtype)))
    cls = ggml.get_type(qtype)
    rows, blocks_per_row = 3, 5
    data = random_blocks(qtype, rows * blocks_per_row, rng).reshape(rows, blocks_per_row * cls.type_size)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
    got = np.array(cls.decode(mx.array(data)))
    assert got.shape == want.shape == (rows, blocks_per_row * cls.block_size)
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_every_type_is_registered_once_by_name_and_id():
    for name, cls in ggml.TYPES.items():
        assert ggml.get_type(name) is cls and ggml.get_type(cls.type_id) is cls
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert (cls.block_size, cls.type_size) == (block_size, type_size), name
    with pytest.raises(KeyError, match="unknown GGML type 'Q9_9'"):
        ggml.get_type("Q9_9")


def test_bad_rows_are_refused_with_the_type_named():
    with pytest.raises(ValueError, match="Q8_0: a row of 33 values"):
        ggml.get_type("Q8_0").row_bytes(33)
    with pytest.raises(ValueError, match="Q4_0.decode: 19 bytes per row"):
        ggml.get_type("Q4_0").decode(mx.zeros((2, 19), dtype=mx.uint8))
    with pytest.raises(TypeError, match="must be uint8"):
        ggml.get_type("Q4_0").decode(mx.zeros((2, 18), dtype=mx.int32))


def test_mxfp4_decodes_every_shared_exponent_as_ggml_does():
    """All 256 E8M0 bytes: ggml halves the scale, so 0 and 1 are the subnormals 2^-128 and 2^-127 and 255
    is 2^127 (not NaN); values past float32's range are inf in both."""
    data = np.random.default_rng(39).integers(0, 256, size=(256, 17), dtype=np.uint8)
    data[:, 0] = np.arange(256)
    with np.errstate(over="ignore"):
        want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.MXFP4).astype(np.float32)
    got = np.array(ggml.get_type("MXFP4").decode(mx.array(data)))
    assert (want[:2] != 0).any() and np.isinf(want[-1]).any()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
