"""Mistral decoder (`MistralForCausalLM`): the Llama block with a sliding attention window.

Parameter names equal Hugging Face's (the same as Llama's). llama.cpp writes Mistral's GGUF files as
``llama``; they load as `LlamaForCausalLM`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.base import Layer
from ...layers.transformer import TransformerBlock
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import build_decoder
from .registry import register
from .rope import rope_options


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``MistralConfig`` that metalnn reads (absent ones take these defaults).

    As Llama's, without the bias keys (Mistral has none), plus ``sliding_window``: when set (not
    null), every position attends only to the last ``sliding_window`` positions, itself included
    (Mistral 7B v0.1 uses 4096; later versions set it to null).
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
    sliding_window: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    #: `SelfAttention`'s RoPE keywords (derived)
    rope: dict = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            refuse("hidden_act", self.hidden_act, ", ".join(ACTIVATIONS))
        if self.sliding_window is not None and self.sliding_window <= 0:
            refuse("sliding_window", self.sliding_window, "a positive integer or null")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.rope = rope_options(self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                 rope_parameters=self.rope_parameters, partial_rotary_factor=self.partial_rotary_factor)


def decoder_layer(args: ModelArgs, init) -> Layer:
    """One Mistral decoder block: the Llama block (no biases) attending within ``sliding_window``."""
    return TransformerBlock(args.num_attention_heads, args.intermediate_size, num_kv_heads=args.num_key_value_heads,
                            head_dim=args.head_dim, eps=args.rms_norm_eps, activation=args.hidden_act,
                            sliding_window=args.sliding_window, init=init, **args.rope)


@register("MistralForCausalLM", model_types=("mistral",))
class MistralForCausalLM(CausalLM):
    """Mistral built from a Hugging Face ``MistralConfig`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        build_decoder(self, args, lambda _, init: decoder_layer(args, init))
