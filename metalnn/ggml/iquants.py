"""ggml's codebook i-quants: super-blocks of 256 values in which a group of 8 (or 4) values is the index
of a point in a fixed grid (`metalnn.ggml.grids`), with signs and a scale per 16 or 32 values
(``block_iq2_xxs`` ... ``block_iq1_m`` in ``ggml-common.h``, ``dequantize_row_iq*`` in ``ggml-quants.c``).

Layouts (bytes; ``d`` is a float16, multi-byte fields little-endian; ``grid[i]`` is point ``i`` of the
type's grid; ``s`` a sub-block's 4-bit (IQ1: 3-bit) scale; ``sign`` is -1 where the value's sign bit is
set, else 1; a sign index ``k`` means the 8 sign bits ``ksigns_iq2xs[k]``):

* IQ2_XXS (66): ``d``, then 8 x 8 bytes, one per 32 values: 4 bytes (indices into the 256-point
  ``iq2xxs_grid``, 8 values each), then a u32 holding four 7-bit sign indices (bits ``7l .. 7l+6`` for
  group ``l``) and ``s`` (bits 28-31); ``x = d * (0.5 + s) * 0.25 * grid * sign``.
* IQ2_XS (74): ``d``, ``qs[32]`` u16 (bits 0-8: index into the 512-point ``iq2xs_grid``; bits 9-15: sign
  index), ``scales[8]`` (per 32 values, low nibble: ``s`` of its first 16, high nibble: of its last 16);
  ``x = d * (0.5 + s) * 0.25 * grid * sign``.
* IQ2_S (82): ``d``, ``qs[32]`` (low 8 bits of indices into the 1024-point ``iq2s_grid``), ``signs[32]``
  (bit ``j`` of byte ``g``: value ``j`` of group ``g``), ``qh[8]`` (bits ``2l, 2l+1`` of ``qh[b]``: bits 8, 9
  of group ``4b + l``'s index), ``scales[8]`` as IQ2_XS; ``x = d * (0.5 + s) * 0.25 * grid * sign``.
* IQ3_XXS (98): ``d``, ``qs[64]`` (indices into the 256-point, 4-value ``iq3xxs_grid``), then 8 u32, one
  per 32 values, as IQ2_XXS's (four 7-bit sign indices, ``s`` in bits 28-31);
  ``x = d * (0.5 + s) * 0.5 * grid * sign``.
* IQ3_S (110): ``d``, ``qs[64]`` (low 8 bits of indices into the 512-point, 4-value ``iq3s_grid``),
  ``qh[8]`` (bit ``k`` of ``qh[b]``: bit 8 of index ``8b + k``), ``signs[32]`` (one bit a value, in
  order), ``scales[4]`` (per 64 values, low nibble: ``s`` of its first 32, high nibble: of its last 32);
  ``x = d * (1 + 2s) * grid * sign``.
* IQ1_S (50): ``d``, ``qs[32]`` (low 8 bits of indices into the 2048-point ``iq1s_grid``, values -1, 0, 1),
  ``qh[8]`` u16, one per 32 values (bits ``3l .. 3l+2``: bits 8-10 of group ``l``'s index; bits 12-14: ``s``;
  bit 15: the sign of ``delta``); ``x = d * (2s + 1) * (grid + delta)``, ``delta = +-IQ1S_DELTA``.
* IQ1_M (56): ``qs[32]`` as IQ1_S, ``qh[16]`` (a nibble per group of 8, low nibble first: bits 0-2: bits
  8-10 of the index; bit 3: the sign of ``delta``), ``scales[4]`` u16 (bits ``3k .. 3k+2`` of ``scales[m]``:
  ``s`` of the 16 values ``4m + k``; bits 12-15 of the four u16, in order, are the four nibbles, lowest
  first, of the float16 ``d``); ``x = d * (2s + 1) * (grid + delta)``, ``delta = +-IQ1M_DELTA``.

The products are rounded as ggml's reference rounds them (the scale first, then scale times grid value;
multiplying by a sign, by 0.5 or 0.25, and adding ``delta`` are exact).
"""

from __future__ import annotations

import mlx.core as mx

from . import grids
from .base import GGMLType, f16, u8s, u16s, u32s

_F32 = mx.float32


def _arange(*shifts):
    return mx.array(shifts, dtype=mx.uint32)


_SIGN_SHIFTS = _arange(0, 7, 14, 21)  # four 7-bit sign indices in a u32
_BITS8 = _arange(*range(8))
_NIBBLE_SHIFTS = _arange(0, 4)


def _bit_signs(packed: mx.array) -> mx.array:
    """``uint32 [n, m]`` bytes -> ``float32 [n, m, 8]``: -1 where bit ``j`` is set, else 1."""
    bits = (packed[..., None] >> _BITS8) & 1
    return 1 - 2 * bits.astype(_F32)


def _ksigns(index: mx.array) -> mx.array:
    """``[...]`` 7-bit sign indices -> ``float32 [..., 8]`` signs (``ksigns_iq2xs``)."""
    return mx.take(grids.as_mlx(grids.ksign_factors), index, axis=0)


def _nibble_pairs(packed: mx.array) -> mx.array:
    """``uint32 [n, m]`` bytes -> ``[n, 2m]``: the low nibble of byte ``b`` at ``2b``, its high one at
    ``2b + 1``."""
    return ((packed[..., None] >> _NIBBLE_SHIFTS) & 0xF).reshape(packed.shape[0], -1)


def _quarter_scale(d: mx.array, s: mx.array) -> mx.array:
    """``d * (0.5 + s) * 0.25`` in float32 (IQ2 types)."""
    return d * (0.5 + s.astype(_F32)) * 0.25


class IQ2_XXS(GGMLType, type_id=16, block_size=256, type_size=66):
    @classmethod
    def decode_blocks(cls, blocks):
        n = blocks.shape[0]
        index = u8s(blocks, 2, 64).reshape(n, 8, 8)[:, :, :4]               # [n, 8, 4]
        aux = u32s(blocks, 2, 16).reshape(n, 8, 2)[:, :, 1]                 # [n, 8]
        db = _quarter_scale(f16(blocks, 0), aux >> 28)                       # [n, 8]
        signs = _ksigns((aux[..., None] >> _SIGN_SHIFTS) & 127)             # [n, 8, 4, 8]
        grid = mx.take(grids.as_mlx(grids.iq2xxs_grid), index, axis=0)     # [n, 8, 4, 8]
        return (db[..., None, None] * grid * signs).reshape(n, 256)


class IQ2_XS(GGMLType, type_id=17, block_size=256, type_size=74):
    @classmethod
    def decode_blocks(cls, blocks):
        n = blocks.shape[0]
        qs = u16s(blocks, 2, 32)                                             # [n, 32]
        db = _quarter_scale(f16(blocks, 0), _nibble_pairs(u8s(blocks, 66, 8)))  # [n, 16]
        grid = mx.take(grids.as_mlx(grids.iq2xs_grid), qs & 511, axis=0)   # [n, 32, 8]
        signs = _ksigns(qs >> 9)                                             # [n, 32, 8]
        return (db.reshape(n, 16, 1, 1) * grid.reshape(n, 16, 2, 8)
                * signs.reshape(n, 16, 2, 8)).reshape(n, 256)


class IQ2_S(GGMLType, type_id=22, block_size=256, type_size=82):
    @classmethod
    def decode_blocks(cls, blocks):
        n = blocks.shape[0]
        high = (u8s(blocks, 66, 8)[..., None] >> _arange(0, 2, 4, 6)) & 3   # [n, 8, 4]
        index = u8s(blocks, 2, 32) | (high.reshape(n, 32) << 8)             # [n, 32]
        db = _quarter_scale(f16(blocks, 0), _nibble_pairs(u8s(blocks, 74, 8)))  # [n, 16]
        grid = mx.take(grids.as_mlx(grids.iq2s_grid), index, axis=0)        # [n, 32, 8]
        signs = _bit_signs(u8s(blocks, 34, 32))                             # [n, 32, 8]
        return (db.reshape(n, 16, 1, 1) * grid.reshape(n, 16, 2, 8)
                * signs.reshape(n, 16, 2, 8)).reshape(n, 256)


class IQ3_XXS(GGMLType, type_id=18, block_size=256, type_size=98):
    @classmethod
    def decode_blocks(cls, blocks):
        n = blocks.shape[0]
        aux = u32s(blocks, 66, 8)                                            # [n, 8]
        db = f16(blocks, 0) * (0.5 + (aux >> 28).astype(_F32)) * 0.5         # [n, 8]
        signs = _ksigns((aux[..., None] >> _SIGN_SHIFTS) & 127)             # [n, 8, 4, 8]
        grid = mx.take(grids.as_mlx(grids.iq3xxs_grid), u8s(blocks, 2, 64), axis=0)  # [n, 64, 4]
        return (db[..., None, None] * grid.reshape(n, 8, 4, 8) * signs).reshape(n, 256)


class IQ3_S(GGMLType, type_id=21, block_size=256, type_size=110):
    @classmethod
    def decode_blocks(cls, blocks):
        n = blocks.shape[0]
        high = (u8s(blocks, 66, 8)[..., None] >> _BITS8) & 1                # [n, 8, 8]
        index = u8s(blocks, 2, 64) | (high.reshape(n, 64) << 8)             # [n, 64]
        s = _nibble_pairs(u8s(blocks, 106, 4))                              # [n, 8]
        db = f16(blocks, 0) * (1 + 2 * s).astype(_F32)                      # [n, 8]
        grid = mx.take(grids.as_mlx(grids.iq3s_grid), index, axis=0)        # [n, 64, 4]
        signs = _bit_signs(u8s(blocks, 74, 32))                             # [n, 32, 8]
        return (db[..., None] * grid.reshape(n, 8, 32) * signs.reshape(n, 8, 32)).reshape(n, 256)


class IQ1_S(GGMLType, type_id=19, block_size=256, type_size=50):
    @classmethod
    def decode_blocks(cls, blocks):
        n = blocks.shape[0]
        qh = u16s(blocks, 34, 8)                                             # [n, 8]
        high = (qh[..., None] >> _arange(0, 3, 6, 9)) & 7                    # [n, 8, 4]
        index = u8s(blocks, 2, 32) | (high.reshape(n, 32) << 8)             # [n, 32]
        dl = f16(blocks, 0) * (2 * ((qh >> 12) & 7) + 1).astype(_F32)       # [n, 8]
        delta = mx.where((qh & 0x8000) != 0, -grids.IQ1S_DELTA, grids.IQ1S_DELTA).astype(_F32)
        grid = mx.take(grids.as_mlx(grids.iq1s_grid), index, axis=0)        # [n, 32, 8]
        return (dl[..., None] * (grid.reshape(n, 8, 32) + delta[..., None])).reshape(n, 256)


def iq1m_scale_bits(scales: mx.array) -> mx.array:
    """IQ1_M's float16 ``d`` as its bits, ``uint32 [n, 1]``, from the block's four u16 ``scales``
    (``uint32 [n, 4]``): bits 12-15 of ``scales[m]`` are bits ``4m .. 4m+3`` of ``d``."""
    return ((scales >> 12) << _arange(0, 4, 8, 12)).sum(axis=-1, keepdims=True)


class IQ1_M(GGMLType, type_id=29, block_size=256, type_size=56):
    @classmethod
    def decode_blocks(cls, blocks):
        n = blocks.shape[0]
        sc = u16s(blocks, 48, 4)                                             # [n, 4]
        d = mx.view(iq1m_scale_bits(sc).astype(mx.uint16), mx.float16).astype(_F32)  # [n, 1]
        s = ((sc[..., None] >> _arange(0, 3, 6, 9)) & 7).reshape(n, 16)     # [n, 16]
        dl = d * (2 * s + 1).astype(_F32)                                    # [n, 16]
        h = _nibble_pairs(u8s(blocks, 32, 16))                              # [n, 32]
        index = u8s(blocks, 0, 32) | ((h & 7) << 8)                          # [n, 32]
        delta = mx.where((h & 8) != 0, -grids.IQ1M_DELTA, grids.IQ1M_DELTA).astype(_F32)  # [n, 32]
        grid = mx.take(grids.as_mlx(grids.iq1s_grid), index, axis=0)        # [n, 32, 8]
        return (dl.reshape(n, 16, 1, 1) * (grid.reshape(n, 16, 2, 8)
                                             + delta.reshape(n, 16, 2, 1))).reshape(n, 256)
