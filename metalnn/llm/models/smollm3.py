"""SmolLM3 decoder (`SmolLM3ForCausalLM`): the Llama block (GQA, SwiGLU, tied embeddings by default)
where some layers use no rotary embedding ("NoPE" layers) and, optionally, a sliding attention window.

Which layers rotate: ``no_rope_layers`` (one ``1`` = RoPE / ``0`` = NoPE per layer; transformers'
name counts the layers that *use* RoPE), else every ``no_rope_layer_interval``-th layer is NoPE
(layers ``interval - 1``, ``2 * interval - 1``, ...). Which layers slide: ``layer_types``
(``sliding_attention`` / ``full_attention``), by default the NoPE layers when ``use_sliding_window``
and ``sliding_window`` are set (`layer_plan`).

Parameter names equal Hugging Face's (those of Llama). GGUF files: ``smollm3``
(`metalnn.llm.gguf.converters.smollm3`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import UnsupportedConfigError
from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.base import Layer
from ...layers.transformer import TransformerBlock
from ..gguf.converters.smollm3 import SmolLM3Converter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import SLIDING, build_decoder, check_layer_types
from .registry import register
from .rope import rope_options


def layer_plan(num_hidden_layers: int, *, no_rope_layers: list | None, no_rope_layer_interval: int,
               use_sliding_window: bool, sliding_window: int | None, layer_types: list | None) -> tuple:
    """``(uses_rope, windows)``, one entry per layer, as transformers' ``SmolLM3Config`` and
    ``SmolLM3Model`` decide them.

    ``uses_rope[i]``: ``no_rope_layers[i]`` (its first ``num_hidden_layers`` entries), by default
    ``(i + 1) % no_rope_layer_interval != 0``. ``windows[i]``: ``sliding_window`` on the layers
    ``layer_types`` marks ``sliding_attention`` (transformers' sliding mask applies there whatever
    ``use_sliding_window`` says), by default the NoPE layers when ``use_sliding_window`` and
    ``sliding_window`` are both set; None elsewhere.

    Raises:
        UnsupportedConfigError: ``no_rope_layers`` shorter than the layers or with entries other than
            0 / 1, a non-positive interval or window, unknown ``layer_types``, or sliding layers without
            a window.
    """
    n = num_hidden_layers
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) <= 0):
        refuse("sliding_window", sliding_window, "a positive integer or null")
    if no_rope_layers is None:
        if isinstance(no_rope_layer_interval, bool) or int(no_rope_layer_interval) <= 0:
            refuse("no_rope_layer_interval", no_rope_layer_interval, "a positive integer")
        uses_rope = [(i + 1) % int(no_rope_layer_interval) != 0 for i in range(n)]
    else:
        if not isinstance(no_rope_layers, (list, tuple)) or len(no_rope_layers) < n:
            raise UnsupportedConfigError(f"no_rope_layers must list (at least) one 1 / 0 per layer "
                                         f"(num_hidden_layers={n}), got {no_rope_layers!r}")
        for i, flag in enumerate(no_rope_layers[:n]):
            if flag not in (0, 1):  # (True / False compare equal to 1 / 0)
                refuse(f"no_rope_layers[{i}]", flag, "1 (RoPE), 0 (no RoPE)")
        uses_rope = [bool(flag) for flag in no_rope_layers[:n]]
    if layer_types is None:
        slides = [bool(use_sliding_window and sliding_window is not None and not rope) for rope in uses_rope]
    else:
        slides = [kind == "sliding_attention" for kind in check_layer_types(layer_types, n, SLIDING)]
    if any(slides) and sliding_window is None:
        raise UnsupportedConfigError("layer_types marks sliding_attention layers but sliding_window is None; "
                                     "expected a positive window")
    return uses_rope, [int(sliding_window) if slide else None for slide in slides]


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``SmolLM3Config`` that metalnn reads (absent ones take transformers'
    defaults: 4 key/value heads, ``rope_theta`` 2e6, tied embeddings, a NoPE layer in every 4).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``; ``attention_bias`` puts biases on
    all four attention projections, ``mlp_bias`` on the three MLP ones; RoPE settings as Llama's
    (`rope_options`); the per-layer plan from ``no_rope_layers`` / ``no_rope_layer_interval`` /
    ``use_sliding_window`` / ``sliding_window`` / ``layer_types`` (`layer_plan`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    max_position_embeddings: int | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = None
    no_rope_layers: list | None = None
    no_rope_layer_interval: int = 4
    layer_types: list | None = None
    rope_theta: float = 2000000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    rope_freq_factors: list | None = None
    #: `SelfAttention`'s RoPE keywords, whether each layer rotates, each layer's window (derived)
    rope: dict = field(init=False, repr=False)
    uses_rope: list = field(init=False, repr=False)
    windows: list = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            refuse("hidden_act", self.hidden_act, ", ".join(ACTIVATIONS))
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.rope = rope_options(self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                 rope_parameters=self.rope_parameters, partial_rotary_factor=self.partial_rotary_factor,
                                 rope_freq_factors=self.rope_freq_factors)
        self.uses_rope, self.windows = layer_plan(
            self.num_hidden_layers, no_rope_layers=self.no_rope_layers,
            no_rope_layer_interval=self.no_rope_layer_interval, use_sliding_window=self.use_sliding_window,
            sliding_window=self.sliding_window, layer_types=self.layer_types)


def decoder_layer(args: ModelArgs, layer: int, init) -> Layer:
    """Decoder block ``layer``: the Llama block, with RoPE or without (NoPE) and its attention window."""
    return TransformerBlock(args.num_attention_heads, args.intermediate_size, num_kv_heads=args.num_key_value_heads,
                            head_dim=args.head_dim, eps=args.rms_norm_eps, attention_bias=args.attention_bias,
                            mlp_bias=args.mlp_bias, activation=args.hidden_act, rope=args.uses_rope[layer],
                            sliding_window=args.windows[layer], init=init, **args.rope)


@register("SmolLM3ForCausalLM", model_types=("smollm3",), gguf=SmolLM3Converter)
class SmolLM3ForCausalLM(CausalLM):
    """SmolLM3 built from a Hugging Face ``SmolLM3Config`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`
    (``model.model.layers``: `TransformerBlock` s, ``self_attn.use_rope`` False on the NoPE layers).

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        build_decoder(self, args, lambda i, init: decoder_layer(args, i, init))

    @property
    def features(self) -> list:
        """What sets the model apart from a Llama, one phrase each (shown by ``metalnn info``)."""
        out = []
        nope = [i for i, rope in enumerate(self.args.uses_rope) if not rope]
        if nope:
            out.append(f"no RoPE (NoPE) on layers {', '.join(map(str, nope))} of {self.num_layers}")
        windowed = {}
        for i, w in enumerate(self.args.windows):
            if w is not None:
                windowed.setdefault(w, []).append(i)
        out += [f"sliding window {w} on layers {', '.join(map(str, layers))}" for w, layers in windowed.items()]
        return out
