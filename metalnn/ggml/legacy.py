"""ggml's first block formats: 32 values a block, one float16 scale (and a float16 minimum for the
``_1`` types), 4, 5 or 8 bits a value (``block_q4_0`` ... ``block_q8_0`` in ``ggml-common.h``).

Layouts (bytes):

* Q4_0 (18): ``d`` f16, ``qs[16]`` (value ``j`` in the low nibble of byte ``j``, ``j + 16`` in its high
  nibble); ``x = d * (q - 8)``.
* Q4_1 (20): ``d`` f16, ``m`` f16, ``qs[16]``; ``x = d * q + m``.
* Q5_0 (22): ``d`` f16, ``qh`` u32 (bit ``j``: the fifth bit of value ``j``), ``qs[16]``; ``x = d * (q - 16)``.
* Q5_1 (24): ``d`` f16, ``m`` f16, ``qh`` u32, ``qs[16]``; ``x = d * q + m``.
* Q8_0 (34): ``d`` f16, ``qs[32]`` int8; ``x = d * q``.

Encoders (``quantize_row_q4_0_ref`` ... ``quantize_row_q8_0_ref``): the ``_0`` types take ``d`` from the
block's value of largest magnitude (``d = max / -8`` for Q4_0, so that value is exactly ``q = 0``;
``max / -16`` for Q5_0; ``amax / 127`` for Q8_0), the ``_1`` types from the range
(``d = (max - min) / (2**bits - 1)``, ``m = min``); a value is ``x / d`` truncated after adding a half
(rounded half away from zero for Q8_0), as C converts a float to a small integer.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .base import (F32, GGMLType, f16, f16_bytes, first_abs_max, i8s, nibbles, pack_nibbles, u8s, u32_bytes,
                   u32s)

_BIT = mx.arange(32, dtype=mx.uint32)


def _fifth_bits(blocks, offset):
    """``[n, 32]``: bit ``j`` of the little-endian u32 at ``offset``, moved to bit 4."""
    return ((u32s(blocks, offset, 1) >> _BIT) & 1) << 4


# -- encoders ---------------------------------------------------------------------------------------

def _c_small_int(f):
    """C's ``(int8_t)f`` / ``(uint8_t)f`` as compiled for x86-64: truncate toward zero to 32 bits
    (the "integer indefinite" ``INT_MIN`` for NaN and out-of-range values), keep the low byte. As
    int64, the low byte's value in ``0..255``."""
    fits = np.abs(f) < F32(2.0 ** 31)
    whole = np.where(fits, np.trunc(np.where(fits, f, F32(0.0))), F32(0.0)).astype(np.int64)
    return np.where(fits, whole, -(2 ** 31)) & 0xFF


def _min_int8(limit, byte):
    """``MIN(limit, (int8_t)f)`` stored in a ``uint8_t``: the byte, with ``(int8_t)f`` read signed."""
    signed = np.where(byte >= 128, byte - 256, byte)
    return np.minimum(limit, signed) & 0xFF


def _roundf(f):
    """C's ``roundf``: half away from zero."""
    whole = np.trunc(f)
    return whole + np.where(np.abs(f - whole) >= F32(0.5), np.sign(f), F32(0.0)).astype(F32)


def _inverse(d):
    """``d ? 1.0f / d : 0.0f``."""
    safe = np.where(d != 0, d, F32(1.0))
    return np.where(d != 0, F32(1.0) / safe, F32(0.0)).astype(F32)


def _min_max(values):
    """``min``, ``max`` of each block as ggml's ``if (v < min) min = v`` finds them: the first value of
    each (which decides the sign of a zero, stored in Q4_1's and Q5_1's ``m``)."""
    lo = np.take_along_axis(values, values.argmin(axis=-1)[:, None], axis=-1)[:, 0]
    hi = np.take_along_axis(values, values.argmax(axis=-1)[:, None], axis=-1)[:, 0]
    return lo.astype(F32), hi.astype(F32)


def _nibble_bytes(q, masked=True):
    """``[n, 32]`` 4-bit values -> ``[n, 16]`` bytes: value ``j`` low, value ``j + 16`` high (Q4_0 and
    Q4_1 store ``q[j] | q[j + 16] << 4`` unmasked: the same for values that fit in four bits)."""
    if masked:
        return pack_nibbles(q[:, :16], q[:, 16:])
    return ((q[:, :16] | (q[:, 16:] << 4)) & 0xFF).astype(np.uint8)


def _fifth_bit_word(q):
    """``[n, 32]`` 5-bit values -> ``[n, 4]`` bytes of the u32 holding bit 4 of value ``j`` in bit ``j``."""
    bits = ((q.astype(np.uint32) >> 4) & 1) << np.arange(32, dtype=np.uint32)
    return u32_bytes(np.bitwise_or.reduce(bits, axis=-1))


class Q4_0(GGMLType, type_id=2, block_size=32, type_size=18):
    @classmethod
    def decode_blocks(cls, blocks):
        q = nibbles(u8s(blocks, 2, 16)).astype(mx.float32) - 8
        return f16(blocks, 0) * q

    @classmethod
    def encode_blocks(cls, values):
        _, vmax = first_abs_max(values)
        d = vmax / F32(-8.0)
        x = values * _inverse(d)[:, None]
        q = _min_int8(15, _c_small_int(x + F32(8.5)))
        return np.concatenate([f16_bytes(d), _nibble_bytes(q, masked=False)], axis=-1)


class Q4_1(GGMLType, type_id=3, block_size=32, type_size=20):
    @classmethod
    def decode_blocks(cls, blocks):
        q = nibbles(u8s(blocks, 4, 16)).astype(mx.float32)
        return f16(blocks, 0) * q + f16(blocks, 2)

    @classmethod
    def encode_blocks(cls, values):
        lo, hi = _min_max(values)
        d = (hi - lo) / F32(15.0)
        x = (values - lo[:, None]) * _inverse(d)[:, None]
        q = _min_int8(15, _c_small_int(x + F32(0.5)))
        return np.concatenate([f16_bytes(d), f16_bytes(lo), _nibble_bytes(q, masked=False)], axis=-1)


class Q5_0(GGMLType, type_id=6, block_size=32, type_size=22):
    @classmethod
    def decode_blocks(cls, blocks):
        q = (nibbles(u8s(blocks, 6, 16)) | _fifth_bits(blocks, 2)).astype(mx.float32) - 16
        return f16(blocks, 0) * q

    @classmethod
    def encode_blocks(cls, values):
        _, vmax = first_abs_max(values)
        d = vmax / F32(-16.0)
        x = values * _inverse(d)[:, None]
        q = _min_int8(31, _c_small_int(x + F32(16.5)))
        return np.concatenate([f16_bytes(d), _fifth_bit_word(q), _nibble_bytes(q)], axis=-1)


class Q5_1(GGMLType, type_id=7, block_size=32, type_size=24):
    @classmethod
    def decode_blocks(cls, blocks):
        q = (nibbles(u8s(blocks, 8, 16)) | _fifth_bits(blocks, 4)).astype(mx.float32)
        return f16(blocks, 0) * q + f16(blocks, 2)

    @classmethod
    def encode_blocks(cls, values):
        lo, hi = _min_max(values)
        d = (hi - lo) / F32(31.0)
        x = (values - lo[:, None]) * _inverse(d)[:, None]
        q = _c_small_int(x + F32(0.5))
        return np.concatenate([f16_bytes(d), f16_bytes(lo), _fifth_bit_word(q), _nibble_bytes(q)], axis=-1)


class Q8_0(GGMLType, type_id=8, block_size=32, type_size=34):
    @classmethod
    def decode_blocks(cls, blocks):
        return i8s(blocks, 2, 32) * f16(blocks, 0)

    @classmethod
    def encode_blocks(cls, values):
        amax = np.abs(values).max(axis=-1).astype(F32)
        d = amax / F32(127.0)
        q = _c_small_int(_roundf(values * _inverse(d)[:, None]))
        return np.concatenate([f16_bytes(d), q.astype(np.uint8)], axis=-1)
