"""``gemma2`` GGUF files (Gemma 2).

llama.cpp's ``Gemma2Model`` converter adds 1 to every RMSNorm weight (llama.cpp's norm multiplies by
the stored gain, transformers' by ``1 + weight``) and drops ``lm_head`` (the head is the embedding);
`Gemma2Converter` subtracts the 1 again. The file does not store what llama.cpp hard-codes, so the
config takes llama.cpp's values: sliding-window layers every other one from layer 0 (or every
``attention.sliding_window_pattern``-th pattern), scores scaled by ``head_dim ** -0.5`` except for the
46-layer (27B) model's ``(hidden / heads) ** -0.5``, soft caps 50 and 30 when absent.
"""

from __future__ import annotations

from ....errors import UnsupportedConfigError
from ..convert import BLOCK_NAMES, Converter

#: gguf-py's names of Gemma's four block norms
GEMMA_BLOCK_NAMES = {**BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
                     "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


class Gemma2Converter(Converter):
    """``gemma2`` files: Gemma's four norms per block, their gains back to ``weight = gain - 1``."""

    architecture = "gemma2"
    block_names = GEMMA_BLOCK_NAMES
    #: llama.cpp's default period of sliding-window layers (``il % period < period - 1`` slide)
    swa_period = 2
    #: llama.cpp's block count of the model whose score scale is ``(hidden / heads) ** -0.5`` (27B)
    wide_scale_blocks = 46
    #: llama.cpp's soft caps when the file has none
    default_attn_softcap = 50.0
    default_final_softcap = 30.0

    def softcap(self, key: str, default: float | None) -> float | None:
        value = self.header.metadata.get(self.prefix + key, default)
        return float(value) if value else None  # (llama.cpp reads 0 as no cap)

    def layer_types(self, layers: int, window: int | None) -> list:
        """llama.cpp's sliding-window layers: ``il % period < period - 1`` (period 0: all of them)."""
        period = self.header.metadata.get(self.prefix + "attention.sliding_window_pattern", self.swa_period)
        if isinstance(period, (list, bool)) or not isinstance(period, int) or period < 0:
            raise UnsupportedConfigError(f"{self.header.path}: {self.prefix}attention.sliding_window_pattern = "
                                         f"{period!r}; expected one non-negative integer")
        if window is None:
            return ["full_attention"] * layers
        return ["sliding_attention" if period == 0 or i % period < period - 1 else "full_attention"
                for i in range(layers)]

    def extra_config(self, config: dict) -> dict:
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        scalar = config["hidden_size"] // heads if layers == self.wide_scale_blocks else config["head_dim"]
        window = self.window()
        return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar, "sliding_window": window,
                "layer_types": self.layer_types(layers, window),
                "attn_logit_softcapping": self.softcap("attn_logit_softcapping", self.default_attn_softcap),
                "final_logit_softcapping": self.softcap("final_logit_softcapping", self.default_final_softcap)}

    def window(self) -> int | None:
        """The sliding window (llama.cpp's Gemma 2 default: 4096)."""
        return self.meta_int("attention.sliding_window", 4096)

    def transform(self, name: str, array, config: dict):
        if name.endswith("norm.weight"):  # llama.cpp stores the gain 1 + weight
            return array - 1
        return array
