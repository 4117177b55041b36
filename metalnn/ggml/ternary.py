"""The ternary types: values in ``{-1, 0, 1}`` times one float16 scale a 256-value block
(``block_tq1_0`` and ``block_tq2_0`` in ``ggml-common.h``).

Layouts (bytes):

* TQ1_0 (54): ``qs[48]``, ``qh[4]``, ``d`` f16. Each byte packs five (``qs``) or four (``qh``) base-3
  digits as a fixed-point fraction: digit ``p`` of byte ``b`` is ``((b * 3^p mod 256) * 3) >> 8``. Values:
  digit ``p`` of ``qs[j]`` is value ``32 p + j`` for ``j < 32``; of ``qs[32 + j]`` is value
  ``160 + 16 p + j``; of ``qh[j]`` is value ``240 + 4 p + j``; ``x = d * (digit - 1)``.
* TQ2_0 (66): ``qs[64]`` (2-bit planes: value ``128 h + 32 s + j`` is bits ``2s, 2s + 1`` of byte
  ``32 h + j``), ``d`` f16; ``x = d * (q - 1)``.
"""

from __future__ import annotations

import mlx.core as mx

from .base import GGMLType, f16, u8s

_POW3 = mx.array([[1], [3], [9], [27], [81]], dtype=mx.uint32)
_PAIR = mx.array([[0], [2], [4], [6]], dtype=mx.uint32)


def _trits(packed, digits):
    """``[n, m]`` bytes -> ``[n, digits * m]``: base-3 digit ``p`` of byte ``j`` at ``p * m + j``."""
    shifted = (packed[:, None, :] * _POW3[:digits]) & 0xFF
    return ((shifted * 3) >> 8).reshape(-1, digits * packed.shape[-1])


class TQ1_0(GGMLType, type_id=34, block_size=256, type_size=54):
    @classmethod
    def decode_blocks(cls, blocks):
        qs = u8s(blocks, 0, 48)
        t = mx.concatenate([_trits(qs[:, :32], 5), _trits(qs[:, 32:], 5), _trits(u8s(blocks, 48, 4), 4)],
                           axis=-1)
        return f16(blocks, 52) * (t.astype(mx.float32) - 1)


class TQ2_0(GGMLType, type_id=35, block_size=256, type_size=66):
    @classmethod
    def decode_blocks(cls, blocks):
        q = ((u8s(blocks, 0, 64).reshape(-1, 2, 1, 32) >> _PAIR) & 3).reshape(-1, 256)
        return f16(blocks, 64) * (q.astype(mx.float32) - 1)
