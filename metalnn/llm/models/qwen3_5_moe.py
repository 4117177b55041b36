"""Qwen3.5-MoE text model (`Qwen3_5MoeForCausalLM`): Qwen3.5's hybrid of Gated DeltaNet linear-attention
layers and gated full-attention layers (zero-centred RMSNorms) with a sparse mixture of experts and a
sigmoid-gated shared expert in every layer.

Each decoder layer is a `DecoderBlock` whose token mixer is chosen by ``layer_types``:

* ``linear_attention``: `GatedDeltaNet` with Qwen3.5's separate input projections
  (``model.layers.<i>.linear_attn.in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``,
  ``A_log``, ``dt_bias``, ``norm``, ``out_proj``);
* ``full_attention``: `SelfAttention` (``self_attn.*``) with q/k RMSNorm, partial rotary embeddings
  (``partial_rotary_factor``, 0.25 by default) and an output gate from a doubled ``q_proj``.

The feed-forward block of every layer is Qwen3-Next's `SparseMoE` (``mlp.gate`` router ``[E, W]``,
``mlp.experts``, ``mlp.shared_expert``, ``mlp.shared_expert_gate`` ``[1, W]``): a softmax over the
experts, the ``num_experts_per_tok`` largest always renormalised (the config has no ``norm_topk_prob``,
``decoder_sparse_step``, ``mlp_only_layers`` or ``intermediate_size``: there are no dense layers), plus
``sigmoid(shared_expert_gate(x)) * shared_expert(x)``.

It reads a ``qwen3_5_moe_text`` config, or the ``text_config`` of a ``qwen3_5_moe`` folder
(``Qwen3_5MoeForConditionalGeneration``): the language model's tensors (``model.language_model.*``)
load as ``model.*``; the vision tower (``model.visual.*``) and the multi-token-prediction tensors
(``mtp.*``) are not used. Experts may be stored per expert (``mlp.experts.<e>.gate_proj.weight``, ...) or
stacked (``mlp.experts.gate_up_proj`` ``[E, 2*I, W]``, ``mlp.experts.down_proj`` ``[E, W, I]``): both
load (`RoutedExperts`). `save_pretrained` writes a text-only ``Qwen3_5MoeForCausalLM`` folder with
per-expert tensors. On text the multimodal rotary sections (``mrope_section``) rotate every section by the
token position, which is the ordinary partial rotation. GGUF files: ``qwen35moe``
(`metalnn.llm.gguf.converters.qwen35moe`).

Caches: a `GatedDeltaCache` per linear-attention layer and a `KVCache` per full-attention layer; the
fused CPU decoding step declines these blocks (gated attention, linear attention, experts), which run
layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.base import Layer
from ...layers.moe import SparseMoE
from ...layers.transformer import DecoderBlock
from ..gguf.converters.qwen35moe import Qwen35MoeConverter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import build_decoder
from .experts import RoutedExperts
from .hybrid import NORM_OFFSET, Qwen35Text, derive_hybrid_layout, hybrid_mixer
from .registry import register


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``Qwen3_5MoeTextConfig`` that metalnn reads (absent ones take
    transformers' defaults).

    ``layer_types`` (``linear_attention`` / ``full_attention``; when absent every
    ``full_attention_interval``-th layer is full attention); the Gated DeltaNet sizes
    ``linear_num_key_heads``, ``linear_num_value_heads`` (a multiple of the key heads),
    ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``; the experts
    ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``shared_expert_intermediate_size`` (the shared expert's width, positive); ``output_router_logits``
    (keep the router logits of each call for `Qwen3_5MoeForCausalLM.aux_loss`) and
    ``router_aux_loss_coef`` (its weight in a training loss).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 2
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int | None = 32768
    layer_types: list | None = None
    full_attention_interval: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
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
        if self.num_experts <= 0:
            refuse("num_experts", self.num_experts, "a positive integer (every layer is sparse)")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            refuse("num_experts_per_tok", self.num_experts_per_tok, f"1 to num_experts ({self.num_experts})")
        for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, key) <= 0:
                refuse(key, getattr(self, key), "a positive integer")
        derive_hybrid_layout(self)


def decoder_layer(args: ModelArgs, layer: int, init) -> Layer:
    """Decoder block ``layer``: its mixer (``linear_attn`` or ``self_attn``) and a `SparseMoE` with a
    shared expert between zero-centred RMSNorms."""
    mixer, name = hybrid_mixer(args, layer, separate_projections=True, init=init)
    mlp = SparseMoE(args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size, norm_topk_prob=True,
                    shared_expert_dims=args.shared_expert_intermediate_size, activation=args.hidden_act,
                    record_router_logits=args.output_router_logits, init=init)
    return DecoderBlock(mixer, mlp, mixer_name=name, eps=args.rms_norm_eps, norm_offset=NORM_OFFSET)


@register("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
          model_types=("qwen3_5_moe_text", "qwen3_5_moe"), gguf=Qwen35MoeConverter)
class Qwen3_5MoeForCausalLM(Qwen35Text, RoutedExperts, CausalLM):
    """Qwen3.5-MoE (text model) built from a Hugging Face ``Qwen3_5MoeTextConfig`` dict, or from a
    ``Qwen3_5MoeConfig`` whose ``text_config`` holds it (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`
    of `DecoderBlock` s, each with a `SparseMoE` ``mlp``.

    The experts' API (stacking on load, splitting on save, ``output_router_logits`` and ``aux_loss``
    for training with the load-balancing loss) is `RoutedExperts`'.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        build_decoder(self, args, lambda i, init: decoder_layer(args, i, init), norm_offset=NORM_OFFSET)

    @property
    def features(self) -> list:
        """What sets the model apart from a Llama, one phrase each (shown by ``metalnn info``)."""
        a = self.args
        linear = [i for i, kind in enumerate(a.kinds) if kind == "linear_attention"]
        full = [i for i, kind in enumerate(a.kinds) if kind == "full_attention"]
        out = []
        if linear:
            out.append(f"Gated DeltaNet linear attention on layers {', '.join(map(str, linear))}")
        if full:
            out.append(f"gated full attention on layers {', '.join(map(str, full))} (q/k RMSNorm, partial rotary "
                       f"{a.rope['rope_dims']} of {a.head_dim} features)")
        out.append("zero-centred RMSNorm")
        out += self.moe_features()
        out.append(f"sigmoid-gated shared expert ({a.shared_expert_intermediate_size} wide)")
        return out
