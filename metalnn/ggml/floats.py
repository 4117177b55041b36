"""The float tensor types: F32, F16 and BF16 (one value a block)."""

from __future__ import annotations

import mlx.core as mx

from .base import GGMLType


class F32(GGMLType, type_id=0, block_size=1, type_size=4):
    """IEEE float32, little-endian."""

    @classmethod
    def decode_blocks(cls, blocks):
        return mx.view(blocks, mx.float32)


class F16(GGMLType, type_id=1, block_size=1, type_size=2):
    """IEEE float16, little-endian."""

    @classmethod
    def decode_blocks(cls, blocks):
        return mx.view(blocks, mx.float16).astype(mx.float32)


class BF16(GGMLType, type_id=30, block_size=1, type_size=2):
    """bfloat16: the upper half of a float32."""

    @classmethod
    def decode_blocks(cls, blocks):
        return mx.view(blocks, mx.bfloat16).astype(mx.float32)
