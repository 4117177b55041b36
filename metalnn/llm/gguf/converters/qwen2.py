"""``qwen2`` GGUF files (Qwen2, Qwen2.5): gguf-py's standard names (the q/k/v biases included), no
transforms; the files carry no sliding window."""

from __future__ import annotations

from ..convert import Converter


class Qwen2Converter(Converter):
    """``qwen2`` files: renamed by the standard tables."""

    architecture = "qwen2"

    def extra_config(self, config: dict) -> dict:
        return {"use_sliding_window": False}
