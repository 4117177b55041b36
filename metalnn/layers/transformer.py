"""`TransformerBlock`: the Llama decoder block (pre-norm RMSNorm, RoPE attention, SwiGLU).

Parameter names follow Hugging Face, so a stack of blocks loads a checkpoint's
``model.layers.<i>.*`` tensors by name.
"""

from __future__ import annotations

from ..data import Data
from ..layer import Layer, no_positional
from .attention import SelfAttention
from .mlp import SwiGLU
from .norm import RMSNorm


class TransformerBlock(Layer):
    """``h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``.

    Input and output dims ``(W=dims, H=positions, D=batch)``; a plain array ``[B, T, dims]``.
    ``cache=`` (a `KVCache`) decodes incrementally.

    Args:
        num_heads: attention heads.
        mlp_dims: SwiGLU hidden width (Hugging Face's ``intermediate_size``).
        num_kv_heads, head_dim: see `SelfAttention`.
        eps: RMSNorm epsilon.
        attention_bias: biases on the q/k/v/o projections.
        mlp_bias: biases on the SwiGLU projections.
        activation: SwiGLU gate activation (``silu``).
        causal, rope_base, rope_traditional, rope_scale, rope_freqs, rope_dims: see `SelfAttention`.
        init, dtype: initializer and dtype of the projections.
    """

    fixed_axes = ("W",)
    is_block = True

    def __init__(self, num_heads: int, mlp_dims: int, *extra, num_kv_heads: int | None = None,
                 head_dim: int | None = None, eps: float = 1e-5, attention_bias: bool = False, mlp_bias: bool = False,
                 activation: str = "silu", causal: bool = True, rope_base: float = 10000.0,
                 rope_traditional: bool = False, rope_scale: float = 1.0, rope_freqs=None, rope_dims: int | None = None,
                 init=None, dtype=None):
        super().__init__()
        no_positional("TransformerBlock", extra, f"TransformerBlock({num_heads}, {mlp_dims}, num_kv_heads=...)")
        self.input_layernorm = RMSNorm(eps=eps, dtype=dtype)
        self.self_attn = SelfAttention(num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=attention_bias,
                                       causal=causal, rope_base=rope_base, rope_traditional=rope_traditional,
                                       rope_scale=rope_scale, rope_freqs=rope_freqs, rope_dims=rope_dims, init=init,
                                       dtype=dtype)
        self.post_attention_layernorm = RMSNorm(eps=eps, dtype=dtype)
        self.mlp = SwiGLU(mlp_dims, bias=mlp_bias, activation=activation, init=init, init_out=init, dtype=dtype)

    def forward(self, device, data, cache=None):
        h = self.compile_child("input_layernorm", self.input_layernorm, device, data)
        h = self.compile_child("self_attn", self.self_attn, device, h, cache=cache)
        x = data.array + h.array
        h = self.compile_child("post_attention_layernorm", self.post_attention_layernorm, device, Data(x, data.dims))
        h = self.compile_child("mlp", self.mlp, device, h)
        return Data(x + h.array, data.dims)
