"""Qwen2 / Qwen2.5 decoder (`Qwen2ForCausalLM`): Llama with biases on the q/k/v projections and an
optional sliding attention window on some layers.

Parameter names equal Hugging Face's (``model.layers.<i>.self_attn.q_proj.bias``, ...).
"""

from __future__ import annotations

from .llama import LlamaForCausalLM, layer_types

SLIDING = ("full_attention", "sliding_attention")


def sliding_windows(config: dict) -> list:
    """Per layer: the attention window (``sliding_window``) or None, as transformers' Qwen2 / Qwen3
    configs decide it: only when ``use_sliding_window`` is set, on the layers ``layer_types`` marks
    ``sliding_attention`` (by default those from ``max_window_layers`` on)."""
    n = int(config["num_hidden_layers"])
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    if config.get("layer_types") is None:
        first = int(config.get("max_window_layers", 28))
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
    else:
        types = layer_types(config, SLIDING, "full_attention")
    return [int(window) if window is not None and kind == "sliding_attention" else None for kind in types]


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 built from a Hugging Face ``Qwen2Config`` dict.

    As `LlamaForCausalLM`, plus: q/k/v projections always carry biases and o_proj never does
    (``attention_bias`` is not read, as in transformers); ``use_sliding_window``,
    ``sliding_window``, ``max_window_layers`` and ``layer_types`` (``full_attention`` /
    ``sliding_attention``) decide which layers attend within a window.
    """

    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    gguf_architecture = "qwen2"

    def block_options(self, layer: int) -> dict:
        return dict(super().block_options(layer), attention_bias=True, attention_out_bias=False,
                    sliding_window=sliding_windows(self.config)[layer])
