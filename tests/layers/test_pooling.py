"""Pooling layers vs torch (forward and input gradients)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import metalnn as mn
import mlx.core as mx


def _run(layer, x, device):
    n, c, h, w = x.shape

    def f(xx):
        return layer.compile(device, mn.Data.from_nchw(xx))

    out = f(mx.array(x))
    g = np.random.default_rng(1).standard_normal((n, c, out.dims.H, out.dims.W)).astype(np.float32)
    gx = mx.grad(lambda xx: (f(xx).to_nchw(c) * mx.array(g)).sum())(mx.array(x))
    return out, g, gx


@pytest.mark.parametrize("kernel, stride, padding, shape", [
    (2, None, 0, (2, 3, 8, 8)), (2, None, 0, (1, 2, 7, 9)), (3, 2, 1, (2, 2, 7, 6)), ((3, 2), (1, 2), (1, 0), (1, 3, 5, 7)),
    (3, 4, 0, (1, 1, 9, 10)),
])
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pool_matches_torch(kind, kernel, stride, padding, shape, device, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    layer = (mn.MaxPool2D if kind == "max" else mn.AvgPool2D)(kernel, stride=stride, padding=padding)
    out, g, gx = _run(layer, x, device)
    xt = torch.tensor(x, requires_grad=True)
    fn = TF.max_pool2d if kind == "max" else TF.avg_pool2d
    yt = fn(xt, kernel, stride, padding)
    (yt * torch.tensor(g)).sum().backward()
    assert out.dims == mn.MTLSize(yt.shape[3], yt.shape[2], shape[0] * shape[1])
    np.testing.assert_allclose(np.array(out.to_nchw(shape[1])), yt.detach().numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(gx), xt.grad.numpy(), atol=1e-5, rtol=1e-5)


def test_avg_pool_count_exclude_pad(device, rng):
    x = rng.standard_normal((1, 2, 5, 6)).astype(np.float32)
    out = mn.AvgPool2D(3, stride=2, padding=1, count_include_pad=False).compile(device, mn.Data.from_nchw(mx.array(x)))
    yt = TF.avg_pool2d(torch.tensor(x), 3, 2, 1, count_include_pad=False).numpy()
    np.testing.assert_allclose(np.array(out.to_nchw(2)), yt, atol=1e-5)


def test_max_pool_ties_grad_to_first_max(device):
    x = np.zeros((1, 1, 2, 2), np.float32)
    _, _, gx = _run(mn.MaxPool2D(2), x, device)
    xt = torch.tensor(x, requires_grad=True)
    TF.max_pool2d(xt, 2).sum().backward()
    g = np.random.default_rng(1).standard_normal((1, 1, 1, 1)).astype(np.float32)
    np.testing.assert_allclose(np.array(gx), xt.grad.numpy() * g, atol=1e-6)


def test_global_avg_pool(device, rng):
    x = rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
    out = mn.GlobalAvgPool(channels=4).compile(device, mn.Data.from_nchw(mx.array(x)))
    assert out.dims == mn.MTLSize(4, 1, 3)
    np.testing.assert_allclose(np.array(out.array).reshape(3, 4), x.mean(axis=(2, 3)), atol=1e-5)
    out = mn.GlobalAvgPool().compile(device, mn.Data.from_nchw(mx.array(x)))
    assert out.dims == mn.MTLSize(1, 1, 12)


def test_pool_errors(device):
    with pytest.raises(mn.ShapeError, match=r"MaxPool2D: expected H, W >= kernel"):
        mn.MaxPool2D(4).compile(device, mn.Data(mx.zeros((1, 3, 3))))
    with pytest.raises(ValueError, match="padding must be >= 0 and at most half"):
        mn.MaxPool2D(2, padding=2)
