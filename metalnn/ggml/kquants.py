"""The K-quants: 256-value super-blocks split into sub-blocks of 16 or 32 values, each sub-block with a
small integer scale (and minimum) that multiplies the super-block's float16 ``d`` (and ``dmin``)
(``block_q2_K`` ... ``block_q6_K`` in ``ggml-common.h``).

Bit layouts shared by several types. A run of 2-bit fields is stored as "planes": the 256 values form
two halves of 128; value ``128 h + 32 s + j`` is bits ``2s, 2s + 1`` of byte ``32 h + j``. A run of
4-bit fields is stored likewise with two nibble planes: value ``64 c + 32 s + j`` is nibble ``s`` of byte
``32 c + j``. A high-bit mask ``hm[32]`` gives value ``32 b + j`` its extra bit from bit ``b`` of byte ``j``.

Layouts (bytes):

* Q2_K (84): ``scales[16]``, ``qs[64]`` (2-bit planes), ``d`` f16, ``dmin`` f16. Sub-block ``i`` of 16
  values: ``sc = scales[i] & 0xF``, ``m = scales[i] >> 4``; ``x = (d * sc) * q - (dmin * m)``.
* Q3_K (110): ``hmask[32]`` (high-bit mask), ``qs[64]`` (2-bit planes), ``scales[12]``, ``d`` f16. Sixteen
  6-bit scales: scale ``i`` takes its low four bits from nibble ``i // 8`` of byte ``i % 8`` and its top
  two from bits ``2 (i // 4)`` of byte ``8 + i % 4``; ``q = low2 - (0 if high bit else 4)``;
  ``x = (d * (scale - 32)) * q``.
* Q4_K (144): ``d`` f16, ``dmin`` f16, ``scales[12]``, ``qs[128]`` (nibble planes). Eight sub-blocks of
  32 with 6-bit scale and minimum (``get_scale_min_k4``): for ``i < 4``, ``sc = s[i] & 63`` and
  ``m = s[i + 4] & 63``; for ``i >= 4``, ``sc = (s[i + 4] & 0xF) | (s[i - 4] >> 6) << 4`` and
  ``m = (s[i + 4] >> 4) | (s[i] >> 6) << 4``; ``x = (d * sc) * q - (dmin * m)``.
* Q5_K (176): ``d`` f16, ``dmin`` f16, ``scales[12]`` (as Q4_K), ``qh[32]`` (high-bit mask), ``qs[128]``
  (nibble planes); ``q = nibble | high << 4``, ``x = (d * sc) * q - (dmin * m)``.
* Q6_K (210): ``ql[128]``, ``qh[64]``, ``scales[16]`` int8, ``d`` f16. In half ``h`` (128 values), value
  ``128 h + 64 s + k`` takes nibble ``s`` of ``ql[64 h + k]`` and value ``128 h + 32 t + j`` takes its top
  two bits from bits ``2t`` of ``qh[32 h + j]``; ``x = (d * scales[i]) * (q - 32)`` over sub-blocks ``i``
  of 16.
"""

from __future__ import annotations

import mlx.core as mx

from .base import GGMLType, f16, i8s, u8s

QK_K = 256

_NIBBLE = mx.array([[0], [4]], dtype=mx.uint32)
_PAIR = mx.array([[0], [2], [4], [6]], dtype=mx.uint32)
_BIT = mx.arange(8, dtype=mx.uint32).reshape(8, 1)


def _crumbs(qs):
    """``[n, 64]`` bytes of 2-bit planes -> ``[n, 256]`` values."""
    return ((qs.reshape(-1, 2, 1, 32) >> _PAIR) & 3).reshape(-1, QK_K)


def _nibble_planes(qs, width=32):
    """``[n, m]`` bytes of nibble planes ``width`` bytes wide -> ``[n, 2m]`` values."""
    return ((qs.reshape(-1, qs.shape[-1] // width, 1, width) >> _NIBBLE) & 0xF).reshape(-1, 2 * qs.shape[-1])


def _high_bits(hm):
    """``[n, 32]`` high-bit mask -> ``[n, 256]``: bit ``b`` of byte ``j`` for value ``32 b + j``."""
    return ((hm[:, None, :] >> _BIT) & 1).reshape(-1, QK_K)


def _scale_min_k4(s):
    """The eight 6-bit scales and minimums of Q4_K/Q5_K from their 12 bytes: two ``[n, 8]`` uint32."""
    lo, mid, top = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = mx.concatenate([lo & 63, (top & 0xF) | ((lo >> 2) & 0x30)], axis=-1)
    mn = mx.concatenate([mid & 63, (top >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return sc, mn


def _per_sub_block(scale, values, sub):
    """``scale [n, k] * values [n, k * sub]`` with each scale over its ``sub`` values, as ``[n, k, sub]``."""
    return scale[:, :, None] * values.reshape(-1, scale.shape[-1], sub)


class Q2_K(GGMLType, type_id=10, block_size=256, type_size=84):
    @classmethod
    def decode_blocks(cls, blocks):
        scales = u8s(blocks, 0, 16)
        q = _crumbs(u8s(blocks, 16, 64)).astype(mx.float32)
        dl = f16(blocks, 80) * (scales & 0xF).astype(mx.float32)
        ml = f16(blocks, 82) * (scales >> 4).astype(mx.float32)
        return (_per_sub_block(dl, q, 16) - ml[:, :, None]).reshape(-1, QK_K)


class Q3_K(GGMLType, type_id=11, block_size=256, type_size=110):
    @classmethod
    def decode_blocks(cls, blocks):
        s = u8s(blocks, 96, 12)
        low = mx.concatenate([s[:, :8] & 0xF, s[:, :8] >> 4], axis=-1)
        high = ((s[:, None, 8:12] >> _PAIR) & 3).reshape(-1, 16)
        dl = f16(blocks, 108) * ((low | (high << 4)).astype(mx.float32) - 32)
        low2 = _crumbs(u8s(blocks, 32, 64)).astype(mx.int32)
        missing = ((_high_bits(u8s(blocks, 0, 32)) ^ 1) << 2).astype(mx.int32)
        q = (low2 - missing).astype(mx.float32)
        return _per_sub_block(dl, q, 16).reshape(-1, QK_K)


class Q4_K(GGMLType, type_id=12, block_size=256, type_size=144):
    @classmethod
    def decode_blocks(cls, blocks):
        sc, mn = _scale_min_k4(u8s(blocks, 4, 12))
        d1 = f16(blocks, 0) * sc.astype(mx.float32)
        m1 = f16(blocks, 2) * mn.astype(mx.float32)
        q = _nibble_planes(u8s(blocks, 16, 128)).astype(mx.float32)
        return (_per_sub_block(d1, q, 32) - m1[:, :, None]).reshape(-1, QK_K)


class Q5_K(GGMLType, type_id=13, block_size=256, type_size=176):
    @classmethod
    def decode_blocks(cls, blocks):
        sc, mn = _scale_min_k4(u8s(blocks, 4, 12))
        d1 = f16(blocks, 0) * sc.astype(mx.float32)
        m1 = f16(blocks, 2) * mn.astype(mx.float32)
        q = (_nibble_planes(u8s(blocks, 48, 128)) | (_high_bits(u8s(blocks, 16, 32)) << 4)).astype(mx.float32)
        return (_per_sub_block(d1, q, 32) - m1[:, :, None]).reshape(-1, QK_K)


class Q6_K(GGMLType, type_id=14, block_size=256, type_size=210):
    @classmethod
    def decode_blocks(cls, blocks):
        low = _nibble_planes(u8s(blocks, 0, 128), width=64)
        high = _crumbs(u8s(blocks, 128, 64))
        q = (low | (high << 4)).astype(mx.float32) - 32
        dl = f16(blocks, 208) * i8s(blocks, 192, 16)
        return _per_sub_block(dl, q, 16).reshape(-1, QK_K)
