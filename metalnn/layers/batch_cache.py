"""Caches of several sequences of different lengths decoded together: `BatchKVCache`, and
`merge_rows` / `keep_rows` over a model's per-layer cache list.

A server decodes every running request in one batched step. Each request's prompt is first run
alone into its own caches (`KVCache`, `GatedDeltaCache`); `merge_rows` then adds those rows to the
batch's caches, and `keep_rows` drops the rows of finished requests.

Attention caches are right-aligned: row ``b`` holds its positions in columns
``[left_padding[b], offset)`` of the buffers ``[B, Hkv, capacity, head_dim]``. Every row's next
position is written at column ``offset`` at once (as `KVCache` does), RoPE gives row ``b`` the
position ``offset - left_padding[b]`` (`BatchKVCache.positions`), and the padding columns are masked
(`BatchKVCache.key_mask`). Recurrent states (`GatedDeltaCache`) have no positions: their rows stack.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .attention import KVCache
from .gated_deltanet import GatedDeltaCache

__all__ = ["BatchKVCache", "merge_rows", "keep_rows"]


class BatchKVCache(KVCache):
    """Keys and values of B sequences of different lengths, right-aligned (see the module docstring).

    Args:
        keys, values: ``[B, Hkv, capacity, head_dim]`` buffers (None for an empty cache).
        offset: the columns in use (the next position's column).
        left_padding: the padding columns before each row's first position, ``B`` ints.
    """

    def __init__(self, keys=None, values=None, offset: int = 0, left_padding: Sequence[int] = ()):
        super().__init__()
        self.keys, self.values, self.offset = keys, values, int(offset)
        self.left_padding = [int(p) for p in left_padding]
        if keys is not None and keys.shape[0] != len(self.left_padding):
            raise ValueError(f"BatchKVCache: {keys.shape[0]} rows of keys but {len(self.left_padding)} paddings")
        if any(p < 0 or p > self.offset for p in self.left_padding):
            raise ValueError(f"BatchKVCache: paddings {self.left_padding} must lie in [0, offset={self.offset}]")

    @property
    def batch_size(self) -> int:
        return len(self.left_padding)

    @property
    def lengths(self) -> list:
        """Each row's number of positions."""
        return [self.offset - p for p in self.left_padding]

    @property
    def positions(self):
        """Each row's next position, int32 ``[B]`` (RoPE's per-sequence offsets)."""
        return mx.array(self.lengths, dtype=mx.int32)

    def key_mask(self):
        """bool ``[B, 1, 1, offset]``: True where a row has a position (None when no row is padded)."""
        if not any(self.left_padding):
            return None
        cols = mx.arange(self.offset, dtype=mx.int32)
        return (cols[None, :] >= mx.array(self.left_padding, dtype=mx.int32)[:, None])[:, None, None, :]

    def trim(self, n: int) -> int:
        """Forget the last ``n`` columns of every row (at most the shortest row's length)."""
        n = min(min(self.lengths, default=0), max(0, int(n)))
        self.offset -= n
        return n

    def reset(self):
        super().reset()
        self.left_padding = []

    @property
    def state(self):
        return [] if self.keys is None else [self.keys[..., :self.offset, :], self.values[..., :self.offset, :]]

    def __repr__(self):
        return f"BatchKVCache(offset={self.offset}, left_padding={self.left_padding})"


def _kv_rows(cache) -> tuple:
    """``(keys, values, offset, left_padding)`` of a `KVCache` or `BatchKVCache` (keys trimmed to offset)."""
    if cache.keys is None:
        return None, None, 0, []
    pads = list(cache.left_padding) if isinstance(cache, BatchKVCache) else [0] * cache.keys.shape[0]
    return cache.keys[..., :cache.offset, :], cache.values[..., :cache.offset, :], cache.offset, pads


def _aligned(parts, offset: int, capacity: int):
    """Concatenate ``(array [b, H, o, hd], o)`` parts along the batch axis, each right-aligned to
    column ``offset`` of a new ``capacity``-column buffer."""
    padded = [mx.pad(a, [(0, 0), (0, 0), (offset - o, capacity - offset), (0, 0)]) for a, o in parts]
    return mx.concatenate(padded, axis=0) if len(padded) > 1 else padded[0]


def _merge_kv(caches) -> BatchKVCache:
    rows = [_kv_rows(c) for c in caches]
    rows = [r for r in rows if r[0] is not None]
    if not rows:
        return BatchKVCache()
    offset = max(r[2] for r in rows)
    capacity = ((offset + KVCache.step) // KVCache.step) * KVCache.step  # room for the next position
    keys = _aligned([(r[0], r[2]) for r in rows], offset, capacity)
    values = _aligned([(r[1], r[2]) for r in rows], offset, capacity)
    pads = [p + offset - r[2] for r in rows for p in r[3]]
    return BatchKVCache(keys, values, offset, pads)


def _merge_recurrent(caches) -> GatedDeltaCache:
    out = GatedDeltaCache()
    live = [c for c in caches if c.recurrent_state is not None]
    if live:
        out.conv_state = mx.concatenate([c.conv_state for c in live], axis=0)
        out.recurrent_state = mx.concatenate([c.recurrent_state for c in live], axis=0)
        out.offset = max(c.offset for c in live)
    return out


def merge_rows(caches_per_group: Sequence[list]) -> list:
    """One cache list holding the rows of several: ``caches_per_group`` is a list of per-layer cache
    lists (each from ``model.make_cache()``, filled by a prompt, or an earlier merge), in row order.
    Returns the per-layer list of merged caches (`BatchKVCache` for attention layers)."""
    groups = [g for g in caches_per_group if g is not None]
    if not groups:
        raise ValueError("merge_rows: no caches to merge")
    layers = len(groups[0])
    if any(len(g) != layers for g in groups):
        raise ValueError(f"merge_rows: cache lists of different lengths {[len(g) for g in groups]}")
    merged = []
    for i in range(layers):
        column = [g[i] for g in groups]
        if all(isinstance(c, KVCache) for c in column):
            merged.append(_merge_kv(column))
        elif all(isinstance(c, GatedDeltaCache) for c in column):
            merged.append(_merge_recurrent(column))
        else:
            raise TypeError(f"merge_rows: layer {i} mixes cache types {sorted({type(c).__name__ for c in column})}")
    return merged


def keep_rows(caches: list, rows: Sequence[int]) -> list:
    """The per-layer caches of ``caches`` (a merged list) restricted to ``rows`` (in that order);
    padding columns no remaining row uses are dropped."""
    rows = [int(r) for r in rows]
    if not rows:
        return [type(c)() if isinstance(c, GatedDeltaCache) else BatchKVCache() for c in caches]
    idx = mx.array(rows, dtype=mx.int32)
    out = []
    for c in caches:
        if isinstance(c, GatedDeltaCache):
            kept = GatedDeltaCache()
            if c.recurrent_state is not None:
                kept.conv_state, kept.recurrent_state = c.conv_state[idx], c.recurrent_state[idx]
                kept.offset = c.offset
            out.append(kept)
            continue
        keys, values, offset, pads = _kv_rows(c)
        if keys is None:
            out.append(BatchKVCache())
            continue
        pads = [pads[r] for r in rows]
        drop = min(pads)
        capacity = ((offset - drop + KVCache.step) // KVCache.step) * KVCache.step
        k = mx.pad(keys[idx][..., drop:, :], [(0, 0), (0, 0), (0, capacity - offset + drop), (0, 0)])
        v = mx.pad(values[idx][..., drop:, :], [(0, 0), (0, 0), (0, capacity - offset + drop), (0, 0)])
        out.append(BatchKVCache(k, v, offset - drop, [p - drop for p in pads]))
    return out
