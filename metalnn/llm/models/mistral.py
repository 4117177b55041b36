"""Mistral decoder (`MistralForCausalLM`): Llama with a sliding attention window.

Parameter names equal Hugging Face's (the same as Llama's).
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral built from a Hugging Face ``MistralConfig`` dict.

    As `LlamaForCausalLM`, plus ``sliding_window``: when set (not null), every position attends only
    to the last ``sliding_window`` positions, itself included (Mistral 7B v0.1 uses 4096; later
    versions set it to null).
    """

    architecture = "MistralForCausalLM"
    model_type = "mistral"

    def block_options(self, layer: int) -> dict:
        window = self.config.get("sliding_window")
        return dict(super().block_options(layer), attention_bias=False, mlp_bias=False,
                    sliding_window=None if window is None else int(window))
