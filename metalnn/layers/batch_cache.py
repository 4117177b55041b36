"""Caches of several sequences of different lengths decoded together: `BatchKVCache`, and
`merge_rows` / `keep_rows` over a model's per-layer cache list.

A server decodes every running request in one batched step. Each request's prompt is first run
into its own caches (`KVCache`, a `StateCache` such as `GatedDeltaCache`; several short prompts
together: `sequence_rows` makes their rows one batch); `merge_rows` then adds those rows to the
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

from .. import functional as F
from .attention import KVCache
from .state_cache import StateCache

__all__ = ["BatchKVCache", "merge_rows", "keep_rows", "sequence_rows"]


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
        stored = None if self.ragged else self._write_to_store(self.lengths[0], k, v)  # (rows at one position)
        if stored is not None:
            return stored
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
    return _stacked([r for r in (_kv_rows(c) for c in caches) if r[0] is not None])


def _stacked(rows) -> BatchKVCache:
    """One `BatchKVCache` of ``rows`` (``(keys, values, lengths)`` each, as `_kv_rows` gives them), in order."""
    if not rows:
        return BatchKVCache()
    longest = max(max(r[2]) for r in rows)
    cap = _capacity(longest)

    def stack(i):
        parts = [mx.pad(r[i], [(0, 0), (0, 0), (0, cap - r[i].shape[2]), (0, 0)]) for r in rows]
        return mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    return BatchKVCache(stack(0), stack(1), [n for r in rows for n in r[2]])


def _store_of(caches):
    """The `metalnn.functional.StackCache` that every cache of ``caches`` is bound to (in its
    order), or None."""
    store = getattr(caches[0], "store", None) if caches else None
    if not isinstance(store, F.StackCache) or len(store.caches) != len(caches):
        return None
    return store if all(c is d and c.store is store for c, d in zip(caches, store.caches)) else None


def _row_lengths(cache, rows: int) -> list:
    return list(cache.lengths) if isinstance(cache, BatchKVCache) else [cache.offset] * rows


def _bound_caches(count: int, lengths: list, buffer) -> list:
    """``count`` `BatchKVCache` s of rows of ``lengths``, bound to one new `StackCache` of ``buffer``."""
    out = []
    for _ in range(count):
        c = BatchKVCache()
        c.lengths, c._before = list(lengths), list(lengths)
        out.append(c)
    F.StackCache(out, buffer)
    return out


def _merge_stored(groups: list) -> list | None:
    """`merge_rows` of attention-cache groups of which at least one is bound to a `StackCache` (a
    batch being decoded): the merged rows go straight into one new stack buffer, so that decoding
    resumes without gathering every layer's cache again; None where the groups do not fit one
    buffer (other layouts or dtypes: the caller merges layer by layer)."""
    stores = [_store_of(g) for g in groups]
    layout = next(s.buffer.shape for s in stores if s is not None)
    layers, _, _, heads, _, width = layout
    parts, lengths = [], []
    for g, store in zip(groups, stores):
        if store is not None:
            rows = store.buffer.shape[2]
            n = max(_row_lengths(g[0], rows), default=0)
            parts.append(store.buffer[..., :n, :])
        else:
            if g[0].keys is None:
                continue
            rows = g[0].keys.shape[0]
            n = max(_row_lengths(g[0], rows), default=0)
            if any(c.keys is None or c.keys.dtype != mx.float32 or c.keys.shape[:2] != (rows, heads)
                   or c.keys.shape[3] != width or c.values.shape[3] != width or c.keys.shape[2] < n for c in g):
                return None
            parts.append(mx.stack([mx.stack([c.keys[..., :n, :], c.values[..., :n, :]]) for c in g]))
        lengths += _row_lengths(g[0], rows)
    cap = _capacity(max(lengths, default=0))
    buffer = mx.zeros((layers, 2, len(lengths), heads, cap, width), mx.float32)
    row = 0
    for part in parts:
        b, n = part.shape[2], part.shape[4]
        buffer[:, :, row:row + b, :, :n, :] = part
        row += b
    return _bound_caches(layers, lengths, buffer)


def merge_rows(caches_per_group: Sequence[list]) -> list:
    """One cache list holding the rows of several: ``caches_per_group`` is a list of per-layer cache
    lists (each from ``model.make_cache()``, filled by a prompt, or an earlier merge), in row order.
    Returns the per-layer list of merged caches (`BatchKVCache` for attention layers; when a group is
    a batch whose caches are bound to a stack buffer, the merged caches are bound to a new one)."""
    groups = [g for g in caches_per_group if g is not None]
    if not groups:
        raise ValueError("merge_rows: no caches to merge")
    layers = len(groups[0])
    if any(len(g) != layers for g in groups):
        raise ValueError(f"merge_rows: cache lists of different lengths {[len(g) for g in groups]}")
    if any(_store_of(g) is not None for g in groups) and all(isinstance(c, KVCache) for g in groups for c in g):
        merged = _merge_stored(groups)
        if merged is not None:
            return merged
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
    new buffers sized for the longest remaining row (caches bound to a stack buffer: in a new stack
    buffer, bound to it)."""
    rows = [int(r) for r in rows]
    if not rows:
        return [type(c)() if isinstance(c, StateCache) else BatchKVCache() for c in caches]
    idx = mx.array(rows, dtype=mx.int32)
    store = _store_of(caches)
    if store is not None:  # (a batch being decoded: its rows taken from the stack buffer in one go)
        lengths = _row_lengths(caches[0], store.buffer.shape[2])
        lengths = [lengths[r] for r in rows]
        cap = _capacity(max(lengths))
        buffer = store.buffer[:, :, idx]  # (indexing: twice as fast as mx.take here)
        used = min(cap, buffer.shape[4])
        if used < buffer.shape[4]:
            buffer = mx.contiguous(buffer[..., :used, :])  # (the stack step writes contiguous buffers in place)
        if cap > used:
            buffer = mx.pad(buffer, [(0, 0)] * 4 + [(0, cap - used), (0, 0)])
        return _bound_caches(len(caches), lengths, buffer)
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


def sequence_rows(caches_per_sequence: Sequence[list]) -> list:
    """Per-layer `BatchKVCache` s with one row per sequence, in order, to run several sequences'
    next positions together: each sequence's caches are a ``model.make_cache()`` list of plain
    `KVCache` s, empty (a row of no positions) or holding that sequence's positions (e.g. a prefix
    cache's match)."""
    if not caches_per_sequence:
        raise ValueError("sequence_rows: no sequences")
    layers = len(caches_per_sequence[0])
    if any(len(c) != layers for c in caches_per_sequence):
        raise ValueError(f"sequence_rows: cache lists of different lengths {[len(c) for c in caches_per_sequence]}")
    out = []
    for i in range(layers):
        column = [caches[i] for caches in caches_per_sequence]
        if any(type(c) is not KVCache or (c.keys is not None and c.keys.shape[0] != 1) for c in column):
            raise TypeError(f"sequence_rows: layer {i} needs one-sequence KVCache s, got "
                            f"{sorted({type(c).__name__ for c in column})}")
        filled = next((c for c in column if c.keys is not None), None)
        if filled is None:
            out.append(BatchKVCache(None, None, [0] * len(column)))
            continue
        k, v = filled.keys, filled.values
        empty = (mx.zeros(k.shape[:2] + (0, k.shape[3]), k.dtype), mx.zeros(v.shape[:2] + (0, v.shape[3]), v.dtype), [0])
        out.append(_stacked([_kv_rows(c) if c.keys is not None else empty for c in column]))
    return out
