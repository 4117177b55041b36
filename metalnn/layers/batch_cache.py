"""Caches of several sequences of different lengths decoded together: `BatchKVCache`, and
`merge_rows` / `keep_rows` over a model's per-layer cache list.

A server decodes every running request in one batched step. Each request's prompt is first run
alone into its own caches (`KVCache`, a `StateCache` such as `GatedDeltaCache`); `merge_rows` then adds those rows to the
batch's caches, and `keep_rows` drops the rows of finished requests.

Attention caches are left-aligned: row ``b`` holds its positions in columns ``[0, lengths[b])`` of
the buffers ``[B, Hkv, capacity, head_dim]``. New positions are written at each row's own column
(one in-place scatter), RoPE gives row ``b`` the positions from ``lengths[b]`` on
(`BatchKVCache.positions`), and `BatchKVCache.key_mask` hides from each query the columns past its
own position. Rows never move: a row that joins, leaves or takes back positions (speculative
decoding's rejected drafts, `BatchKVCache.rewind`) costs no copy of the others. Recurrent states
(`StateCache` s) have no positions: their rows stack.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .attention import KVCache
from .state_cache import StateCache

__all__ = ["BatchKVCache", "merge_rows", "keep_rows"]


def _capacity(n: int) -> int:
    """Columns for ``n`` positions and room for more: a multiple of ``KVCache.step`` above ``n``."""
    return ((n + KVCache.step) // KVCache.step) * KVCache.step


class BatchKVCache(KVCache):
    """Keys and values of B sequences of different lengths, left-aligned (see the module docstring).

    Args:
        keys, values: ``[B, Hkv, capacity, head_dim]`` buffers (None for an empty cache).
        lengths: each row's number of positions (``B`` ints, each at most ``capacity``).

    ``offset`` is the longest row's length (the columns any row uses).
    """

    def __init__(self, keys=None, values=None, lengths: Sequence[int] = ()):
        super().__init__()
        self.keys, self.values = keys, values
        self.lengths = [int(n) for n in lengths]
        if keys is not None and keys.shape[0] != len(self.lengths):
            raise ValueError(f"BatchKVCache: {keys.shape[0]} rows of keys but {len(self.lengths)} lengths")
        cap = keys.shape[2] if keys is not None else 0
        if any(n < 0 or n > cap for n in self.lengths):
            raise ValueError(f"BatchKVCache: lengths {self.lengths} must lie in [0, capacity={cap}]")
        self._before = list(self.lengths)  # the lengths before the last update (what key_mask needs)

    @property
    def offset(self) -> int:
        return max(self.lengths, default=0)

    @offset.setter
    def offset(self, value):  # (KVCache.__init__ assigns it; the lengths decide)
        pass

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def positions(self):
        """Each row's next position, int32 ``[B]`` (RoPE's per-sequence offsets)."""
        return mx.array(self.lengths, dtype=mx.int32)

    @property
    def ragged(self) -> bool:
        """Whether the rows have different lengths."""
        return len(set(self.lengths)) > 1

    def update_and_fetch(self, k, v):
        """Append ``k``, ``v`` ``[B, Hkv, T, head_dim]`` after each row's positions; return the keys
        and values of columns ``[0, offset)`` (columns past a row's length are hidden by `key_mask`)."""
        b, t = k.shape[0], k.shape[2]
        if b != len(self.lengths):
            raise ValueError(f"BatchKVCache: {b} rows of new keys for a cache of {len(self.lengths)} rows")
        if self._store is not None and not self.ragged and self._store.write(self._slot, self.lengths[0], k, v):
            self.count_written(t)  # (a bound cache, every row at one position: written in its store)
            n = self.offset
            return self._store.keys(self._slot)[..., :n, :], self._store.values(self._slot)[..., :n, :]
        self._before = list(self.lengths)
        need = max(self.lengths) + t
        if self.keys is None or need > self.keys.shape[2]:
            cap, old = _capacity(need), self.keys
            shape = (b, k.shape[1], cap, k.shape[3])
            nk, nv = mx.zeros(shape, k.dtype), mx.zeros(shape[:3] + (v.shape[3],), k.dtype)
            if old is not None and self.offset:
                nk[..., :self.offset, :] = self.keys[..., :self.offset, :]
                nv[..., :self.offset, :] = self.values[..., :self.offset, :]
            self.keys, self.values = nk, nv
        if not self.ragged:
            n = self.lengths[0]
            self.keys[..., n:n + t, :] = k
            self.values[..., n:n + t, :] = v
        else:  # each row at its own columns: one scatter (in place once nothing else holds the buffer)
            cols = mx.array(self.lengths, dtype=mx.int32)[:, None] + mx.arange(t, dtype=mx.int32)[None, :]
            self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(cols[:, None, :, None], k.shape), k, axis=2)
            self.values = mx.put_along_axis(self.values, mx.broadcast_to(cols[:, None, :, None], v.shape), v, axis=2)
        self.lengths = [n + t for n in self.lengths]
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def buffers_for(self, batch: int, kv_heads: int, head_dim: int, t: int, dtype, value_dim: int | None = None):
        """The buffers with room for ``t`` more positions after the longest row (see `KVCache`)."""
        prev = self.offset
        if self.keys is None or prev + t > self.keys.shape[2]:
            shape = (batch, kv_heads, _capacity(prev + t), head_dim)
            nk, nv = mx.zeros(shape, dtype), mx.zeros(shape[:3] + (value_dim or head_dim,), dtype)
            if self.keys is not None and prev:
                nk[..., :prev, :] = self.keys[..., :prev, :]
                nv[..., :prev, :] = self.values[..., :prev, :]
            self.keys, self.values = nk, nv
        return self.keys, self.values

    def capacity(self, n: int) -> int:
        """Room for ``n`` positions: a multiple of ``KVCache.step`` above ``n``."""
        return _capacity(n)

    def advance(self, keys, values, t: int):
        """Take ``keys`` / ``values`` (the buffers of `buffers_for` with ``t`` new positions written
        after each row's positions) as the cache."""
        self.keys, self.values = keys, values
        self.count_written(t)

    def count_written(self, t: int):
        """Count ``t`` new positions written after each row's positions (in place, see `KVCache`)."""
        self._before = list(self.lengths)
        self.lengths = [n + t for n in self.lengths]

    def write_rows(self, k, v):
        """Write one new position ``k``, ``v`` ``[B, Hkv, 1, head_dim]`` at each row's own column of
        the buffers of `buffers_for` (in place) and count it."""
        if not self.ragged:
            n = self.lengths[0]
            self.keys[:, :, n:n + 1, :] = k
            self.values[:, :, n:n + 1, :] = v
        else:
            idx = mx.broadcast_to(mx.array(self.lengths, dtype=mx.int32)[:, None, None, None], k.shape)
            self.keys = mx.put_along_axis(self.keys, idx, k, axis=2)
            self.values = mx.put_along_axis(self.values, idx, v, axis=2)
        self._before = list(self.lengths)
        self.lengths = [n + 1 for n in self.lengths]

    def key_mask(self, t: int = 1, window: int | None = None):
        """After an update of ``t`` positions: bool ``[B, 1, t, offset]``, True where query ``i`` of
        row ``b`` may attend (its own causal past, within ``window`` positions when given); None when
        every row has the same length (the attention's own causal mask and window then apply)."""
        if len(set(self._before)) <= 1:
            return None
        cols = mx.arange(self.offset, dtype=mx.int32)[None, None, :]                      # [1, 1, Tk]
        last = mx.array(self._before, dtype=mx.int32)[:, None, None] + mx.arange(t, dtype=mx.int32)[None, :, None]
        mask = cols <= last                                                                 # [B, t, Tk]
        if window is not None:
            mask = mx.logical_and(mask, cols > last - window)
        return mask[:, None]

    def rewind(self, counts: Sequence[int]):
        """Forget the last ``counts[b]`` positions of each row b (e.g. rejected draft tokens)."""
        if len(counts) != len(self.lengths):
            raise ValueError(f"BatchKVCache.rewind: {len(counts)} counts for {len(self.lengths)} rows")
        self.lengths = [n - min(n, max(0, int(c))) for n, c in zip(self.lengths, counts)]
        self._before = list(self.lengths)

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions of every row (at most the shortest row's length)."""
        n = min(min(self.lengths, default=0), max(0, int(n)))
        self.rewind([n] * len(self.lengths))
        return n

    def reset(self):
        self.keys = self.values = None
        self.lengths, self._before = [], []

    @property
    def state(self):
        return [] if self.keys is None else [self.keys[..., :self.offset, :], self.values[..., :self.offset, :]]

    def __repr__(self):
        return f"BatchKVCache(lengths={self.lengths})"


def _kv_rows(cache) -> tuple:
    """``(keys, values, lengths)`` of a `KVCache` or `BatchKVCache` (keys cut at its longest row)."""
    if cache.keys is None:
        return None, None, []
    lengths = list(cache.lengths) if isinstance(cache, BatchKVCache) else [cache.offset] * cache.keys.shape[0]
    n = max(lengths)
    return cache.keys[..., :n, :], cache.values[..., :n, :], lengths


def _merge_kv(caches) -> BatchKVCache:
    rows = [r for r in (_kv_rows(c) for c in caches) if r[0] is not None]
    if not rows:
        return BatchKVCache()
    longest = max(max(r[2]) for r in rows)
    cap = _capacity(longest)

    def stack(i):
        parts = [mx.pad(r[i], [(0, 0), (0, 0), (0, cap - r[i].shape[2]), (0, 0)]) for r in rows]
        return mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    return BatchKVCache(stack(0), stack(1), [n for r in rows for n in r[2]])


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
        elif all(type(c) is type(column[0]) and isinstance(c, StateCache) for c in column):
            merged.append(type(column[0]).merge(column))
        else:
            raise TypeError(f"merge_rows: layer {i} mixes cache types {sorted({type(c).__name__ for c in column})}")
    return merged


def keep_rows(caches: list, rows: Sequence[int]) -> list:
    """The per-layer caches of ``caches`` (a merged list) restricted to ``rows`` (in that order), in
    new buffers sized for the longest remaining row."""
    rows = [int(r) for r in rows]
    if not rows:
        return [type(c)() if isinstance(c, StateCache) else BatchKVCache() for c in caches]
    idx = mx.array(rows, dtype=mx.int32)
    out = []
    for c in caches:
        if isinstance(c, StateCache):
            out.append(c.take(idx))
            continue
        keys, values, lengths = _kv_rows(c)
        if keys is None:
            out.append(BatchKVCache())
            continue
        lengths = [lengths[r] for r in rows]
        cap = _capacity(max(lengths))
        used = min(cap, keys.shape[2])
        k = mx.pad(keys[idx][..., :used, :], [(0, 0), (0, 0), (0, cap - used), (0, 0)])
        v = mx.pad(values[idx][..., :used, :], [(0, 0), (0, 0), (0, cap - used), (0, 0)])
        out.append(BatchKVCache(k, v, lengths))
    return out
