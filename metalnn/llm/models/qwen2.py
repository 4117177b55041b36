"""Qwen2 / Qwen2.5 decoder (`Qwen2ForCausalLM`): the Llama block with biases on the q/k/v projections
and an optional sliding attention window on some layers.

Parameter names equal Hugging Face's (``model.layers.<i>.self_attn.q_proj.bias``, ...). GGUF files:
``qwen2`` (`metalnn.llm.gguf.converters.qwen2`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.base import Layer
from ...layers.transformer import TransformerBlock
from ..gguf.converters.qwen2 import Qwen2Converter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import build_decoder, sliding_windows
from .registry import register
from .rope import rope_options


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``Qwen2Config`` that metalnn reads (absent ones take these defaults).

    As Llama's, except the bias keys: q/k/v projections always carry biases and o_proj never does,
    the MLP none (as in transformers). ``use_sliding_window``, ``sliding_window``,
    ``max_window_layers`` and ``layer_types`` (``full_attention`` / ``sliding_attention``) decide which
    layers attend within a window (`sliding_windows`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: list | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    #: `SelfAttention`'s RoPE keywords and each layer's attention window (derived)
    rope: dict = field(init=False, repr=False)
    windows: list = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            refuse("hidden_act", self.hidden_act, ", ".join(ACTIVATIONS))
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.rope = rope_options(self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                 rope_parameters=self.rope_parameters, partial_rotary_factor=self.partial_rotary_factor)
        self.windows = sliding_windows(self.num_hidden_layers, use_sliding_window=self.use_sliding_window,
                                       sliding_window=self.sliding_window, max_window_layers=self.max_window_layers,
                                       layer_types=self.layer_types)


def decoder_layer(args: ModelArgs, layer: int, init) -> Layer:
    """Decoder block ``layer``: the Llama block with q/k/v biases and that layer's attention window."""
    return TransformerBlock(args.num_attention_heads, args.intermediate_size, num_kv_heads=args.num_key_value_heads,
                            head_dim=args.head_dim, eps=args.rms_norm_eps, attention_bias=True,
                            attention_out_bias=False, activation=args.hidden_act,
                            sliding_window=args.windows[layer], init=init, **args.rope)


@register("Qwen2ForCausalLM", model_types=("qwen2",), gguf=Qwen2Converter)
class Qwen2ForCausalLM(CausalLM):
    """Qwen2 / Qwen2.5 built from a Hugging Face ``Qwen2Config`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        build_decoder(self, args, lambda i, init: decoder_layer(args, i, init))
