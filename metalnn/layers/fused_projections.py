"""Layers whose projections are stored fused, as Phi-3's checkpoints hold them: `FusedQKVAttention`
(one ``qkv_proj`` for queries, keys and values) and `FusedGateUpMLP` (one ``gate_up_proj`` for the
gate and the up projection), with `LongRoPE` (Phi-3's rotary scaling: per-frequency factors, short
ones up to the pretraining length and long ones past it, and an attention factor on the rotated
features).

Keeping the projections fused keeps Hugging Face's parameter names, so checkpoints load by name and
LoRA targets (``qkv_proj``, ``gate_up_proj``) mean what they mean in PEFT.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import functional as F
from ..data import Data
from .attention import SelfAttention
from .linear import Linear
from .mlp import GATED, MLP


class LongRoPE:
    """LongRoPE (Phi-3's ``rope_type: longrope``) as transformers computes it.

    The frequency ``i`` of the ``dims`` rotated features is ``1 / (factor_i * base ** (2i / dims))``
    with the short factors while every position of a call is below ``original_length``, with the long
    factors when a call reaches past it (transformers' rule: a call's largest position picks one set for
    the whole call; rows of a batch with per-row positions pick their own). The rotated features are
    multiplied by ``attention_factor`` (transformers scales cos and sin; ``sqrt(1 + log(s) / log(L))``
    for a context extension ``s = max_position_embeddings / L``, ``L = original_length``).

    Args:
        dims: rotated features per head (even).
        base: rope theta.
        short_factors, long_factors: ``dims // 2`` per-frequency divisors each.
        original_length: the pretraining context length ``L``.
        attention_factor: the multiplier of the rotated features.
    Raises:
        ValueError: factors that are not ``dims // 2`` positive numbers each, naming which.
    """

    def __init__(self, dims: int, base: float, short_factors, long_factors, original_length: int,
                 attention_factor: float = 1.0):
        self.dims, self.base = int(dims), float(base)
        self.original_length = int(original_length)
        self.attention_factor = float(attention_factor)
        exponents = np.arange(0, self.dims, 2, dtype=np.float32) / np.float32(self.dims)
        powers = np.float32(self.base) ** exponents
        periods = []
        for name, factors in (("short_factors", short_factors), ("long_factors", long_factors)):
            f = np.asarray(factors, dtype=np.float32)
            if f.shape != (self.dims // 2,) or not (f > 0).all():
                raise ValueError(f"LongRoPE: {name} must be {self.dims // 2} positive numbers (one per frequency of "
                                 f"{self.dims} rotated features), got shape {f.shape}")
            periods.append(mx.array(powers * f, dtype=mx.float32))
        self.short_periods, self.long_periods = periods

    def __call__(self, x, offset, device=None):
        """Rotate ``x`` ``[B, n, T, head_dim]`` whose first position is ``offset`` (an int, a 0-d array, or
        ``[B]`` per row)."""
        t = x.shape[-2]
        if isinstance(offset, int):
            periods = self.long_periods if offset + t > self.original_length else self.short_periods
            y = F.rope(x, self.dims, False, self.base, 1.0, offset, periods, device=device)
        else:
            offset = offset if isinstance(offset, mx.array) else mx.array(offset)
            short = F.rope(x, self.dims, False, self.base, 1.0, offset, self.short_periods, device=device)
            long = F.rope(x, self.dims, False, self.base, 1.0, offset, self.long_periods, device=device)
            past = offset + t > self.original_length
            if past.ndim == 1:
                past = past.reshape(-1, *([1] * (x.ndim - 1)))
            y = mx.where(past, long, short)
        if self.attention_factor != 1.0:
            if self.dims == x.shape[-1]:
                y = y * self.attention_factor
            else:
                y = mx.concatenate([y[..., :self.dims] * self.attention_factor, y[..., self.dims:]], axis=-1)
        return y

    def __repr__(self):
        return (f"LongRoPE(dims={self.dims}, original_length={self.original_length}, "
                f"attention_factor={self.attention_factor:.6g})")


class FusedQKVAttention(SelfAttention):
    """`SelfAttention` with one ``qkv_proj`` ``[(num_heads + 2 * num_kv_heads) * head_dim, W]`` whose rows
    are the queries', then the keys', then the values' (Phi-3's layout), and ``o_proj``.

    Args:
        num_heads: query heads.
        long_rope: a `LongRoPE` that replaces the plain rotary embedding, or None.
        **kwargs: `SelfAttention`'s other options (``num_kv_heads``, ``head_dim``, ``bias``, the RoPE
            options, ``sliding_window``, ``init``, ``dtype``); ``qk_norm`` and ``output_gate`` are not
            supported.
    Raises:
        ValueError: ``qk_norm`` or ``output_gate`` given.
    """

    positional_hint = "{cls}({num_heads}, num_kv_heads=...)"

    def __init__(self, num_heads: int, *, long_rope: LongRoPE | None = None, **kwargs):
        for option in ("qk_norm", "output_gate"):
            if kwargs.get(option):
                raise ValueError(f"FusedQKVAttention: {option} is not supported (got {option}=True)")
        super().__init__(num_heads, **kwargs)
        self.long_rope = long_rope

    def build(self, device, dims, dtype):
        if self.head_dim is None:
            self.require(dims.W % self.num_heads == 0, f"a width divisible by num_heads={self.num_heads}",
                         f"W={dims.W}")
            self.head_dim = dims.W // self.num_heads
        kw = dict(init=self._init, dtype=self._dtype)
        self.qkv_proj = Linear((self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=self.use_bias, **kw)
        self.o_proj = Linear(dims.W, bias=self.out_bias, **kw)

    def _project(self, device, data):
        qkv = self.compile_child(self.qkv_proj, device, data).array
        q_end = self.num_heads * self.head_dim
        k_end = q_end + self.num_kv_heads * self.head_dim
        return qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]

    def _rotate(self, x, offset, device):
        if self.long_rope is None:
            return super()._rotate(x, offset, device)
        return self.long_rope(x, offset, device=device)

    def _extra_repr(self):
        return super()._extra_repr() + ("" if self.long_rope is None else f", long_rope={self.long_rope!r}")


class FusedGateUpMLP(MLP):
    """The gated MLP ``down_proj(act(gate) * up)`` with one ``gate_up_proj`` ``[2 * hidden_dims, W]`` whose
    first ``hidden_dims`` rows give the gate and the others the up projection (Phi-3's layout), and
    ``down_proj`` ``[W, hidden_dims]``.

    Args:
        hidden_dims: hidden width (Hugging Face's ``intermediate_size``).
        activation: the gate's activation (``silu``: SwiGLU; ``gelu``, ``gelu_tanh``, ``sigmoid``,
            ``relu``: the other gated variants of `MLP`).
        bias, dropout, init, init_out, dtype, dims: as `MLP`.
    Raises:
        ValueError: an activation no gated variant uses.
    """

    positional_hint = "{cls}({hidden_dims}, activation=...)"

    def __init__(self, hidden_dims: int, *, activation: str = "silu", bias: bool = False, dropout: float = 0.0,
                 init=None, init_out=None, dtype=None, dims: int | None = None):
        variants = {v: k for k, v in GATED.items()}
        if activation not in variants:
            raise ValueError(f"FusedGateUpMLP: the gate activation must be one of {sorted(variants)}, got "
                             f"{activation!r}")
        super().__init__(dims, activation=variants[activation], hidden_dims=hidden_dims, dropout=dropout, bias=bias,
                         init=init, init_out=init_out, dtype=dtype)

    def _create(self, dims, in_features=None):
        self.dims = dims
        kw = dict(bias=self.use_bias, dtype=self._dtype)
        self.gate_up_proj = Linear(2 * self.hidden_dims, in_features=in_features, init=self._init, **kw)
        self.down_proj = Linear(dims, in_features=None if in_features is None else self.hidden_dims,
                                init=self._init_out, **kw)

    def forward(self, device, data):
        gate_up = self.compile_child(self.gate_up_proj, device, data).array
        gate, up = gate_up[..., :self.hidden_dims], gate_up[..., self.hidden_dims:]
        h = F.gated_activation(gate, up, self.gate_activation, device=device)
        h = self.compile_child(self.dropout, device, Data(h, data.dims._replace(W=self.hidden_dims)))
        return self.compile_child(self.down_proj, device, h)
