"""``gpt-oss`` GGUF files (placeholder while the converter is written)."""

from __future__ import annotations

from ..convert import BLOCK_NAMES, Converter


class GptOssConverter(Converter):
    architecture = "gpt-oss"
    block_names = dict(BLOCK_NAMES)
