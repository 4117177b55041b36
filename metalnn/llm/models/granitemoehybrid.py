"""Granite 4 hybrid (`GraniteMoeHybridForCausalLM`, model type ``granitemoehybrid``): Mamba2
state-space layers and attention layers, each followed by a mixture of experts plus a shared MLP.

Each decoder layer is a `GraniteHybridBlock`::

    h = x + residual_multiplier * mixer(input_layernorm(x))
    out = h + residual_multiplier * (block_sparse_moe(n) + shared_mlp(n)),  n = post_attention_layernorm(h)

with the mixer chosen by ``layer_types``:

* ``mamba`` / ``linear_attention``: `Mamba2` (``model.layers.<i>.mamba.*``: ``in_proj``, ``conv1d``,
  ``A_log``, ``dt_bias``, ``D``, ``norm``, ``out_proj``);
* ``attention`` / ``full_attention``: `SelfAttention` (``self_attn.*``) with scale
  ``attention_multiplier`` and rotary embeddings when ``position_embedding_type`` is ``rope``
  (none for ``nope`` / null: Granite 4's attention layers have no positions of their own).

The experts (``block_sparse_moe``, when ``num_local_experts > 0``) route each token to the top
``num_experts_per_tok`` of the router logits, weighted by the softmax over those (the same as a
softmax over all experts renormalised over the chosen ones: `SparseMoE` with ``norm_topk_prob``).
The shared MLP is a gated MLP with fused gate and up rows (``shared_mlp.input_linear`` ``[2*S, W]``,
gate first; ``shared_mlp.output_linear``). The embeddings are multiplied by
``embedding_multiplier`` and the logits divided by ``logits_scaling``.

Checkpoint names: the Hub's (``block_sparse_moe.input_linear.weight`` ``[E, 2*I, W]``,
``block_sparse_moe.output_linear.weight`` ``[E, W, I]``, ``block_sparse_moe.router.layer.weight``
``[E, W]``), which transformers 5 writes too; its in-memory names (``experts.gate_up_proj``,
``experts.down_proj``, ``router.weight``) load as well. GGUF files: ``granitehybrid``
(`metalnn.llm.gguf.converters.granitehybrid`).

Caches: `make_cache` gives a `Mamba2Cache` per Mamba2 layer and a `KVCache` per attention layer.
The decoding step fused for Llama-like blocks (`DecoderBlock._step_plan`) does not apply to these
blocks (residual multipliers, shared MLP): they always run their layers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import mlx.core as mx

from ... import functional as F
from ... import init as initializers
from ...data import Data, MTLSize
from ...errors import UnsupportedConfigError
from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.attention import KVCache, SelfAttention
from ...layers.base import Layer
from ...layers.linear import Linear
from ...layers.mamba2 import Mamba2, Mamba2Cache
from ...layers.moe import SparseMoE
from ...layers.norm import RMSNorm
from ..gguf.converters.granitehybrid import GraniteHybridConverter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import DecoderStack
from .experts import RoutedExperts
from .registry import register
from .rope import rope_options

#: ``layer_types`` entries: transformers 5's names and the Hub configs' older ones
MAMBA, ATTENTION = ("linear_attention", "mamba"), ("full_attention", "attention")


def _limit(value, name: str) -> float:
    """One end of ``time_step_limit``: a number, ``"inf"``/``"Infinity"``, or transformers'
    ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        out = float(value)
    except (TypeError, ValueError):
        refuse(name, value, "a number")
    if math.isnan(out):
        refuse(name, value, "a number")
    return out


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``GraniteMoeHybridConfig`` that metalnn reads (absent ones take
    transformers' defaults).

    ``layer_types`` (``mamba``/``linear_attention`` or ``attention``/``full_attention``; absent: every
    layer Mamba2); the Mamba2 sizes ``mamba_n_heads``, ``mamba_d_head`` (``"auto"``:
    ``mamba_expand * hidden_size / mamba_n_heads``), ``mamba_d_state``, ``mamba_n_groups``,
    ``mamba_d_conv``, ``mamba_conv_bias``, ``mamba_proj_bias``, ``mamba_chunk_size``,
    ``time_step_limit``; the experts ``num_local_experts`` (0: no experts, the shared MLP alone),
    ``num_experts_per_tok``, ``intermediate_size`` (per expert), ``shared_intermediate_size``; the
    multipliers ``embedding_multiplier``, ``attention_multiplier``, ``residual_multiplier`` and
    ``logits_scaling``; ``position_embedding_type`` (``rope``, or ``nope``/null for none).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int = 11008
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int | None = None
    layer_types: list | None = None
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    shared_intermediate_size: int = 1024
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    position_embedding_type: str | None = None
    mamba_n_heads: int = 128
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_head: object = "auto"
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: list | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    #: derived: each layer's kind (``mamba`` / ``attention``), `SelfAttention`'s RoPE keywords (None: no RoPE)
    kinds: list = field(init=False, repr=False)
    rope: dict | None = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            refuse("hidden_act", self.hidden_act, ", ".join(ACTIVATIONS))
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        types = self.layer_types if self.layer_types is not None else ["mamba"] * self.num_hidden_layers
        if not isinstance(types, (list, tuple)) or len(types) != self.num_hidden_layers:
            raise UnsupportedConfigError(f"layer_types must list one entry per layer (num_hidden_layers="
                                         f"{self.num_hidden_layers}), got {types!r}")
        self.kinds = []
        for i, kind in enumerate(types):
            if kind not in MAMBA + ATTENTION:
                refuse(f"layer_types[{i}]", kind, ", ".join(MAMBA + ATTENTION))
            self.kinds.append("mamba" if kind in MAMBA else "attention")
        if self.num_local_experts < 0 or (self.num_local_experts and not 0 < self.num_experts_per_tok
                                          <= self.num_local_experts):
            refuse("num_experts_per_tok", self.num_experts_per_tok,
                   f"1 to num_local_experts = {self.num_local_experts}")
        if "mamba" in self.kinds:
            inner = self.mamba_expand * self.hidden_size
            if self.mamba_d_head == "auto":
                self.mamba_d_head = inner // self.mamba_n_heads
            if isinstance(self.mamba_d_head, bool) or not isinstance(self.mamba_d_head, int) or \
                    self.mamba_d_head * self.mamba_n_heads != inner:
                refuse("mamba_d_head", self.mamba_d_head,
                       f"'auto' or mamba_expand * hidden_size / mamba_n_heads = {inner / self.mamba_n_heads:g}")
            if self.mamba_n_groups <= 0 or self.mamba_n_heads % self.mamba_n_groups:
                refuse("mamba_n_groups", self.mamba_n_groups, f"a divisor of mamba_n_heads = {self.mamba_n_heads}")
        limit = self.time_step_limit if self.time_step_limit is not None else (0.0, math.inf)
        if not isinstance(limit, (list, tuple)) or len(limit) != 2:
            refuse("time_step_limit", limit, "[min, max]")
        self.time_step_limit = [_limit(limit[0], "time_step_limit[0]"), _limit(limit[1], "time_step_limit[1]")]
        kind = self.position_embedding_type
        if kind not in (None, "nope", "rope"):
            refuse("position_embedding_type", kind, "'rope', 'nope' or null")
        self.rope = None
        if kind == "rope":
            self.rope = rope_options(self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                     rope_parameters=self.rope_parameters, partial_rotary_factor=1.0)


class SharedMLP(Layer):
    """Granite's shared expert: ``output_linear(act(gate) * up)`` with ``gate, up`` the two halves of
    ``input_linear(x)`` (``input_linear.weight`` ``[2*hidden, W]``, gate rows first).

    Args:
        hidden_dims: ``shared_intermediate_size``.
        activation: the gate's activation (``silu``).
        init: initializer of both projections.
    """

    fixed_axes = ("W",)

    def __init__(self, hidden_dims: int, *, activation: str = "silu", init=None):
        super().__init__()
        self.hidden_dims = int(hidden_dims)
        self.activation = F.check_activation(activation)
        self.input_linear = Linear(2 * self.hidden_dims, bias=False, init=init)
        self._init = init

    def build(self, device, dims, dtype):
        self.output_linear = Linear(dims.W, bias=False, init=self._init)

    def forward(self, device, data):
        d = data.dims
        h = self.compile_child(self.input_linear, device, data).array
        gate, up = h[..., :self.hidden_dims], h[..., self.hidden_dims:]
        h = F.activation(gate, self.activation, device=device) * up
        return self.compile_child(self.output_linear, device, Data(h, MTLSize(self.hidden_dims, d.H, d.D)))

    def _extra_repr(self):
        return f"hidden_dims={self.hidden_dims}, activation={self.activation!r}"


class GraniteHybridBlock(Layer):
    """One Granite 4 hybrid decoder layer (see the module docstring); ``cache=`` goes to the mixer.

    Args:
        mixer: `Mamba2` or `SelfAttention`.
        mixer_name: its parameter prefix (``mamba`` or ``self_attn``).
        moe: the `SparseMoE` (``block_sparse_moe``) or None.
        shared_mlp: the `SharedMLP`.
        eps: epsilon of both RMSNorms.
        residual_multiplier: the factor of both branches.
    """

    fixed_axes = ("W",)
    is_block = True

    def __init__(self, mixer: Layer, mixer_name: str, moe: Layer | None, shared_mlp: Layer, *, eps: float,
                 residual_multiplier: float = 1.0):
        super().__init__()
        self.mixer_name = mixer_name
        self.input_layernorm = RMSNorm(eps=eps)
        setattr(self, mixer_name, mixer)
        self.post_attention_layernorm = RMSNorm(eps=eps)
        if moe is not None:
            self.block_sparse_moe = moe
        self.shared_mlp = shared_mlp
        self.residual_multiplier = float(residual_multiplier)

    @property
    def mixer(self) -> Layer:
        return self[self.mixer_name]

    def forward(self, device, data, cache=None):
        m = self.residual_multiplier
        h = self.compile_child(self.input_layernorm, device, data)
        h = self.compile_child(self.mixer, device, h, cache=cache).array
        x = data.array + (h * m if m != 1.0 else h)
        n = self.compile_child(self.post_attention_layernorm, device, Data(x, data.dims))
        h = self.compile_child(self.shared_mlp, device, n).array
        if "block_sparse_moe" in self:
            h = self.compile_child(self.block_sparse_moe, device, n).array + h
        return Data(x + (h * m if m != 1.0 else h), data.dims)

    def _extra_repr(self):
        return f"mixer={self.mixer_name}, residual_multiplier={self.residual_multiplier}"


def decoder_layer(args: ModelArgs, layer: int, init) -> Layer:
    """Decoder layer ``layer`` of ``args``: its mixer, experts and shared MLP."""
    if args.kinds[layer] == "mamba":
        mixer = Mamba2(args.mamba_n_heads, head_dim=args.mamba_d_head, state_size=args.mamba_d_state,
                       n_groups=args.mamba_n_groups, conv_kernel=args.mamba_d_conv, conv_bias=args.mamba_conv_bias,
                       bias=args.mamba_proj_bias, time_step_limit=tuple(args.time_step_limit), eps=args.rms_norm_eps,
                       chunk_size=args.mamba_chunk_size, activation=args.hidden_act, init=init)
        name = "mamba"
    else:
        rope = args.rope if args.rope is not None else {}
        mixer = SelfAttention(args.num_attention_heads, num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                              bias=args.attention_bias, rope=args.rope is not None, scale=args.attention_multiplier,
                              init=init, **rope)
        name = "self_attn"
    moe = None
    if args.num_local_experts:
        moe = SparseMoE(args.num_local_experts, args.num_experts_per_tok, args.intermediate_size, norm_topk_prob=True,
                        activation=args.hidden_act, record_router_logits=args.output_router_logits, init=init)
    shared = SharedMLP(args.shared_intermediate_size, activation=args.hidden_act, init=init)
    return GraniteHybridBlock(mixer, name, moe, shared, eps=args.rms_norm_eps,
                              residual_multiplier=args.residual_multiplier)


#: checkpoint names of the experts -> metalnn's (`SparseMoE`: ``gate``, ``experts.gate_up_proj``, ``experts.down_proj``)
_LOAD_NAMES = [(re.compile(r"\.block_sparse_moe\.input_linear\.weight$"), ".block_sparse_moe.experts.gate_up_proj"),
               (re.compile(r"\.block_sparse_moe\.output_linear\.weight$"), ".block_sparse_moe.experts.down_proj"),
               (re.compile(r"\.block_sparse_moe\.router\.(layer\.)?weight$"), ".block_sparse_moe.gate.weight")]
_SAVE_NAMES = [(re.compile(r"\.block_sparse_moe\.experts\.gate_up_proj$"), ".block_sparse_moe.input_linear.weight"),
               (re.compile(r"\.block_sparse_moe\.experts\.down_proj$"), ".block_sparse_moe.output_linear.weight"),
               (re.compile(r"\.block_sparse_moe\.gate\.weight$"), ".block_sparse_moe.router.layer.weight")]


def _rename(name: str, table) -> str:
    for pattern, repl in table:
        if pattern.search(name):
            return pattern.sub(repl, name)
    return name


@register("GraniteMoeHybridForCausalLM", model_types=("granitemoehybrid",), gguf=GraniteHybridConverter)
class GraniteMoeHybridForCausalLM(RoutedExperts, CausalLM):
    """Granite 4 hybrid built from a Hugging Face ``GraniteMoeHybridConfig`` dict (`ModelArgs` lists
    the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]`` (divided by ``logits_scaling``);
    ``model.model`` is the `DecoderStack` of `GraniteHybridBlock` s. ``output_router_logits`` and
    ``aux_loss`` (the load-balancing loss) work as in `RoutedExperts`.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        init = initializers.Normal(args.initializer_range)  # transformers' init
        layers = [decoder_layer(args, i, init) for i in range(args.num_hidden_layers)]
        scale = args.embedding_multiplier if args.embedding_multiplier != 1.0 else None
        self.model = DecoderStack(args.vocab_size, args.hidden_size, layers, eps=args.rms_norm_eps,
                                  init_std=args.initializer_range, embed_scale=scale)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.vocab_size, bias=False, init=init)

    def forward(self, device, data, cache=None, last_only: bool = False):
        logits = super().forward(device, data, cache=cache, last_only=last_only)
        s = self.args.logits_scaling
        return logits if s == 1.0 else Data(logits.array / mx.array(s, dtype=logits.array.dtype), logits.dims)

    @property
    def layer_kinds(self) -> list:
        """``mamba`` / ``attention`` per layer."""
        return list(self.args.kinds)

    def make_cache(self) -> list:
        """A `Mamba2Cache` per Mamba2 layer and a `KVCache` per attention layer."""
        return [Mamba2Cache() if kind == "mamba" else KVCache() for kind in self.args.kinds]

    def moe_layers(self) -> list:
        return [block.block_sparse_moe for block in self.decoder_layers if "block_sparse_moe" in block]

    @property
    def features(self) -> list:
        a = self.args
        n = a.kinds.count("mamba")
        out = [f"hybrid: {n} Mamba2 (state-space) layers, {len(a.kinds) - n} attention layers"]
        if a.num_local_experts:
            out.append(f"mixture of experts: {a.num_experts_per_tok} of {a.num_local_experts} experts per token, "
                       f"plus a shared MLP")
        out.append("rotary embeddings" if a.rope is not None else "no position embeddings (NoPE)")
        mults = [f"{k} {v:g}" for k, v in (("embedding_multiplier", a.embedding_multiplier),
                                           ("attention_multiplier", a.attention_multiplier),
                                           ("residual_multiplier", a.residual_multiplier),
                                           ("logits_scaling", a.logits_scaling))]
        out.append("multipliers: " + ", ".join(mults))
        return out

    # -- weights -----------------------------------------------------------------------------------
    def rename_weight(self, name):
        name = super().rename_weight(name)
        return None if name is None else _rename(name, _LOAD_NAMES)

    def load_weights_from(self, provider, strict: bool = True):
        return CausalLM.load_weights_from(self, provider, strict=strict)

    def export_weights(self):
        return {_rename(k, _SAVE_NAMES): v for k, v in self.named_parameters().items()}
