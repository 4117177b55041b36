"""F.rms_norm on the emulated Metal kernels and the reference path, against mx.fast.rms_norm."""

import mlx.core as mx
import numpy as np
import pytest

from metalnn import functional as F

from kernel_cases import TOL, close, emulate, random, reference

SHAPES = [(3, 1), (2, 31), (3, 33), (1, 4096), (3, 2, 5, 64), (7, 130)]
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def grads(fn, x, w, cot):
    def loss(x, w):
        return (fn(x, w).astype(mx.float32) * cot).sum()

    return mx.grad(loss, argnums=(0, 1))(x, w)


@pytest.mark.parametrize("path", ["emulate", "reference"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_backward_match_mlx(path, shape, dtype):
    if path == "emulate" and shape[-1] == 4096 and dtype != mx.float32:
        shape = (1, 4096)
    device = emulate() if path == "emulate" else reference()
    x = random(shape, dtype, 1)
    w = (random(shape[-1:], mx.float32, 2) * 0.3 + 1).astype(dtype)
    cot = random(shape, mx.float32, 3)
    eps = 1e-5
    y = F.rms_norm(x, w, eps, device=device)
    assert y.dtype == dtype and y.shape == x.shape
    close(y, mx.fast.rms_norm(x, w, eps), dtype)
    gx, gw = grads(lambda a, b: F.rms_norm(a, b, eps, device=device), x, w, cot)
    rx, rw = grads(lambda a, b: mx.fast.rms_norm(a, b, eps), x, w, cot)
    # dw sums over every row: allow the tolerance to grow with the number of rows summed.
    rows = int(np.prod(shape[:-1]))
    close(gx, rx, dtype, scale=2)
    close(gw, rw, dtype, scale=max(2, np.sqrt(rows)))


@pytest.mark.parametrize("lane_order", ["reversed", "shuffled"])
def test_lane_order_does_not_change_result(lane_order):
    x = random((4, 100), mx.float32)
    w = random((100,), mx.float32, 5)
    a = F.rms_norm(x, w, 1e-6, device=emulate())
    b = F.rms_norm(x, w, 1e-6, device=emulate(lane_order, seed=3))
    close(a, b, mx.float32)


def test_no_weight_and_non_contiguous_input():
    base = random((6, 40), mx.float32)
    x = base.T[:33]          # a transposed, sliced view: (33, 6) with strides (1, 40)
    for device in (emulate(), reference()):
        close(F.rms_norm(x, None, 1e-5, device=device), mx.fast.rms_norm(x, None, 1e-5), mx.float32)
        g = mx.grad(lambda v: (F.rms_norm(v, None, 1e-5, device=device) ** 2).sum())(x)
        r = mx.grad(lambda v: (mx.fast.rms_norm(v, None, 1e-5) ** 2).sum())(x)
        close(g, r, mx.float32)


def test_bad_weight_shape_is_reported():
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        F.rms_norm(mx.zeros((2, 8)), mx.ones((7,)), device=reference())


def test_rmsnorm_layer_runs_on_emulated_kernel():
    import metalnn as mn

    x = random((2, 3, 16), mx.float32)
    layer = mn.RMSNorm()
    out_ref = layer.compile(reference(), mn.Data(x)).array
    out_emu = layer.compile(emulate(), mn.Data(x)).array
    close(out_emu, out_ref, mx.float32)
    assert TOL[mx.float32] <= 1e-4
