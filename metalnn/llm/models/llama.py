"""Llama-family decoder (`LlamaForCausalLM`): RMSNorm pre-norm blocks, RoPE, GQA, SwiGLU.

Parameter names equal Hugging Face's (``model.embed_tokens.weight``,
``model.layers.<i>.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``), so
checkpoints load with no renaming except a tied ``lm_head``. GGUF files: ``llama``
(`metalnn.llm.gguf.converters.llama`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.base import Layer
from ...layers.transformer import TransformerBlock
from ..gguf.converters.llama import LlamaConverter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import build_decoder
from .registry import register
from .rope import rope_options


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``LlamaConfig`` that metalnn reads (absent ones take these defaults).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` and ``num_key_value_heads`` to
    ``num_attention_heads``; ``rope_theta`` / ``rope_scaling`` / ``rope_parameters`` /
    ``partial_rotary_factor`` / ``rope_freq_factors`` (per-frequency factors from GGUF files) give
    the RoPE settings (`rope_options`: default, linear, llama3); ``max_position_embeddings`` is only
    reported (`CausalLM.context_length`): RoPE has no hard limit.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    rope_freq_factors: list | None = None
    #: `SelfAttention`'s RoPE keywords (derived)
    rope: dict = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            refuse("hidden_act", self.hidden_act, ", ".join(ACTIVATIONS))
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.rope = rope_options(self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                 rope_parameters=self.rope_parameters, partial_rotary_factor=self.partial_rotary_factor,
                                 rope_freq_factors=self.rope_freq_factors)


def decoder_layer(args: ModelArgs, init) -> Layer:
    """One Llama decoder block: RMSNorm, RoPE attention (``self_attn``), RMSNorm, SwiGLU (``mlp``)."""
    return TransformerBlock(args.num_attention_heads, args.intermediate_size, num_kv_heads=args.num_key_value_heads,
                            head_dim=args.head_dim, eps=args.rms_norm_eps, attention_bias=args.attention_bias,
                            mlp_bias=args.mlp_bias, activation=args.hidden_act, init=init, **args.rope)


@register("LlamaForCausalLM", model_types=("llama",), gguf=LlamaConverter)
class LlamaForCausalLM(CausalLM):
    """Llama / Llama 2 / Llama 3 style decoder built from a Hugging Face ``LlamaConfig`` dict
    (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`
    (``model.model.layers``: `TransformerBlock` s).

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        build_decoder(self, args, lambda _, init: decoder_layer(args, init))


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
