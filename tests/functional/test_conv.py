"""Convolutions vs torch.nn.functional: forward and gradients (dx, dw, db), errors.

Each case runs on the "reference" implementation (plain MLX ops, MLX autodiff), on "auto" (the
CPU path with its hand-written backward, here on the CPU backend) and through MLX's
``mx.conv_general`` (what "auto" runs on a GPU) where `mlx_conv_supports` says MLX can.

Tolerance: float32, random N(0,1) inputs and weights; each output is a sum of up to
C/groups * prod(kernel) (here <= 72) products and each weight gradient a sum over batch and output
positions (<= a few hundred terms of size ~O(1)). Summation order differs from PyTorch's (im2col +
BLAS GEMM vs oneDNN), so rounding differences grow like sqrt(terms) * |value| * 2^-24, i.e.
~1e-5 for these sizes; 1e-4 absolute (plus 1e-4 relative) leaves margin without hiding real bugs
(an index error changes values by O(1)).
"""

import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import importlib

import metalnn as mn
import mlx.core as mx
from metalnn.functional import (conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d,
                                conv_transpose3d)

Fconv = importlib.import_module("metalnn.functional.conv")

ATOL = RTOL = 1e-4
MN = {(False, 1): conv1d, (False, 2): conv2d, (False, 3): conv3d,
      (True, 1): conv_transpose1d, (True, 2): conv_transpose2d, (True, 3): conv_transpose3d}
TORCH = {(False, 1): TF.conv1d, (False, 2): TF.conv2d, (False, 3): TF.conv3d,
         (True, 1): TF.conv_transpose1d, (True, 2): TF.conv_transpose2d, (True, 3): TF.conv_transpose3d}

# (transposed, n, N, C, O, spatial, kernel, kwargs)
CASES = [
    (False, 2, 2, 3, 5, (7, 9), (3, 3), dict(padding=1)),
    (False, 2, 2, 4, 6, (7, 11), (3, 2), dict(stride=(2, 3), padding=(1, 0), dilation=(1, 2), groups=2)),
    (False, 2, 1, 2, 3, (5, 6), (1, 1), dict(stride=3)),  # stride > kernel
    (False, 2, 3, 6, 6, (6, 5), (3, 3), dict(groups=6, padding=2)),  # depthwise, padding > k//2
    (False, 2, 2, 3, 4, (9, 8), (2, 3), dict(stride=2, dilation=3, padding=(2, 1))),
    (False, 1, 3, 3, 6, (11,), (3,), dict(stride=4, padding=2, dilation=2, groups=3)),
    (False, 1, 2, 5, 4, (13,), (5,), dict()),
    (False, 3, 2, 2, 4, (5, 6, 7), (2, 3, 2), dict(stride=(1, 2, 1), padding=(1, 0, 2), groups=2)),
    (False, 3, 1, 3, 2, (4, 5, 6), (3, 1, 2), dict(dilation=(1, 2, 2), stride=(2, 1, 3))),
    (True, 2, 2, 4, 6, (5, 7), (3, 2), dict(padding=1)),
    (True, 2, 2, 4, 6, (5, 7), (3, 3), dict(stride=(2, 3), padding=(1, 0), output_padding=(1, 2), dilation=(1, 2),
                                            groups=2)),
    (True, 2, 1, 3, 2, (4, 3), (2, 2), dict(stride=3)),  # stride > kernel: gaps in the output
    (True, 2, 2, 2, 3, (6, 5), (3, 2), dict(stride=1, padding=2, dilation=2, output_padding=1)),
    (True, 1, 2, 4, 6, (5,), (4,), dict(stride=3, padding=1, output_padding=1, dilation=2, groups=2)),
    # output_padding >= stride (allowed below the dilation) and > padding: extra output rows that
    # windows of the zero-padded input still reach
    (True, 2, 2, 3, 2, (4, 5), (3, 2), dict(stride=2, dilation=3, output_padding=(2, 1), padding=(0, 1))),
    (True, 3, 2, 2, 4, (3, 4, 5), (2, 3, 2), dict(stride=(2, 1, 2), padding=(0, 1, 1), output_padding=(1, 0, 1),
                                                  dilation=(1, 1, 2), groups=2)),
]


def _ids(case):
    t, n, N, C, O, S, k, kw = case
    return f"{'T' if t else 'C'}{n}d-{'x'.join(map(str, S))}-k{'x'.join(map(str, k))}-" + \
        "-".join(f"{a}{b}" for a, b in kw.items()).replace(" ", "")


def _close(a, b, what):
    a = np.array(a)
    b = b.detach().numpy() if isinstance(b, torch.Tensor) else b
    assert a.shape == b.shape, f"{what}: shape {a.shape} vs torch {b.shape}"
    np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL, err_msg=what)


def _normalised(case):
    transposed, n, N, C, O, S, k, kw = case
    tup = lambda v: tuple(v) if isinstance(v, tuple) else (v,) * n  # noqa: E731
    args = dict(stride=tup(kw.get("stride", 1)), padding=tup(kw.get("padding", 0)),
                dilation=tup(kw.get("dilation", 1)), groups=kw.get("groups", 1))
    if transposed:
        args["output_padding"] = tup(kw.get("output_padding", 0))
    return args


def _mlx_builtin(case):
    """``(fn, supported)``: the case run through mx.conv_general, and whether metalnn would do so."""
    transposed, n = case[:2]
    a = _normalised(case)
    if transposed:
        fn = lambda x, w, b, **_: Fconv._add_bias(Fconv.conv_transpose_mlx(  # noqa: E731
            x, w, a["stride"], a["padding"], a["output_padding"], a["dilation"], a["groups"]), b, n)
        return fn, Fconv.mlx_conv_supports(n, a["groups"], a["padding"], a["output_padding"])
    fn = lambda x, w, b, **_: Fconv._add_bias(Fconv.conv_mlx(  # noqa: E731
        x, w, a["stride"], a["padding"], a["dilation"], a["groups"]), b, n)
    return fn, Fconv.mlx_conv_supports(n, a["groups"])


# "mlx": only the cases metalnn sends to mx.conv_general (the others: test_mlx_limits_are_real).
# "auto-mlx-im2col": the CPU path with metalnn.cpu.im2col's MLX-op fallback (no native extension).
PATHS = [pytest.param(case, path, id=f"{path}-{_ids(case)}") for case in CASES
         for path in ("reference", "auto", "auto-mlx-im2col", "mlx") if path != "mlx" or _mlx_builtin(case)[1]]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case,path", PATHS)
def test_matches_torch_forward_and_grads(case, path, bias, monkeypatch):
    transposed, n, N, C, O, S, k, kw = case
    if path == "auto-mlx-im2col":
        monkeypatch.setattr(mn.cpu.im2col, "_ext", None)
        path = "auto"
    rng = np.random.default_rng(zlib.crc32(_ids(case).encode()))
    g = kw.get("groups", 1)
    x = rng.standard_normal((N, C) + S).astype(np.float32)
    wshape = (C, O // g) + k if transposed else (O, C // g) + k
    w = rng.standard_normal(wshape).astype(np.float32)
    b = rng.standard_normal((O,)).astype(np.float32)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    yt = TORCH[transposed, n](xt, wt, bt if bias else None, **kw)
    gy = rng.standard_normal(tuple(yt.shape)).astype(np.float32)
    (yt * torch.tensor(gy)).sum().backward()

    fn = MN[transposed, n]
    if path == "mlx":
        fn = _mlx_builtin(case)[0]
    device = mn.Device(kernels=path if path != "mlx" else "auto")

    def loss(x_, w_, b_):
        y = fn(x_, w_, b_ if bias else None, device=device, **kw)
        return (y * mx.array(gy)).sum(), y

    (_, y), grads = mx.value_and_grad(loss, argnums=(0, 1, 2))(mx.array(x), mx.array(w), mx.array(b))
    _close(y, yt, "output")
    _close(grads[0], xt.grad, "dx")
    _close(grads[1], wt.grad, "dw")
    if bias:
        _close(grads[2], bt.grad, "db")


@pytest.mark.parametrize("case", [c for c in CASES if not _mlx_builtin(c)[1]], ids=_ids)
def test_mlx_limits_are_real(case):
    """The cases kept away from mx.conv_general do fail there (so the guard is still needed):
    MLX 0.32 refuses grouped 3-D convolutions and returns an input gradient of the wrong shape for
    transposed ones with output_padding > padding."""
    transposed, n, N, C, O, S, k, kw = case
    g = kw.get("groups", 1)
    x = mx.ones((N, C) + S)
    w = mx.ones(((C, O // g) if transposed else (O, C // g)) + k)
    fn = _mlx_builtin(case)[0]
    try:
        dx = mx.grad(lambda x_: fn(x_, w, None).sum())(x)
    except ValueError as e:
        assert "groups" in str(e)
    else:
        assert dx.shape != x.shape


def test_auto_on_cpu_runs_the_cpu_path(monkeypatch):
    calls = []
    real = Fconv.conv_cpu
    monkeypatch.setattr(Fconv, "conv_cpu", lambda *a: (calls.append(1), real(*a))[1])
    monkeypatch.setattr(mx, "conv_general", None)  # any call would fail
    x, w = mx.ones((1, 2, 5, 5)), mx.ones((3, 2, 3, 3))
    y = conv2d(x, w, padding=1, device=mn.Device())
    assert calls and float(y[0, 0, 2, 2]) == 18.0


def test_int_and_tuple_args_agree(device):
    x = mx.random.normal((1, 2, 6, 6), key=mx.random.key(1))
    w = mx.random.normal((3, 2, 3, 3), key=mx.random.key(2))
    a = conv2d(x, w, stride=2, padding=1, dilation=1, device=device)
    b = conv2d(x, w, stride=(2, 2), padding=[1, 1], dilation=(1, 1), device=device)
    assert mx.array_equal(a, b)


def test_under_compile_and_second_call(device):
    x = mx.random.normal((2, 3, 8, 8), key=mx.random.key(0))
    w = mx.random.normal((4, 3, 3, 3), key=mx.random.key(1))
    f = lambda x_, w_: (conv2d(x_, w_, padding=1, device=device) ** 2).sum()  # noqa: E731
    g1 = mx.grad(f, argnums=(0, 1))(x, w)
    g2 = mx.compile(mx.grad(f, argnums=(0, 1)))(x, w)
    for a, b in zip(g1, g2):
        assert mx.allclose(a, b, atol=1e-4)


# -- errors ---------------------------------------------------------------------------------------
def _x(shape):
    return mx.zeros(shape)


@pytest.mark.parametrize("call, match", [
    (lambda: conv2d(_x((1, 2, 5, 5)), _x((3, 2, 3, 3)), padding=-1), "conv2d: padding must be >= 0"),
    (lambda: conv2d(_x((1, 3, 5, 5)), _x((4, 1, 3, 3)), groups=2), "conv2d: input channels 3 not divisible by groups=2"),
    (lambda: conv2d(_x((1, 4, 5, 5)), _x((3, 2, 3, 3)), groups=2), "conv2d: output channels 3 not divisible"),
    (lambda: conv2d(_x((1, 4, 5, 5)), _x((3, 4, 3, 3)), groups=2), r"C/groups = 4/2 = 2, got weight shape \(3, 4, 3, 3\)"),
    (lambda: conv2d(_x((1, 2, 2, 2)), _x((3, 2, 3, 3))), r"conv2d: output size \(0, 0\) is smaller than 1"),
    (lambda: conv2d(_x((1, 2, 5, 5)), _x((3, 2, 3))), r"conv2d: expected weight of rank 4 .* got shape \(3, 2, 3\)"),
    (lambda: conv2d(_x((2, 5, 5)), _x((3, 2, 3, 3))), r"conv2d: expected input of rank 4"),
    (lambda: conv2d(_x((1, 2, 5, 5)), _x((3, 2, 3, 3)), stride=0), "conv2d: stride must be >= 1"),
    (lambda: conv2d(_x((1, 2, 5, 5)), _x((3, 2, 3, 3)), stride=(1, 2, 3)), "conv2d: stride must be an int or a tuple of 2"),
    (lambda: conv2d(_x((1, 2, 5, 5)), _x((3, 2, 3, 3)), bias=_x((4,))), r"conv2d: expected bias of shape \(3,\)"),
    (lambda: conv1d(_x((1, 2, 5)), _x((3, 2, 3)), dilation=0), "conv1d: dilation must be >= 1"),
    (lambda: conv3d(_x((1, 2, 5, 5, 5)), _x((3, 2, 3, 3)),), "conv3d: expected weight of rank 5"),
    (lambda: conv_transpose2d(_x((1, 2, 4, 4)), _x((2, 3, 3, 3)), stride=2, output_padding=2),
     "conv_transpose2d: output_padding must be >= 0 and smaller than stride or dilation"),
    (lambda: conv_transpose2d(_x((1, 2, 4, 4)), _x((3, 3, 3, 3))), r"C_in = input channels 2"),
    (lambda: conv_transpose1d(_x((1, 2, 1)), _x((2, 3, 1)), padding=1), r"conv_transpose1d: output size \(-1,\)"),
])
def test_invalid_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
