"""Gemma 2 decoder (`Gemma2ForCausalLM`): `SandwichBlock` s (zero-centred RMSNorms, gain ``1 + weight``,
before and after attention and the MLP), GeGLU with tanh GELU, the embedding scaled by
``sqrt(hidden_size)``, sliding-window layers alternating with global ones (``layer_types``: layers
0, 2, 4, ... slide by default), scores scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped
(``attn_logit_softcapping``), and soft-capped output logits (``final_logit_softcapping``).

Parameter names equal Hugging Face's (``model.layers.<i>.pre_feedforward_layernorm.weight``
``[hidden]``, ...). GGUF files: ``gemma2`` (`metalnn.llm.gguf.converters.gemma2`). Gemma 3 reuses
`gemma_block` and `GELU_GATES` (`metalnn.llm.models.gemma3`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ... import init as initializers
from ...layers.attention import SelfAttention
from ...layers.base import Layer
from ...layers.linear import Linear
from ...layers.mlp import SwiGLU
from ...layers.transformer import SandwichBlock
from ..gguf.converters.gemma2 import Gemma2Converter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import SLIDING, DecoderStack, check_layer_types
from .registry import register
from .rope import rope_options

#: Gemma's RMSNorm gain is ``1 + weight``
NORM_OFFSET = 1.0
#: ``hidden_activation`` -> the gate activation of the GeGLU MLP
GELU_GATES = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}


def gate_activation(hidden_activation: str) -> str:
    """The MLP's gate activation of a Gemma ``hidden_activation`` (refused unless a GELU)."""
    if hidden_activation not in GELU_GATES:
        refuse("hidden_activation", hidden_activation, ", ".join(GELU_GATES))
    return GELU_GATES[hidden_activation]


def check_positive(name: str, value, allow_none: bool = True):
    """``value`` if a positive number (or None when ``allow_none``), else refused naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        refuse(name, value, "a positive number" + (" or null" if allow_none else ""))
    return value


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``Gemma2Config`` that metalnn reads (absent ones take transformers'
    defaults).

    ``hidden_activation`` names the GELU of the gated MLP (``gelu_pytorch_tanh``); ``layer_types``
    (default: even layers ``sliding_attention``, odd ones ``full_attention``) picks the layers that
    attend to the last ``sliding_window`` positions only. ``use_bidirectional_attention`` is refused.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    max_position_embeddings: int | None = 8192
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: list | None = None
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0
    use_bidirectional_attention: bool | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    #: derived: the MLP's gate activation, each layer's window, `SelfAttention`'s RoPE keywords
    activation: str = field(init=False, repr=False)
    windows: list = field(init=False, repr=False)
    rope: dict = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        self.activation = gate_activation(self.hidden_activation)
        if self.use_bidirectional_attention:
            refuse("use_bidirectional_attention", self.use_bidirectional_attention, "false or null")
        check_positive("query_pre_attn_scalar", self.query_pre_attn_scalar, allow_none=False)
        check_positive("final_logit_softcapping", self.final_logit_softcapping)
        check_positive("attn_logit_softcapping", self.attn_logit_softcapping)
        if self.sliding_window is not None and self.sliding_window <= 0:
            refuse("sliding_window", self.sliding_window, "a positive integer or null")
        types = self.layer_types
        if types is None:
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)]
        types = check_layer_types(types, self.num_hidden_layers, SLIDING)
        self.windows = [self.sliding_window if kind == "sliding_attention" else None for kind in types]
        self.rope = rope_options(self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                 rope_parameters=self.rope_parameters, partial_rotary_factor=1.0)


def gemma_block(args, *, window: int | None, rope: dict, softcap: float | None, qk_norm: bool, init) -> Layer:
    """A Gemma decoder layer: `SandwichBlock` of `SelfAttention` (scores scaled by
    ``query_pre_attn_scalar ** -0.5``, soft-capped by ``softcap``, attending to ``window`` positions,
    RoPE keywords ``rope``, q/k norms when ``qk_norm``) and a GeGLU `SwiGLU` (``args.activation``)."""
    attn = SelfAttention(args.num_attention_heads, num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                         bias=args.attention_bias, scale=float(args.query_pre_attn_scalar) ** -0.5, softcap=softcap,
                         qk_norm=qk_norm, norm_eps=args.rms_norm_eps, norm_offset=NORM_OFFSET, sliding_window=window,
                         init=init, **rope)
    mlp = SwiGLU(args.intermediate_size, activation=args.activation, init=init, init_out=init)
    return SandwichBlock(attn, mlp, eps=args.rms_norm_eps, norm_offset=NORM_OFFSET)


def gemma_stack(args, layers: list) -> DecoderStack:
    """The ``model`` of a Gemma checkpoint: the embedding scaled by ``sqrt(hidden_size)``, ``layers``,
    the final zero-centred RMSNorm."""
    return DecoderStack(args.vocab_size, args.hidden_size, layers, eps=args.rms_norm_eps,
                        init_std=args.initializer_range, norm_offset=NORM_OFFSET,
                        embed_scale=math.sqrt(args.hidden_size))


def gemma_features(args) -> list:
    """The `CausalLM.features` Gemma 2 and 3 share: norms, embedding scale, MLP, windows, score scale,
    final soft cap."""
    sliding = [i for i, w in enumerate(args.windows) if w is not None]
    out = ["norms before and after attention and MLP (gain 1 + weight)",
           f"embedding scaled by sqrt({args.hidden_size})", f"GeGLU ({args.hidden_activation})",
           f"scores scaled by query_pre_attn_scalar {args.query_pre_attn_scalar:g} ** -0.5"]
    if sliding:
        out.append(f"sliding window {args.sliding_window} on {len(sliding)} of {args.num_hidden_layers} layers")
    if args.final_logit_softcapping is not None:
        out.append(f"final logit soft cap {args.final_logit_softcapping:g}")
    return out


@register("Gemma2ForCausalLM", model_types=("gemma2",), gguf=Gemma2Converter)
class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 built from a Hugging Face ``Gemma2Config`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]`` (soft-capped); ``model.model`` is the
    `DecoderStack` of `SandwichBlock` s.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        init = initializers.Normal(args.initializer_range)  # transformers' init
        layers = [gemma_block(args, window=args.windows[i], rope=args.rope, softcap=args.attn_logit_softcapping,
                              qk_norm=False, init=init) for i in range(args.num_hidden_layers)]
        self.model = gemma_stack(args, layers)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.vocab_size, bias=False, init=init)

    @property
    def logit_softcap(self) -> float | None:
        return self.args.final_logit_softcapping

    @property
    def features(self) -> list:
        out = gemma_features(self.args)
        if self.args.attn_logit_softcapping is not None:
            out.append(f"attention soft cap {self.args.attn_logit_softcapping:g}")
        return out
