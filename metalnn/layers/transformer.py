"""Pre-norm decoder blocks: `DecoderBlock` (any token mixer and feed-forward), `TransformerBlock`
(the Llama block: RoPE attention and SwiGLU) and `SandwichBlock` (Gemma's: norms before and after
each branch).

Parameter names follow Hugging Face, so a stack of blocks loads a checkpoint's
``model.layers.<i>.*`` tensors by name.
"""

from __future__ import annotations

import mlx.core as mx

from .. import functional as F
from ..data import Data
from .attention import KVCache, SelfAttention
from .base import Layer, parameter_epoch
from .dropout import Dropout
from .embedding import Embedding
from .ggml import GGMLEmbedding, GGMLLinear
from .linear import Linear
from .mlp import MLP, SwiGLU
from .norm import RMSNorm


# (Called for every block at every decoding step: parameters are read as the layers' dict items,
# which is several times faster than mlx.nn.Module's attribute fallback.)


def _projection(layer):
    """``(weight, GGUF type id or -1 for float32, bias or None)`` of a projection the fused decoding
    step can run (a packed GGML or a plain float32 layer), else None."""
    kind = type(layer)
    if kind is not GGMLLinear and kind is not Linear:
        return None
    w = layer["weight"]
    bias = layer["bias"] if layer.use_bias else None
    if kind is GGMLLinear:
        return w, layer.qtype.type_id, bias
    return (w, -1, bias) if w.dtype == mx.float32 else None


def step_gain(norm):
    """The RMSNorm's gain ``weight + offset`` as the fused decoding step takes it, or None for a
    norm the fused step cannot run."""
    if type(norm) is not RMSNorm or not norm.affine:
        return None
    return norm["weight"] + norm.offset if norm.offset else norm["weight"]


def step_matrix(layer):
    """``(weight [rows, D], GGUF type id or -1 for float32)`` of a token table (a float32
    `Embedding`, a `GGMLEmbedding`: the fused decoding step's lookup, or its output head when tied)
    or an output head without bias (as `_projection` takes it) that the fused decoding step can
    run; else None."""
    kind = type(layer)
    if kind is GGMLEmbedding:
        return layer["weight"], layer.qtype.type_id
    if kind is Embedding:
        w = layer["weight"]
        return (w, -1) if w.dtype == mx.float32 else None
    p = _projection(layer)
    return None if p is None or p[2] is not None else p[:2]


class DecoderBlock(Layer):
    """``h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``.

    Input and output dims ``(W=dims, H=positions, D=batch)``; a plain array ``[B, T, dims]``.
    ``cache=`` is passed to the token mixer (a `KVCache` for attention, a `GatedDeltaCache` for
    `GatedDeltaNet`).

    Args:
        mixer: the token-mixing layer (`SelfAttention`, `GatedDeltaNet`, ...).
        mlp: the position-wise layer (`SwiGLU`, `SparseMoE`, ...).
        mixer_name: the mixer's parameter prefix (``self_attn``; Hugging Face's hybrid models
            call their linear-attention layers ``linear_attn``).
        eps: RMSNorm epsilon.
        norm_offset: gain offset of both norms (see `RMSNorm`; 1 for zero-centred gains).
        dtype: dtype of the norm weights.
    """

    fixed_axes = ("W",)
    is_block = True

    positional_hint = "{cls}(mixer, mlp, mixer_name=..., eps=...)"

    def __init__(self, mixer: Layer, mlp: Layer, *, mixer_name: str = "self_attn", eps: float = 1e-5,
                 norm_offset: float = 0.0, dtype=None):
        super().__init__()
        if mixer_name in ("input_layernorm", "post_attention_layernorm", "mlp") or not mixer_name.isidentifier():
            raise ValueError(f"DecoderBlock: mixer_name must be an identifier other than the block's own names, got "
                             f"{mixer_name!r}")
        self.mixer_name = mixer_name
        self.input_layernorm = RMSNorm(eps=eps, offset=norm_offset, dtype=dtype)
        setattr(self, mixer_name, mixer)
        self.post_attention_layernorm = RMSNorm(eps=eps, offset=norm_offset, dtype=dtype)
        self.mlp = mlp

    @property
    def mixer(self) -> Layer:
        return self[self.mixer_name]

    def forward(self, device, data, cache=None):
        if isinstance(cache, KVCache) and data.dims.H == 1:
            out = self._fused_step(device, data, cache)
            if out is not None:
                return Data(out, data.dims)
        h = self.compile_child(self.input_layernorm, device, data)
        h = self.compile_child(self.mixer, device, h, cache=cache)
        x = data.array + h.array
        h = self.compile_child(self.post_attention_layernorm, device, Data(x, data.dims))
        h = self.compile_child(self.mlp, device, h)
        return Data(x + h.array, data.dims)


    def _step_plan(self):
        """The block as `metalnn.functional.BlockStep` (for decoding one position), or None when its
        layers are not of the form the fused step runs (RMSNorms, `SelfAttention` without an output
        gate, soft-cap or attention sinks, a gated `MLP` without active dropout; float32 or GGML
        projections, no adapters). YaRN's attention factor is part of the attention's ``scale``."""
        attn, mlp = self[self.mixer_name], self["mlp"]
        if (type(attn) is not SelfAttention or attn.output_gate or not attn.causal or attn.head_dim is None
                or attn.softcap is not None or attn.use_sinks):
            return None
        if type(mlp) not in (MLP, SwiGLU) or not mlp.is_gated:
            return None
        dropout = mlp["dropout"]
        if isinstance(dropout, Dropout) and dropout.p and dropout.training:
            return None
        norm1, norm2 = self["input_layernorm"], self["post_attention_layernorm"]
        gains = (step_gain(norm1), step_gain(norm2))
        if gains[0] is None or gains[1] is None or norm1.eps != norm2.eps:
            return None
        projections = tuple(_projection(p) for p in (attn["q_proj"], attn["k_proj"], attn["v_proj"], attn["o_proj"],
                                                     mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"]))
        if None in projections:  # (tuples compare by identity first: no array == None)
            return None
        qk_gains = None
        if attn.qk_norm:
            qk_gains = (step_gain(attn["q_norm"]), step_gain(attn["k_norm"]))
            if qk_gains[0] is None or qk_gains[1] is None:
                return None
        return F.BlockStep(
            gains=gains, eps=norm1.eps, projections=projections, heads=attn.num_heads,
            kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            rope_dims=(attn.rope_dims or attn.head_dim) if attn.use_rope else 0,
            rope_traditional=attn.rope_traditional, rope_base=attn.rope_base, rope_scale=attn.rope_scale,
            rope_freqs=attn._rope_freqs, attn_scale=attn.scale, window=attn.sliding_window, qk_gains=qk_gains,
            qk_eps=attn.norm_eps, activation=mlp.gate_activation)

    def fused_step_plan(self):
        """The block as a `metalnn.functional.BlockStep` for decoding one position (kept until a
        parameter changes), or None when the fused step does not run it (see `_step_plan`) or its
        layers are not built yet (their first call builds them)."""
        if not (self["input_layernorm"].built and self[self.mixer_name].built and self["post_attention_layernorm"].built
                and self["mlp"].built):
            return None
        key = (parameter_epoch(), self.training)
        cached = self.__dict__.get("_step_plan_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        plan = self._step_plan()
        object.__setattr__(self, "_step_plan_cache", (key, plan))  # (kept outside the module's parameter tree)
        return plan

    def _fused_step(self, device, data, cache):
        """One decoding position through `metalnn.functional.decoder_block_step` (the whole block as
        one fused op where it applies); None when it does not (the caller runs the layers)."""
        plan = self.fused_step_plan()
        if plan is None:
            return None
        return F.decoder_block_step(data.array, plan, cache, device=device)


class TransformerBlock(DecoderBlock):
    """The Llama decoder block: a `DecoderBlock` of `SelfAttention` (``self_attn``) and `SwiGLU`
    (``mlp``).

    Input and output dims ``(W=dims, H=positions, D=batch)``; a plain array ``[B, T, dims]``.
    ``cache=`` (a `KVCache`) decodes incrementally.

    Args:
        num_heads: attention heads.
        mlp_dims: SwiGLU hidden width (Hugging Face's ``intermediate_size``).
        num_kv_heads, head_dim: see `SelfAttention`.
        eps: RMSNorm epsilon (also of the q/k norms with ``qk_norm``).
        attention_bias: biases on the q/k/v projections; ``attention_out_bias`` (default: the same)
            on o_proj (Qwen2 has q/k/v biases only).
        mlp_bias: biases on the SwiGLU projections.
        activation: SwiGLU gate activation (``silu``).
        causal, rope, rope_base, rope_traditional, rope_scale, rope_freqs, rope_dims, rope_attention_factor:
            see `SelfAttention`
            (``rope=False``: a block without position embeddings, as SmolLM3's NoPE layers).
        qk_norm, sliding_window: see `SelfAttention` (Qwen3's q/k norms, Mistral's window).
        init, dtype: initializer and dtype of the projections.
    """

    positional_hint = "{cls}({num_heads}, {mlp_dims}, num_kv_heads=...)"

    def __init__(self, num_heads: int, mlp_dims: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, eps: float = 1e-5, attention_bias: bool = False,
                 attention_out_bias: bool | None = None, mlp_bias: bool = False, activation: str = "silu",
                 causal: bool = True, rope: bool = True, rope_base: float = 10000.0, rope_traditional: bool = False,
                 rope_scale: float = 1.0, rope_freqs=None, rope_dims: int | None = None,
                 rope_attention_factor: float = 1.0, qk_norm: bool = False, sliding_window: int | None = None,
                 init=None, dtype=None):
        attn = SelfAttention(num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=attention_bias,
                             out_bias=attention_out_bias, causal=causal, rope=rope, rope_base=rope_base,
                             rope_traditional=rope_traditional, rope_scale=rope_scale, rope_freqs=rope_freqs,
                             rope_dims=rope_dims, rope_attention_factor=rope_attention_factor, qk_norm=qk_norm,
                             sliding_window=sliding_window, norm_eps=eps, init=init, dtype=dtype)
        mlp = SwiGLU(mlp_dims, bias=mlp_bias, activation=activation, init=init, init_out=init, dtype=dtype)
        super().__init__(attn, mlp, eps=eps, dtype=dtype)


class SandwichBlock(Layer):
    """A decoder block with norms before and after each branch (Gemma 2 and 3)::

        h   = x + post_attention_layernorm(self_attn(input_layernorm(x)))
        out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

    Input and output dims ``(W=dims, H=positions, D=batch)``; a plain array ``[B, T, dims]``.
    ``cache=`` (a `KVCache`) is passed to the attention. The fused decoding step of `DecoderBlock`
    does not run it (its norms around the branches' outputs are no part of that step).

    Args:
        attn: the token mixer (``self_attn``, a `SelfAttention`).
        mlp: the position-wise layer (``mlp``, a gated `MLP`).
        eps: RMSNorm epsilon of the four norms.
        norm_offset: gain offset of the four norms (1 for Gemma's ``1 + weight``; see `RMSNorm`).
        dtype: dtype of the norm weights.
    """

    fixed_axes = ("W",)
    is_block = True
    positional_hint = "{cls}(attn, mlp, eps=..., norm_offset=...)"

    def __init__(self, attn: Layer, mlp: Layer, *, eps: float = 1e-6, norm_offset: float = 0.0, dtype=None):
        super().__init__()
        kw = dict(eps=eps, offset=norm_offset, dtype=dtype)
        self.input_layernorm = RMSNorm(**kw)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(**kw)
        self.pre_feedforward_layernorm = RMSNorm(**kw)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(**kw)

    def forward(self, device, data, cache=None):
        h = self.compile_child(self.input_layernorm, device, data)
        h = self.compile_child(self.self_attn, device, h, cache=cache)
        h = self.compile_child(self.post_attention_layernorm, device, h)
        x = data.array + h.array
        h = self.compile_child(self.pre_feedforward_layernorm, device, Data(x, data.dims))
        h = self.compile_child(self.mlp, device, h)
        h = self.compile_child(self.post_feedforward_layernorm, device, h)
        return Data(x + h.array, data.dims)
