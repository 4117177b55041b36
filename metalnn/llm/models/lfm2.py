"""LFM2 (`Lfm2ForCausalLM`, Liquid AI): a hybrid of gated short-convolution layers and grouped-query
attention layers with q/k RMSNorms, each followed by a SwiGLU feed-forward block.

Each decoder layer is an `Lfm2Block` (``h = x + mixer(operator_norm(x))``, ``out = h +
feed_forward(ffn_norm(h))``) whose token mixer is chosen by ``layer_types``:

* ``conv``: `metalnn.layers.ShortConv` (``conv.in_proj`` ``[3 * hidden, hidden]``, ``conv.conv``
  ``[hidden, 1, conv_L_cache]``, ``conv.out_proj``; biases when ``conv_bias``);
* ``full_attention``: `Lfm2Attention` (``self_attn.q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj``,
  ``q_layernorm`` / ``k_layernorm`` per head, RoPE over the whole head).

The feed-forward block is `Lfm2MLP` (``feed_forward.w1`` gate, ``w3`` up, ``w2`` down); its hidden
width is ``intermediate_size`` adjusted by transformers' rule (`feed_forward_width`). The final norm,
``model.embedding_norm`` in checkpoints, sits after the last layer (``model.model.norm`` here, the
`DecoderStack`'s). Every other parameter has its checkpoint name, so LoRA targets (``q_proj``,
``k_proj``, ``v_proj``, ``out_proj``, ``in_proj``, ``w1``, ``w2``, ``w3``) are PEFT's.

Caches: a `ShortConvCache` (the last ``conv_L_cache - 1`` gated inputs) per convolution layer and a
`KVCache` per attention layer. The fused CPU decoding step of `DecoderBlock` does not run these
blocks (they are no `DecoderBlock`); each layer runs its own ops. GGUF files: ``lfm2``
(`metalnn.llm.gguf.converters.lfm2`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ... import functional as F
from ...data import Data
from ...layers.attention import KVCache, SelfAttention
from ...layers.base import Layer
from ...layers.linear import Linear
from ...layers.norm import RMSNorm
from ...layers.short_conv import ShortConv, ShortConvCache
from ..gguf.converters.lfm2 import Lfm2Converter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import build_decoder, check_layer_types
from .registry import register
from .rope import rope_options

#: ``layer_types`` entries
KINDS = ("conv", "full_attention")
#: the final norm: its checkpoint name and metalnn's (`DecoderStack.norm`)
CHECKPOINT_NORM, NORM = "model.embedding_norm.", "model.norm."


def feed_forward_width(intermediate_size: int, *, auto_adjust: bool, multiplier: float | None, multiple_of: int) -> int:
    """The feed-forward hidden width, as transformers' ``Lfm2MLP`` computes it: with ``auto_adjust``
    two thirds of ``intermediate_size``, then (when ``multiplier`` is set) times ``multiplier``,
    rounded up to a multiple of ``multiple_of``; else ``intermediate_size``."""
    width = int(intermediate_size)
    if auto_adjust:
        width = int(2 * width / 3)
        if multiplier is not None:
            width = int(multiplier * width)
            width = multiple_of * ((width + multiple_of - 1) // multiple_of)
    return width


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``Lfm2Config`` that metalnn reads (absent ones take transformers'
    defaults).

    ``layer_types`` (``conv`` / ``full_attention``; when absent, ``full_attn_idxs`` lists the attention
    layers, by default all of them); ``conv_L_cache`` (the convolution's width) and ``conv_bias``;
    ``intermediate_size`` (older configs: ``block_ff_dim``) with ``block_auto_adjust_ff_dim``,
    ``block_ffn_dim_multiplier`` and ``block_multiple_of`` (`feed_forward_width`); ``norm_eps`` of
    every RMSNorm; ``tie_word_embeddings`` (older configs: ``tie_embedding``, which wins, as in
    transformers).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int | None = None
    block_ff_dim: int | None = None
    num_key_value_heads: int = 8
    head_dim: int | None = None
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    tie_embedding: bool | None = None
    initializer_range: float = 0.02
    max_position_embeddings: int | None = 128000
    layer_types: list | None = None
    full_attn_idxs: list | None = None
    conv_L_cache: int = 3
    conv_bias: bool = False
    block_auto_adjust_ff_dim: bool = True
    block_ffn_dim_multiplier: float | None = 1.0
    block_multiple_of: int = 256
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    #: each layer's kind, the feed-forward width and `SelfAttention`'s RoPE keywords (derived)
    kinds: list = field(init=False, repr=False)
    ffn_width: int = field(init=False, repr=False)
    rope: dict = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.tie_embedding is not None:
            self.tie_word_embeddings = self.tie_embedding
        if self.block_ff_dim is not None and self.intermediate_size is None:
            self.intermediate_size = self.block_ff_dim
        if self.intermediate_size is None:
            refuse("intermediate_size", None, "a positive integer (or block_ff_dim)")
        if self.conv_L_cache < 1:
            refuse("conv_L_cache", self.conv_L_cache, "a positive integer")
        if self.block_multiple_of < 1:
            refuse("block_multiple_of", self.block_multiple_of, "a positive integer")
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            refuse("num_key_value_heads", self.num_key_value_heads,
                   f"a positive divisor of num_attention_heads = {self.num_attention_heads}")
        if self.layer_types is None:
            attention = self.full_attn_idxs if self.full_attn_idxs is not None else range(self.num_hidden_layers)
            self.kinds = ["full_attention" if i in attention else "conv" for i in range(self.num_hidden_layers)]
        else:
            self.kinds = check_layer_types(self.layer_types, self.num_hidden_layers, KINDS)
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.ffn_width = feed_forward_width(self.intermediate_size, auto_adjust=self.block_auto_adjust_ff_dim,
                                            multiplier=self.block_ffn_dim_multiplier,
                                            multiple_of=self.block_multiple_of)
        if self.ffn_width <= 0:
            refuse("intermediate_size", self.intermediate_size, "a size whose adjusted feed-forward width is positive")
        self.rope = rope_options(self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                 rope_parameters=self.rope_parameters, partial_rotary_factor=1.0)


class Lfm2Attention(SelfAttention):
    """`SelfAttention` with per-head q/k RMSNorms under LFM2's checkpoint names: ``q_proj``,
    ``k_proj``, ``v_proj``, ``out_proj`` (the output projection), ``q_layernorm`` and ``k_layernorm``
    (``[head_dim]`` gains). Arguments as `SelfAttention` (``qk_norm`` is always on)."""

    def __init__(self, num_heads: int, **kwargs):
        super().__init__(num_heads, qk_norm=True, **kwargs)

    def build(self, device, dims, dtype):
        if self.head_dim is None:
            self.require(dims.W % self.num_heads == 0, f"a width divisible by num_heads={self.num_heads}",
                         f"W={dims.W}")
            self.head_dim = dims.W // self.num_heads
        hd, kw = self.head_dim, dict(init=self._init, dtype=self._dtype)
        self.q_proj = Linear(self.num_heads * hd, bias=self.use_bias, **kw)
        self.k_proj = Linear(self.num_kv_heads * hd, bias=self.use_bias, **kw)
        self.v_proj = Linear(self.num_kv_heads * hd, bias=self.use_bias, **kw)
        self.out_proj = Linear(dims.W, bias=self.out_bias, **kw)
        nkw = dict(eps=self.norm_eps, offset=self.norm_offset, dtype=self._dtype)
        self.q_layernorm = RMSNorm(hd, **nkw)
        self.k_layernorm = RMSNorm(hd, **nkw)

    # `SelfAttention.forward` reads its output projection and norms under Llama's names.
    @property
    def o_proj(self):
        return self["out_proj"]

    @property
    def q_norm(self):
        return self["q_layernorm"]

    @property
    def k_norm(self):
        return self["k_layernorm"]


class Lfm2MLP(Layer):
    """LFM2's SwiGLU feed-forward block ``w2(silu(w1(x)) * w3(x))`` (``w1``, ``w3`` ``[hidden_dims, W]``,
    ``w2`` ``[W, hidden_dims]``, no biases). Input and output dims ``(W, H=positions, D=batch)``.

    Args:
        hidden_dims: the hidden width (`feed_forward_width`).
        init: initializer of the projections (default `Linear`'s).
        dtype: parameter dtype.
    """

    fixed_axes = ("W",)
    positional_hint = "{cls}({hidden_dims}, init=...)"

    def __init__(self, hidden_dims: int, *, init=None, dtype=None):
        super().__init__()
        self.hidden_dims = int(hidden_dims)
        self._init, self._dtype = init, dtype

    def build(self, device, dims, dtype):
        kw = dict(bias=False, init=self._init, dtype=self._dtype)
        self.w1 = Linear(self.hidden_dims, **kw)
        self.w3 = Linear(self.hidden_dims, **kw)
        self.w2 = Linear(dims.W, **kw)

    def forward(self, device, data):
        gate = self.compile_child(self.w1, device, data).array
        up = self.compile_child(self.w3, device, data).array
        h = F.gated_activation(gate, up, "silu", device=device)
        return self.compile_child(self.w2, device, Data(h, data.dims._replace(W=self.hidden_dims)))

    def _extra_repr(self):
        return f"hidden_dims={self.hidden_dims}"


class Lfm2Block(Layer):
    """``h = x + mixer(operator_norm(x)); out = h + feed_forward(ffn_norm(h))`` (RMSNorms).

    Input and output dims ``(W=hidden, H=positions, D=batch)``; ``cache=`` goes to the mixer (a
    `ShortConvCache` for `ShortConv`, a `KVCache` for attention).

    Args:
        mixer: the token mixer (`ShortConv` or `Lfm2Attention`).
        feed_forward: the position-wise block (`Lfm2MLP`).
        mixer_name: the mixer's parameter prefix (``conv`` or ``self_attn``).
        eps: epsilon of both norms.
        dtype: dtype of the norm weights.
    """

    fixed_axes = ("W",)
    is_block = True
    positional_hint = "{cls}(mixer, feed_forward, mixer_name=..., eps=...)"

    def __init__(self, mixer: Layer, feed_forward: Layer, *, mixer_name: str, eps: float = 1e-5, dtype=None):
        super().__init__()
        if mixer_name not in ("conv", "self_attn"):
            raise ValueError(f"Lfm2Block: mixer_name must be 'conv' or 'self_attn', got {mixer_name!r}")
        self.mixer_name = mixer_name
        self.operator_norm = RMSNorm(eps=eps, dtype=dtype)
        setattr(self, mixer_name, mixer)
        self.ffn_norm = RMSNorm(eps=eps, dtype=dtype)
        self.feed_forward = feed_forward

    @property
    def mixer(self) -> Layer:
        return self[self.mixer_name]

    def forward(self, device, data, cache=None):
        h = self.compile_child(self.operator_norm, device, data)
        h = self.compile_child(self.mixer, device, h, cache=cache)
        x = data.array + h.array
        h = self.compile_child(self.ffn_norm, device, Data(x, data.dims))
        h = self.compile_child(self.feed_forward, device, h)
        return Data(x + h.array, data.dims)


def token_mixer(args: ModelArgs, layer: int, init) -> tuple:
    """``(mixer, name)`` of decoder layer ``layer``: a `ShortConv` (``conv``) or an `Lfm2Attention`
    (``self_attn``)."""
    if args.kinds[layer] == "conv":
        return ShortConv(args.conv_L_cache, bias=args.conv_bias, init=init), "conv"
    attn = Lfm2Attention(args.num_attention_heads, num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                         norm_eps=args.norm_eps, init=init, **args.rope)
    return attn, "self_attn"


def layer_caches(kinds: list) -> list:
    """A `ShortConvCache` per convolution layer and a `KVCache` per attention layer."""
    return [ShortConvCache() if kind == "conv" else KVCache() for kind in kinds]


@register("Lfm2ForCausalLM", "LFM2ForCausalLM", model_types=("lfm2",), gguf=Lfm2Converter)
class Lfm2ForCausalLM(CausalLM):
    """LFM2 built from a Hugging Face ``Lfm2Config`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`
    of `Lfm2Block` s.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        def layer(i, init):
            mixer, name = token_mixer(args, i, init)
            return Lfm2Block(mixer, Lfm2MLP(args.ffn_width, init=init), mixer_name=name, eps=args.norm_eps)

        build_decoder(self, args, layer, eps=args.norm_eps)

    @property
    def layer_kinds(self) -> list:
        """``conv`` / ``full_attention`` per layer."""
        return list(self.args.kinds)

    def make_cache(self) -> list:
        """A `ShortConvCache` per convolution layer and a `KVCache` per attention layer."""
        return layer_caches(self.args.kinds)

    @property
    def features(self) -> list:
        """What sets the model apart from a Llama, one phrase each (shown by ``metalnn info``)."""
        args = self.args
        convs = args.kinds.count("conv")
        return [f"gated short convolution (width {args.conv_L_cache}"
                + (", with biases" if args.conv_bias else "") + f") on {convs} of {len(args.kinds)} layers",
                "q/k RMSNorm on the attention layers"]

    def rename_weight(self, name):
        if name.startswith(CHECKPOINT_NORM):
            name = NORM + name[len(CHECKPOINT_NORM):]
        return super().rename_weight(name)

    def export_weights(self):
        return {(CHECKPOINT_NORM + k[len(NORM):] if k.startswith(NORM) else k): v
                for k, v in super().export_weights().items()}
