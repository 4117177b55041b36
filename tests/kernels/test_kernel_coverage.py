"""Every kernel in ``metal_kernels/*.metal`` runs through the emulator, via metalnn's public op, on a
small case, and gives what the reference implementation gives.

`CASES` maps each ``(family, kernel)`` to a computation through `metalnn.functional` whose result
depends on that kernel (a forward output, or the gradient the backward kernel computes); each test
runs it on an emulate device (and, where Metal is available, on a metal device) and on the
reference, checks with a spy that the kernel ran, and compares the results.
`test_cases_cover_every_kernel` fails when a kernel is added to the tree without a case here.
Tolerance: float32, 1e-4 absolute and relative (`kernel_cases.TOL`; sums of at most a few dozen
terms of order 1 in another order).
"""

import mlx.core as mx
import numpy as np
import pytest

import metal_kernels
import metalnn as mn
from metalnn import functional as F
from metalnn import ggml

from ggml_blocks import random_blocks
from kernel_cases import close, emulate, random, reference, spy_launches

BACKENDS = ["emulate", pytest.param("metal", marks=pytest.mark.skipif(not mx.metal.is_available(),
                                                                     reason="needs Metal"))]


def _rms_norm(argnum):
    x, w = random((3, 40), mx.float32, 1), random((40,), mx.float32, 2)

    def run(device):
        fn = lambda a, b: F.rms_norm(a, b, 1e-5, device=device)  # noqa: E731
        if argnum is None:
            return fn(x, w)
        return mx.grad(lambda a, b: (fn(a, b) * x).sum(), argnums=argnum)(x, w)
    return run


def _rope(device):
    x = random((2, 5, 16), mx.float32, 3)
    return mx.vjp(lambda a: F.rope(a, 12, offset=2, device=device), [x], [x * 0.5])[1][0]


def _attention(argnums):
    q, k, v = random((1, 2, 5, 32), mx.float32, 4), random((1, 1, 6, 32), mx.float32, 5), \
        random((1, 1, 6, 32), mx.float32, 6)

    def run(device):
        fn = lambda a, b, c: F.attention(a, b, c, device=device)  # noqa: E731
        if argnums is None:
            return fn(q, k, v)
        return mx.grad(lambda a, b, c: (fn(a, b, c) * q).sum(), argnums=argnums)(q, k, v)
    return run


def _conv(argnum):
    x, w = random((2, 3, 5, 6), mx.float32, 7), random((4, 3, 3, 3), mx.float32, 8)

    def run(device):
        fn = lambda a, b: F.conv2d(a, b, padding=1, device=device)  # noqa: E731
        if argnum is None:
            return fn(x, w)
        return mx.grad(lambda a, b: (fn(a, b) ** 2).sum(), argnums=argnum)(x, w)
    return run


def _gated_delta(grad):
    B, T, H, K, V = 1, 6, 2, 8, 4
    q, k = (random((B, T, H, K), mx.float32, s) * 0.3 for s in (9, 10))
    v = random((B, T, H, V), mx.float32, 11)
    g = -mx.abs(random((B, T, H), mx.float32, 12)) * 0.1
    beta = mx.sigmoid(random((B, T, H), mx.float32, 13))

    def run(device):
        def fn(*a):
            o, ht = F.gated_delta_rule(*a, device=device)
            return (o * o).sum() + ht.sum()
        return mx.grad(fn, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta) if grad else \
            F.gated_delta_rule(q, k, v, g, beta, device=device)
    return run


def _ssd(grad):
    B, T, H, P, G, N = 1, 6, 2, 3, 1, 5
    x, b, c = random((B, T, H, P), mx.float32, 16), random((B, T, G, N), mx.float32, 17), \
        random((B, T, G, N), mx.float32, 18)
    dt = mx.abs(random((B, T, H), mx.float32, 19)) * 0.3
    A, D = -mx.abs(random((H,), mx.float32, 20)), random((H,), mx.float32, 21)

    def run(device):
        def fn(*a):
            y, ht = F.ssd_scan(*a, device=device)
            return (y * y).sum() + ht.sum()
        return mx.grad(fn, argnums=(0, 1, 2, 3, 4, 5))(x, dt, A, b, c, D) if grad else \
            F.ssd_scan(x, dt, A, b, c, D, device=device)
    return run


def _ggml(x_rows, grad):
    # Q4_K, 3 rows of one 256-value block: x of 2 rows runs matvec, of 9 rows matmul; the gradient dequantize
    cls = ggml.get_type("Q4_K")
    w = mx.array(random_blocks("Q4_K", 3, np.random.default_rng(14)).reshape(3, cls.type_size))
    x = random((x_rows, 256), mx.float32, 15)

    def run(device):
        fn = lambda a: F.ggml_matmul(a, w, cls, device=device)  # noqa: E731
        return mx.grad(lambda a: (fn(a) ** 2).sum())(x) if grad else fn(x)
    return run


CASES = {
    ("rms_norm", "rms_norm_forward"): _rms_norm(None),
    ("rms_norm", "rms_norm_backward_dx"): _rms_norm(0),
    ("rms_norm", "rms_norm_backward_dw"): _rms_norm(1),
    ("rope", "rope"): _rope,
    ("attention", "attention_forward"): _attention(None),
    ("attention", "attention_backward_dq"): _attention(0),
    ("attention", "attention_backward_dkv"): _attention((1, 2)),
    ("conv", "conv2d_forward"): _conv(None),
    ("conv", "conv2d_dgrad"): _conv(0),
    ("conv", "conv2d_wgrad"): _conv(1),
    ("gated_delta", "gated_delta_forward"): _gated_delta(False),
    ("gated_delta", "gated_delta_backward"): _gated_delta(True),
    ("ssd", "ssd_forward"): _ssd(False),
    ("ssd", "ssd_backward"): _ssd(True),
    ("ggml", "matvec"): _ggml(2, False),
    ("ggml", "matmul"): _ggml(9, False),
    ("ggml", "dequantize"): _ggml(2, True),
}


def _flat(result):
    return list(result) if isinstance(result, (list, tuple)) else [result]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family,kernel", sorted(CASES), ids=[f"{f}.{k}" for f, k in sorted(CASES)])
def test_kernel_runs_and_matches_reference(family, kernel, backend, monkeypatch):
    launches = spy_launches(monkeypatch)
    got = _flat(CASES[family, kernel](emulate() if backend == "emulate" else mn.Device(kernels="metal")))
    assert (family, kernel) in {(launch.family, launch.name) for launch in launches}
    launches.clear()
    want = _flat(CASES[family, kernel](reference()))
    assert not launches
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        close(a, b, mx.float32)


def test_cases_cover_every_kernel():
    in_tree = {(family, name) for family in metal_kernels.families() for name in metal_kernels.load(family).kernels}
    assert len(in_tree) >= 12
    assert set(CASES) == in_tree
