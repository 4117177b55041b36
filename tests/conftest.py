"""Shared test setup (the BLAS is set up by metalnn's startup hook, whatever is imported first)."""

import os

os.environ.setdefault("TQDM_DISABLE", "1")

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
