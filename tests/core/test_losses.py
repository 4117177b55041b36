"""Losses against torch.nn.functional, over random shapes (hypothesis). fp32 sums of <= a few
hundred log-probabilities: 1e-5 relative."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import metalnn as mn


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 12), classes=st.integers(2, 9), ignore=st.booleans(), smooth=st.sampled_from([0.0, 0.1]),
       seed=st.integers(0, 2**16))
def test_cross_entropy_matches_torch(rows, classes, ignore, smooth, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(rows, classes)) * 3).astype(np.float32)
    targets = rng.integers(0, classes, size=rows).astype(np.int64)
    if ignore:
        targets[rng.random(rows) < 0.3] = -100
    kw = dict(ignore_index=-100) if ignore else {}
    ours = mn.losses.cross_entropy(mx.array(logits), mx.array(targets.astype(np.int32)), label_smoothing=smooth, **kw)
    lt = torch.tensor(logits, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(lt, torch.tensor(targets), label_smoothing=smooth,
                                            ignore_index=-100 if ignore else -100)
    if ignore and (targets == -100).all():
        assert ours.item() == 0.0  # nothing counted: defined as 0 instead of torch's NaN
        return
    np.testing.assert_allclose(ours.item(), ref.item(), rtol=1e-5, atol=1e-6)
    ref.backward()
    g = mx.grad(lambda z: mn.losses.cross_entropy(z, mx.array(targets.astype(np.int32)), label_smoothing=smooth,
                                                  **kw))(mx.array(logits))
    np.testing.assert_allclose(np.array(g), lt.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_cross_entropy_on_sequences_and_reductions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, size=(2, 5))
    none = mn.losses.cross_entropy(mx.array(logits), mx.array(targets), reduction="none")
    ref = torch.nn.functional.cross_entropy(torch.tensor(logits).reshape(-1, 7), torch.tensor(targets).reshape(-1),
                                            reduction="none").reshape(2, 5)
    np.testing.assert_allclose(np.array(none), ref.numpy(), rtol=1e-5)
    s = mn.losses.cross_entropy(mx.array(logits), mx.array(targets), reduction="sum")
    np.testing.assert_allclose(s.item(), ref.sum().item(), rtol=1e-5)


def test_loss_errors_name_shapes():
    with pytest.raises(ValueError, match=r"logits \(3, 4\) need targets of shape \(3,\), got \(4,\)"):
        mn.losses.cross_entropy(mx.zeros((3, 4)), mx.zeros((4,), dtype=mx.int32))
    with pytest.raises(TypeError, match="targets must be integers"):
        mn.losses.cross_entropy(mx.zeros((3, 4)), mx.zeros((3,)))
    with pytest.raises(ValueError, match="mse: predictions"):
        mn.losses.mse(mx.zeros((3,)), mx.zeros((4,)))


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), seed=st.integers(0, 1000))
def test_mse_matches_torch(shape, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
    ours = mn.losses.mse(mx.array(a), mx.array(b))
    ref = torch.nn.functional.mse_loss(torch.tensor(a), torch.tensor(b))
    np.testing.assert_allclose(ours.item(), ref.item(), rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(dims=st.tuples(st.integers(1, 5), st.integers(1, 5), st.integers(1, 5)))
def test_data_dims_round_trip(dims):
    W, H, D = dims
    arr = mx.arange(W * H * D, dtype=mx.float32)
    d = mn.Data(arr, mn.MTLSize(W, H, D))
    assert d.array.shape == (D, H, W)
    assert tuple(mn.Data(d.array).dims) == (W, H, D)
    assert d.rows().shape == (D * H, W)
    np.testing.assert_array_equal(np.array(d.array).ravel(), np.arange(W * H * D))


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_cross_entropy_matches_torch_with_large_logits(kernels):
    """Rows of huge, tied and far-apart logits: float32 rounding of torch's log-softmax (rtol 1e-6)."""
    x = np.array([[1.0, 2.0, 3.0], [1000.0, 1000.0, 0.0], [-1e4, -1e4, -2e4], [80.0, -80.0, 0.0]], dtype=np.float32)
    t = np.array([2, 1, 0, 1])
    want = torch.nn.functional.cross_entropy(torch.tensor(x), torch.tensor(t), reduction="none").numpy()
    got = mn.losses.cross_entropy(mx.array(x), mx.array(t), reduction="none", device=mn.Device(kernels=kernels))
    np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-6)
    finite = np.random.default_rng(0).normal(size=(4, 1000)).astype(np.float32) * 20
    targets = np.array([3, 999, 0, 500])
    g = mx.grad(lambda z: mn.losses.cross_entropy(z, mx.array(targets), device=mn.Device(kernels=kernels)))(
        mx.array(finite))
    tt = torch.tensor(finite, requires_grad=True)
    torch.nn.functional.cross_entropy(tt, torch.tensor(targets)).backward()
    np.testing.assert_allclose(np.array(g), tt.grad.numpy(), rtol=1e-5, atol=1e-7)
