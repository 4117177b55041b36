"""Qwen3.5 text model (`Qwen3_5ForCausalLM`): a hybrid of Gated DeltaNet linear-attention layers and
gated full-attention layers (zero-centred RMSNorms) with dense SwiGLU feed-forward blocks.

Each decoder layer is a `DecoderBlock` whose token mixer is chosen by ``layer_types``:

* ``linear_attention``: `GatedDeltaNet` with Qwen3.5's separate input projections
  (``model.layers.<i>.linear_attn.in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``,
  ``A_log``, ``dt_bias``, ``norm``, ``out_proj``);
* ``full_attention``: `SelfAttention` (``self_attn.*``) with q/k RMSNorm, partial rotary embeddings
  (``partial_rotary_factor``, 0.25 by default) and an output gate from a doubled ``q_proj``.

It reads a ``qwen3_5_text`` config, or the ``text_config`` of a ``qwen3_5`` folder
(``Qwen3_5ForConditionalGeneration``): the language model's tensors (``model.language_model.*``) load
as ``model.*``; the vision tower (``model.visual.*``) and the multi-token-prediction tensors
(``mtp.*``) are not used. `save_pretrained` writes a text-only ``Qwen3_5ForCausalLM`` folder. GGUF
files: ``qwen35`` (`metalnn.llm.gguf.converters.qwen35`).

Caches: a `GatedDeltaCache` per linear-attention layer and a `KVCache` per full-attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.base import Layer
from ...layers.mlp import SwiGLU
from ...layers.transformer import DecoderBlock
from ..gguf.converters.qwen35 import Qwen35Converter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import build_decoder
from .hybrid import NORM_OFFSET, Qwen35Text, derive_hybrid_layout, hybrid_mixer
from .registry import register


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``Qwen3_5TextConfig`` that metalnn reads (absent ones take
    transformers' defaults, except the linear-attention sizes, which a model with linear-attention
    layers must give).

    ``layer_types`` (``linear_attention`` / ``full_attention``; when absent every
    ``full_attention_interval``-th layer is full attention); the Gated DeltaNet sizes
    ``linear_num_key_heads``, ``linear_num_value_heads`` (a multiple of the key heads),
    ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``; every
    feed-forward block is a `SwiGLU` of ``intermediate_size``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int | None = None
    layer_types: list | None = None
    full_attention_interval: int = 4
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int = 4
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 0.25
    #: `SelfAttention`'s RoPE keywords and each layer's kind (derived)
    rope: dict = field(init=False, repr=False)
    kinds: list = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            refuse("hidden_act", self.hidden_act, ", ".join(ACTIVATIONS))
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        derive_hybrid_layout(self)


def decoder_layer(args: ModelArgs, layer: int, init) -> Layer:
    """Decoder block ``layer``: its mixer (``linear_attn`` or ``self_attn``) and a `SwiGLU` between
    zero-centred RMSNorms."""
    mixer, name = hybrid_mixer(args, layer, separate_projections=True, init=init)
    mlp = SwiGLU(args.intermediate_size, activation=args.hidden_act, init=init, init_out=init)
    return DecoderBlock(mixer, mlp, mixer_name=name, eps=args.rms_norm_eps, norm_offset=NORM_OFFSET)


@register("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", model_types=("qwen3_5_text", "qwen3_5"),
          gguf=Qwen35Converter)
class Qwen3_5ForCausalLM(Qwen35Text, CausalLM):
    """Qwen3.5 (dense text model) built from a Hugging Face ``Qwen3_5TextConfig`` dict, or from a
    ``Qwen3_5Config`` whose ``text_config`` holds it (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`
    of `DecoderBlock` s.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        build_decoder(self, args, lambda i, init: decoder_layer(args, i, init), norm_offset=NORM_OFFSET)
