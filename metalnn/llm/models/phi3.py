"""Phi-3 / Phi-4-mini decoder (`Phi3ForCausalLM`): the Llama block with fused projections
(``self_attn.qkv_proj``, ``mlp.gate_up_proj``), optional partial rotary features (Phi-4-mini),
LongRoPE scaling (``rope_scaling`` of type ``longrope``: short and long per-frequency factors and an
attention factor; `metalnn.layers.LongRoPE`) and an optional sliding window on every layer.

Parameter names equal Hugging Face's (``model.layers.<i>.self_attn.qkv_proj.weight``
``[(heads + 2 * kv_heads) * head_dim, hidden]``, ``model.layers.<i>.mlp.gate_up_proj.weight``
``[2 * intermediate, hidden]``, ...), so checkpoints load by name and LoRA targets ``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj`` are PEFT's. GGUF files: ``phi3``
(`metalnn.llm.gguf.converters.phi3`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...functional.activations import NAMES as ACTIVATIONS
from ...layers.fused_projections import FusedGateUpMLP, FusedQKVAttention
from ...layers.transformer import DecoderBlock
from ..gguf.converters.phi3 import Phi3Converter
from .base import BaseModelArgs, CausalLM, refuse
from .decoder import build_decoder
from .registry import register
from .rope import longrope_options


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``Phi3Config`` that metalnn reads (absent ones take these defaults,
    transformers' own).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``; ``original_max_position_embeddings``
    (the pretraining length LongRoPE switches at) is read at the top level, as transformers does;
    ``sliding_window`` applies to every layer. Phi-3 has no biases.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096
    sliding_window: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    #: `FusedQKVAttention`'s RoPE keywords (derived)
    rope: dict = field(init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            refuse("hidden_act", self.hidden_act, ", ".join(ACTIVATIONS))
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.sliding_window is not None and self.sliding_window <= 0:
            refuse("sliding_window", self.sliding_window, "a positive number of positions or null")
        self.rope = longrope_options(self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                                     rope_parameters=self.rope_parameters,
                                     partial_rotary_factor=self.partial_rotary_factor,
                                     max_position_embeddings=self.max_position_embeddings,
                                     original_max_position_embeddings=self.original_max_position_embeddings)


def decoder_layer(args: ModelArgs, init) -> DecoderBlock:
    """One decoder block: fused-QKV attention (LongRoPE when configured) and the fused gated MLP."""
    attn = FusedQKVAttention(args.num_attention_heads, num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                             sliding_window=args.sliding_window, init=init, **args.rope)
    mlp = FusedGateUpMLP(args.intermediate_size, activation=args.hidden_act, init=init, init_out=init)
    return DecoderBlock(attn, mlp, eps=args.rms_norm_eps)


@register("Phi3ForCausalLM", model_types=("phi3",), gguf=Phi3Converter)
class Phi3ForCausalLM(CausalLM):
    """Phi-3 / Phi-4-mini built from a Hugging Face ``Phi3Config`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]``, logits ``[B, T, vocab_size]``; ``model.model`` is the `DecoderStack`.
    With LongRoPE, a call whose positions reach past ``original_max_position_embeddings`` rotates with
    the long factors (transformers' rule; keys cached by earlier calls keep the factors they were
    rotated with).

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        build_decoder(self, args, lambda _, init: decoder_layer(args, init))

    @property
    def features(self) -> list:
        """The family's special features, as `metalnn info` lists them."""
        a, out = self.args, ["fused qkv_proj and gate_up_proj"]
        rope = a.rope
        if rope["rope_dims"] != a.head_dim:
            out.append(f"partial rotary ({rope['rope_dims']} of {a.head_dim} features)")
        if rope["long_rope"] is not None:
            lr = rope["long_rope"]
            out.append(f"LongRoPE (long factors past {lr.original_length} positions, attention factor "
                       f"{lr.attention_factor:.4f})")
        if a.sliding_window is not None:
            out.append(f"sliding window {a.sliding_window}")
        return out
