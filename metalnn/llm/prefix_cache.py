"""`PrefixCache`: the caches of earlier sequences, reused by prompts that begin the same way.

A chat's next turn repeats the whole conversation so far, and agents resend the same system
prompt: with the keys and values of that shared beginning kept, only the new tokens are run.

Entries are ``(tokens, per-layer caches)`` saved when a prompt has been run and when a sequence
ends (its prompt and every new token but the last, which was never fed back). A lookup returns
the longest usable match:

* attention caches (`KVCache`) hold one column per position, so any common prefix of an entry
  is usable (the entry's first ``n`` columns);
* recurrent states (`StateCache` s such as the hybrid models' `GatedDeltaCache`) are the state after exactly the
  entry's tokens, so an entry of such a model matches only when all its tokens begin the prompt.

Entries are MLX arrays shared with the sequence that made them: MLX writes a cache in place only
when nothing else holds it, so a sequence continuing from an entry copies it on its first write
instead of changing it. The cache holds at most ``max_bytes`` (least recently used entries go
first); ``save``/``load`` keep entries in a folder between runs. Sequences decoded with a LoRA
adapter store and look up their entries under its name (``adapter=``): the keys and values of the
same tokens differ from one adapter to another.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..layers.attention import KVCache
from ..layers.state_cache import StateCache

__all__ = ["PrefixCache"]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _arrays(caches) -> list:
    out = []
    for c in caches:
        if isinstance(c, StateCache):
            out += c.state
        else:
            out += [c.keys, c.values]
    return [a for a in out if a is not None]


class _Entry:
    def __init__(self, tokens, caches, adapter=None):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.adapter = adapter
        self.caches = caches
        self.recurrent = any(isinstance(c, StateCache) for c in caches)
        self.nbytes = sum(a.nbytes for a in _arrays(caches))


def _own(a):
    """A new array object with ``a``'s value: MLX's in-place writes (``x[i] = v``) change the
    Python object they are made through, so caches must never share one (the first write through
    a copy copies the buffer instead of changing the entry)."""
    return None if a is None else mx.array(a)


def _single(cache, n: int):
    """A fresh cache of one sequence holding the first ``n`` positions of ``cache`` (a one-row
    `KVCache` / `BatchKVCache`, or a `StateCache` of exactly ``n`` tokens)."""
    if isinstance(cache, StateCache):
        return cache.copy(offset=n)
    out = KVCache()
    if cache.keys is not None:
        out.keys, out.values, out.offset = _own(cache.keys), _own(cache.values), n
    return out


class PrefixCache:
    """The caches of earlier sequences by their tokens (see the module docstring).

    Args:
        max_bytes: the most bytes of cache arrays kept (least recently used entries are dropped).
        min_tokens: shorter matches are not worth using (and shorter sequences are not stored).

        follower: keep every entry until `drop` removes it (no budget, no entry replaced by a longer
            one): a cache that repeats another's removals.

    ``evicted``: None, or a list to which the key (``(adapter, *tokens)``) of every entry removed or
    refused is appended, so that a follower cache can `drop` the same ones at the same point (the
    ranks of a split model keep rank 0's entries this way, `metalnn.llm.server.lockstep`).
    """

    def __init__(self, max_bytes: int = 1 << 30, min_tokens: int = 16, *, follower: bool = False):
        if int(max_bytes) < 0:
            raise ValueError(f"PrefixCache: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes, self.min_tokens = int(max_bytes), max(1, int(min_tokens))
        self.follower = bool(follower)
        self.evicted: list | None = None
        self._entries: OrderedDict = OrderedDict()  # key -> _Entry, least recently used first
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.hit_tokens = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the cache arrays kept (any thread: read under the lock the worker stores under)."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self):
        with self._lock:
            return len(self._entries)

    def store(self, tokens, caches, adapter: str | None = None) -> bool:
        """Keep ``caches`` (one sequence's per-layer caches, unpadded, holding exactly ``tokens``,
        computed with LoRA adapter ``adapter``, None: the base model). Returns False when not kept
        (too short, or larger than the whole budget)."""
        tokens = [int(t) for t in tokens]
        if len(tokens) < self.min_tokens:
            return False
        for c in caches:
            lengths = getattr(c, "lengths", None)
            if lengths is not None and lengths != [len(tokens)]:
                raise ValueError(f"PrefixCache.store: one sequence of {len(tokens)} positions is needed, got lengths "
                                 f"{lengths}")
        entry = _Entry(tokens, [_single(c, len(tokens)) for c in caches], adapter)
        key = (adapter, *tokens)
        if entry.nbytes > self.max_bytes and not self.follower:
            self._removed([key])
            return False
        with self._lock:
            self._entries.pop(key, None)
            # an entry that is a prefix of the new one (the same conversation, one turn earlier) is
            # covered by it unless recurrent states make exact lengths matter
            if not entry.recurrent and not self.follower:
                covered = [k for k in self._entries if k[0] == adapter and len(k) < len(key) and key[:len(k)] == k]
                for k in covered:
                    del self._entries[k]
                self._removed(covered)
            self._entries[key] = entry
            if not self.follower:
                self._evict()
        return True

    def _removed(self, keys):
        if self.evicted is not None:
            self.evicted += keys

    def _evict(self):
        total = sum(e.nbytes for e in self._entries.values())
        while total > self.max_bytes and self._entries:
            key, old = self._entries.popitem(last=False)
            total -= old.nbytes
            self._removed([key])

    def drop(self, keys):
        """Remove the entries of ``keys`` (``(adapter, *tokens)`` each, as `evicted` lists them) that
        are kept."""
        with self._lock:
            for key in keys:
                self._entries.pop(tuple(key), None)

    def lookup(self, prompt, max_tokens: int | None = None, adapter: str | None = None):
        """``(n, caches)``: fresh per-layer caches holding the first ``n`` tokens of ``prompt`` (the
        longest stored match computed with LoRA adapter ``adapter``, at most ``max_tokens``), or None
        when nothing matches ``min_tokens``."""
        prompt = np.asarray([int(t) for t in prompt], dtype=np.int64)
        limit = len(prompt) if max_tokens is None else min(len(prompt), int(max_tokens))
        best, best_key = 0, None
        with self._lock:
            for key, entry in self._entries.items():
                if entry.adapter != adapter:
                    continue
                n = min(_common_prefix(entry.tokens, prompt), limit)
                if entry.recurrent and n != len(entry.tokens):
                    continue
                if n > best:
                    best, best_key = n, key
            if best < self.min_tokens or best_key is None:
                self.misses += 1
                return None
            entry = self._entries[best_key]
            self._entries.move_to_end(best_key)
            self.hits += 1
            self.hit_tokens += best
        return best, [_single(c, best) for c in entry.caches]

    def clear(self):
        with self._lock:
            self._entries.clear()

    # -- on disk -------------------------------------------------------------------------------
    def save(self, folder) -> int:
        """Write every entry to ``folder`` (``prefix-<i>.safetensors`` with its tokens and cache
        kinds in the metadata); returns how many were written."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("prefix-*.safetensors"):
            old.unlink()
        with self._lock:
            entries = list(self._entries.values())
        for i, entry in enumerate(entries):
            arrays, kinds = {}, []
            for j, c in enumerate(entry.caches):
                if isinstance(c, StateCache):
                    kinds.append(type(c).__name__)
                    arrays.update({f"{j}.{name}": a for name, a in c.arrays().items()})
                else:
                    kinds.append("kv")
                    n = len(entry.tokens)
                    arrays[f"{j}.keys"], arrays[f"{j}.values"] = c.keys[..., :n, :], c.values[..., :n, :]
            meta = {"tokens": json.dumps(entry.tokens.tolist()), "kinds": json.dumps(kinds)}
            if entry.adapter is not None:
                meta["adapter"] = entry.adapter
            mx.save_safetensors(str(folder / f"prefix-{i:05d}.safetensors"), arrays, metadata=meta)
        return len(entries)

    def load(self, folder) -> int:
        """Read the entries `save` wrote to ``folder`` (a missing folder holds none); returns how many
        were kept within the budget. A file that does not read is skipped with its error raised
        only if nothing else loads (a half-written file must not stop the server)."""
        folder = Path(folder)
        count = 0
        for path in sorted(folder.glob("prefix-*.safetensors")) if folder.is_dir() else []:
            try:
                arrays, meta = mx.load(str(path), return_metadata=True)
                tokens, kinds = json.loads(meta["tokens"]), json.loads(meta["kinds"])
                caches = []
                for j, kind in enumerate(kinds):
                    if kind != "kv":
                        cls = StateCache.kind(kind)
                        c = cls.from_arrays({name: arrays[f"{j}.{name}"] for name in cls.fields}, len(tokens))
                    else:
                        c = KVCache()
                        c.keys, c.values, c.offset = arrays[f"{j}.keys"], arrays[f"{j}.values"], len(tokens)
                    caches.append(c)
            except (KeyError, ValueError, RuntimeError, json.JSONDecodeError):
                continue
            count += bool(self.store(tokens, caches, adapter=meta.get("adapter")))
        return count
