"""`SelfAttention` (Llama-style: RoPE, GQA, KV cache) and its `KVCache`.

It takes sequences as `Data` with dims ``(W=features, H=positions, D=batch)`` (a plain array
``[B, T, F]``) and returns the same dims. For decoding, pass a `KVCache` as ``cache=``: the new
positions' keys and values are appended to it and the queries attend to everything cached so far,
so each new token costs one projection of that token plus one pass over the cache (no recompute).
"""

from __future__ import annotations

import math

import mlx.core as mx

from .. import functional as F
from ..data import Data, MTLSize
from ..layer import Layer, no_positional
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


def split_heads(x, b, t, n, hd):
    """``[B, T, n*hd]`` -> ``[B, n, T, hd]``."""
    return x.reshape(b, t, n, hd).transpose(0, 2, 1, 3)


def merge_heads(o, b, t):
    """``[B, n, T, hd]`` -> ``[B, T, n*hd]``."""
    return o.transpose(0, 2, 1, 3).reshape(b, t, -1)


class SelfAttention(Layer):
    """Multi-head self-attention with rotary positions, grouped-query heads and a KV cache.

    Parameters (Hugging Face Llama names): ``q_proj`` ``[num_heads*head_dim, W]``, ``k_proj`` and
    ``v_proj`` ``[num_kv_heads*head_dim, W]``, ``o_proj`` ``[W, num_heads*head_dim]``, each with an
    optional bias.

    Args:
        num_heads: query heads.
        num_kv_heads: key/value heads (default ``num_heads``); ``num_heads`` must be a multiple of it.
        head_dim: width of one head (default ``W // num_heads``).
        bias: biases on the q/k/v projections; ``out_bias`` (default: same as ``bias``) on o_proj.
        causal: each position attends only to itself and earlier positions.
        rope: apply rotary position embeddings to queries and keys.
        rope_base, rope_traditional, rope_scale, rope_freqs, rope_dims: as `metalnn.functional.rope`
            (``rope_dims`` defaults to ``head_dim``; ``rope_freqs`` are periods, for custom scalings
            such as Llama 3's).
        scale: score scale (default ``head_dim ** -0.5``).
        init: initializer of the projections (default `Linear`'s).
        dtype: parameter dtype.
    """

    fixed_axes = ("W",)

    def __init__(self, num_heads: int, *extra, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = False, out_bias: bool | None = None, causal: bool = True, rope: bool = True,
                 rope_base: float = 10000.0, rope_traditional: bool = False, rope_scale: float = 1.0, rope_freqs=None,
                 rope_dims: int | None = None, scale: float | None = None, init=None, dtype=None):
        super().__init__()
        no_positional("SelfAttention", extra, f"SelfAttention({num_heads}, num_kv_heads=...)")
        self.num_heads = int(num_heads)
        self.num_kv_heads = int(num_kv_heads or num_heads)
        if self.num_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"SelfAttention: num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
                             f"({num_kv_heads})")
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
        self._init, self._dtype = init, dtype

    def build(self, device, dims, dtype):
        if self.head_dim is None:
            self.require(dims.W % self.num_heads == 0, f"a width divisible by num_heads={self.num_heads}",
                         f"W={dims.W}")
            self.head_dim = dims.W // self.num_heads
        hd, kw = self.head_dim, dict(init=self._init, dtype=self._dtype)
        self.q_proj = Linear(self.num_heads * hd, bias=self.use_bias, **kw)
        self.k_proj = Linear(self.num_kv_heads * hd, bias=self.use_bias, **kw)
        self.v_proj = Linear(self.num_kv_heads * hd, bias=self.use_bias, **kw)
        self.o_proj = Linear(dims.W, bias=self.out_bias, **kw)

    def forward(self, device, data, cache=None):
        d = data.dims
        b, t, hd = d.D, d.H, self.head_dim
        q = self.compile_child("q_proj", self.q_proj, device, data).array
        k = self.compile_child("k_proj", self.k_proj, device, data).array
        v = self.compile_child("v_proj", self.v_proj, device, data).array
        q = split_heads(q, b, t, self.num_heads, hd)
        k = split_heads(k, b, t, self.num_kv_heads, hd)
        v = split_heads(v, b, t, self.num_kv_heads, hd)
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
        o = Data(merge_heads(o, b, t), MTLSize(self.num_heads * hd, t, b))
        return self.compile_child("o_proj", self.o_proj, device, o)

    def _extra_repr(self):
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"rope={self.use_rope}")
