"""Nemotron-H (`NemotronHForCausalLM`, model type ``nemotron_h``): a stack of single-mixer layers,
each a Mamba2 state-space layer, an attention layer, a squared-ReLU MLP or a mixture of experts.

Every decoder layer is a `NemotronHBlock`: one pre-norm and a residual around one mixer::

    out = x + mixer(norm(x))

The mixer of layer ``i`` comes from ``layers_block_type[i]`` (transformers 5's names; the Hub's
configs give the same as the string ``hybrid_override_pattern``, one character a layer):

* ``linear_attention`` / ``M``: `Mamba2` (``in_proj``, ``conv1d``, ``A_log``, ``dt_bias``, ``D``,
  the gated RMSNorm ``norm`` over ``n_groups`` groups, ``out_proj``; projection biases with
  ``use_bias``); dt is clamped below at ``time_step_min`` (transformers' chunked scan; the config's
  ``time_step_limit`` is not read, as in transformers);
* ``full_attention`` / ``*``: `SelfAttention` with no position embeddings at all (no rotary
  embedding: the Mamba2 layers carry the order), no biases, scale ``head_dim ** -0.5``;
* ``mlp`` / ``-``: an ungated `MLP` ``down_proj(relu(up_proj(x)) ** 2)`` (``mlp_hidden_act``
  ``relu2``; biases with ``mlp_bias``);
* ``moe`` / ``E``: `NemotronHMoE`: DeepSeek-V3's sigmoid routing (`GroupLimitedMoE`: correction bias,
  ``n_group`` / ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``) over ungated
  squared-ReLU experts (`SwitchMLP`, optionally inside a ``moe_latent_size`` projection), plus one
  ungated shared expert of ``moe_shared_expert_intermediate_size``.

The output head is never tied to the embedding (transformers' Nemotron-H ties nothing, whatever
``tie_word_embeddings`` says). ``residual_in_fp32`` is read and, as in transformers 5's model,
changes nothing (the residual keeps the hidden states' dtype).

Checkpoint names: the Hub's (``backbone.embeddings``, ``backbone.layers.<i>.norm`` /
``.mixer.*``, ``backbone.norm_f``, ``lm_head``; experts one by one,
``mixer.experts.<e>.{up,down}_proj.weight``), which transformers 5 writes too; its in-memory names
(``model.*``, stacked ``mixer.experts.up_proj`` ``[E, I, W]`` / ``down_proj`` ``[E, W, I]``) load as
well. Multi-token-prediction tensors (``mtp.*``) are dropped. GGUF files: ``nemotron_h`` and
``nemotron_h_moe`` (`metalnn.llm.gguf.converters.nemotron_h`).

Caches: `make_cache` gives a `Mamba2Cache` per Mamba2 layer, a `KVCache` per attention layer and a
`PositionCount` (a state cache without state, counting positions) per MLP or MoE layer. The decoding
step fused for Llama-like blocks (`DecoderBlock._step_plan`) does not apply: these blocks always run
their layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import mlx.core as mx

from ... import init as initializers
from ...data import Data, MTLSize
from ...errors import UnsupportedConfigError
from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.attention import KVCache, SelfAttention
from ...layers.base import Layer
from ...layers.linear import Linear
from ...layers.mamba2 import Mamba2, Mamba2Cache
from ...layers.mlp import MLP
from ...layers.moe import SwitchMLP
from ...layers.norm import RMSNorm
from ...layers.sigmoid_moe import GroupLimitedMoE
from ...layers.state_cache import StateCache
from ...weights import Provider, open_provider
from ..gguf.converters.nemotron_h import NemotronHConverter, NemotronHMoEConverter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import DecoderStack
from .registry import register

#: the layer kinds, each with the names configs use for it (transformers 5's, the older lists', the pattern's)
KINDS = {"mamba": ("linear_attention", "mamba", "M"), "attention": ("full_attention", "attention", "*"),
         "mlp": ("mlp", "-"), "moe": ("moe", "E")}
#: transformers' layers when the config names none
DEFAULT_LAYERS = ["linear_attention", "moe", "full_attention", "mlp"]
#: the older config keys transformers still reads, and the key each stands for (the older one wins)
LEGACY_KEYS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
               "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}


def layer_kinds(entries) -> list:
    """``mamba`` / ``attention`` / ``mlp`` / ``moe`` for each entry of a layer list or pattern string."""
    out = []
    for i, entry in enumerate(entries):
        kind = next((k for k, names in KINDS.items() if entry in names), None)
        if kind is None:
            refuse(f"layers_block_type[{i}]", entry, ", ".join(n for names in KINDS.values() for n in names))
        out.append(kind)
    return out


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``NemotronHConfig`` that metalnn reads (absent ones take
    transformers' defaults).

    Layers: ``layers_block_type`` (also read as ``layer_types``), else ``hybrid_override_pattern``
    (``M``, ``*``, ``-``, ``E``); the number of layers is their count (``num_hidden_layers`` is not
    read, as in transformers). Attention: ``num_attention_heads``, ``num_key_value_heads``,
    ``head_dim`` (also ``attention_head_dim``). MLP: ``intermediate_size``, ``mlp_hidden_act``,
    ``mlp_bias``. Mamba2: ``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``, ``n_groups``,
    ``conv_kernel``, ``use_conv_bias``, ``use_bias`` (the projections), ``mamba_hidden_act``,
    ``time_step_min``, ``chunk_size`` (and the older ``mamba_*`` names of `LEGACY_KEYS`). Experts:
    ``n_routed_experts`` (also ``num_local_experts``), ``num_experts_per_tok``,
    ``moe_intermediate_size``, ``moe_shared_expert_intermediate_size``, ``moe_latent_size``,
    ``n_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``.
    """

    vocab_size: int
    hidden_size: int
    layers_block_type: list | None = None
    layer_types: list | None = None
    hybrid_override_pattern: str | None = None
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    attention_head_dim: int | None = None
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    conv_kernel: int = 4
    time_step_min: float = 0.001
    use_conv_bias: bool = True
    chunk_size: int = 128
    use_bias: bool = False
    mamba_n_groups: int | None = None
    mamba_d_conv: int | None = None
    mamba_dt_min: float | None = None
    mamba_conv_bias: bool | None = None
    mamba_chunk_size: int | None = None
    n_routed_experts: int | None = None
    num_local_experts: int | None = None
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    layer_norm_epsilon: float = 1e-5
    residual_in_fp32: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int | None = 4096
    #: derived: each layer's kind (``mamba`` / ``attention`` / ``mlp`` / ``moe``) and their number
    kinds: list = field(init=False, repr=False)
    num_hidden_layers: int = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        for old, new in LEGACY_KEYS.items():
            if getattr(self, old) is not None:
                setattr(self, new, getattr(self, old))
        for name in ("mlp_hidden_act", "mamba_hidden_act"):
            if getattr(self, name) not in ACTIVATIONS:
                refuse(name, getattr(self, name), ", ".join(ACTIVATIONS))
        layers = self.layers_block_type if self.layers_block_type is not None else self.layer_types
        if layers is None:
            layers = self.hybrid_override_pattern if self.hybrid_override_pattern is not None else DEFAULT_LAYERS
        if not isinstance(layers, (list, tuple, str)) or not layers:
            raise UnsupportedConfigError(f"layers_block_type must list the layers (or hybrid_override_pattern spell "
                                         f"them), got {layers!r}")
        self.kinds = layer_kinds(layers)
        self.num_hidden_layers = len(self.kinds)
        self.head_dim = self.head_dim or self.attention_head_dim or self.hidden_size // self.num_attention_heads
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if "attention" in self.kinds and self.num_attention_heads % self.num_key_value_heads:
            refuse("num_key_value_heads", self.num_key_value_heads,
                   f"a divisor of num_attention_heads = {self.num_attention_heads}")
        if "mamba" in self.kinds and (self.n_groups <= 0 or self.mamba_num_heads % self.n_groups):
            refuse("n_groups", self.n_groups, f"a divisor of mamba_num_heads = {self.mamba_num_heads}")
        experts = self.n_routed_experts if self.n_routed_experts is not None else self.num_local_experts
        self.n_routed_experts = self.num_local_experts = 8 if experts is None else experts  # transformers' default
        if "moe" in self.kinds:
            e, g = self.n_routed_experts, self.n_group
            if g <= 0 or e % g or e // g < 2:
                refuse("n_group", g, f"a divisor of n_routed_experts ({e}) leaving at least 2 experts a group")
            if not 0 < self.topk_group <= g:
                refuse("topk_group", self.topk_group, f"1 to n_group ({g})")
            if not 0 < self.num_experts_per_tok <= self.topk_group * (e // g):
                refuse("num_experts_per_tok", self.num_experts_per_tok,
                       f"1 to the {self.topk_group * (e // g)} experts of topk_group groups")
            if self.moe_latent_size is not None and self.moe_latent_size <= 0:
                refuse("moe_latent_size", self.moe_latent_size, "a positive integer or null")


class PositionCount(StateCache):
    """The cache entry of a layer without decoding state (an MLP or MoE layer): nothing but
    ``offset``, the positions seen, so that every layer of `NemotronHForCausalLM.make_cache` has one."""

    fields = ()


class NemotronHMoE(GroupLimitedMoE):
    """Nemotron-H's mixture of experts: `GroupLimitedMoE` routing (``gate.weight``,
    ``gate.e_score_correction_bias``) over ungated `SwitchMLP` experts (``experts.up_proj``
    ``[E, I, L]``, ``experts.down_proj`` ``[E, L, I]``), plus the ungated `MLP` ``shared_experts``
    (``up_proj`` / ``down_proj``) on the block's input.

    With ``latent_dims`` L the experts work at width L: ``fc1_latent_proj`` ``[L, W]`` before them,
    ``fc2_latent_proj`` ``[W, L]`` after their weighted sum (the router and the shared expert see the
    input itself). Input and output dims ``(W=dims, H, D)``.

    Args:
        num_experts, top_k, hidden_dims, n_group, topk_group, norm_topk_prob, routed_scaling_factor:
            see `GroupLimitedMoE`.
        shared_dims: hidden width of the shared expert.
        latent_dims: the experts' width (None: the model's).
        activation: of the experts and the shared expert (``relu2``).
        bias: biases on the shared expert and the latent projections (``mlp_bias``).
        init: initializer of every weight.
    """

    positional_hint = "{cls}({num_experts}, {top_k}, {hidden_dims}, shared_dims=...)"

    def __init__(self, num_experts: int, top_k: int, hidden_dims: int, *, shared_dims: int, n_group: int = 1,
                 topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 latent_dims: int | None = None, activation: str = "relu2", bias: bool = False, init=None):
        super().__init__(num_experts, top_k, hidden_dims, n_group=n_group, topk_group=topk_group,
                         norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor, init=init)
        init = initializers.get(init, initializers.Normal(0.02))
        self.experts = SwitchMLP(num_experts, hidden_dims, activation=activation, init=init)
        self.shared_experts = MLP(hidden_dims=int(shared_dims), activation=activation, bias=bias, init=init,
                                  init_out=init)
        self.latent_dims = None if latent_dims is None else int(latent_dims)
        self.use_bias = bool(bias)
        self._init = init
        if self.latent_dims is not None:
            self.fc1_latent_proj = Linear(self.latent_dims, bias=bias, init=init)

    def build(self, device, dims, dtype):
        if self.latent_dims is not None:
            self.fc2_latent_proj = Linear(dims.W, bias=self.use_bias, init=self._init)

    def forward(self, device, data):
        d = data.dims
        x = data.array.reshape(-1, d.W)
        n = x.shape[0]
        rows = Data(x, MTLSize(d.W, 1, n))
        logits = self.compile_child(self.gate, device, rows).array.reshape(-1, self.num_experts)
        if self.record_router_logits:
            self._record.logits = logits
        weights, ids = self.route(logits)
        inner = rows if self.latent_dims is None else self.compile_child(self.fc1_latent_proj, device, rows)
        y = self.compile_child(self.experts, device, inner, indices=ids).array      # [N, k, L]
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=1)
        if self.latent_dims is not None:
            y = self.compile_child(self.fc2_latent_proj, device, Data(y, MTLSize(self.latent_dims, 1, n))).array
        y = y.reshape(-1, d.W) + self.compile_child(self.shared_experts, device, rows).array.reshape(-1, d.W)
        return Data(y.reshape(data.array.shape[:-1] + (d.W,)), d)

    def _extra_repr(self):
        return super()._extra_repr() + f", latent_dims={self.latent_dims}"


class NemotronHBlock(Layer):
    """One Nemotron-H layer: ``x + mixer(norm(x))`` (see the module docstring); ``cache=`` goes to a
    Mamba2 or attention mixer, and only counts positions for an MLP or MoE one.

    Args:
        mixer: `Mamba2`, `SelfAttention`, `MLP` or `NemotronHMoE`.
        kind: ``mamba``, ``attention``, ``mlp`` or ``moe``.
        eps: epsilon of the RMSNorm.
    """

    fixed_axes = ("W",)
    is_block = True

    def __init__(self, mixer: Layer, kind: str, *, eps: float):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(eps=eps)
        self.mixer = mixer

    def forward(self, device, data, cache=None):
        h = self.compile_child(self.norm, device, data)
        if self.kind in ("mamba", "attention"):
            h = self.compile_child(self.mixer, device, h, cache=cache)
        else:
            h = self.compile_child(self.mixer, device, h)
            if cache is not None:
                cache.offset += data.dims.H
        return Data(data.array + h.array, data.dims)

    def _extra_repr(self):
        return f"kind={self.kind}"


def mixer(args: ModelArgs, layer: int, init) -> Layer:
    """The mixer of layer ``layer`` of ``args``."""
    kind = args.kinds[layer]
    if kind == "mamba":
        return Mamba2(args.mamba_num_heads, head_dim=args.mamba_head_dim, state_size=args.ssm_state_size,
                      n_groups=args.n_groups, conv_kernel=args.conv_kernel, conv_bias=args.use_conv_bias,
                      bias=args.use_bias, time_step_limit=(args.time_step_min, float("inf")),
                      eps=args.layer_norm_epsilon, chunk_size=args.chunk_size, activation=args.mamba_hidden_act,
                      init=init)
    if kind == "attention":
        return SelfAttention(args.num_attention_heads, num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                             bias=False, rope=False, init=init)
    if kind == "mlp":
        return MLP(hidden_dims=args.intermediate_size, activation=args.mlp_hidden_act, bias=args.mlp_bias, init=init,
                   init_out=init)
    return NemotronHMoE(args.n_routed_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                        shared_dims=args.moe_shared_expert_intermediate_size, n_group=args.n_group,
                        topk_group=args.topk_group, norm_topk_prob=args.norm_topk_prob,
                        routed_scaling_factor=args.routed_scaling_factor, latent_dims=args.moe_latent_size,
                        activation=args.mlp_hidden_act, bias=args.mlp_bias, init=init)


#: one expert's projection in a checkpoint (``<prefix>.experts.<e>.{up,down}_proj.weight``)
_EXPERT = re.compile(r"^(?P<prefix>.+\.mixer\.experts)\.(?P<e>\d+)\.(?P<kind>up_proj|down_proj)\.weight$")


class StackedExperts(Provider):
    """``base`` with each layer's per-expert ``experts.<e>.up_proj.weight`` / ``down_proj.weight``
    shown as the stacked ``experts.up_proj`` / ``experts.down_proj`` (built on first ``get``).

    Raises `UnsupportedConfigError` naming the missing tensors when a layer's experts are incomplete.
    """

    def __init__(self, base):
        base = open_provider(base)
        super().__init__(base.source)
        self.base = base
        groups: dict = {}
        self._plain = []
        for key in base.keys():
            m = _EXPERT.match(key)
            if m is None:
                self._plain.append(key)
            else:
                groups.setdefault(f"{m['prefix']}.{m['kind']}", {})[int(m["e"])] = key
        self._stacked = {}
        for name, experts in groups.items():
            n = max(experts) + 1
            missing = [e for e in range(n) if e not in experts]
            if missing:
                raise UnsupportedConfigError(f"{self.source}: {name} lacks experts {missing} (expected 0..{n - 1})")
            self._stacked[name] = [experts[e] for e in range(n)]

    def keys(self):
        return self._plain + list(self._stacked)

    def spec(self, name):
        if name not in self._stacked:
            return self.base.spec(name)
        keys = self._stacked[name]
        shape, dtype = self.base.spec(keys[0])
        return (len(keys),) + tuple(shape), dtype

    def get(self, name):
        if name not in self._stacked:
            return self.base.get(name)
        return mx.stack([self.base.get(k) for k in self._stacked[name]])


def checkpoint_to_model(name: str) -> str | None:
    """A checkpoint tensor name as metalnn's parameter name (None: dropped)."""
    if name.startswith("mtp."):
        return None
    if name.startswith("backbone."):
        name = "model." + name[len("backbone."):]
    if name.startswith("model.embeddings."):
        return "model.embed_tokens." + name[len("model.embeddings."):]
    if name.startswith("model.norm_f."):
        return "model.norm." + name[len("model.norm_f."):]
    return name


def model_to_checkpoint(name: str) -> str:
    """metalnn's parameter name as the Hub checkpoint's."""
    if name.startswith("model.embed_tokens."):
        return "backbone.embeddings." + name[len("model.embed_tokens."):]
    if name.startswith("model.norm."):
        return "backbone.norm_f." + name[len("model.norm."):]
    if name.startswith("model."):
        return "backbone." + name[len("model."):]
    return name


@register("NemotronHForCausalLM", model_types=("nemotron_h",), gguf=(NemotronHConverter, NemotronHMoEConverter))
class NemotronHForCausalLM(CausalLM):
    """Nemotron-H built from a Hugging Face ``NemotronHConfig`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`
    of `NemotronHBlock` s (its ``embed_tokens`` and ``norm`` are the checkpoint's ``embeddings`` and
    ``norm_f``). The routers balance their experts with the correction bias: there is no auxiliary
    loss (`aux_loss` refuses).

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        init = initializers.Normal(args.initializer_range)  # transformers' init
        layers = [NemotronHBlock(mixer(args, i, init), kind, eps=args.layer_norm_epsilon)
                  for i, kind in enumerate(args.kinds)]
        self.model = DecoderStack(args.vocab_size, args.hidden_size, layers, eps=args.layer_norm_epsilon,
                                  init_std=args.initializer_range)
        self.lm_head = Linear(args.vocab_size, bias=False, init=init)

    @property
    def tie_word_embeddings(self) -> bool:
        return False  # transformers' Nemotron-H never ties its head

    @property
    def layer_kinds(self) -> list:
        """``mamba`` / ``attention`` / ``mlp`` / ``moe`` per layer."""
        return list(self.args.kinds)

    def make_cache(self) -> list:
        """A `Mamba2Cache` per Mamba2 layer, a `KVCache` per attention layer, a `PositionCount` per
        MLP or MoE layer."""
        return [Mamba2Cache() if k == "mamba" else KVCache() if k == "attention" else PositionCount()
                for k in self.args.kinds]

    def moe_layers(self) -> list:
        """The `NemotronHMoE` mixers, in layer order."""
        return [block.mixer for block in self.decoder_layers if block.kind == "moe"]

    def aux_loss(self):
        raise NotImplementedError(f"{self.architecture}: no auxiliary load-balancing loss (Nemotron-H balances its "
                                  "experts with mixer.gate.e_score_correction_bias)")

    @property
    def features(self) -> list:
        """What sets the model apart from a Llama, one phrase each (shown by ``metalnn info``)."""
        a = self.args
        counts = {k: a.kinds.count(k) for k in KINDS}
        parts = [f"{counts['mamba']} Mamba2 (state-space)", f"{counts['attention']} attention",
                 f"{counts['mlp']} MLP"] + ([f"{counts['moe']} mixture-of-experts"] if counts["moe"] else [])
        out = [f"hybrid: {', '.join(parts)} layers, one mixer a layer",
               f"ungated {'squared-ReLU' if a.mlp_hidden_act == 'relu2' else a.mlp_hidden_act} MLPs"]
        if counts["moe"]:
            out.append(f"mixture of experts: {a.num_experts_per_tok} of {a.n_routed_experts} experts per token, "
                       f"sigmoid routing from {a.topk_group} of {a.n_group} expert groups, weights x"
                       f"{a.routed_scaling_factor:g}, plus a shared expert")
            if a.moe_latent_size is not None:
                out.append(f"experts in a {a.moe_latent_size}-wide latent space")
        out.append("no position embeddings (NoPE)")
        return out

    # -- weights -----------------------------------------------------------------------------------
    def rename_weight(self, name):
        return checkpoint_to_model(name)

    def load_weights_from(self, provider, strict: bool = True):
        return super().load_weights_from(StackedExperts(provider), strict=strict)

    def export_weights(self):
        out = {}
        for name, a in self.named_parameters().items():
            name = model_to_checkpoint(name)
            if a.ndim == 3 and name.endswith((".experts.up_proj", ".experts.down_proj")):
                prefix, _, kind = name.rpartition(".")
                for e in range(a.shape[0]):
                    out[f"{prefix}.{e}.{kind}.weight"] = a[e]
            else:
                out[name] = a
        return out
