"""Shared test setup (the BLAS is set up by metalnn's startup hook, whatever is imported first).

The test folders mirror the packages (core, layers, functional, kernels, cpu, llm/..., cli, emulator);
the helpers they share live in ``tests/support`` (put on ``sys.path`` here).
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
# The Python processes the tests start (servers, ranks, commands, examples) would each compile
# metalnn's modules again when the shell sets PYTHONDONTWRITEBYTECODE (0.7 s a process for the
# server's imports): they share one bytecode cache in a temporary folder instead, removed at exit,
# and the source tree stays free of .pyc files as that setting asks.
if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
    _bytecode = tempfile.mkdtemp(prefix="metalnn-tests-bytecode-")
    atexit.register(shutil.rmtree, _bytecode, ignore_errors=True)
    os.environ["PYTHONPYCACHEPREFIX"] = _bytecode
    del os.environ["PYTHONDONTWRITEBYTECODE"]
# the shared helpers (hf_models, kernel_cases, gguf_files, ...) live in tests/support
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

import metalnn  # noqa: E402,F401
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_kernel_override(monkeypatch):
    """Tests choose their kernels explicitly: METALNN_KERNELS from the shell does not leak in."""
    monkeypatch.delenv("METALNN_KERNELS", raising=False)


@pytest.fixture
def device():
    return metalnn.Device(kernels="reference", seed=0)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
