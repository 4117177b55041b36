"""Shared test setup: metalnn is imported before mlx so MLX binds the optimized BLAS."""

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import metalnn  # noqa: E402,F401  (must precede mlx.core)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def device():
    return metalnn.Device(kernels="reference", seed=0)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def to_np(a):
    return np.array(a.astype(mx.float32)) if isinstance(a, mx.array) else np.asarray(a)


def pytest_collection_modifyitems(session, config, items):
    """Run the kernel-coverage check last, after every kernel test had its chance."""
    last = [i for i in items if i.module.__name__.endswith("test_zz_kernel_coverage")]
    items[:] = [i for i in items if i not in last] + last
