"""Attention layers: `SelfAttention` (Llama-style: RoPE, GQA, KV cache) and `GPT2Attention`.

Both take sequences as `Data` with dims ``(W=features, H=positions, D=batch)`` and return the same
dims. For decoding, pass a `KVCache` to ``compile(device, data, cache=...)``: the new positions'
keys and values are appended to it and the queries attend to everything cached so far, so each
new token costs one projection of that token plus one pass over the cache (no recompute).
"""

from __future__ import annotations

import math

import mlx.core as mx

from .. import functional as F
from ..data import Data, MTLSize
from ..layer import Layer
from .linear import Linear


class KVCache:
    """Keys and values of the positions seen so far, for one attention layer.

    Storage grows in blocks of ``step`` positions and new entries are written in place, so
    appending one token does not copy the whole cache. ``offset`` is the number of cached
    positions (the position of the next token).
    """

    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, k, v):
        """Append ``k``, ``v`` (``[B, Hkv, T, head_dim]``); return all cached keys and values."""
        prev, t = self.offset, k.shape[2]
        if self.keys is None or prev + t > self.keys.shape[2]:
            cap = ((prev + t + self.step - 1) // self.step) * self.step
            nk = mx.zeros(k.shape[:2] + (cap, k.shape[3]), k.dtype)
            nv = mx.zeros(v.shape[:2] + (cap, v.shape[3]), v.dtype)
            if self.keys is not None and prev:
                nk[..., :prev, :] = self.keys[..., :prev, :]
                nv[..., :prev, :] = self.values[..., :prev, :]
            self.keys, self.values = nk, nv
        self.keys[..., prev:prev + t, :] = k
        self.values[..., prev:prev + t, :] = v
        self.offset = prev + t
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions; returns how many were dropped."""
        n = min(self.offset, max(0, int(n)))
        self.offset -= n
        return n

    def reset(self):
        self.keys = self.values = None
        self.offset = 0

    @property
    def state(self):
        if self.keys is None:
            return []
        return [self.keys[..., :self.offset, :], self.values[..., :self.offset, :]]

    def __repr__(self):
        return f"KVCache(offset={self.offset})"


class CachedLayer(Layer):
    """A `Layer` whose ``compile`` (and ``forward``) take an optional ``cache`` for decoding."""

    def compile(self, device, data, cache=None):
        return super().compile(device, data, cache=cache)

    def forward(self, device, data, cache=None):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def compile_child(self, name, child, device, data, cache=None):
        """Compile a sub-layer; a `CachedLayer` child also gets ``cache``."""
        child._path = f"{self._path}.{name}" if self._path else name
        if isinstance(child, CachedLayer):
            return child.compile(device, data, cache)
        return child.compile(device, data)


def _heads(x, b, t, n, hd):
    """``[B, T, n*hd]`` -> ``[B, n, T, hd]``."""
    return x.reshape(b, t, n, hd).transpose(0, 2, 1, 3)


def _merge(o, b, t):
    """``[B, n, T, hd]`` -> ``[B, T, n*hd]``."""
    return o.transpose(0, 2, 1, 3).reshape(b, t, -1)


class SelfAttention(CachedLayer):
    """Multi-head self-attention with rotary positions, grouped-query heads and a KV cache.

    Parameters (Hugging Face Llama names): ``q_proj`` ``[n_heads*head_dim, W]``, ``k_proj`` and
    ``v_proj`` ``[n_kv_heads*head_dim, W]``, ``o_proj`` ``[W, n_heads*head_dim]``, each with an
    optional bias.

    Args:
        n_heads: query heads.
        n_kv_heads: key/value heads (default ``n_heads``); ``n_heads`` must be a multiple of it.
        head_dim: width of one head (default ``W // n_heads``).
        bias: biases on the q/k/v projections; ``out_bias`` (default: same as ``bias``) on o_proj.
        causal: each position attends only to itself and earlier positions.
        rope: apply rotary position embeddings to queries and keys.
        rope_base, rope_traditional, rope_scale, rope_freqs, rope_dims: as `metalnn.functional.rope`
            (``rope_dims`` defaults to ``head_dim``; ``rope_freqs`` are periods, for custom scalings
            such as Llama 3's).
        scale: score scale (default ``head_dim ** -0.5``).
        init: initializer of the projections (default Xavier normal).
    """

    fixed_axes = ("W",)

    def __init__(self, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None, bias: bool = False,
                 out_bias: bool | None = None, causal: bool = True, rope: bool = True, rope_base: float = 10000.0,
                 rope_traditional: bool = False, rope_scale: float = 1.0, rope_freqs=None,
                 rope_dims: int | None = None, scale: float | None = None, init="xavier_normal"):
        super().__init__()
        self.n_heads = int(n_heads)
        self.n_kv_heads = int(n_kv_heads or n_heads)
        if self.n_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"SelfAttention: n_heads ({n_heads}) must be a positive multiple of n_kv_heads "
                             f"({n_kv_heads})")
        self.head_dim = int(head_dim) if head_dim else None
        self.use_bias = bool(bias)
        self.out_bias = self.use_bias if out_bias is None else bool(out_bias)
        self.causal = causal
        self.use_rope = rope
        self.rope_base = float(rope_base)
        self.rope_traditional = rope_traditional
        self.rope_scale = float(rope_scale)
        self._rope_freqs = None if rope_freqs is None else mx.array(rope_freqs, dtype=mx.float32)
        self.rope_dims = rope_dims
        self.scale = scale
        self._init = init

    def build(self, device, dims, dtype):
        if self.head_dim is None:
            self.require(dims.W % self.n_heads == 0, f"a width divisible by n_heads={self.n_heads}", f"W={dims.W}")
            self.head_dim = dims.W // self.n_heads
        if "q_proj" not in self:
            hd = self.head_dim
            self.q_proj = Linear(self.n_heads * hd, bias=self.use_bias, init=self._init)
            self.k_proj = Linear(self.n_kv_heads * hd, bias=self.use_bias, init=self._init)
            self.v_proj = Linear(self.n_kv_heads * hd, bias=self.use_bias, init=self._init)
            self.o_proj = Linear(dims.W, bias=self.out_bias, init=self._init)

    def forward(self, device, data, cache=None):
        d = data.dims
        b, t, hd = d.D, d.H, self.head_dim
        q = self.compile_child("q_proj", self.q_proj, device, data).array
        k = self.compile_child("k_proj", self.k_proj, device, data).array
        v = self.compile_child("v_proj", self.v_proj, device, data).array
        q = _heads(q, b, t, self.n_heads, hd)
        k = _heads(k, b, t, self.n_kv_heads, hd)
        v = _heads(v, b, t, self.n_kv_heads, hd)
        offset = cache.offset if cache is not None else 0
        if self.use_rope:
            rd = self.rope_dims or hd
            q = F.rope(q, rd, self.rope_traditional, self.rope_base, self.rope_scale, offset, self._rope_freqs,
                       device=device)
            k = F.rope(k, rd, self.rope_traditional, self.rope_base, self.rope_scale, offset, self._rope_freqs,
                       device=device)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = F.attention(q, k, v, scale=self.scale, causal=self.causal, device=device)
        o = Data(_merge(o, b, t), MTLSize(self.n_heads * hd, t, b))
        return self.compile_child("o_proj", self.o_proj, device, o)

    def _extra_repr(self):
        return (f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"rope={self.use_rope}")


class GPT2Attention(CachedLayer):
    """GPT-2's causal multi-head attention: one fused ``c_attn`` projection to q, k, v and ``c_proj``.

    No rotary embeddings (GPT-2 adds learned positions to the input). ``c_attn.weight`` is
    ``[3W, W]`` in metalnn's ``[out, in]`` layout; Hugging Face stores GPT-2's as ``[in, out]``
    (its ``Conv1D``), which the GPT-2 model transposes on load and save.

    Args:
        n_heads: attention heads (``W`` must be divisible by it).
        bias: biases on both projections (GPT-2 has them).
        scale: score scale (default ``head_dim ** -0.5``).
    """

    fixed_axes = ("W",)

    def __init__(self, n_heads: int, bias: bool = True, causal: bool = True, scale: float | None = None,
                 init="xavier_normal"):
        super().__init__()
        self.n_heads = int(n_heads)
        self.use_bias = bias
        self.causal = causal
        self.scale = scale
        self._init = init

    def build(self, device, dims, dtype):
        self.require(dims.W % self.n_heads == 0, f"a width divisible by n_heads={self.n_heads}", f"W={dims.W}")
        if "c_attn" not in self:
            self.c_attn = Linear(3 * dims.W, bias=self.use_bias, init=self._init)
            self.c_proj = Linear(dims.W, bias=self.use_bias, init=self._init)

    def forward(self, device, data, cache=None):
        d = data.dims
        b, t, n = d.D, d.H, self.n_heads
        hd = d.W // n
        qkv = self.compile_child("c_attn", self.c_attn, device, data).array
        q, k, v = mx.split(qkv, 3, axis=-1)
        q, k, v = (_heads(a, b, t, n, hd) for a in (q, k, v))
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(hd)
        o = F.attention(q, k, v, scale=scale, causal=self.causal, device=device)
        o = Data(_merge(o, b, t), d)
        return self.compile_child("c_proj", self.c_proj, device, o)
