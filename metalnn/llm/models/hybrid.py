"""Shared pieces of the hybrid Gated DeltaNet models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): which layers are
linear attention, the two token mixers (`hybrid_mixer` picks a layer's), the per-layer caches, the checks
of the linear-attention sizes and the derived `ModelArgs` fields (`derive_hybrid_layout`), the text
model's tensor names in a multimodal Qwen3.5 folder, and the model-class mixins `HybridLayers`
(``layer_kinds``, ``make_cache``) and `Qwen35Text` (a Qwen3.5 text model read from a text-only or a
multimodal folder).

Both architectures use zero-centred RMSNorms (gain ``1 + weight``, `NORM_OFFSET`) everywhere except
the gated norm inside `GatedDeltaNet`.
"""

from __future__ import annotations

from ...errors import UnsupportedConfigError
from ...layers.attention import KVCache, SelfAttention
from ...layers.base import Layer
from ...layers.gated_deltanet import GatedDeltaCache, GatedDeltaNet
from .base import refuse, text_config
from .decoder import check_layer_types
from .rope import rope_options

HYBRID = ("linear_attention", "full_attention")
#: where a multimodal Qwen3.5 folder (``...ForConditionalGeneration``) keeps the text model's tensors
LANGUAGE_MODEL = "model.language_model."
#: gain offset of every RMSNorm of these models (zero-centred gains)
NORM_OFFSET = 1.0
#: the config keys of the linear-attention layers (required when the model has any)
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


def hybrid_layer_types(num_hidden_layers: int, layer_types: list | None, full_attention_interval: int) -> list:
    """``linear_attention`` / ``full_attention`` per layer: ``layer_types`` checked, or when absent every
    ``full_attention_interval``-th layer full attention and the others linear attention, as transformers
    fills it in."""
    if layer_types is None:
        if full_attention_interval <= 0:
            refuse("full_attention_interval", full_attention_interval, "a positive integer")
        return ["linear_attention" if (i + 1) % full_attention_interval else "full_attention"
                for i in range(num_hidden_layers)]
    return check_layer_types(layer_types, num_hidden_layers, HYBRID)


def check_linear_sizes(args, kinds: list):
    """Refuse a config with linear-attention layers whose sizes are absent or do not fit together
    (``args`` has the `LINEAR_KEYS` fields)."""
    if "linear_attention" not in kinds:
        return
    for key in LINEAR_KEYS:
        if getattr(args, key) is None:
            raise UnsupportedConfigError(f"the config has linear_attention layers but no {key}")
    nk, nv = args.linear_num_key_heads, args.linear_num_value_heads
    if nk <= 0 or nv <= 0 or nv % nk:
        refuse("linear_num_value_heads", nv, f"a positive multiple of linear_num_key_heads = {nk}")


def derive_hybrid_layout(args):
    """Fill in a Qwen3.5 / Qwen3-Next ``ModelArgs``' derived fields: ``kinds`` (`hybrid_layer_types`, the
    linear-attention sizes checked by `check_linear_sizes`) and ``rope`` (`SelfAttention`'s RoPE keywords
    from ``head_dim``, ``rope_theta``, ``rope_scaling``, ``rope_parameters``, ``partial_rotary_factor``)."""
    args.kinds = hybrid_layer_types(args.num_hidden_layers, args.layer_types, args.full_attention_interval)
    check_linear_sizes(args, args.kinds)
    args.rope = rope_options(args.head_dim, rope_theta=args.rope_theta, rope_scaling=args.rope_scaling,
                             rope_parameters=args.rope_parameters, partial_rotary_factor=args.partial_rotary_factor)


def gated_attention(*, num_heads: int, num_kv_heads: int, head_dim: int, rope: dict, bias: bool, eps: float,
                    init) -> Layer:
    """The full-attention mixer: `SelfAttention` with zero-centred q/k RMSNorms, partial rotary
    embeddings (``rope``: `rope_options`) and an output gate from a doubled ``q_proj``."""
    return SelfAttention(num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=bias, qk_norm=True,
                         output_gate=True, norm_eps=eps, norm_offset=NORM_OFFSET, init=init, **rope)


def gated_deltanet(args, *, separate_projections: bool, init) -> Layer:
    """The linear-attention mixer of ``args`` (a hybrid ``ModelArgs``): a `GatedDeltaNet` with grouped
    (Qwen3-Next) or ``separate_projections`` (Qwen3.5) input projections."""
    return GatedDeltaNet(args.linear_num_key_heads, num_v_heads=args.linear_num_value_heads,
                         head_k_dim=args.linear_key_head_dim, head_v_dim=args.linear_value_head_dim,
                         conv_kernel=args.linear_conv_kernel_dim, eps=args.rms_norm_eps,
                         separate_projections=separate_projections, activation=args.hidden_act, init=init)


def hybrid_mixer(args, layer: int, *, separate_projections: bool, init) -> tuple:
    """``(mixer, checkpoint name)`` of layer ``layer`` of ``args`` (a hybrid ``ModelArgs``, its ``kinds``):
    `gated_deltanet` (``linear_attn``) on a ``linear_attention`` layer, else `gated_attention`
    (``self_attn``)."""
    if args.kinds[layer] == "linear_attention":
        return gated_deltanet(args, separate_projections=separate_projections, init=init), "linear_attn"
    mixer = gated_attention(num_heads=args.num_attention_heads, num_kv_heads=args.num_key_value_heads,
                            head_dim=args.head_dim, rope=args.rope, bias=args.attention_bias, eps=args.rms_norm_eps,
                            init=init)
    return mixer, "self_attn"


def hybrid_caches(kinds: list) -> list:
    """A `GatedDeltaCache` per linear-attention layer and a `KVCache` per full-attention layer."""
    return [GatedDeltaCache() if kind == "linear_attention" else KVCache() for kind in kinds]


def text_weight_name(name: str) -> str | None:
    """A checkpoint tensor name of a (possibly multimodal) Qwen3.5 folder as the text model's:
    ``model.language_model.*`` -> ``model.*``; the vision tower (``model.visual.*``, ``visual.*``) and the
    multi-token-prediction tensors (``mtp.*``) dropped (None); any other name unchanged."""
    if name.startswith(LANGUAGE_MODEL):
        return "model." + name[len(LANGUAGE_MODEL):]
    if name.startswith(("model.visual.", "visual.", "mtp.")):
        return None
    return name


class HybridLayers:
    """Mixin of the hybrid `CausalLM` s (``args.kinds``: one `HYBRID` entry per layer)."""

    @property
    def layer_kinds(self) -> list:
        """``linear_attention`` / ``full_attention`` per layer."""
        return list(self.args.kinds)

    def make_cache(self) -> list:
        """A `GatedDeltaCache` per linear-attention layer and a `KVCache` per full-attention layer."""
        return hybrid_caches(self.args.kinds)


class Qwen35Text(HybridLayers):
    """Mixin of the Qwen3.5 text models (dense and MoE): built from a text config or from the
    ``text_config`` of a multimodal one (`text_config`), reading a multimodal folder's language-model
    tensors (`text_weight_name`; the vision tower and the multi-token-prediction tensors dropped)."""

    def __init__(self, config: dict, seed: int = 0):
        super().__init__(text_config(config), seed=seed)

    def rename_weight(self, name):
        name = text_weight_name(name)
        return None if name is None else super().rename_weight(name)
