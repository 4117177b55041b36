"""Llama-family decoder (`LlamaForCausalLM`): RMSNorm pre-norm blocks, RoPE, GQA, SwiGLU.

Parameter names equal Hugging Face's (``model.embed_tokens.weight``,
``model.layers.<i>.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``), so
checkpoints load with no renaming except a tied ``lm_head``.
"""

from __future__ import annotations

import math

import numpy as np

from ... import init as initializers
from ...data import Data, MTLSize
from ...errors import UnsupportedConfigError
from ...layers.base import Layer
from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.embedding import Embedding
from ...layers.linear import Linear
from ...layers.norm import RMSNorm
from ...layers.transformer import TransformerBlock
from .base import CausalLM


def rope_settings(config: dict, head_dim: int) -> dict:
    """RoPE keyword arguments for `SelfAttention` from a Llama config.

    Reads ``rope_theta`` / ``rope_scaling`` (older configs) or ``rope_parameters`` (newer ones).
    Supports rope types ``default``, ``linear`` and ``llama3``, and ``rope_freq_factors`` (the
    per-frequency factors GGUF files store for Llama 3's scaling: frequency ``i`` is divided by
    factor ``i``).
    """
    params = dict(config.get("rope_parameters") or {})
    params.update(config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    rope_dims = int(head_dim * partial)
    out = {"rope_base": theta, "rope_scale": 1.0, "rope_freqs": None, "rope_dims": rope_dims}
    factors = config.get("rope_freq_factors")  # per-frequency divisors, as GGUF files store them
    if factors is not None:
        if kind != "default" or len(factors) != rope_dims // 2:
            raise UnsupportedConfigError(f"rope_freq_factors: {len(factors)} factors for {rope_dims // 2} "
                                         f"frequencies with rope type {kind!r} (expected the default type)")
        exponents = np.arange(0, rope_dims, 2, dtype=np.float32) / np.float32(rope_dims)
        out["rope_freqs"] = (np.float32(theta) ** exponents * np.asarray(factors, dtype=np.float32)).astype(np.float32)
        return out
    if kind == "default":
        return out
    if kind == "linear":
        out["rope_scale"] = 1.0 / float(params["factor"])
        return out
    if kind == "llama3":
        out["rope_freqs"] = llama3_rope_periods(rope_dims, theta, params)
        return out
    raise UnsupportedConfigError(f"rope_scaling / rope_parameters: rope type {kind!r} is not supported "
                                 "(supported: default, linear, llama3)")


def llama3_rope_periods(dims: int, base: float, params: dict):
    """Llama 3.1's frequency scaling; returns periods (``1 / inv_freq``) for `metalnn.functional.rope`."""
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_len = float(params.get("original_max_position_embeddings", 8192))
    inv = (1.0 / (np.float32(base) ** (np.arange(0, dims, 2, dtype=np.int64).astype(np.float32) / np.float32(dims))))
    inv = inv.astype(np.float32)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    scaled = np.where(medium, smoothed, scaled).astype(np.float32)
    return (1.0 / scaled).astype(np.float32)


class LlamaModel(Layer):
    """Embedding, decoder blocks and final norm (``model.*`` in a checkpoint).

    Args:
        vocab_size, hidden: embedding table size and width.
        layers: the decoder blocks (each called as ``block.compile(device, h, cache=...)``).
        eps: epsilon of the final RMSNorm.
        init_std: std of the embedding initialisation.
        norm_offset: gain offset of the final RMSNorm (see `RMSNorm`).
    """

    def __init__(self, vocab_size, hidden, layers, eps, init_std=0.02, norm_offset=0.0):
        super().__init__()
        self.embed_tokens = Embedding(vocab_size, hidden, init=initializers.Normal(init_std))
        self.layers = list(layers)
        self.norm = RMSNorm(hidden, eps=eps, offset=norm_offset)

    def forward(self, device, data, cache=None):
        h = self.compile_child(self.embed_tokens, device, data)
        for i, layer in enumerate(self.layers):
            h = self.compile_child(layer, device, h, cache=cache[i] if cache is not None else None)
        return self.compile_child(self.norm, device, h)


class LlamaForCausalLM(CausalLM):
    """Llama / Llama 2 / Llama 3 style decoder built from a Hugging Face ``LlamaConfig`` dict.

    Honoured config keys: ``vocab_size``, ``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
    ``rms_norm_eps``, ``rope_theta`` / ``rope_scaling`` / ``rope_parameters`` (default, linear,
    llama3), ``attention_bias``, ``mlp_bias``, ``hidden_act``, ``tie_word_embeddings``,
    ``max_position_embeddings``, ``initializer_range`` (random init std of the embeddings).

    The Llama relatives (`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `MistralForCausalLM`, the hybrid
    Qwen3.5 and Qwen3-Next models) subclass it and change ``block_options`` / ``decoder_layer``.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    #: llama.cpp's ``general.architecture`` for this family (GGUF files); Mistral is written as "llama" too
    gguf_architecture = "llama"
    #: head width when the config has no ``head_dim`` (None: ``hidden_size // num_attention_heads``)
    default_head_dim: int | None = None
    #: gain offset of every RMSNorm (1 for the zero-centred gains of Qwen3.5 / Qwen3-Next)
    norm_offset = 0.0

    def _build(self):
        c = self.config
        hidden = int(c["hidden_size"])
        act = c.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise UnsupportedConfigError(f"hidden_act {act!r} is not supported (supported: {list(ACTIVATIONS)})")
        self.init = initializers.Normal(float(c.get("initializer_range", 0.02)))  # transformers' init
        self.tie_word_embeddings = bool(c.get("tie_word_embeddings", False))
        eps = float(c.get("rms_norm_eps", 1e-6))
        layers = [self.decoder_layer(i) for i in range(int(c["num_hidden_layers"]))]
        self.model = LlamaModel(int(c["vocab_size"]), hidden, layers, eps, float(c.get("initializer_range", 0.02)),
                                norm_offset=self.norm_offset)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(int(c["vocab_size"]), bias=False, init=self.init)

    @property
    def head_dim(self) -> int:
        c = self.config
        return int(c.get("head_dim") or self.default_head_dim or int(c["hidden_size"]) // int(c["num_attention_heads"]))

    def attention_options(self) -> dict:
        """`SelfAttention` keywords shared by every attention layer (heads, RoPE, init)."""
        c = self.config
        n_heads = int(c["num_attention_heads"])
        return dict(num_heads=n_heads, num_kv_heads=int(c.get("num_key_value_heads") or n_heads),
                    head_dim=self.head_dim, init=self.init, **rope_settings(c, self.head_dim))

    def block_options(self, layer: int) -> dict:
        """`TransformerBlock` keywords of decoder layer ``layer``."""
        c = self.config
        return dict(self.attention_options(), mlp_dims=int(c["intermediate_size"]),
                    eps=float(c.get("rms_norm_eps", 1e-6)), attention_bias=bool(c.get("attention_bias", False)),
                    mlp_bias=bool(c.get("mlp_bias", False)), activation=c.get("hidden_act", "silu"))

    def decoder_layer(self, layer: int) -> Layer:
        """Decoder layer number ``layer`` (a `TransformerBlock` for Llama)."""
        return TransformerBlock(**self.block_options(layer))

    @property
    def num_layers(self):
        return len(self.model.layers)

    @property
    def max_positions(self):
        return None  # RoPE has no hard limit

    def forward(self, device, data, cache=None):
        ids = self._token_batch(data)
        b, t = ids.shape
        self._check_positions(cache, t)
        h = self.compile_child(self.model, device, Data(ids), cache=cache)
        if self.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h.array, device=device)
            return Data(logits, MTLSize(self.vocab_size, t, b))
        return self.compile_child(self.lm_head, device, h)

    def rename_weight(self, name):
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        if name.endswith(".rotary_emb.inv_freq"):
            return None
        return name

    def export_weights(self):
        return self.named_parameters()


def layer_types(config: dict, allowed: tuple, default: str) -> list:
    """The config's ``layer_types`` (one per layer), checked against ``allowed``; ``default`` for
    every layer when the config has none."""
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        return [default] * n
    if not isinstance(types, (list, tuple)) or len(types) != n:
        raise UnsupportedConfigError(f"layer_types must list one entry per layer (num_hidden_layers={n}), got "
                                     f"{types!r}")
    for i, kind in enumerate(types):
        if kind not in allowed:
            raise UnsupportedConfigError(f"layer_types[{i}] = {kind!r} is not supported (supported: "
                                         f"{', '.join(allowed)})")
    return list(types)


def llama_config(vocab_size: int, hidden_size: int = 256, num_hidden_layers: int = 4, num_attention_heads: int = 4,
                 num_key_value_heads: int | None = None, intermediate_size: int | None = None, **extra) -> dict:
    """A complete Llama ``config.json`` dict (for building a model from scratch and saving it)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": int(vocab_size),
        "hidden_size": int(hidden_size), "intermediate_size": int(intermediate_size or (8 * hidden_size) // 3),
        "num_hidden_layers": int(num_hidden_layers), "num_attention_heads": int(num_attention_heads),
        "num_key_value_heads": int(num_key_value_heads or num_attention_heads),
        "head_dim": int(hidden_size) // int(num_attention_heads), "hidden_act": "silu",
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "use_cache": True,
    }
    cfg.update(extra)
    return cfg
