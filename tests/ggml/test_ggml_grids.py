"""The i-quant codebooks of `metalnn.ggml.grids` against gguf-py's copies of ggml's tables (its
``grid_hex`` strings and ``ksigns``, decoded by gguf-py itself), and the i-quant decoders on the smallest
input, one block."""

import gguf
import mlx.core as mx
import numpy as np
import pytest

from metalnn import ggml
from metalnn.ggml import grids

GRIDS = {  # our table -> gguf-py's class holding the same grid
    "iq2xxs_grid": ("IQ2_XXS", (256, 8), np.uint8),
    "iq2xs_grid": ("IQ2_XS", (512, 8), np.uint8),
    "iq2s_grid": ("IQ2_S", (1024, 8), np.uint8),
    "iq3xxs_grid": ("IQ3_XXS", (256, 4), np.uint8),
    "iq3s_grid": ("IQ3_S", (512, 4), np.uint8),
    "iq1s_grid": ("IQ1_S", (2048, 8), np.int8),
}
IQUANTS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_grid_equals_gguf_py(name):
    qtype, shape, dtype = GRIDS[name]
    ref = getattr(gguf.quants, qtype)
    ref.init_grid()
    ours = getattr(grids, name)()
    assert ours.shape == shape and ours.dtype == dtype
    np.testing.assert_array_equal(ours.astype(np.float32), ref.grid.reshape(shape))
    assert np.array_equal(grids.as_mlx(getattr(grids, name)), ours.astype(np.float32))


def test_grid_points_are_distinct():
    for name in GRIDS:
        table = getattr(grids, name)()
        assert len(np.unique(table, axis=0)) == len(table), name


def test_sign_tables_equal_ggml():
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
    np.testing.assert_array_equal(grids.ksigns_iq2xs(), ksigns)
    bits = np.unpackbits(ksigns[:, None], axis=1, bitorder="little")
    np.testing.assert_array_equal(grids.ksign_factors(), np.where(bits == 1, -1.0, 1.0).astype(np.float32))
    assert (bits.sum(axis=1) % 2 == 0).all()  # the 8th sign keeps the count of negations even
    assert grids.KMASK_IQ2XS == (1, 2, 4, 8, 16, 32, 64, 128)
    assert grids.IQ1S_DELTA == grids.IQ1M_DELTA == float(gguf.quants.IQ1_S.delta) == 0.125


@pytest.mark.parametrize("qtype", IQUANTS)
def test_one_block_decodes_like_gguf_py(qtype):
    cls = ggml.get_type(qtype)
    data = np.random.default_rng(7).integers(0, 256, size=(1, cls.type_size), dtype=np.uint8)
    if qtype == "IQ1_M":  # d = 0x2E66 (about 0.1), nibbles in bits 12-15 of the four u16 scales
        scales = data[:, 48:56].copy().view(np.uint16)
        scales[:] = (scales & 0x0FFF) | (np.array([0x6, 0x6, 0xE, 0x2], dtype=np.uint16) << 12)
        data[:, 48:56] = scales.view(np.uint8)
    else:
        data[:, 0:2] = np.array([0.1], dtype=np.float16).view(np.uint8)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
    got = np.array(cls.decode(mx.array(data)))
    assert got.shape == (1, 256)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
