"""Decoder blocks: `TransformerBlock` (Llama: pre-norm RMSNorm, RoPE attention, SwiGLU) and
`GPT2Block` (pre-norm LayerNorm, fused-qkv attention, GELU MLP).

Parameter names follow Hugging Face, so a stack of blocks loads a checkpoint's
``model.layers.<i>.*`` / ``transformer.h.<i>.*`` tensors by name.
"""

from __future__ import annotations

from ..data import Data
from .attention import CachedLayer, GPT2Attention, SelfAttention
from .mlp import GPT2MLP, SwiGluFfn
from .norm import LayerNorm, RMSNorm


class TransformerBlock(CachedLayer):
    """``h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``.

    Input and output dims ``(W=dim, H=positions, D=batch)``.

    Args:
        n_heads, n_kv_heads, head_dim: attention heads (see `SelfAttention`).
        intermediate: SwiGLU hidden width.
        eps: RMSNorm epsilon.
        attention_bias: biases on q/k/v/o projections.
        mlp_bias: biases on the SwiGLU projections.
        activation: SwiGLU gate activation (``silu``).
        causal, rope_base, rope_traditional, rope_scale, rope_freqs, rope_dims: passed to `SelfAttention`.
    """

    fixed_axes = ("W",)

    def __init__(self, n_heads: int, intermediate: int, n_kv_heads: int | None = None, head_dim: int | None = None,
                 eps: float = 1e-5, attention_bias: bool = False, mlp_bias: bool = False, activation: str = "silu",
                 causal: bool = True, rope_base: float = 10000.0, rope_traditional: bool = False,
                 rope_scale: float = 1.0, rope_freqs=None, rope_dims: int | None = None, init="xavier_normal"):
        super().__init__()
        self.input_layernorm = RMSNorm(eps)
        self.self_attn = SelfAttention(n_heads, n_kv_heads, head_dim, bias=attention_bias, causal=causal,
                                       rope_base=rope_base, rope_traditional=rope_traditional,
                                       rope_scale=rope_scale, rope_freqs=rope_freqs, rope_dims=rope_dims, init=init)
        self.post_attention_layernorm = RMSNorm(eps)
        self.mlp = SwiGluFfn(intermediate, bias=mlp_bias, activation=activation, init=init)

    def forward(self, device, data, cache=None):
        h = self.compile_child("input_layernorm", self.input_layernorm, device, data)
        h = self.compile_child("self_attn", self.self_attn, device, h, cache)
        x = data.array + h.array
        h = self.compile_child("post_attention_layernorm", self.post_attention_layernorm, device, Data(x, data.dims))
        h = self.compile_child("mlp", self.mlp, device, h)
        return Data(x + h.array, data.dims)


class GPT2Block(CachedLayer):
    """``h = x + attn(ln_1(x)); out = h + mlp(ln_2(h))`` with GPT-2's names.

    Args:
        n_heads: attention heads.
        intermediate: MLP hidden width (GPT-2: ``4 * W``).
        eps: LayerNorm epsilon.
        scale: attention score scale (default ``head_dim ** -0.5``).
        activation: MLP activation (``gelu_tanh``, GPT-2's ``gelu_new``).
    """

    fixed_axes = ("W",)

    def __init__(self, n_heads: int, intermediate: int, eps: float = 1e-5, scale: float | None = None,
                 activation: str = "gelu_tanh", init="xavier_normal"):
        super().__init__()
        self.ln_1 = LayerNorm(eps)
        self.attn = GPT2Attention(n_heads, scale=scale, init=init)
        self.ln_2 = LayerNorm(eps)
        self.mlp = GPT2MLP(intermediate, activation=activation, init=init)

    def forward(self, device, data, cache=None):
        h = self.compile_child("ln_1", self.ln_1, device, data)
        h = self.compile_child("attn", self.attn, device, h, cache)
        x = data.array + h.array
        h = self.compile_child("ln_2", self.ln_2, device, Data(x, data.dims))
        h = self.compile_child("mlp", self.mlp, device, h)
        return Data(x + h.array, data.dims)
