"""F.layer_norm: the reference (plain MLX ops) against torch, "auto" is mx.fast.layer_norm.

Tolerance: float32 statistics over 48 features of order 1: rounding ~1e-6; 1e-5 absolute and
relative (gradients 1e-4: sums over the row of products of order 1).
"""

import mlx.core as mx
import numpy as np
import pytest
import torch

import metalnn as mn
from metalnn import functional as F

from kernel_cases import random, reference


@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_reference_matches_torch(affine):
    x, w, b = random((3, 5, 48), mx.float32, 1), random((48,), mx.float32, 2), random((48,), mx.float32, 3)
    w = w if affine != "none" else None
    b = b if affine == "both" else None
    cot = random((3, 5, 48), mx.float32, 4)
    args = [a for a in (x, w, b) if a is not None]

    def fn(*a):
        return F.layer_norm(a[0], a[1] if w is not None else None, a[2] if b is not None else None, 1e-5,
                            device=reference())

    y, grads = mx.vjp(fn, args, [cot])
    leaves = [torch.tensor(np.array(a), requires_grad=True) for a in args]
    yt = torch.nn.functional.layer_norm(leaves[0], (48,), leaves[1] if w is not None else None,
                                        leaves[2] if b is not None else None, 1e-5)
    (yt * torch.tensor(np.array(cot))).sum().backward()
    np.testing.assert_allclose(np.array(y[0]), yt.detach().numpy(), atol=1e-5, rtol=1e-5)
    for g, leaf in zip(grads, leaves):
        np.testing.assert_allclose(np.array(g), leaf.grad.numpy(), atol=1e-4, rtol=1e-4)


def test_auto_is_mlx_fast(monkeypatch):
    calls = []
    real = mx.fast.layer_norm
    monkeypatch.setattr(mx.fast, "layer_norm", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    x, w = random((2, 16), mx.float32), random((16,), mx.float32, 1)
    assert mx.array_equal(F.layer_norm(x, w, None, 1e-5, device=mn.Device()), real(x, w, None, 1e-5))
    assert calls == [1]
    F.layer_norm(x, w, None, 1e-5, device=reference())
    assert calls == [1]


def test_bad_shapes_are_reported():
    with pytest.raises(ValueError, match=r"layer_norm: bias must have shape \(8,\), got \(7,\)"):
        F.layer_norm(mx.zeros((2, 8)), None, mx.zeros((7,)), device=reference())
