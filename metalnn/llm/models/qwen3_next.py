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
not used and dropped.

Caches: `make_cache` gives a `GatedDeltaCache` (convolution tail and recurrent state) for each
linear-attention layer and a `KVCache` for each full-attention layer; the prompt runs the chunked
gated delta rule, each decoded token one recurrent step.
"""

from __future__ import annotations

from ...errors import UnsupportedConfigError
from ...layers.base import Layer
from ...layers.attention import KVCache, SelfAttention
from ...layers.gated_deltanet import GatedDeltaCache, GatedDeltaNet
from ...layers.mlp import SwiGLU
from ...layers.moe import SparseMoE, load_balancing_loss
from ...layers.transformer import DecoderBlock
from .experts import StackedExpertsProvider, split_experts
from .llama import LlamaForCausalLM, layer_types, rope_settings

HYBRID = ("linear_attention", "full_attention")


def hybrid_layer_types(config: dict) -> list:
    """``layer_types`` of a hybrid config; when absent, every ``full_attention_interval``-th layer
    (default 4) is full attention and the others linear attention, as transformers fills it in."""
    if config.get("layer_types") is None:
        every = int(config.get("full_attention_interval", 4))
        return ["linear_attention" if (i + 1) % every else "full_attention"
                for i in range(int(config["num_hidden_layers"]))]
    return layer_types(config, HYBRID, "full_attention")


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Qwen3-Next built from a Hugging Face ``Qwen3NextConfig`` dict.

    Config keys read beyond Llama's: ``layer_types`` (``linear_attention`` / ``full_attention``) or
    ``full_attention_interval``, ``head_dim`` (256 when absent), ``partial_rotary_factor``,
    ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
    ``linear_value_head_dim``, ``linear_conv_kernel_dim``, ``num_experts``, ``num_experts_per_tok``,
    ``moe_intermediate_size``, ``shared_expert_intermediate_size``, ``norm_topk_prob``,
    ``decoder_sparse_step``, ``mlp_only_layers``, ``output_router_logits`` (keep the router logits
    of each call for `aux_loss`), ``router_aux_loss_coef``. Absent keys take transformers' defaults.

    Training with the auxiliary load-balancing loss::

        model.output_router_logits = True
        def loss_fn(model, batch, device):
            logits = model(batch[:, :-1], device=device)
            ce = metalnn.losses.cross_entropy(logits, batch[:, 1:])
            return ce + model.config.get("router_aux_loss_coef", 0.001) * model.aux_loss()
    """

    architecture = "Qwen3NextForCausalLM"
    model_type = "qwen3_next"
    gguf_architecture = "qwen3next"
    default_head_dim = 256
    norm_offset = 1.0
    #: Qwen3.5's four linear-attention input projections instead of the grouped two
    separate_projections = False
    #: transformers' defaults for the mixture-of-experts keys
    moe_defaults = dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                        shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True)

    def __init__(self, config: dict, seed: int = 0):
        super().__init__(config, seed)
        self.output_router_logits = bool(self.config.get("output_router_logits", False))

    @property
    def layer_kinds(self) -> list:
        """``linear_attention`` / ``full_attention`` per layer."""
        return hybrid_layer_types(self.config)

    @property
    def output_router_logits(self) -> bool:
        """Keep each MoE layer's router logits of the most recent call (for `aux_loss`)."""
        layers = self.moe_layers()
        return bool(layers) and all(moe.record_router_logits for moe in layers)

    @output_router_logits.setter
    def output_router_logits(self, value: bool):
        for moe in self.moe_layers():
            moe.record_router_logits = bool(value)
            moe.forget_router_logits()

    # -- construction ------------------------------------------------------------------------
    def attention_options(self) -> dict:
        c = dict(self.config)
        params = c.get("rope_parameters") or {}
        if "partial_rotary_factor" not in params and "partial_rotary_factor" not in c:
            c["partial_rotary_factor"] = 0.25  # transformers' default for these models
        n_heads = int(c["num_attention_heads"])
        return dict(num_heads=n_heads, num_kv_heads=int(c.get("num_key_value_heads") or n_heads),
                    head_dim=self.head_dim, init=self.init, **rope_settings(c, self.head_dim))

    def full_attention(self, layer: int) -> Layer:
        c = self.config
        return SelfAttention(**self.attention_options(), bias=bool(c.get("attention_bias", False)), qk_norm=True,
                             output_gate=True, norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                             norm_offset=self.norm_offset)

    def linear_attention(self, layer: int) -> Layer:
        c = self.config
        try:
            return GatedDeltaNet(int(c["linear_num_key_heads"]), num_v_heads=int(c["linear_num_value_heads"]),
                                 head_k_dim=int(c["linear_key_head_dim"]),
                                 head_v_dim=int(c["linear_value_head_dim"]),
                                 conv_kernel=int(c.get("linear_conv_kernel_dim", 4)),
                                 eps=float(c.get("rms_norm_eps", 1e-6)),
                                 separate_projections=self.separate_projections, activation=c.get("hidden_act", "silu"),
                                 init=self.init)
        except KeyError as e:
            raise UnsupportedConfigError(f"{self.architecture}: the config has linear_attention layers but no "
                                         f"{e.args[0]}") from None
        except ValueError as e:
            raise UnsupportedConfigError(f"{self.architecture}: linear_num_key_heads / linear_num_value_heads: "
                                         f"{e}") from None

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s feed-forward block is a `SparseMoE`."""
        c, d = self.config, self.moe_defaults
        experts = int(c.get("num_experts", d["num_experts"]))
        step = int(c.get("decoder_sparse_step", d["decoder_sparse_step"]))
        return experts > 0 and layer not in (c.get("mlp_only_layers") or []) and (layer + 1) % step == 0

    def feed_forward(self, layer: int) -> Layer:
        c, d = self.config, self.moe_defaults
        act = c.get("hidden_act", "silu")
        if not self.is_sparse(layer):
            return SwiGLU(int(c["intermediate_size"]), activation=act, init=self.init, init_out=self.init)
        get = lambda key: c.get(key, d[key])  # noqa: E731
        return SparseMoE(int(get("num_experts")), int(get("num_experts_per_tok")), int(get("moe_intermediate_size")),
                         norm_topk_prob=bool(get("norm_topk_prob")),
                         shared_expert_dims=int(get("shared_expert_intermediate_size")) or None, activation=act,
                         init=self.init)

    def decoder_layer(self, layer: int) -> Layer:
        kind = hybrid_layer_types(self.config)[layer]
        if kind == "linear_attention":
            mixer, name = self.linear_attention(layer), "linear_attn"
        else:
            mixer, name = self.full_attention(layer), "self_attn"
        return DecoderBlock(mixer, self.feed_forward(layer), mixer_name=name,
                            eps=float(self.config.get("rms_norm_eps", 1e-6)), norm_offset=self.norm_offset)

    # -- caches and the auxiliary loss -------------------------------------------------------
    def make_cache(self):
        """A `GatedDeltaCache` per linear-attention layer and a `KVCache` per full-attention layer."""
        return [GatedDeltaCache() if kind == "linear_attention" else KVCache() for kind in self.layer_kinds]

    def moe_layers(self) -> list:
        return [block.mlp for block in self.model.layers if isinstance(block.mlp, SparseMoE)]

    def router_logits(self) -> list:
        """The router logits ``[tokens, E]`` of every MoE layer from the most recent call (needs
        ``output_router_logits``)."""
        return [moe.router_logits for moe in self.moe_layers() if moe.router_logits is not None]

    def aux_loss(self):
        """The load-balancing loss (`load_balancing_loss`, as transformers' ``aux_loss``) of the most
        recent call, over all MoE layers; the kept router logits are released. Call it inside the
        loss function, after the forward pass, with ``output_router_logits`` set."""
        logits = self.router_logits()
        if not logits:
            raise ValueError(f"{self.architecture}.aux_loss: no router logits; set model.output_router_logits = "
                             "True and run the model first")
        c, d = self.config, self.moe_defaults
        loss = load_balancing_loss(logits, int(c.get("num_experts", d["num_experts"])),
                                   int(c.get("num_experts_per_tok", d["num_experts_per_tok"])))
        for moe in self.moe_layers():
            moe.forget_router_logits()
        return loss

    # -- weights -----------------------------------------------------------------------------
    def rename_weight(self, name):
        if name.startswith("mtp."):
            return None
        return super().rename_weight(name)

    def load_weights_from(self, provider, strict: bool = True):
        return super().load_weights_from(StackedExpertsProvider(provider), strict=strict)

    def export_weights(self):
        return split_experts(self.named_parameters())
