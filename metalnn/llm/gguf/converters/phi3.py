"""``phi3`` GGUF files (Phi-3, Phi-3.5-mini, Phi-4-mini).

llama.cpp's ``Phi3MiniModel`` converter keeps Phi-3's fused tensors (``attn_qkv`` is ``qkv_proj``,
``ffn_up`` is ``gate_up_proj`` with the gate rows first) and transforms none. LongRoPE's factors
become the ``rope_factors_long`` / ``rope_factors_short`` tensors and its attention factor the
``rope.scaling.attn_factor`` metadata; `Phi3Converter` turns them back into the config's
``rope_scaling``. A sliding window of 0 means none (Phi-4-mini).
"""

from __future__ import annotations

import mlx.core as mx

from ....errors import UnsupportedConfigError
from ..convert import BLOCK_NAMES, Converter


class Phi3Converter(Converter):
    """``phi3`` files: the standard tables with the fused ``attn_qkv`` and ``ffn_up``, rope factor
    tensors and LongRoPE metadata to config."""

    architecture = "phi3"
    block_names = {**BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

    def extra_config(self, config: dict) -> dict:
        meta, p = self.header.metadata, self.prefix
        window = meta.get(p + "attention.sliding_window")
        return {"original_max_position_embeddings": int(meta.get(p + "rope.scaling.original_context_length",
                                                                 config["max_position_embeddings"])),
                "sliding_window": int(window) if window else None}

    def check_sizes(self, cfg: dict):
        # ffn_up holds the gate and the up rows: twice feed_forward_length
        super().check_sizes({**cfg, "intermediate_size": 2 * cfg["intermediate_size"]})

    def convert(self, arrays: dict, config: dict) -> dict:
        long = arrays.pop("rope_factors_long.weight", None)
        short = arrays.pop("rope_factors_short.weight", None)
        if long is not None or short is not None:
            missing = "rope_factors_short" if short is None else "rope_factors_long" if long is None else None
            if missing:
                raise UnsupportedConfigError(f"{self.header.path}: {missing}.weight is missing (LongRoPE needs "
                                             "both rope_factors_long and rope_factors_short)")
            scaling = {"rope_type": "longrope",
                       "long_factor": [float(f) for f in long.astype(mx.float32).tolist()],
                       "short_factor": [float(f) for f in short.astype(mx.float32).tolist()]}
            attention = self.header.metadata.get(self.prefix + "rope.scaling.attn_factor")
            if attention is not None:
                scaling["attention_factor"] = float(attention)
            config["rope_scaling"] = scaling
        return super().convert(arrays, config)
