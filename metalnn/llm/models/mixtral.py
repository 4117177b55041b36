"""Mixtral (`MixtralForCausalLM`): Mistral's attention (GQA, optional sliding window) with a sparse
mixture of experts as every layer's feed-forward block.

Each decoder layer is a `DecoderBlock` of `SelfAttention` (``self_attn``) and `SparseMoE` (``mlp``):
the router ``mlp.gate`` ``[E, W]`` gives softmax probabilities over ``num_local_experts`` experts,
the ``num_experts_per_tok`` largest pick the experts, renormalised to sum to 1, and the output is
their weighted sum of SwiGLU experts (``mlp.experts.gate_up_proj`` ``[E, 2*I, W]``,
``mlp.experts.down_proj`` ``[E, W, I]``, transformers 5's names in memory).

Checkpoints (as transformers 4 and 5 write them) store ``model.layers.<i>.block_sparse_moe.gate.weight``
and each expert separately, ``block_sparse_moe.experts.<e>.w1.weight`` (gate ``[I, W]``), ``w3``
(up ``[I, W]``), ``w2`` (down ``[W, I]``): they are stacked on load and split again by
`save_pretrained`; already stacked ``mlp.experts.*`` tensors load as they are.

GGUF files: llama.cpp writes Mixtral as ``llama`` with expert tensors (``ffn_gate_exps`` ...);
`metalnn.llm.gguf.converters.llama` reads them and names this architecture.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.attention import SelfAttention
from ...layers.base import Layer
from ...layers.moe import SparseMoE
from ...layers.transformer import DecoderBlock
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import build_decoder
from .experts import MIXTRAL_PROJECTIONS, RoutedExperts
from .registry import register
from .rope import rope_options

#: the checkpoints' module of the feed-forward block, and metalnn's
CHECKPOINT_MOE, MOE = ".block_sparse_moe.", ".mlp."


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``MixtralConfig`` that metalnn reads (absent ones take transformers'
    defaults).

    Mistral's keys (``sliding_window``: when set, every position attends only to the last
    ``sliding_window`` positions, itself included) plus the experts: ``num_local_experts`` (E),
    ``num_experts_per_tok`` (k), ``intermediate_size`` (each expert's hidden width);
    ``output_router_logits`` (keep the router logits of each call for `MixtralForCausalLM.aux_loss`)
    and ``router_aux_loss_coef`` (its weight in a training loss). ``router_jitter_noise`` (a
    training-time multiplicative noise on the router input) is not applied; a config must leave it 0.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int | None = None
    sliding_window: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    rope_theta: float = 1e6
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
        if self.num_local_experts <= 0:
            refuse("num_local_experts", self.num_local_experts, "a positive integer")
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            refuse("num_experts_per_tok", self.num_experts_per_tok,
                   f"an integer in [1, num_local_experts={self.num_local_experts}]")
        if self.router_jitter_noise:
            refuse("router_jitter_noise", self.router_jitter_noise, "0 (router noise is not implemented)")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.rope = rope_options(self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                 rope_parameters=self.rope_parameters, partial_rotary_factor=self.partial_rotary_factor)


def decoder_layer(args: ModelArgs, init) -> Layer:
    """One Mixtral decoder block: RMSNorm, RoPE attention within ``sliding_window`` (``self_attn``),
    RMSNorm, top-k routed experts (``mlp``)."""
    attn = SelfAttention(args.num_attention_heads, num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                         sliding_window=args.sliding_window, norm_eps=args.rms_norm_eps, init=init, **args.rope)
    moe = SparseMoE(args.num_local_experts, args.num_experts_per_tok, args.intermediate_size, norm_topk_prob=True,
                    activation=args.hidden_act, record_router_logits=args.output_router_logits, init=init)
    return DecoderBlock(attn, moe, eps=args.rms_norm_eps)


@register("MixtralForCausalLM", model_types=("mixtral",))
class MixtralForCausalLM(RoutedExperts, CausalLM):
    """Mixtral built from a Hugging Face ``MixtralConfig`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`
    of `DecoderBlock` s (``block.mlp``: `SparseMoE`). Training with the auxiliary load-balancing
    loss: see `RoutedExperts`.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        build_decoder(self, args, lambda _, init: decoder_layer(args, init))

    @property
    def features(self) -> list:
        """What sets the model apart from a Llama, one phrase each (shown by ``metalnn info``)."""
        args = self.args
        out = [f"mixture of experts: {args.num_experts_per_tok} of {args.num_local_experts} experts per token "
               f"(hidden {args.intermediate_size}) on every layer"]
        if args.sliding_window is not None:
            out.append(f"sliding window {args.sliding_window}")
        return out

    # -- weights -----------------------------------------------------------------------------------
    def rename_weight(self, name):
        return super().rename_weight(name.replace(CHECKPOINT_MOE, MOE))

    expert_names = MIXTRAL_PROJECTIONS

    def export_weights(self):
        return {k.replace(MOE, CHECKPOINT_MOE): v for k, v in super().export_weights().items()}
