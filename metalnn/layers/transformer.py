"""Pre-norm decoder blocks: `DecoderBlock` (any token mixer and feed-forward) and `TransformerBlock`
(the Llama block: RoPE attention and SwiGLU).

Parameter names follow Hugging Face, so a stack of blocks loads a checkpoint's
``model.layers.<i>.*`` tensors by name.
"""

from __future__ import annotations

from ..data import Data
from .base import Layer
from .attention import SelfAttention
from .mlp import SwiGLU
from .norm import RMSNorm


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
        h = self.compile_child(self.input_layernorm, device, data)
        h = self.compile_child(self.mixer, device, h, cache=cache)
        x = data.array + h.array
        h = self.compile_child(self.post_attention_layernorm, device, Data(x, data.dims))
        h = self.compile_child(self.mlp, device, h)
        return Data(x + h.array, data.dims)


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
        causal, rope_base, rope_traditional, rope_scale, rope_freqs, rope_dims: see `SelfAttention`.
        qk_norm, sliding_window: see `SelfAttention` (Qwen3's q/k norms, Mistral's window).
        init, dtype: initializer and dtype of the projections.
    """

    positional_hint = "{cls}({num_heads}, {mlp_dims}, num_kv_heads=...)"

    def __init__(self, num_heads: int, mlp_dims: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, eps: float = 1e-5, attention_bias: bool = False,
                 attention_out_bias: bool | None = None, mlp_bias: bool = False, activation: str = "silu",
                 causal: bool = True, rope_base: float = 10000.0, rope_traditional: bool = False,
                 rope_scale: float = 1.0, rope_freqs=None, rope_dims: int | None = None, qk_norm: bool = False,
                 sliding_window: int | None = None, init=None, dtype=None):
        attn = SelfAttention(num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=attention_bias,
                             out_bias=attention_out_bias, causal=causal, rope_base=rope_base,
                             rope_traditional=rope_traditional, rope_scale=rope_scale, rope_freqs=rope_freqs,
                             rope_dims=rope_dims, qk_norm=qk_norm, sliding_window=sliding_window, norm_eps=eps,
                             init=init, dtype=dtype)
        mlp = SwiGLU(mlp_dims, bias=mlp_bias, activation=activation, init=init, init_out=init, dtype=dtype)
        super().__init__(attn, mlp, eps=eps, dtype=dtype)
