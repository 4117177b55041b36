"""``qwen3`` GGUF files (dense Qwen3): gguf-py's standard names plus the per-head q/k norms, no
transforms."""

from __future__ import annotations

from ..convert import BLOCK_NAMES, Converter


class Qwen3Converter(Converter):
    """``qwen3`` files: the standard tables plus ``attn_q_norm`` / ``attn_k_norm``."""

    architecture = "qwen3"
    block_names = {**BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
