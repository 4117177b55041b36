"""Convolutions on the emulated Metal kernels (``metal_kernels/conv.metal``) against torch.

Every case checks the forward and the gradients in input, weight and bias (through ``mx.grad``,
so the kernels' VJPs run: conv's dx = dgrad kernel, dw = wgrad kernel; conv_transpose's forward =
dgrad kernel, dx = forward kernel, dw = wgrad kernel). Shapes are tiny (the emulator runs each GPU
thread as a fiber) but odd: not multiples of the 32 x 32 x 16 tiles, non-square, stride larger
than the kernel, groups (depthwise too), dilation, padding, output_padding, several tiles along
every GEMM axis, split weight-gradient reductions, 1-D and 3-D.
"""

import mlx.core as mx
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import metalnn as mn
from metalnn import functional as F
from metalnn.kernels import conv as conv_kernels

from kernel_cases import CONV_CASES, emulate, spy_launches

KERNELS = {"conv2d_forward", "conv2d_dgrad", "conv2d_wgrad"}

# float32 tolerance (absolute and relative): the kernels sum the same products as torch in a
# different order (16-long chunks through 8x8 tile products, split-K partials), with values of
# order 1-10 and at most ~100 terms per sum, so results differ by ~100 ulps of 10 (~1e-5) at most.
TOL32 = 1e-4


def _rand(shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _run_mx(fn, x, w, b, cot, dtype):
    xm, wm, bm = (mx.array(a).astype(dtype) for a in (x, w, b))
    cm = mx.array(cot)

    def loss(x_, w_, b_):
        return (fn(x_, w_, b_).astype(mx.float32) * cm).sum()

    y = fn(xm, wm, bm)
    grads = mx.grad(loss, argnums=(0, 1, 2))(xm, wm, bm)
    return [np.array(a.astype(mx.float32)) for a in (y, *grads)], y


def _run_torch(fn, x, w, b, cot):
    xt, wt, bt = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, b))
    y = fn(xt, wt, bt)
    (y * torch.tensor(cot, dtype=torch.float64)).sum().backward()
    return [a.detach().numpy() for a in (y, xt.grad, wt.grad, bt.grad)]


def check(op, x_shape, w_shape, kwargs, device=None, dtype=mx.float32, tol=TOL32, seed=0):
    """Compare ``op`` ('conv' or 'conv_transpose', rank from the shapes) with torch: y, dx, dw, db."""
    n = len(x_shape) - 2
    name = f"{op}{n}d"
    out_ch = w_shape[0] if op == "conv" else w_shape[1] * kwargs.get("groups", 1)
    # Inputs are rounded to ``dtype`` first, so torch (float64) sees the values the kernels see.
    x, w, b = (np.array(mx.array(_rand(shape, seed + i)).astype(dtype).astype(mx.float32))
               for i, shape in enumerate((x_shape, w_shape, (out_ch,))))
    ref = _run_torch(lambda a, c, d: getattr(TF, name)(a, c, d, **kwargs), x, w, b,
                     _rand(getattr(TF, name)(torch.tensor(x), torch.tensor(w), **kwargs).shape, seed + 3))
    cot = _rand(ref[0].shape, seed + 3)
    device = device or emulate()
    got, y = _run_mx(lambda a, c, d: getattr(F, name)(a, c, d, device=device, **kwargs), x, w, b, cot, dtype)
    assert y.dtype == dtype and tuple(y.shape) == ref[0].shape
    for label, g, r in zip(("y", "dx", "dw", "db"), got, ref):
        np.testing.assert_allclose(g, r, atol=tol, rtol=tol, err_msg=f"{name} {label} {kwargs}")
    return got


CONV2D = [c[1:] for c in CONV_CASES if c[0] == "conv" and len(c[1]) == 4]
CONV_T2D = [c[1:] for c in CONV_CASES if c[0] == "conv_transpose" and len(c[1]) == 4]
OTHER_RANKS = [c for c in CONV_CASES if len(c[1]) != 4]


@pytest.mark.parametrize("x_shape,w_shape,kwargs", CONV2D)
def test_conv2d_forward_and_grads(x_shape, w_shape, kwargs, monkeypatch):
    launches = spy_launches(monkeypatch)
    check("conv", x_shape, w_shape, kwargs)
    assert launches.names() == KERNELS


@pytest.mark.parametrize("x_shape,w_shape,kwargs", CONV_T2D)
def test_conv_transpose2d_forward_and_grads(x_shape, w_shape, kwargs, monkeypatch):
    launches = spy_launches(monkeypatch)
    check("conv_transpose", x_shape, w_shape, kwargs)
    assert launches.names() == KERNELS


@pytest.mark.parametrize("op,x_shape,w_shape,kwargs", OTHER_RANKS)
def test_1d_and_3d_forward_and_grads(op, x_shape, w_shape, kwargs, monkeypatch):
    launches = spy_launches(monkeypatch)
    check(op, x_shape, w_shape, kwargs)
    assert launches.names() == KERNELS


def test_split_weight_gradient(monkeypatch):
    # Slices of at least 13 terms, rounded up to the 16-long K chunk: the conv's 32 reduction
    # terms (2 x 4 x 4 outputs) make 2 full slices, the transposed conv's 40 (2 x 4 x 5 inputs)
    # make 3 slices, the last one partial.
    monkeypatch.setattr(conv_kernels, "WGRAD_MIN_SLICE", 13)
    seen = []
    launch = conv_kernels._launch
    monkeypatch.setattr(conv_kernels, "_launch", lambda name, geom, inputs, shape, *a, **k: (
        seen.append((name, shape)), launch(name, geom, inputs, shape, *a, **k))[1])
    check("conv", *CONV2D[0])
    check("conv_transpose", *CONV_T2D[0])
    assert ("conv2d_wgrad", (2, 5, 18)) in seen and ("conv2d_wgrad", (3, 3, 24)) in seen


@pytest.mark.parametrize("lane_order", ["reversed", "shuffled"])
def test_lane_order_does_not_change_result(lane_order, monkeypatch):
    launches = spy_launches(monkeypatch)
    base = check("conv", *CONV2D[1])
    other = check("conv", *CONV2D[1], device=emulate(lane_order=lane_order, seed=3))
    for a, b in zip(base, other):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    orders = {(launch.name, launch.options.get("lane_order", "forward")) for launch in launches}
    assert orders == {(name, order) for name in KERNELS for order in ("forward", lane_order)}


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision(dtype):
    # Products of the (exactly representable) inputs are summed in float32; the outputs and the
    # cotangent fed to the backward kernels are rounded to 10 (float16) or 7 (bfloat16) mantissa
    # bits: ~1e-3 / ~8e-3 relative per rounding, a few roundings on values of order 1-10.
    check("conv", (1, 3, 5, 4), (4, 3, 2, 2), dict(padding=1), dtype=dtype,
          tol=1e-2 if dtype == mx.float16 else 5e-2)
    check("conv_transpose", (1, 3, 3, 4), (3, 2, 2, 3), dict(stride=2, output_padding=1), dtype=dtype,
          tol=1e-2 if dtype == mx.float16 else 5e-2)


def test_layers_run_on_the_kernels(monkeypatch):
    launches = spy_launches(monkeypatch)
    x = mx.array(_rand((2, 4, 6, 5), 7))
    ref_dev, emu_dev = mn.Device(kernels="reference"), emulate()
    # conv runs the forward kernel; the transposed conv's forward is the dgrad kernel.
    for layer, out_ch, kernel in ((mn.Conv2D(6, 3, padding=1, groups=2, in_channels=4), 6, "conv2d_forward"),
                                  (mn.ConvTransposed2D(3, 3, stride=2, padding=1, output_padding=1, in_channels=4),
                                   3, "conv2d_dgrad")):
        ref = layer.compile(ref_dev, mn.Data.from_nchw(x)).to_nchw(out_ch)
        assert not launches
        got = layer.compile(emu_dev, mn.Data.from_nchw(x)).to_nchw(out_ch)
        assert launches.names() == {kernel}
        launches.clear()
        np.testing.assert_allclose(np.array(got), np.array(ref), atol=TOL32, rtol=TOL32)


@pytest.mark.parametrize("kernels", ["emulate", "reference", "auto"])
def test_empty_batch_gives_empty_output_and_zero_grads(kernels, monkeypatch):
    launches = spy_launches(monkeypatch)
    device = mn.Device(kernels=kernels)
    x = mx.zeros((0, 3, 5, 5))
    w = mx.array(_rand((4, 3, 3, 3), 9))
    y = F.conv2d(x, w, padding=1, device=device)
    assert y.shape == (0, 4, 5, 5)
    dw = mx.grad(lambda w_: F.conv2d(x, w_, device=device).sum())(w)
    assert dw.shape == w.shape and not np.any(np.array(dw))
    yt = F.conv_transpose2d(x, mx.array(_rand((3, 2, 3, 3), 9)), stride=2, device=device)
    assert yt.shape == (0, 2, 11, 11)      # (5 - 1) * 2 + 3
    assert not launches


def test_mixed_and_integer_dtypes_are_promoted(monkeypatch):
    launches = spy_launches(monkeypatch)
    x = mx.array(np.arange(2 * 3 * 4 * 4).reshape(2, 3, 4, 4) % 5)           # int32
    w = mx.array(_rand((2, 3, 3, 3), 4)).astype(mx.float16)
    for kernels in ("emulate", "reference", "auto"):
        y = F.conv2d(x, w, padding=1, device=mn.Device(kernels=kernels))
        assert y.dtype == mx.float16
        want = TF.conv2d(torch.tensor(np.array(x), dtype=torch.float64),
                         torch.tensor(np.array(w.astype(mx.float32)), dtype=torch.float64), padding=1)
        # float16 output of sums of up to 27 products of size <= 4 * 3: 1e-2 relative (a few roundings)
        np.testing.assert_allclose(np.array(y.astype(mx.float32)), want.numpy(), rtol=1e-2, atol=1e-2)
    assert launches.names() == {"conv2d_forward"}
