"""``nemotron_h`` GGUF files (placeholder, filled in below)."""

from __future__ import annotations

from ..convert import Converter


class NemotronHConverter(Converter):
    architecture = "nemotron_h"
