"""RoPE from cached cosine/sine tables: the ``"auto"`` form on the CPU backend.

On the CPU, ``mx.fast.rope`` has no kernel: every call builds its fallback graph again (about 30
ops: positions, ``exp`` of the frequencies, ``cos``, ``sin``, the rotation). Decoding calls RoPE
twice per layer and step, so that graph dominated the per-token op count. Here the angles'
cosines and sines are computed once per setting (dims, base, scale, frequencies) and position
range, in float64 and rounded to float32, and kept in a small cache:

* one position (a decoding step, ``T == 1``, small head width): the rotation of that position is
  a ``[D, D]`` matrix, built once per step and shared by every layer, so RoPE is one product
  ``x @ R``;
* several positions: ``x * C + swap(x) * S`` with the tables' rows for those positions (``swap``
  exchanges the two members of each rotated pair, ``S`` carries the signs).

Same semantics as ``mx.fast.rope`` (rotated halves or interleaved pairs, partial ``dims``, custom
``freqs`` given as periods, ``scale`` multiplying the positions); results agree to float32
rounding of the angles' sines and cosines. Differentiable in ``x`` (the tables are constants).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import mlx.core as mx
import numpy as np

__all__ = ["rope_cached"]

#: widest head (rotated or not) for the one-position matrix form; wider heads use the table form
MATRIX_MAX_DIM = 256
#: settings kept in the cache (least recently used ones are dropped)
MAX_SETTINGS = 16
#: smallest table, in positions (tables grow by doubling)
MIN_POSITIONS = 256


class _Table:
    """Cosines and sines of one setting for positions ``[0, size)``, and arrays derived from them."""

    def __init__(self, dims, base, scale, traditional, inv_freqs):
        self.dims, self.base, self.scale, self.traditional = dims, base, scale, traditional
        self.inv = inv_freqs  # float32 [dims / 2]
        self.size = 0
        self.cos = self.sin = None  # float32 numpy [size, dims / 2]
        self.full = {}  # dtype -> (C, S) mx arrays [size, dims]
        self.recent = OrderedDict()  # (form, offset, size, dtype) -> derived arrays for those positions

    def ensure(self, n):
        if n <= self.size:
            return
        size = max(MIN_POSITIONS, 1 << math.ceil(math.log2(n)))
        # Positions and angles rounded to float32 as mx.fast.rope computes them; the trigonometry in
        # float64, rounded once.
        pos = np.arange(size, dtype=np.float32) * np.float32(self.scale)
        theta = (pos[:, None] * self.inv[None, :]).astype(np.float64)
        self.cos = np.cos(theta).astype(np.float32)
        self.sin = np.sin(theta).astype(np.float32)
        self.size = size
        self.full.clear()
        self.recent.clear()

    def _interleave(self, a, b):
        """Full-width rows from per-pair values: halves ``[a, b]`` or pairs ``(a0, b0, a1, b1, ...)``."""
        if self.traditional:
            return np.stack([a, b], axis=-1).reshape(a.shape[0], -1)
        return np.concatenate([a, b], axis=-1)

    def full_tables(self, dtype):
        """``C = [cos, cos]`` and ``S = [-sin, sin]`` (arranged as the pairs are) ``[size, dims]``."""
        if dtype not in self.full:
            c = self._interleave(self.cos, self.cos)
            s = self._interleave(-self.sin, self.sin)
            self.full[dtype] = (mx.array(c).astype(dtype), mx.array(s).astype(dtype))
        return self.full[dtype]

    def rotation(self, offset, width, dtype):
        """``R [width, width]`` with ``x @ R`` = RoPE of a row ``x`` at position ``offset`` (the
        features past ``dims`` pass through)."""
        h = self.dims // 2
        c, s = self.cos[offset], self.sin[offset]
        r = np.eye(width, dtype=np.float32)
        idx = np.arange(h)
        first, second = (2 * idx, 2 * idx + 1) if self.traditional else (idx, idx + h)
        # y[first] = x[first] c - x[second] s;  y[second] = x[first] s + x[second] c
        r[first, first] = c
        r[second, first] = -s
        r[first, second] = s
        r[second, second] = c
        return mx.array(r).astype(dtype)

    def derived(self, key, make):
        """A per-position array, kept for the last few positions (every layer of a step asks for the
        same one)."""
        if key in self.recent:
            self.recent.move_to_end(key)
            return self.recent[key]
        value = make()
        self.recent[key] = value
        if len(self.recent) > 8:
            self.recent.popitem(last=False)
        return value


_TABLES: OrderedDict = OrderedDict()


def _inv_freqs(dims, base, freqs):
    if freqs is not None:
        periods = np.asarray(freqs, dtype=np.float32).reshape(-1)
        if periods.shape != (dims // 2,):
            raise ValueError(f"rope: freqs must have dims / 2 = {dims // 2} values, got shape {periods.shape}")
        return (np.float32(1.0) / periods).astype(np.float32)
    # base ** (-2i / dims) as mx.fast.rope spells it: exp(-i * log(base) / (dims / 2)), float32 exponent
    exponent = np.arange(0, -(dims // 2), -1, dtype=np.float32) * np.float32(math.log(base) / (dims // 2))
    return np.exp(exponent.astype(np.float64)).astype(np.float32)


def _table(dims, base, scale, traditional, freqs):
    fkey = None if freqs is None else np.asarray(freqs, dtype=np.float32).tobytes()
    key = (dims, float(base), float(scale), bool(traditional), fkey)
    table = _TABLES.get(key)
    if table is None:
        table = _Table(dims, base, scale, traditional, _inv_freqs(dims, base, freqs))
        _TABLES[key] = table
        if len(_TABLES) > MAX_SETTINGS:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return table


def _swap(x, dims, traditional):
    """``x [..., dims]`` with the two members of each rotated pair exchanged."""
    if traditional:
        pairs = x.reshape(*x.shape[:-1], dims // 2, 2)
        return pairs[..., ::-1].reshape(x.shape)
    h = dims // 2
    return mx.concatenate([x[..., h:], x[..., :h]], axis=-1)


def rope_cached(x, dims: int, traditional: bool, base: float, scale: float, offset: int, freqs=None):
    """RoPE of ``x [..., T, D]`` at positions ``offset + t`` (an int ``offset >= 0``) from cached tables."""
    T, D = x.shape[-2], x.shape[-1]
    table = _table(dims, base, scale, traditional, freqs)
    table.ensure(offset + T)
    if T == 1 and D <= MATRIX_MAX_DIM:
        r = table.derived(("matrix", offset, D, x.dtype), lambda: table.rotation(offset, D, x.dtype))
        return x @ r
    c, s = table.derived(("rows", offset, T, x.dtype),
                         lambda: tuple(t[offset:offset + T] for t in table.full_tables(x.dtype)))
    rot = x[..., :dims] if dims < D else x
    y = rot * c + _swap(rot, dims, traditional) * s
    return mx.concatenate([y, x[..., dims:]], axis=-1) if dims < D else y
