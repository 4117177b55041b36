"""Qwen3-Next (`Qwen3NextForCausalLM`): a hybrid of Gated DeltaNet linear-attention layers and gated
full-attention layers, with sparse mixture-of-experts feed-forward blocks.

Each decoder layer is a `DecoderBlock` (zero-centred RMSNorms: gain ``1 + weight``) whose token
mixer is chosen by ``layer_types``:

* ``linear_attention``: `GatedDeltaNet` (``model.layers.<i>.linear_attn.*``: ``in_proj_qkvz``,
  ``in_proj_ba``, ``conv1d``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj``);
* ``full_attention``: `SelfAttention` (``self_attn.*``) with q/k RMSNorm, partial rotary embeddings
  (``partial_rotary_factor``, 0.25 by default) and an output gate from a doubled ``q_proj``.

The feed-forward block of layer ``i`` is a `SparseMoE` (``mlp.gate``, ``mlp.experts``,
``mlp.shared_expert``, ``mlp.shared_expert_gate``) when ``num_experts > 0``, ``i`` is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; a `SwiGLU` of
``intermediate_size`` otherwise.

Checkpoints store each expert separately (``mlp.experts.<e>.gate_proj.weight``, ...): they are
stacked on load and split again by `save_pretrained`; multi-token-prediction tensors (``mtp.*``) are
not used and dropped. GGUF files: ``qwen3next`` (`metalnn.llm.gguf.converters.qwen3next`).

Caches: `make_cache` gives a `GatedDeltaCache` (convolution tail and recurrent state) for each
linear-attention layer and a `KVCache` for each full-attention layer; the prompt runs the chunked
gated delta rule, each decoded token one recurrent step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.base import Layer
from ...layers.mlp import SwiGLU
from ...layers.moe import SparseMoE
from ...layers.transformer import DecoderBlock
from ..gguf.converters.qwen3next import Qwen3NextConverter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import build_decoder
from .experts import RoutedExperts
from .hybrid import NORM_OFFSET, HybridLayers, derive_hybrid_layout, hybrid_mixer
from .registry import register


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``Qwen3NextConfig`` that metalnn reads (absent ones take
    transformers' defaults, except the linear-attention sizes, which a model with linear-attention
    layers must give).

    ``layer_types`` (``linear_attention`` / ``full_attention``; when absent every
    ``full_attention_interval``-th layer is full attention); the Gated DeltaNet sizes
    ``linear_num_key_heads``, ``linear_num_value_heads`` (a multiple of the key heads),
    ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``; the experts
    ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``shared_expert_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``,
    ``mlp_only_layers``; ``output_router_logits`` (keep the router logits of each call for
    `Qwen3NextForCausalLM.aux_loss`) and ``router_aux_loss_coef`` (its weight in a training loss).
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
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list | None = None
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
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
        if self.decoder_sparse_step <= 0:
            refuse("decoder_sparse_step", self.decoder_sparse_step, "a positive integer")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        derive_hybrid_layout(self)

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s feed-forward block is a `SparseMoE`."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


def decoder_layer(args: ModelArgs, layer: int, init) -> Layer:
    """Decoder block ``layer``: its mixer (``linear_attn`` or ``self_attn``) and its feed-forward
    (`SparseMoE` or `SwiGLU`) between zero-centred RMSNorms."""
    mixer, name = hybrid_mixer(args, layer, separate_projections=False, init=init)
    if args.is_sparse(layer):
        mlp = SparseMoE(args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                        norm_topk_prob=args.norm_topk_prob,
                        shared_expert_dims=args.shared_expert_intermediate_size or None, activation=args.hidden_act,
                        record_router_logits=args.output_router_logits, init=init)
    else:
        mlp = SwiGLU(args.intermediate_size, activation=args.hidden_act, init=init, init_out=init)
    return DecoderBlock(mixer, mlp, mixer_name=name, eps=args.rms_norm_eps, norm_offset=NORM_OFFSET)


@register("Qwen3NextForCausalLM", model_types=("qwen3_next",), gguf=Qwen3NextConverter)
class Qwen3NextForCausalLM(HybridLayers, RoutedExperts, CausalLM):
    """Qwen3-Next built from a Hugging Face ``Qwen3NextConfig`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`
    of `DecoderBlock` s.

    The experts' API (stacking on load, splitting on save, ``output_router_logits`` and
    ``aux_loss`` for training with the load-balancing loss) is `RoutedExperts`'.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        build_decoder(self, args, lambda i, init: decoder_layer(args, i, init), norm_offset=NORM_OFFSET)

    # -- weights -----------------------------------------------------------------------------------
    def rename_weight(self, name):
        if name.startswith("mtp."):
            return None
        return super().rename_weight(name)

