"""gpt-oss (`GptOssForCausalLM`): a mixture-of-experts decoder with attention sinks, alternating
sliding-window and full attention layers and YaRN rotary positions.

Each decoder layer is a `DecoderBlock` of a `SelfAttention` (``self_attn``: biases on q/k/v/o, a
learned sink logit per head, ``sliding_window`` on the layers ``layer_types`` marks
``sliding_attention``) and a `SparseMoE` (``mlp``): the router ``mlp.router`` (a biased linear layer;
the ``num_experts_per_tok`` largest logits kept, softmax over them) and `ClampedSwitchGLU` experts
(``mlp.experts.gate_up_proj`` ``[E, W, 2*I]`` with gate and up columns interleaved,
``mlp.experts.down_proj`` ``[E, I, W]``, their biases; ``(up + 1) * gate * sigmoid(alpha * gate)``
with ``gate`` clamped above and ``up`` both sides at ``swiglu_limit``). Parameter names and layouts
are transformers' own, except the router, held as the `SparseMoE`'s ``mlp.gate`` (renamed on load
and save).

Checkpoints: transformers' float folders, and the released folders whose experts are MXFP4
(``quantization_config.quant_method`` ``mxfp4``: ``mlp.experts.gate_up_proj_blocks`` ``[E, 2*I, W/32, 16]``
uint8, two FP4 E2M1 codes a byte, low nibble first, with ``..._scales`` ``[E, 2*I, W/32]`` E8M0 exponents;
the same for ``down_proj``), decoded to floats on load (`MXFP4ExpertsProvider`, through
`metalnn.ggml.MXFP4`'s decoder). `save_pretrained` writes float experts. GGUF files: ``gpt-oss``
(`metalnn.llm.gguf.converters.gpt_oss`).

The fused CPU decoding step declines these blocks (sinks and experts are no part of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from ... import init as initializers
from ...errors import WeightLoadError
from ...ggml.nonlinear import MXFP4
from ...layers.attention import SelfAttention
from ...layers.linear import Linear
from ...layers.moe import ClampedSwitchGLU, SparseMoE
from ...layers.transformer import DecoderBlock
from ...weights import Provider, open_provider
from ..gguf.converters.gpt_oss import GptOssConverter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import SLIDING, DecoderStack, check_layer_types
from .experts import RoutedExperts
from .registry import register
from .rope import rope_options

#: transformers' ``GptOssConfig`` rope parameters when a config gives none (YaRN, 32x over 4096 positions)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``GptOssConfig`` that metalnn reads (absent ones take transformers'
    defaults).

    Attention: ``num_attention_heads``, ``num_key_value_heads`` (8), ``head_dim`` (64),
    ``attention_bias`` (true: all four projections), ``sliding_window`` (128) on the layers
    ``layer_types`` marks ``sliding_attention`` (default: the even layers), ``rope_theta`` (150000) and
    ``rope_parameters`` / ``rope_scaling`` (default: transformers' YaRN, `DEFAULT_ROPE`).
    Experts: ``num_local_experts`` (128; ``num_experts`` is read too), ``num_experts_per_tok`` (4),
    ``intermediate_size`` (each expert's width), ``swiglu_alpha`` (1.702), ``swiglu_limit`` (7.0);
    ``output_router_logits`` / ``router_aux_loss_coef`` (the auxiliary load-balancing loss).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int = 2880
    num_key_value_heads: int | None = 8
    head_dim: int | None = 64
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int = 131072
    sliding_window: int | None = 128
    layer_types: list | None = None
    num_local_experts: int | None = None
    num_experts: int | None = None
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    rope_theta: float = 150000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    #: `SelfAttention`'s RoPE keywords and each layer's attention window (derived)
    rope: dict = field(init=False, repr=False)
    windows: list = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act != "silu":  # (transformers' experts ignore it; the clamped SwiGLU is fixed)
            refuse("hidden_act", self.hidden_act, "silu")
        experts = self.num_local_experts if self.num_local_experts is not None else self.num_experts
        self.num_local_experts = self.num_experts = 128 if experts is None else experts  # transformers' default
        if self.num_local_experts <= 0:
            refuse("num_local_experts", self.num_local_experts, "a positive integer")
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            refuse("num_experts_per_tok", self.num_experts_per_tok, f"1 to num_local_experts ({self.num_local_experts})")
        if not self.swiglu_limit > 0:
            refuse("swiglu_limit", self.swiglu_limit, "a positive number")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers, SLIDING)
        if self.sliding_window is not None and self.sliding_window <= 0:
            refuse("sliding_window", self.sliding_window, "a positive integer or null")
        self.windows = [self.sliding_window if kind == "sliding_attention" else None for kind in self.layer_types]
        scaling = self.rope_scaling
        if self.rope_parameters is None and scaling is None:
            scaling = dict(DEFAULT_ROPE)
        self.rope = rope_options(self.head_dim, rope_theta=self.rope_theta, rope_scaling=scaling,
                                 rope_parameters=self.rope_parameters, partial_rotary_factor=1.0,
                                 max_position_embeddings=self.max_position_embeddings)


def decoder_layer(args: ModelArgs, layer: int, init) -> DecoderBlock:
    """Decoder block ``layer``: sink attention (windowed on sliding layers) and the clamped-SwiGLU experts."""
    attn = SelfAttention(args.num_attention_heads, num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                         bias=args.attention_bias, sinks=True, sliding_window=args.windows[layer], init=init,
                         **args.rope)
    experts = ClampedSwitchGLU(args.num_local_experts, args.intermediate_size, alpha=args.swiglu_alpha,
                               limit=args.swiglu_limit, init=init)
    mlp = SparseMoE(args.num_local_experts, args.num_experts_per_tok, args.intermediate_size, norm_topk_prob=True,
                    router_bias=True, experts=experts, record_router_logits=args.output_router_logits, init=init)
    return DecoderBlock(attn, mlp, eps=args.rms_norm_eps)


#: the halves of an MXFP4 expert tensor in transformers' released folders
MXFP4_SUFFIXES = ("_blocks", "_scales")


def decode_mxfp4(blocks, scales):
    """transformers' MXFP4 expert tensor (``blocks`` ``[E, R, G, 16]`` uint8: two E2M1 codes a byte, low
    nibble first; ``scales`` ``[E, R, G]`` uint8 E8M0 exponents, ``2^(s - 127)``) as float32 ``[E, R, G*32]``.

    Each group of 32 is re-laid as a GGML MXFP4 block (the exponent byte, then 16 bytes holding
    elements ``j`` and ``j + 16`` in the low and high nibbles) and decoded by `metalnn.ggml.MXFP4`.
    """
    e, r, g, b = blocks.shape
    if b != 16 or scales.shape != (e, r, g):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected "
                         f"[E, R, G, 16] and [E, R, G]")
    blocks = blocks.astype(mx.uint8)
    codes = mx.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(e, r, g, 32)   # element order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    packed = mx.concatenate([scales.astype(mx.uint8)[..., None], qs], axis=-1)      # [E, R, G, 17]
    return MXFP4.decode(packed.reshape(e, r, g * 17))


class MXFP4ExpertsProvider(Provider):
    """A provider that shows each ``<prefix>_blocks`` / ``<prefix>_scales`` pair of ``base`` as the float
    tensor transformers' ``GptOssExperts`` holds (``gate_up_proj`` ``[E, W, 2*I]``, ``down_proj`` ``[E, I, W]``:
    the decoded ``[E, out, in]`` transposed); every other name passes through.

    Raises `WeightLoadError` for a blocks tensor without its scales (or the reverse).
    """

    def __init__(self, base):
        base = open_provider(base)
        super().__init__(base.source)
        self.base = base
        keys = list(base.keys())
        present = set(keys)
        self._pairs = {}
        for key in keys:
            for suffix in MXFP4_SUFFIXES:
                if key.endswith(suffix):
                    stem = key[: -len(suffix)]
                    other = stem + MXFP4_SUFFIXES[1 - MXFP4_SUFFIXES.index(suffix)]
                    if other not in present:
                        raise WeightLoadError(missing=[other], source=self.source, message=(
                            f"{self.source}: MXFP4 tensor {key} has no {other}"))
                    self._pairs[stem] = (stem + "_blocks", stem + "_scales")
        hidden = {name for pair in self._pairs.values() for name in pair}
        self._plain = [k for k in keys if k not in hidden]

    def keys(self):
        return self._plain + list(self._pairs)

    def spec(self, name):
        if name not in self._pairs:
            return self.base.spec(name)
        (e, r, g, _), _ = self.base.spec(self._pairs[name][0])
        return (e, g * 32, r), mx.float32

    def get(self, name):
        if name not in self._pairs:
            return self.base.get(name)
        blocks, scales = (self.base.get(k) for k in self._pairs[name])
        return decode_mxfp4(blocks, scales).swapaxes(-1, -2)


@register("GptOssForCausalLM", model_types=("gpt_oss",), gguf=GptOssConverter)
class GptOssForCausalLM(RoutedExperts, CausalLM):
    """gpt-oss built from a Hugging Face ``GptOssConfig`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`
    of `DecoderBlock` s (``self_attn``: `SelfAttention` with sinks; ``mlp``: `SparseMoE` with a biased
    router and `ClampedSwitchGLU` experts). ``output_router_logits`` and ``aux_loss`` are
    `RoutedExperts`'s (the load-balancing loss over the router's logits, bias included).

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        init = initializers.Normal(args.initializer_range)  # transformers' init
        layers = [decoder_layer(args, i, init) for i in range(args.num_hidden_layers)]
        self.model = DecoderStack(args.vocab_size, args.hidden_size, layers, eps=args.rms_norm_eps,
                                  init_std=args.initializer_range)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.vocab_size, bias=False, init=init)

    def rename_weight(self, name: str):
        """transformers' ``mlp.router.*`` is the `SparseMoE`'s ``mlp.gate.*``."""
        name = super().rename_weight(name)
        return None if name is None else name.replace(".mlp.router.", ".mlp.gate.")

    def load_weights_from(self, provider, strict: bool = True):
        """Load a checkpoint; MXFP4 experts (``*_blocks`` / ``*_scales``) are decoded to floats."""
        return CausalLM.load_weights_from(self, MXFP4ExpertsProvider(provider), strict=strict)

    def export_weights(self):
        """transformers' names (``mlp.router.*``), the experts stacked as transformers holds them."""
        return {name.replace(".mlp.gate.", ".mlp.router."): a for name, a in self.named_parameters().items()}

    @property
    def features(self) -> list:
        """What sets the model apart from a Llama, one phrase each (shown by ``metalnn info``)."""
        a = self.args
        out = ["attention sinks", "q/k/v/o biases", *self.moe_features(),
               f"clamped SwiGLU experts with biases (alpha {a.swiglu_alpha:g}, limit {a.swiglu_limit:g})"]
        sliding = [i for i, w in enumerate(a.windows) if w is not None]
        if sliding:
            out.append(f"sliding window {a.sliding_window} on layers {', '.join(map(str, sliding))}")
        if "rope_attention_factor" in a.rope:
            out.append(f"YaRN rope (attention factor {a.rope['rope_attention_factor']:.4g})")
        return out
