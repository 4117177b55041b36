"""Gemma 3 text decoder (`Gemma3ForCausalLM`, ``model_type`` ``gemma3_text``): Gemma 2's layers
(`metalnn.llm.models.gemma2.gemma_block`: `SandwichBlock` s of zero-centred RMSNorms, GeGLU with tanh
GELU, the embedding scaled by ``sqrt(hidden_size)``, scores scaled by ``query_pre_attn_scalar ** -0.5``)
with per-head q/k RMSNorms, no attention soft-capping, and local and global layers with their own
RoPE: sliding-window layers rotate with base ``rope_local_base_freq`` (unscaled), global ones with
``rope_theta`` and ``rope_scaling`` (five local layers to one global by default).

Parameter names equal Hugging Face's (``model.layers.<i>.self_attn.q_norm.weight`` ``[head_dim]``, ...).
GGUF files: ``gemma3`` (`metalnn.llm.gguf.converters.gemma3`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ... import init as initializers
from ...layers.linear import Linear
from ..gguf.converters.gemma3 import Gemma3Converter
from .base import BaseModelArgs, CausalLM, refuse, text_config
from .decoder import SLIDING, check_layer_types
from .gemma2 import check_positive, gate_activation, gemma_block, gemma_features, gemma_stack
from .registry import register
from .rope import rope_options


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``Gemma3TextConfig`` that metalnn reads (absent ones take
    transformers' defaults).

    ``layer_types`` defaults to ``sliding_window_pattern`` (6: every sixth layer global). RoPE per
    layer type: ``rope_parameters`` as transformers 5 writes it (``{"sliding_attention": {...},
    "full_attention": {...}}``), or the older flat keys (``rope_theta`` and ``rope_scaling`` for the
    global layers, ``rope_local_base_freq`` for the local ones). ``attn_logit_softcapping`` is not
    read (transformers' Gemma 3 does not apply it); ``use_bidirectional_attention`` is refused.
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
    max_position_embeddings: int | None = 131072
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6
    layer_types: list | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: bool | None = False
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    #: derived: the MLP's gate activation, each layer's window and RoPE keywords
    activation: str = field(init=False, repr=False)
    windows: list = field(init=False, repr=False)
    ropes: list = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        self.activation = gate_activation(self.hidden_activation)
        if self.use_bidirectional_attention:
            refuse("use_bidirectional_attention", self.use_bidirectional_attention, "false or null")
        check_positive("query_pre_attn_scalar", self.query_pre_attn_scalar, allow_none=False)
        check_positive("final_logit_softcapping", self.final_logit_softcapping)
        if self.sliding_window is not None and self.sliding_window <= 0:
            refuse("sliding_window", self.sliding_window, "a positive integer or null")
        types = self.layer_types
        if types is None:
            if self.sliding_window_pattern <= 0:
                refuse("sliding_window_pattern", self.sliding_window_pattern, "a positive integer")
            types = ["sliding_attention" if (i + 1) % self.sliding_window_pattern else "full_attention"
                     for i in range(self.num_hidden_layers)]
        types = check_layer_types(types, self.num_hidden_layers, SLIDING)
        self.windows = [self.sliding_window if kind == "sliding_attention" else None for kind in types]
        by_kind = {kind: self.layer_rope(kind) for kind in SLIDING}
        self.ropes = [by_kind[kind] for kind in types]

    def layer_rope(self, kind: str) -> dict:
        """`SelfAttention`'s RoPE keywords of the layers of type ``kind`` (as transformers'
        ``Gemma3TextConfig.convert_rope_params_to_dict`` reads the config)."""
        params = dict(self.rope_parameters or {})
        nested = any(k in params for k in SLIDING)
        if kind == "full_attention":
            own = dict(params.get(kind) or {}) if nested else params
            own.update(self.rope_scaling or {})
            own.setdefault("rope_theta", self.rope_theta)
        else:
            own = dict(params.get(kind) or {}) if nested else {}
            own.setdefault("rope_theta", self.rope_local_base_freq)
        return rope_options(self.head_dim, rope_theta=float(own["rope_theta"]), rope_scaling=None,
                            rope_parameters=own, partial_rotary_factor=1.0)


#: where the text model's tensors sit in a multimodal checkpoint (transformers 5, then 4), and what
#: of it is not loaded (the vision tower and its projector)
_LANGUAGE_MODEL = (("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_VISION = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


@register("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", model_types=("gemma3_text", "gemma3"),
          gguf=Gemma3Converter)
class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 (text) built from a Hugging Face ``Gemma3TextConfig`` dict, or the text model of a
    multimodal ``Gemma3Config`` (``Gemma3ForConditionalGeneration`` folders: the 4B and larger
    checkpoints; ``text_config`` is read, the vision tower is not loaded) (`ModelArgs` lists the keys
    read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack` of
    `SandwichBlock` s.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def __init__(self, config: dict, seed: int = 0):
        super().__init__(text_config(config), seed=seed)

    def rename_weight(self, name):
        for prefix, to in _LANGUAGE_MODEL:
            if name.startswith(prefix):
                name = to + name[len(prefix):]
                break
        else:
            if name.startswith(_VISION):
                return None
        return super().rename_weight(name)

    def _build(self, args: ModelArgs):
        init = initializers.Normal(args.initializer_range)  # transformers' init
        layers = [gemma_block(args, window=args.windows[i], rope=args.ropes[i], softcap=None, qk_norm=True, init=init)
                  for i in range(args.num_hidden_layers)]
        self.model = gemma_stack(args, layers)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.vocab_size, bias=False, init=init)

    @property
    def logit_softcap(self) -> float | None:
        return self.args.final_logit_softcapping

    @property
    def features(self) -> list:
        out = gemma_features(self.args) + ["q/k norms"]
        kinds = {}
        for window, rope in zip(self.args.windows, self.args.ropes):
            kinds.setdefault("local" if window is not None else "global", rope)
        for kind, rope in kinds.items():
            scale = f", scale {rope['rope_scale']:g}" if rope["rope_scale"] != 1 else ""
            scale += ", llama3 frequencies" if rope["rope_freqs"] is not None else ""
            out.append(f"RoPE base {rope['rope_base']:g} on {kind} layers{scale}")
        return out
