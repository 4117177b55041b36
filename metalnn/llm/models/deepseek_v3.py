"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention and sigmoid-routed,
group-limited mixture-of-experts feed-forward blocks with shared experts.

Every decoder layer is a `DecoderBlock` (RMSNorms) whose ``self_attn`` is a `LatentAttention`
(``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` with a ``q_lora_rank``, else ``q_proj``;
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``). The first
``first_k_dense_replace`` layers have a dense `SwiGLU` of ``intermediate_size``; the others a
`GroupLimitedMoE` (``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``, the routed experts and
``mlp.shared_experts`` of ``moe_intermediate_size * n_shared_experts``).

Rotary embeddings rotate the last ``qk_rope_head_dim`` features of each query/key head, adjacent
pairs when ``rope_interleave`` (the checkpoints' layout, transformers' default), halves otherwise.
The score scale is `softmax_scale` (``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
``mscale ** 2`` under a YaRN rope scaling with ``mscale_all_dim``, as transformers). Rope types: those of
`rope_options`, YaRN (which DeepSeek-V3's released checkpoints use) included: its attention factor
multiplies the rotated query and key parts.

Caches hold the compressed latent ``[B, 1, T, kv_lora_rank]`` and the rotated key ``[B, 1, T,
qk_rope_head_dim]`` per layer (`LatentAttention`); decoding attends in the latent space (the absorbed
form), the uncached forward pass (training, scoring) expands the latents as transformers does.

Checkpoints store each expert separately (``mlp.experts.<e>.gate_proj.weight``, ...): they are
stacked on load and split again by `save_pretrained`; multi-token-prediction layers (``model.layers.<i>``
for ``i >= num_hidden_layers``) are dropped. GGUF files: ``deepseek2``
(`metalnn.llm.gguf.converters.deepseek2`).
"""

from __future__ import annotations

import math

import re
from dataclasses import dataclass, field

from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.base import Layer
from ...layers.latent_attention import LatentAttention
from ...layers.mlp import SwiGLU
from ...layers.sigmoid_moe import GroupLimitedMoE
from ...layers.transformer import DecoderBlock
from ..gguf.converters.deepseek2 import Deepseek2Converter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import build_decoder
from .experts import RoutedExperts
from .registry import register
from .rope import rope_options

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``DeepseekV3Config`` that metalnn reads (absent ones take
    transformers' defaults).

    Attention: ``num_attention_heads`` (``num_key_value_heads`` is not read: latent attention has a
    key and a value for every head), ``q_lora_rank`` (null: one ``q_proj``),
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``attention_bias``,
    ``rope_interleave``, the rope keys. Experts: ``n_routed_experts`` (also read as
    ``num_local_experts``), ``num_experts_per_tok``, ``moe_intermediate_size``, ``n_shared_experts``,
    ``n_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``,
    ``first_k_dense_replace``; ``scoring_func`` must be ``sigmoid`` and ``topk_method``
    ``noaux_tc`` (DeepSeek-V3's; transformers assumes them).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    n_routed_experts: int | None = None
    num_local_experts: int | None = None
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int | None = 8
    topk_group: int | None = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    hidden_act: str = "silu"
    max_position_embeddings: int | None = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    #: `LatentAttention`'s RoPE keywords (derived)
    rope: dict = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            refuse("hidden_act", self.hidden_act, ", ".join(ACTIVATIONS))
        if self.scoring_func != "sigmoid":
            refuse("scoring_func", self.scoring_func, "sigmoid")
        if self.topk_method != "noaux_tc":
            refuse("topk_method", self.topk_method, "noaux_tc")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                refuse(name, getattr(self, name), "a positive integer")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            refuse("qk_rope_head_dim", self.qk_rope_head_dim, "a positive even integer")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            refuse("q_lora_rank", self.q_lora_rank, "a positive integer or null")
        experts = self.n_routed_experts if self.n_routed_experts is not None else self.num_local_experts
        self.n_routed_experts = self.num_local_experts = 256 if experts is None else experts  # transformers' default
        self.n_group = self.n_group or 1
        self.topk_group = self.topk_group or 1
        e, g = self.n_routed_experts, self.n_group
        if e <= 0:
            refuse("n_routed_experts", e, "a positive integer")
        if e % g or e // g < 2:
            refuse("n_group", g, f"a divisor of n_routed_experts ({e}) leaving at least 2 experts a group")
        if not 0 < self.topk_group <= g:
            refuse("topk_group", self.topk_group, f"1 to n_group ({g})")
        if not 0 < self.num_experts_per_tok <= self.topk_group * (e // g):
            refuse("num_experts_per_tok", self.num_experts_per_tok,
                   f"1 to the {self.topk_group * (e // g)} experts of topk_group groups")
        if self.n_shared_experts < 0:
            refuse("n_shared_experts", self.n_shared_experts, "a non-negative integer")
        if self.first_k_dense_replace < 0:
            refuse("first_k_dense_replace", self.first_k_dense_replace, "a non-negative integer")
        self.rope = rope_options(self.qk_rope_head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                 rope_parameters=self.rope_parameters, partial_rotary_factor=1.0,
                                 max_position_embeddings=self.max_position_embeddings)
        self.rope.pop("rope_dims")  # (every one of qk_rope_head_dim features is rotated)

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s feed-forward block is a `GroupLimitedMoE` (transformers' rule)."""
        return layer >= self.first_k_dense_replace


def softmax_scale(args: ModelArgs) -> float:
    """The attention score scale: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
    ``mscale ** 2`` when a rope scaling (YaRN) sets ``mscale_all_dim`` (``mscale = 0.1 * mscale_all_dim *
    ln(factor) + 1`` for factors above 1), as transformers' ``yarn_apply_mscale``."""
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    params = args.rope_parameters or args.rope_scaling or {}
    kind = params.get("rope_type", params.get("type", "default"))
    all_dim = params.get("mscale_all_dim") or 0
    factor = float(params.get("factor") or 1.0)
    if kind != "default" and all_dim and factor > 1:
        mscale = 0.1 * float(all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def decoder_layer(args: ModelArgs, layer: int, init) -> Layer:
    """Decoder block ``layer``: `LatentAttention` and a `GroupLimitedMoE` (or, on the first
    ``first_k_dense_replace`` layers, a `SwiGLU`)."""
    attn = LatentAttention(args.num_attention_heads, kv_lora_rank=args.kv_lora_rank,
                           qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim,
                           v_head_dim=args.v_head_dim, q_lora_rank=args.q_lora_rank, bias=args.attention_bias,
                           rope_traditional=args.rope_interleave, scale=softmax_scale(args), init=init, **args.rope)
    if args.is_sparse(layer):
        mlp = GroupLimitedMoE(args.n_routed_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                              n_group=args.n_group, topk_group=args.topk_group, norm_topk_prob=args.norm_topk_prob,
                              routed_scaling_factor=args.routed_scaling_factor,
                              shared_dims=args.moe_intermediate_size * args.n_shared_experts,
                              activation=args.hidden_act, init=init)
    else:
        mlp = SwiGLU(args.intermediate_size, activation=args.hidden_act, init=init, init_out=init)
    return DecoderBlock(attn, mlp, eps=args.rms_norm_eps)


@register("DeepseekV3ForCausalLM", model_types=("deepseek_v3",), gguf=Deepseek2Converter)
class DeepseekV3ForCausalLM(RoutedExperts, CausalLM):
    """DeepSeek-V3 built from a Hugging Face ``DeepseekV3Config`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`
    of `DecoderBlock` s (`LatentAttention` ``self_attn``; `GroupLimitedMoE` or `SwiGLU` ``mlp``).
    Expert weights stack on load and split on save (`RoutedExperts`); DeepSeek-V3 balances its
    experts with the router's correction bias, so there is no auxiliary loss (`aux_loss` refuses).

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        build_decoder(self, args, lambda i, init: decoder_layer(args, i, init))

    def aux_loss(self):
        raise NotImplementedError(f"{self.architecture}: no auxiliary load-balancing loss (DeepSeek-V3 balances its "
                                  "experts with mlp.gate.e_score_correction_bias)")

    @property
    def features(self) -> list:
        """What sets the model apart from a Llama, one phrase each (shown by ``metalnn info``)."""
        a = self.args
        q = f"query rank {a.q_lora_rank}" if a.q_lora_rank is not None else "full-rank queries"
        out = [f"multi-head latent attention (cached latent {a.kv_lora_rank} + rotary key {a.qk_rope_head_dim} a "
               f"position; {q})", *self.moe_features()]
        moe = self.moe_layers()
        if moe:
            m = moe[0]
            out.append(f"sigmoid routing from {m.topk_group} of {m.n_group} expert groups, weights x"
                       f"{m.routed_scaling_factor:g}")
            if a.n_shared_experts:
                out.append(f"{a.n_shared_experts} shared expert{'s' if a.n_shared_experts != 1 else ''}")
        out.append("interleaved rotary pairs" if a.rope_interleave else "half-split rotary features")
        return out

    # -- weights -----------------------------------------------------------------------------------
    def rename_weight(self, name):
        m = _LAYER.match(name)
        if m is not None and int(m.group(1)) >= self.args.num_hidden_layers:
            return None  # a multi-token-prediction layer
        return super().rename_weight(name)
