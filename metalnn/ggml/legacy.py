"""ggml's first block formats: 32 values a block, one float16 scale (and a float16 minimum for the
``_1`` types), 4, 5 or 8 bits a value (``block_q4_0`` ... ``block_q8_0`` in ``ggml-common.h``).

Layouts (bytes):

* Q4_0 (18): ``d`` f16, ``qs[16]`` (value ``j`` in the low nibble of byte ``j``, ``j + 16`` in its high
  nibble); ``x = d * (q - 8)``.
* Q4_1 (20): ``d`` f16, ``m`` f16, ``qs[16]``; ``x = d * q + m``.
* Q5_0 (22): ``d`` f16, ``qh`` u32 (bit ``j``: the fifth bit of value ``j``), ``qs[16]``; ``x = d * (q - 16)``.
* Q5_1 (24): ``d`` f16, ``m`` f16, ``qh`` u32, ``qs[16]``; ``x = d * q + m``.
* Q8_0 (34): ``d`` f16, ``qs[32]`` int8; ``x = d * q``.
"""

from __future__ import annotations

import mlx.core as mx

from .base import GGMLType, f16, i8s, nibbles, u8s, u32s

_BIT = mx.arange(32, dtype=mx.uint32)


def _fifth_bits(blocks, offset):
    """``[n, 32]``: bit ``j`` of the little-endian u32 at ``offset``, moved to bit 4."""
    return ((u32s(blocks, offset, 1) >> _BIT) & 1) << 4


class Q4_0(GGMLType, type_id=2, block_size=32, type_size=18):
    @classmethod
    def decode_blocks(cls, blocks):
        q = nibbles(u8s(blocks, 2, 16)).astype(mx.float32) - 8
        return f16(blocks, 0) * q


class Q4_1(GGMLType, type_id=3, block_size=32, type_size=20):
    @classmethod
    def decode_blocks(cls, blocks):
        q = nibbles(u8s(blocks, 4, 16)).astype(mx.float32)
        return f16(blocks, 0) * q + f16(blocks, 2)


class Q5_0(GGMLType, type_id=6, block_size=32, type_size=22):
    @classmethod
    def decode_blocks(cls, blocks):
        q = (nibbles(u8s(blocks, 6, 16)) | _fifth_bits(blocks, 2)).astype(mx.float32) - 16
        return f16(blocks, 0) * q


class Q5_1(GGMLType, type_id=7, block_size=32, type_size=24):
    @classmethod
    def decode_blocks(cls, blocks):
        q = (nibbles(u8s(blocks, 8, 16)) | _fifth_bits(blocks, 4)).astype(mx.float32)
        return f16(blocks, 0) * q + f16(blocks, 2)


class Q8_0(GGMLType, type_id=8, block_size=32, type_size=34):
    @classmethod
    def decode_blocks(cls, blocks):
        return i8s(blocks, 2, 32) * f16(blocks, 0)
