"""`LatentAttention`: multi-head latent attention (MLA, DeepSeek-V2 / V3), whose cache holds one
compressed latent per position instead of every head's keys and values.

For hidden states ``x`` ``[B, T, W]`` (Hugging Face's ``DeepseekV3Attention`` names):

* queries ``[B, H, T, nope + rope]``: ``q_proj(x)``, or with a query rank
  ``q_b_proj(q_a_layernorm(q_a_proj(x)))``; each head's first ``qk_nope_head_dim`` features carry no
  position, the last ``qk_rope_head_dim`` are rotated;
* ``kv_a_proj_with_mqa(x)`` ``[B, T, kv_lora_rank + rope]``: the latent ``c = kv_a_layernorm(...)``
  ``[B, T, kv_lora_rank]`` and one rotated key ``k_rot`` ``[B, T, rope]`` shared by all heads;
* ``kv_b_proj`` ``[H * (nope + v_head_dim), kv_lora_rank]`` expands the latent into each head's
  position-free key ``k_nope`` and value: ``k = [k_nope, k_rot]``;
* ``o = softmax(q k^T * scale) v`` per head, then ``o_proj``.

The cache (a `KVCache`, or a `BatchKVCache` after `merge_rows`) holds the latent as its "keys"
``[B, 1, T, kv_lora_rank]`` and the rotated key as its "values" ``[B, 1, T, rope]``, so rows merge,
split, rewind and go through the prefix cache as any attention cache's do; per-row positions come
from ``cache.positions`` and ``cache.key_mask``.

Two equal ways to attend (the same scores and outputs, summed in another order):

* expanded (no cache, or a ``kv_b_proj`` that is not a plain `Linear`: adapters, quantized
  weights): ``kv_b_proj`` runs on every latent, as transformers does;
* absorbed (with a cache and a plain ``kv_b_proj``): the query's position-free part is taken into
  the latent space (``q_nope @ W_k`` per head, ``W_k`` the key rows of ``kv_b_proj``), every head
  attends to the cached ``[c, k_rot]`` as one shared key/value head (multi-query attention, the
  values being the latent), and the result is taken out through the value rows ``W_v``: a decoded
  token costs one pass over the ``kv_lora_rank + rope`` wide cache, no expansion of the past.
"""

from __future__ import annotations

import mlx.core as mx

from .. import functional as F
from ..data import Data, MTLSize
from .base import Layer
from .linear import Linear
from .norm import RMSNorm


class LatentAttention(Layer):
    """Multi-head latent attention with rotary positions and a latent cache (see the module docstring).

    Input and output dims ``(W=dims, H=positions, D=batch)``; a plain array ``[B, T, dims]``.

    Args:
        num_heads: attention heads H.
        kv_lora_rank: width of the cached latent.
        qk_nope_head_dim, qk_rope_head_dim: position-free and rotated widths of each query/key head.
        v_head_dim: width of each value head.
        q_lora_rank: width of the query bottleneck (``q_a_proj`` -> ``q_a_layernorm`` ->
            ``q_b_proj``); None: one ``q_proj``.
        bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (``attention_bias``).
        rope_base, rope_scale, rope_freqs: as `metalnn.functional.rope`.
        rope_traditional: rotate adjacent pairs (DeepSeek's ``rope_interleave``) instead of halves.
        rope_attention_factor: multiplies the rotated query and key parts (YaRN's attention factor,
            which transformers applies to the cosines and sines).
        scale: score scale (default ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``).
        norm_eps: epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``.
        init: initializer of the projections (default `Linear`'s).
        dtype: parameter dtype.
    """

    fixed_axes = ("W",)

    positional_hint = "{cls}({num_heads}, kv_lora_rank=..., qk_nope_head_dim=..., ...)"

    def __init__(self, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, q_lora_rank: int | None = None, bias: bool = False, rope_base: float = 10000.0,
                 rope_traditional: bool = True, rope_scale: float = 1.0, rope_freqs=None, scale: float | None = None,
                 rope_attention_factor: float = 1.0,
                 norm_eps: float = 1e-6, init=None, dtype=None):
        super().__init__()
        sizes = dict(num_heads=num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                     qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim)
        bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0}
        if q_lora_rank is not None and (isinstance(q_lora_rank, bool) or int(q_lora_rank) <= 0):
            bad["q_lora_rank"] = q_lora_rank
        if "qk_rope_head_dim" not in bad and qk_rope_head_dim % 2:
            bad["qk_rope_head_dim"] = qk_rope_head_dim
        if bad:
            raise ValueError(f"LatentAttention: sizes must be positive integers (qk_rope_head_dim even), got {bad}")
        self.num_heads = int(num_heads)
        self.kv_lora_rank = int(kv_lora_rank)
        self.qk_nope_head_dim = int(qk_nope_head_dim)
        self.qk_rope_head_dim = int(qk_rope_head_dim)
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = int(v_head_dim)
        self.q_lora_rank = None if q_lora_rank is None else int(q_lora_rank)
        self.use_bias = bool(bias)
        self.rope_base = float(rope_base)
        self.rope_traditional = bool(rope_traditional)
        self.rope_scale = float(rope_scale)
        self._rope_freqs = None if rope_freqs is None else mx.array(rope_freqs, dtype=mx.float32)
        self.scale = float(scale) if scale is not None else self.qk_head_dim ** -0.5
        self.rope_attention_factor = float(rope_attention_factor)
        if not self.rope_attention_factor > 0:
            raise ValueError(f"LatentAttention: rope_attention_factor must be positive, got {rope_attention_factor!r}")
        self.norm_eps = float(norm_eps)
        self._init, self._dtype = init, dtype

    def build(self, device, dims, dtype):
        kw = dict(init=self._init, dtype=self._dtype)
        h = self.num_heads
        if self.q_lora_rank is None:
            self.q_proj = Linear(h * self.qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = Linear(self.q_lora_rank, bias=self.use_bias, **kw)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=self.norm_eps, dtype=self._dtype)
            self.q_b_proj = Linear(h * self.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = Linear(self.kv_lora_rank + self.qk_rope_head_dim, bias=self.use_bias, **kw)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=self.norm_eps, dtype=self._dtype)
        self.kv_b_proj = Linear(h * (self.qk_nope_head_dim + self.v_head_dim), bias=False, **kw)
        self.o_proj = Linear(dims.W, bias=self.use_bias, **kw)

    def _rotate(self, x, offset, device):
        """RoPE of ``[B, n, T, rope]`` whose first position is ``offset`` (an int or ``[B]``), times
        ``rope_attention_factor`` (YaRN's factor on the rotated cosines and sines, as transformers)."""
        out = F.rope(x, self.qk_rope_head_dim, self.rope_traditional, self.rope_base, self.rope_scale, offset,
                     self._rope_freqs, device=device)
        return out if self.rope_attention_factor == 1.0 else out * self.rope_attention_factor

    def _queries(self, device, data):
        """``[B, H, T, nope + rope]``."""
        if self.q_lora_rank is None:
            q = self.compile_child(self.q_proj, device, data)
        else:
            q = self.compile_child(self.q_a_proj, device, data)
            q = self.compile_child(self.q_a_layernorm, device, q)
            q = self.compile_child(self.q_b_proj, device, q)
        b, t = data.dims.D, data.dims.H
        return q.array.reshape(b, t, self.num_heads, self.qk_head_dim).transpose(0, 2, 1, 3)

    def absorbs(self, cache) -> bool:
        """Whether a call with ``cache`` attends in the latent space (a cache and a plain float ``kv_b_proj``)."""
        return cache is not None and type(self.kv_b_proj) is Linear

    def forward(self, device, data, cache=None):
        d = data.dims
        b, t, h = d.D, d.H, self.num_heads
        nope, rank = self.qk_nope_head_dim, self.kv_lora_rank
        q = self._queries(device, data)
        q_nope, q_rot = q[..., :nope], q[..., nope:]
        ckv = self.compile_child(self.kv_a_proj_with_mqa, device, data).array
        latent = self.compile_child(self.kv_a_layernorm, device, Data(ckv[..., :rank])).array
        latent = latent.reshape(b, 1, t, rank)
        k_rot = ckv[..., rank:].reshape(b, 1, t, self.qk_rope_head_dim)
        offset = cache.positions if cache is not None else 0
        q_rot, k_rot = self._rotate(q_rot, offset, device), self._rotate(k_rot, offset, device)
        mask = None
        if cache is not None:
            latent, k_rot = cache.update_and_fetch(latent, k_rot)
            mask = cache.key_mask(t)    # rows of different lengths: each query's own causal past
        if self.absorbs(cache):
            o = self._absorbed(device, q_nope, q_rot, latent, k_rot, mask)
        else:
            o = self._expanded(device, q_nope, q_rot, latent, k_rot, mask)
        o = o.transpose(0, 2, 1, 3).reshape(b, t, h * self.v_head_dim)
        return self.compile_child(self.o_proj, device, Data(o, MTLSize(h * self.v_head_dim, t, b)))

    def _expanded(self, device, q_nope, q_rot, latent, k_rot, mask):
        """Attention with the latents ``[B, 1, Tk, rank]`` expanded by ``kv_b_proj``; ``[B, H, T, v]``."""
        b, tk, h = latent.shape[0], latent.shape[2], self.num_heads
        nope, vd = self.qk_nope_head_dim, self.v_head_dim
        rows = latent.reshape(b, tk, self.kv_lora_rank)
        kv = self.compile_child(self.kv_b_proj, device, Data(rows, MTLSize(self.kv_lora_rank, tk, b))).array
        kv = kv.reshape(b, tk, h, nope + vd).transpose(0, 2, 1, 3)
        k = mx.concatenate([kv[..., :nope], mx.broadcast_to(k_rot, (b, h, tk, self.qk_rope_head_dim))], axis=-1)
        v = kv[..., nope:]
        if vd < self.qk_head_dim:  # (values as wide as the keys, as every attention path takes them)
            v = mx.pad(v, [(0, 0), (0, 0), (0, 0), (0, self.qk_head_dim - vd)])
        q = mx.concatenate([q_nope, q_rot], axis=-1)
        if vd > self.qk_head_dim:
            pad = [(0, 0), (0, 0), (0, 0), (0, vd - self.qk_head_dim)]
            q, k = mx.pad(q, pad), mx.pad(k, pad)  # zero features add nothing to the scores
        o = F.attention(q, k, v, scale=self.scale, causal=True, mask=mask, device=device)
        return o[..., :vd]

    def _absorbed(self, device, q_nope, q_rot, latent, k_rot, mask):
        """Attention in the latent space (one shared head ``[c, k_rot]``); ``[B, H, T, v]``."""
        h, nope, rank = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        w = self.kv_b_proj["weight"].reshape(h, nope + self.v_head_dim, rank)
        w_k, w_v = w[:, :nope], w[:, nope:]                                      # [H, nope, rank], [H, v, rank]
        q = mx.concatenate([q_nope @ w_k.astype(q_nope.dtype), q_rot], axis=-1)  # [B, H, T, rank + rope]
        kv = mx.concatenate([latent, k_rot.astype(latent.dtype)], axis=-1)      # [B, 1, Tk, rank + rope]
        o = F.attention(q, kv, kv, scale=self.scale, causal=True, mask=mask, device=device)
        return o[..., :rank] @ w_v.swapaxes(-1, -2).astype(o.dtype)            # [B, H, T, v]

    def _extra_repr(self):
        return (f"num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
                f"v_head_dim={self.v_head_dim}")
