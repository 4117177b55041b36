"""Qwen3 decoder (`Qwen3ForCausalLM`): Llama with a per-head RMSNorm on queries and keys and an
explicit ``head_dim``.

Parameter names equal Hugging Face's (``model.layers.<i>.self_attn.q_norm.weight`` ``[head_dim]``,
...).
"""

from __future__ import annotations

from .llama import LlamaForCausalLM
from .qwen2 import sliding_windows


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense) built from a Hugging Face ``Qwen3Config`` dict.

    As `LlamaForCausalLM`, plus: ``q_norm`` / ``k_norm`` on every attention layer (eps
    ``rms_norm_eps``), ``head_dim`` (128 when absent, transformers' default), ``attention_bias`` on
    all four projections, and the sliding-window keys of `Qwen2ForCausalLM`.
    """

    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    gguf_architecture = "qwen3"
    default_head_dim = 128

    def block_options(self, layer: int) -> dict:
        return dict(super().block_options(layer), qk_norm=True, sliding_window=sliding_windows(self.config)[layer])
