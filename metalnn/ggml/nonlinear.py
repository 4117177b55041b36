"""The 4-bit types whose codes index a table of non-uniform values instead of a uniform grid
(``block_iq4_nl``, ``block_iq4_xs`` and ``block_mxfp4`` in ``ggml-common.h``).

Layouts (bytes):

* IQ4_NL (18, 32 values): ``d`` f16, ``qs[16]`` (value ``j`` in the low nibble of byte ``j``, ``j + 16``
  in its high nibble); ``x = d * kvalues_iq4nl[q]``.
* IQ4_XS (136, 256 values): ``d`` f16, ``scales_h`` u16, ``scales_l[4]``, ``qs[128]``. Eight sub-blocks
  of 32 with a 6-bit scale: ``ls = ((scales_l[i / 2] >> 4 (i % 2)) & 0xF) | ((scales_h >> 2i) & 3) << 4``;
  sub-block ``i`` packs its values in ``qs[16 i : 16 i + 16]`` as IQ4_NL does;
  ``x = (d * (ls - 32)) * kvalues_iq4nl[q]``.
* MXFP4 (17, 32 values): ``e`` u8 (an E8M0 exponent), ``qs[16]`` (nibbles as IQ4_NL). A nibble is an FP4
  E2M1 code; ggml's table ``kvalues_mxfp4`` holds twice the E2M1 values (integers), and the exponent is
  read as half its power of two, ``2^(e - 128)`` (``ggml_e8m0_to_fp32_half``; ``e < 2`` gives the
  subnormals ``2^-128`` and ``2^-127``, and ``e = 255`` is ``2^127``, not NaN); ``x = half(e) * kvalues[q]``.
"""

from __future__ import annotations

import mlx.core as mx

from .base import GGMLType, f16, nibbles, u8s, u16s

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

_IQ4NL = mx.array(KVALUES_IQ4NL, dtype=mx.float32)
_MXFP4 = mx.array(KVALUES_MXFP4, dtype=mx.float32)
_NIBBLE = mx.array([0, 4], dtype=mx.uint32)
_SCALE_H_SHIFT = 2 * mx.arange(8, dtype=mx.uint32)


class IQ4_NL(GGMLType, type_id=20, block_size=32, type_size=18):
    @classmethod
    def decode_blocks(cls, blocks):
        return f16(blocks, 0) * mx.take(_IQ4NL, nibbles(u8s(blocks, 2, 16)))


class IQ4_XS(GGMLType, type_id=23, block_size=256, type_size=136):
    @classmethod
    def decode_blocks(cls, blocks):
        low = ((u8s(blocks, 4, 4)[:, :, None] >> _NIBBLE) & 0xF).reshape(-1, 8)
        high = (u16s(blocks, 2, 1) >> _SCALE_H_SHIFT) & 3
        dl = f16(blocks, 0) * ((low | (high << 4)).astype(mx.float32) - 32)
        qs = u8s(blocks, 8, 128).reshape(-1, 8, 16)
        codes = mx.concatenate([qs & 0xF, qs >> 4], axis=-1)
        return (dl[:, :, None] * mx.take(_IQ4NL, codes)).reshape(-1, 256)


class MXFP4(GGMLType, type_id=39, block_size=32, type_size=17):
    @classmethod
    def decode_blocks(cls, blocks):
        e = u8s(blocks, 0, 1)
        bits = mx.where(e < 2, mx.array(0x00200000, dtype=mx.uint32) << e, (e - 1) << 23)
        half = mx.view(bits.astype(mx.uint32), mx.float32)
        return half * mx.take(_MXFP4, nibbles(u8s(blocks, 1, 16)))
