"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head RMSNorm on queries and keys, an
explicit ``head_dim``) with sparse mixture-of-experts feed-forward blocks and no shared expert.

The feed-forward block of layer ``i`` is a `SparseMoE` (``mlp.gate`` router ``[E, W]``,
``mlp.experts``) when ``num_experts > 0``, ``i`` is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; a `SwiGLU` of ``intermediate_size`` otherwise. Routing: a
softmax over the experts, the ``num_experts_per_tok`` largest kept (renormalised when
``norm_topk_prob``).

Checkpoints store each expert separately (``mlp.experts.<e>.gate_proj.weight``, ...) or stacked
(transformers 5 in memory): both load, stacked into ``mlp.experts.gate_up_proj`` ``[E, 2*I, W]`` and
``mlp.experts.down_proj`` ``[E, W, I]``; `save_pretrained` splits them again (`RoutedExperts`).
Sliding windows as transformers' ``Qwen3MoeConfig``: ``sliding_window`` on every layer when
``use_sliding_window``. GGUF files: ``qwen3moe`` (`metalnn.llm.gguf.converters.qwen3moe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.attention import SelfAttention
from ...layers.base import Layer
from ...layers.moe import SparseMoE
from ...layers.transformer import DecoderBlock, TransformerBlock
from ..gguf.converters.qwen3moe import Qwen3MoeConverter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import build_decoder
from .experts import RoutedExperts
from .registry import register
from .rope import rope_options


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``Qwen3MoeConfig`` that metalnn reads (absent ones take transformers'
    defaults).

    As Qwen3's attention keys (``head_dim`` 128 by default, ``attention_bias`` on all four
    projections); the experts ``num_experts`` (saved by transformers as ``num_local_experts``: either
    is read), ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
    ``decoder_sparse_step``, ``mlp_only_layers``; ``output_router_logits`` (keep the router logits of
    each call for `Qwen3MoeForCausalLM.aux_loss`) and ``router_aux_loss_coef`` (its weight in a
    training loss); ``use_sliding_window`` / ``sliding_window`` (every layer).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int = 6144
    num_key_value_heads: int | None = None
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = None
    num_experts: int | None = None
    num_local_experts: int | None = None
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list | None = None
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    #: `SelfAttention`'s RoPE keywords and the attention window of every layer (derived)
    rope: dict = field(init=False, repr=False)
    window: int | None = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            refuse("hidden_act", self.hidden_act, ", ".join(ACTIVATIONS))
        if self.decoder_sparse_step <= 0:
            refuse("decoder_sparse_step", self.decoder_sparse_step, "a positive integer")
        experts = self.num_experts if self.num_experts is not None else self.num_local_experts
        self.num_experts = self.num_local_experts = 128 if experts is None else experts  # transformers' default
        if self.num_experts < 0:
            refuse("num_experts", self.num_experts, "a non-negative integer")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            refuse("num_experts_per_tok", self.num_experts_per_tok, f"1 to num_experts ({self.num_experts})")
        if self.sliding_window is not None and self.sliding_window <= 0:
            refuse("sliding_window", self.sliding_window, "a positive integer or null")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        self.rope = rope_options(self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                 rope_parameters=self.rope_parameters, partial_rotary_factor=self.partial_rotary_factor)
        self.window = self.sliding_window if self.use_sliding_window else None

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s feed-forward block is a `SparseMoE` (transformers' rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


def decoder_layer(args: ModelArgs, layer: int, init) -> Layer:
    """Decoder block ``layer``: Qwen3's attention with a `SparseMoE` (a `DecoderBlock`), or Qwen3's
    whole dense block (a `TransformerBlock`) on the dense layers."""
    attention = dict(num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim, qk_norm=True,
                     sliding_window=args.window, init=init, **args.rope)
    if not args.is_sparse(layer):
        return TransformerBlock(args.num_attention_heads, args.intermediate_size, eps=args.rms_norm_eps,
                                attention_bias=args.attention_bias, activation=args.hidden_act, **attention)
    attn = SelfAttention(args.num_attention_heads, bias=args.attention_bias, norm_eps=args.rms_norm_eps, **attention)
    mlp = SparseMoE(args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                    norm_topk_prob=args.norm_topk_prob, activation=args.hidden_act,
                    record_router_logits=args.output_router_logits, init=init)
    return DecoderBlock(attn, mlp, eps=args.rms_norm_eps)


@register("Qwen3MoeForCausalLM", model_types=("qwen3_moe",), gguf=Qwen3MoeConverter)
class Qwen3MoeForCausalLM(RoutedExperts, CausalLM):
    """Qwen3-MoE built from a Hugging Face ``Qwen3MoeConfig`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`
    (`DecoderBlock` s with a `SparseMoE` ``mlp``; `TransformerBlock` s on dense layers).

    The experts' API (stacking on load, splitting on save, ``output_router_logits`` and ``aux_loss``
    for training with the load-balancing loss) is `RoutedExperts`'s.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        build_decoder(self, args, lambda i, init: decoder_layer(args, i, init))

    @property
    def features(self) -> list:
        """What sets the model apart from a Llama, one phrase each (shown by ``metalnn info``)."""
        out = ["q/k RMSNorm", *self.moe_features()]
        if self.args.window is not None:
            out.append(f"sliding window {self.args.window} on every layer")
        return out
