"""``gemma3`` GGUF files (Gemma 3 text models).

As ``gemma2`` (`Gemma2Converter`: norm gains stored as ``1 + weight``, llama.cpp's hard-coded score
scale), plus the per-head q/k norms (also stored ``1 + weight``), no attention soft cap, the final
soft cap only when the file names one, the local layers' RoPE base ``rope.freq_base_swa`` (llama.cpp's
default 10000) and sliding windows only when ``attention.sliding_window`` is given, five local layers
to one global by default. llama.cpp's converter also cuts the embedding to the tokenizer's size; the
vocabulary is the table's rows.
"""

from __future__ import annotations

from .gemma2 import GEMMA_BLOCK_NAMES, Gemma2Converter


class Gemma3Converter(Gemma2Converter):
    """``gemma3`` files: Gemma 2's plus ``attn_q_norm`` / ``attn_k_norm`` and the local RoPE base."""

    architecture = "gemma3"
    block_names = {**GEMMA_BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    swa_period = 6
    wide_scale_blocks = 62
    default_final_softcap = None

    def window(self) -> int | None:
        window = self.header.metadata.get(self.prefix + "attention.sliding_window")
        return self.meta_int("attention.sliding_window") if window else None

    def extra_config(self, config: dict) -> dict:
        out = super().extra_config(config)
        del out["attn_logit_softcapping"]
        out["rope_local_base_freq"] = float(self.header.metadata.get(self.prefix + "rope.freq_base_swa", 10000.0))
        return out
