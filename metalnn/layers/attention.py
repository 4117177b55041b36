"""`SelfAttention` (Llama-style: RoPE, GQA, KV cache) and its `KVCache`.

It takes sequences as `Data` with dims ``(W=features, H=positions, D=batch)`` (a plain array
``[B, T, F]``) and returns the same dims. For decoding, pass a `KVCache` as ``cache=``: the new
positions' keys and values are appended to it and the queries attend to everything cached so far,
so each new token costs one projection of that token plus one pass over the cache (no recompute).

Options used by the Llama relatives: per-head RMSNorm of queries and keys (Qwen3, Qwen3-Next,
Qwen3.5, Gemma 3), partial rotary dimensions (``rope_dims``), a sigmoid output gate produced by a doubled
``q_proj`` (Qwen3-Next, Qwen3.5), a sliding attention window (Mistral, Qwen2, Gemma), soft-capped
attention scores (Gemma 2), attention sinks and YaRN's attention factor (gpt-oss).
"""

from __future__ import annotations


import mlx.core as mx

from .. import functional as F
from .. import init as initializers
from ..data import Data, MTLSize
from .base import Layer
from .linear import Linear, float_dtype
from .norm import RMSNorm


class KVCache:
    """Keys and values of the positions seen so far, for one attention layer.

    Storage grows in blocks of ``step`` positions (below ``step``, to the next power of two, at
    least ``first``, so a short generation does not hold 256 positions) and new entries are
    written in place, so appending one token does not copy the whole cache. ``offset`` is the
    number of cached positions (the position of the next token).

    ``keys`` / ``values`` (``[B, Hkv, capacity, head_dim]``) are the cache's own buffers. The fused
    decoding step of a whole stack of blocks instead keeps every layer's keys and values in one
    buffer, written by one graph node a token, and `bind` s the caches to it; reading or assigning
    ``keys`` or ``values`` ends the binding (the cache then owns views of what it held, so code that
    updates them in place updates the cache).
    """

    step = 256
    first = 16

    def __init__(self):
        self._store = None
        self._slot = 0
        self._keys = None
        self._values = None
        self.offset = 0

    @property
    def keys(self):
        if self._store is not None:
            self.unbind()
        return self._keys

    @keys.setter
    def keys(self, value):
        self.unbind()
        self._keys = value

    @property
    def values(self):
        if self._store is not None:
            self.unbind()
        return self._values

    @values.setter
    def values(self, value):
        self.unbind()
        self._values = value

    @property
    def store(self):
        """The shared buffer this cache is bound to (see `bind`), or None."""
        return self._store

    def bind(self, store, slot: int):
        """Keep this cache's keys and values in ``store`` until `unbind`: ``store.keys(slot)`` and
        ``store.values(slot)`` give them (``[B, Hkv, capacity, head_dim]``; ``store`` holds what the
        cache held, its own buffers are dropped). The owner of ``store`` writes new positions there
        and counts them with `count_written`; `offset` and the lengths stay the cache's.
        `update_and_fetch` writes into the store too (``store.write(slot, start, k, v)``, which may
        decline: the cache then takes its keys and values back first)."""
        self._store, self._slot = store, int(slot)
        self._keys = self._values = None

    def _write_to_store(self, start: int, k, v):
        """For a bound cache: ``k``, ``v`` written at ``start`` in its store and counted; returns
        all cached keys and values (as `update_and_fetch`). None (nothing done) for an unbound cache
        or where the store declines them."""
        if self._store is None or not self._store.write(self._slot, start, k, v):
            return None
        self.count_written(k.shape[2])
        n = self.offset
        return self._store.keys(self._slot)[..., :n, :], self._store.values(self._slot)[..., :n, :]

    def unbind(self):
        """End a `bind`: the cache takes views of its keys and values in the store as its own buffers."""
        store = self._store
        if store is not None:
            self._store = None
            self._keys, self._values = store.keys(self._slot), store.values(self._slot)

    def buffers_for(self, batch: int, kv_heads: int, head_dim: int, t: int, dtype, value_dim: int | None = None):
        """The key and value buffers ``[batch, kv_heads, capacity, head_dim]`` with room for ``t`` more
        positions after ``offset`` (grown as `capacity` says, the cached positions copied over);
        ``value_dim`` (default ``head_dim``): the values' last axis, when it differs (multi-head
        latent attention caches its latent as keys and its rotary key as values)."""
        prev = self.offset
        if self.keys is None or prev + t > self.keys.shape[2]:
            cap = self.capacity(prev + t)
            shape = (batch, kv_heads, cap, head_dim)
            nk = mx.zeros(shape, dtype)
            nv = mx.zeros(shape[:3] + (value_dim or head_dim,), dtype)
            if self.keys is not None and prev:
                nk[..., :prev, :] = self.keys[..., :prev, :]
                nv[..., :prev, :] = self.values[..., :prev, :]
            self.keys, self.values = nk, nv
        return self.keys, self.values

    def capacity(self, n: int) -> int:
        """Room for ``n`` positions: the next power of two (at least ``first``) while below ``step``,
        else a multiple of ``step``."""
        small = max(self.first, 1 << max(n - 1, 0).bit_length())
        return small if small < self.step else -(-n // self.step) * self.step

    def advance(self, keys, values, t: int):
        """Take ``keys`` / ``values`` (the buffers of `buffers_for` with ``t`` new positions written
        after ``offset``) as the cache."""
        self.keys, self.values = keys, values
        self.count_written(t)

    def count_written(self, t: int):
        """Count ``t`` new positions written after ``offset`` into the buffers in place (a bound
        cache's store, see `bind`)."""
        self.offset += t

    def update_and_fetch(self, k, v):
        """Append ``k``, ``v`` (``[B, Hkv, T, head_dim]``; ``v``'s last axis may differ); return all
        cached keys and values."""
        prev, t = self.offset, k.shape[2]
        stored = self._write_to_store(prev, k, v)
        if stored is not None:
            return stored
        keys, values = self.buffers_for(k.shape[0], k.shape[1], k.shape[3], t, k.dtype, v.shape[3])
        keys[..., prev:prev + t, :] = k
        values[..., prev:prev + t, :] = v
        self.advance(keys, values, t)
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    @property
    def positions(self):
        """The position of the next token: ``offset`` (a `BatchKVCache` gives one per row)."""
        return self.offset

    def write_rows(self, k, v):
        """Write one new position ``k``, ``v`` ``[B, Hkv, 1, head_dim]`` at ``offset`` of the buffers of
        `buffers_for` (in place once nothing else holds them) and count it."""
        n = self.offset
        self.keys[:, :, n:n + 1, :] = k
        self.values[:, :, n:n + 1, :] = v
        self.offset += 1

    def key_mask(self, t: int = 1, window: int | None = None):
        """Which cached columns each query may attend to beyond the causal mask: None (one sequence,
        or sequences of one length; see `BatchKVCache`)."""
        return None

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
    """``[B, T, n*hd]`` -> ``[B, n, T, hd]`` (one position: a reshape, no transpose op)."""
    if t == 1:
        return x.reshape(b, n, 1, hd)
    return x.reshape(b, t, n, hd).transpose(0, 2, 1, 3)


def merge_heads(o, b, t):
    """``[B, n, T, hd]`` -> ``[B, T, n*hd]`` (one position: a reshape, no transpose op)."""
    if t == 1:
        return o.reshape(b, 1, -1)
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
        qk_norm: RMS-normalise each query and key head before RoPE, with learned gains ``q_norm``
            and ``k_norm`` ``[head_dim]`` (`RMSNorm` with ``norm_eps`` and ``norm_offset``).
        output_gate: ``q_proj`` also produces a gate: its rows are, per head, ``head_dim`` query rows
            then ``head_dim`` gate rows (``[num_heads*2*head_dim, W]``), and the attention output
            is multiplied by ``sigmoid(gate)`` before ``o_proj``.
        sliding_window: each position attends only to the last ``sliding_window`` positions
            (itself included); None attends to all earlier positions.
        norm_eps, norm_offset: epsilon and gain offset of the q/k norms (see `RMSNorm`).
        softcap: soft-cap the scaled scores to ``softcap * tanh(score / softcap)`` (Gemma 2's
            ``attn_logit_softcapping``); None leaves them.
        sinks: a learned logit per query head, ``sinks`` ``[num_heads]``, joins each row of scores in
            the softmax's denominator (it takes probability mass and contributes no value; gpt-oss's
            attention sinks).
        rope_attention_factor: multiplies the rotated queries and keys (YaRN's attention factor on
            cos and sin), applied as its square on ``scale``.
        init: initializer of the projections (default `Linear`'s).
        dtype: parameter dtype.
    """

    fixed_axes = ("W",)

    positional_hint = "{cls}({num_heads}, num_kv_heads=...)"

    def __init__(self, num_heads: int, *, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = False, out_bias: bool | None = None, causal: bool = True, rope: bool = True,
                 rope_base: float = 10000.0, rope_traditional: bool = False, rope_scale: float = 1.0, rope_freqs=None,
                 rope_dims: int | None = None, scale: float | None = None, qk_norm: bool = False,
                 output_gate: bool = False, sliding_window: int | None = None, norm_eps: float = 1e-6,
                 norm_offset: float = 0.0, softcap: float | None = None, sinks: bool = False,
                 rope_attention_factor: float = 1.0, init=None, dtype=None):
        super().__init__()
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
        self.qk_norm = bool(qk_norm)
        self.output_gate = bool(output_gate)
        if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) <= 0):
            raise ValueError(f"SelfAttention: sliding_window must be a positive int or None, got {sliding_window!r}")
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        self.norm_eps = float(norm_eps)
        self.norm_offset = float(norm_offset)
        if softcap is not None and (isinstance(softcap, bool) or not float(softcap) > 0):
            raise ValueError(f"SelfAttention: softcap must be a positive number or None, got {softcap!r}")
        self.softcap = None if softcap is None else float(softcap)
        self.use_sinks = bool(sinks)
        self.rope_attention_factor = float(rope_attention_factor)
        if not self.rope_attention_factor > 0:
            raise ValueError(f"SelfAttention: rope_attention_factor must be positive, got {rope_attention_factor!r}")
        self._base_scale = scale
        if self.head_dim is not None:
            self._set_scale()
        self._init, self._dtype = init, dtype

    def _set_scale(self):
        """``scale`` with YaRN's attention factor folded in (squared: it multiplies queries and keys)."""
        f = self.rope_attention_factor
        if f != 1.0:
            base = self._base_scale if self._base_scale is not None else self.head_dim ** -0.5
            self.scale = base * f * f

    def build(self, device, dims, dtype):
        if self.head_dim is None:
            self.require(dims.W % self.num_heads == 0, f"a width divisible by num_heads={self.num_heads}",
                         f"W={dims.W}")
            self.head_dim = dims.W // self.num_heads
            self._set_scale()
        hd, kw = self.head_dim, dict(init=self._init, dtype=self._dtype)
        self.q_proj = Linear(self.num_heads * hd * (2 if self.output_gate else 1), bias=self.use_bias, **kw)
        self.k_proj = Linear(self.num_kv_heads * hd, bias=self.use_bias, **kw)
        self.v_proj = Linear(self.num_kv_heads * hd, bias=self.use_bias, **kw)
        self.o_proj = Linear(dims.W, bias=self.out_bias, **kw)
        if self.qk_norm:
            nkw = dict(eps=self.norm_eps, offset=self.norm_offset, dtype=self._dtype)
            self.q_norm = RMSNorm(hd, **nkw)
            self.k_norm = RMSNorm(hd, **nkw)
        if self.use_sinks:
            init = initializers.get(self._init, initializers.Zeros())
            self.sinks = init((self.num_heads,), hd, 1, device.next_key(), self._dtype or float_dtype(dtype))

    def _head_norm(self, name, norm, device, x):
        """Per-head RMSNorm of ``x`` ``[B, T, n*hd]`` (each head normalised over its ``hd``)."""
        b, t = x.shape[0], x.shape[1]
        y = self.compile_child(norm, device, Data(x.reshape(b, -1, self.head_dim))).array
        return y.reshape(b, t, -1)

    def _window_mask(self, t, k, v):
        """Drop the keys no query can see and give the sliding-window part of the mask (the causal
        part is the attention op's). Queries are the last ``t`` of the ``k.shape[2]`` positions."""
        w, tk = self.sliding_window, k.shape[2]
        start = max(0, tk - t - w + 1)
        k, v = k[..., start:, :], v[..., start:, :]
        if t == 1:
            return k, v, None
        q_pos = mx.arange(tk - t, tk)[:, None]
        k_pos = mx.arange(start, tk)[None, :]
        return k, v, k_pos > q_pos - w

    def _project(self, device, data):
        """Queries, keys and values ``[B, T, rows]`` of ``data`` (a subclass with other projections
        overrides this)."""
        q = self.compile_child(self.q_proj, device, data).array
        k = self.compile_child(self.k_proj, device, data).array
        v = self.compile_child(self.v_proj, device, data).array
        return q, k, v

    def _rotate(self, x, offset, device):
        """RoPE of queries or keys ``[B, n, T, head_dim]`` whose first position is ``offset`` (an int, or
        ``[B]`` per row; a subclass with another rotary scheme overrides this)."""
        return F.rope(x, self.rope_dims or self.head_dim, self.rope_traditional, self.rope_base, self.rope_scale,
                      offset, self._rope_freqs, device=device)

    def forward(self, device, data, cache=None):
        d = data.dims
        b, t, hd = d.D, d.H, self.head_dim
        q, k, v = self._project(device, data)
        gate = None
        if self.output_gate:
            qg = q.reshape(b, t, self.num_heads, 2 * hd)
            q, gate = qg[..., :hd].reshape(b, t, -1), qg[..., hd:].reshape(b, t, -1)
        if self.qk_norm:
            q = self._head_norm("q_norm", self.q_norm, device, q)
            k = self._head_norm("k_norm", self.k_norm, device, k)
        q = split_heads(q, b, t, self.num_heads, hd)
        k = split_heads(k, b, t, self.num_kv_heads, hd)
        v = split_heads(v, b, t, self.num_kv_heads, hd)
        offset = cache.positions if cache is not None else 0
        if self.use_rope:
            q, k = self._rotate(q, offset, device), self._rotate(k, offset, device)
        mask = None
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
            # sequences of different lengths: [B, 1, t, Tk], each row's causal past (and window)
            mask = cache.key_mask(t, self.sliding_window)
        if mask is None and self.sliding_window is not None:
            k, v, mask = self._window_mask(t, k, v)
        o = F.attention(q, k, v, scale=self.scale, causal=self.causal, mask=mask, softcap=self.softcap,
                        sinks=self["sinks"] if self.use_sinks else None, device=device)
        o = merge_heads(o, b, t)
        if gate is not None:
            o = o * F.activation(gate, "sigmoid", device=device)
        o = Data(o, MTLSize(self.num_heads * hd, t, b))
        return self.compile_child(self.o_proj, device, o)

    def _extra_repr(self):
        extra = "".join(f", {k}=True" for k in ("qk_norm", "output_gate") if getattr(self, k))
        if self.sliding_window is not None:
            extra += f", sliding_window={self.sliding_window}"
        if self.softcap is not None:
            extra += f", softcap={self.softcap}"
        if self.use_sinks:
            extra += ", sinks=True"
        if self.rope_attention_factor != 1.0:
            extra += f", rope_attention_factor={self.rope_attention_factor:g}"
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"rope={self.use_rope}" + extra)
