"""``smollm3`` GGUF files (SmolLM3): written by llama.cpp's ``SmolLM3Model``, a ``LlamaModel``, so
the query and key rows are in llama.cpp's order (`LlamaConverter` restores them).

The files carry no per-layer plan: llama.cpp's ``smollm3`` graph skips RoPE on every 4th layer
(``n_no_rope_layer_step = 4``, layers 3, 7, ...) and attends to every position, so the config gets
``no_rope_layer_interval`` 4 and no sliding window.
"""

from __future__ import annotations

from .llama import LlamaConverter

#: llama.cpp's fixed NoPE step of ``smollm3`` models (``llama_model_smollm3::load_arch_hparams``)
NO_ROPE_LAYER_STEP = 4


class SmolLM3Converter(LlamaConverter):
    """``smollm3`` files: the ``llama`` tensors (Q/K rows restored), llama.cpp's fixed NoPE layers."""

    architecture = "smollm3"

    def extra_config(self, config: dict) -> dict:
        return {"no_rope_layer_interval": NO_ROPE_LAYER_STEP, "no_rope_layers": None, "use_sliding_window": False,
                "sliding_window": None, "layer_types": None}
