"""The float tensor types: F32, F16 and BF16 (one value a block).

Encoders: F16 rounds to nearest even (``GGML_FP32_TO_FP16``; beyond the half range, infinity), BF16
keeps the upper half of the float32 rounded to nearest even, NaN made quiet (``GGML_FP32_TO_BF16``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .base import GGMLType, to_f16


class F32(GGMLType, type_id=0, block_size=1, type_size=4):
    """IEEE float32, little-endian."""

    @classmethod
    def decode_blocks(cls, blocks):
        return mx.view(blocks, mx.float32)

    @classmethod
    def encode_blocks(cls, values):
        return np.ascontiguousarray(values, dtype="<f4").view(np.uint8).reshape(-1, 4)


class F16(GGMLType, type_id=1, block_size=1, type_size=2):
    """IEEE float16, little-endian."""

    @classmethod
    def decode_blocks(cls, blocks):
        return mx.view(blocks, mx.float16).astype(mx.float32)

    @classmethod
    def encode_blocks(cls, values):
        return to_f16(values).astype("<u2").view(np.uint8).reshape(-1, 2)


class BF16(GGMLType, type_id=30, block_size=1, type_size=2):
    """bfloat16: the upper half of a float32."""

    @classmethod
    def decode_blocks(cls, blocks):
        return mx.view(blocks, mx.bfloat16).astype(mx.float32)

    @classmethod
    def encode_blocks(cls, values):
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        quiet = (bits >> 16) | 64
        half = np.where((bits & 0x7FFFFFFF) > 0x7F800000, quiet, rounded).astype("<u2")
        return half.view(np.uint8).reshape(-1, 2)
