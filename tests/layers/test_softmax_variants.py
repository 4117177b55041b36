"""The hierarchical, mixture and adaptive softmax variants and Parallel's grid_scatter.

References: torch.nn.AdaptiveLogSoftmaxWithLoss (same weights), hand-computed values, and central
finite differences in float64 (numpy) for the gradients of the parameter-free variants.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
import torch

import metalnn as mn
from metalnn.layers.softmax import hierarchical_softmax


def finite_difference_check(fn, x, eps=1e-3, rtol=2e-3, atol=2e-4):
    """mx.grad of sum(fn(x) * c) against central differences of the same function in float32.

    eps 1e-3 on O(1) logits: truncation error ~eps^2 = 1e-6, float32 rounding ~1e-7/eps = 1e-4 of the
    O(1) sums, hence atol 2e-4.
    """
    c = mx.array(np.random.default_rng(5).normal(size=fn(x).shape).astype(np.float32))
    g = np.array(mx.grad(lambda v: (fn(v) * c).sum())(x))
    base = np.array(x, dtype=np.float32)
    num = np.zeros_like(base)
    for idx in np.ndindex(base.shape):
        hi, lo = base.copy(), base.copy()
        hi[idx] += eps
        lo[idx] -= eps
        num[idx] = ((np.array((fn(mx.array(hi)) * c).sum()) - np.array((fn(mx.array(lo)) * c).sum())) / (2 * eps))
    np.testing.assert_allclose(g, num, rtol=rtol, atol=atol)


def test_hierarchical_is_a_product_of_nested_decisions():
    levels = (2, 3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 2 + 6)).astype(np.float32)
    p = np.array(mn.Softmax("hierarchical", levels=levels)(mx.array(x)))
    assert p.shape == (4, 6)
    np.testing.assert_allclose(p.sum(-1), 1, atol=1e-6)

    def softmax(v):
        e = np.exp(v - v.max())
        return e / e.sum()

    for r in range(4):  # by hand: P(strategy s) * P(unit u | s)
        top = softmax(x[r, :2])
        for s in range(2):
            inner = softmax(x[r, 2 + 3 * s:2 + 3 * s + 3])
            np.testing.assert_allclose(p[r, 3 * s:3 * s + 3], top[s] * inner, rtol=1e-6)


def test_hierarchical_three_levels_sum_to_one_and_gradients():
    levels = (3, 3, 4)
    width = 3 + 9 + 36
    x = mx.array(np.random.default_rng(1).normal(size=(2, width)).astype(np.float32))
    layer = mn.Softmax("hierarchical", levels=levels)
    out = layer.compile(None, mn.Data(x))
    assert out.dims == mn.MTLSize(36, 1, 2)
    np.testing.assert_allclose(np.array(out.array).sum(-1), 1, atol=1e-6)
    # a strategy's leaves carry exactly that strategy's probability
    top = np.array(mx.softmax(x[:, :3], axis=-1))
    np.testing.assert_allclose(np.array(out.array).reshape(2, 3, 12).sum(-1), top, rtol=1e-5)
    finite_difference_check(lambda v: hierarchical_softmax(v, levels), x[:1])
    with pytest.raises(mn.ShapeError, match="input W=48"):
        layer(mx.zeros((2, 36)))
    with pytest.raises(ValueError, match="levels"):
        mn.Softmax("hierarchical")


def test_mixture_defaults_weights_and_learning():
    x = mx.array(np.random.default_rng(2).normal(size=(3, 7)).astype(np.float32))
    p = np.array(mn.Softmax("mixture")(x))
    xt = torch.tensor(np.array(x))
    want = sum(torch.softmax(xt / t, -1) for t in (0.5, 1.0, 2.0)).numpy() / 3
    np.testing.assert_allclose(p, want, atol=1e-6)
    np.testing.assert_allclose(p.sum(-1), 1, atol=1e-6)
    weighted = np.array(mn.Softmax("mixture", temperatures=(1.0, 3.0), weights=(3, 1))(x))
    want = (0.75 * torch.softmax(xt, -1) + 0.25 * torch.softmax(xt / 3, -1)).numpy()
    np.testing.assert_allclose(weighted, want, atol=1e-6)
    finite_difference_check(lambda v: mn.Softmax("mixture")(v), x[:1])
    # learned blend: the weights are a parameter that receives a gradient
    layer = mn.Softmax("mixture", learn_weights=True)
    assert set(layer.for_update()) == {"mixture_logits"}
    def first_column(params):
        layer.update(params)
        return layer(x)[:, 0].sum()

    g = mx.grad(first_column)(layer.trainable_parameters())
    assert float(mx.abs(g["mixture_logits"]).sum()) > 0
    with pytest.raises(ValueError, match="mixture weights"):
        mn.Softmax("mixture", weights=(1.0,))


@pytest.fixture
def adaptive_pair():
    torch.manual_seed(0)
    ref = torch.nn.AdaptiveLogSoftmaxWithLoss(16, 50, [10, 30], div_value=2.0, head_bias=True)
    ours = mn.AdaptiveSoftmax(16, 50, [10, 30], div_value=2.0, head_bias=True)
    ours.load_weights([(k, mx.array(v.detach().numpy())) for k, v in ref.state_dict().items()])
    return ref, ours


def test_adaptive_softmax_equals_torch(adaptive_pair):
    """log_prob, predict, output, loss and every gradient, on PyTorch's weights; float32 1e-5."""
    ref, ours = adaptive_pair
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 16)).astype(np.float32)
    target = np.concatenate([rng.integers(0, 10, 14), rng.integers(10, 30, 13), rng.integers(30, 50, 13)])
    xt = torch.tensor(x, requires_grad=True)
    out_t, loss_t = ref(xt, torch.tensor(target))
    loss_t.backward()
    res = ours(mx.array(x), mx.array(target))
    np.testing.assert_allclose(np.array(res.output), out_t.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(res.loss.item(), loss_t.item(), atol=1e-5)
    np.testing.assert_allclose(np.array(ours.log_prob(mx.array(x))), ref.log_prob(xt).detach().numpy(), atol=1e-5)
    np.testing.assert_array_equal(np.array(ours.predict(mx.array(x))), ref.predict(xt).numpy())

    def loss(params, xx):
        ours.update(params)
        return ours(xx, mx.array(target)).loss

    gp, gx = mx.grad(loss, argnums=(0, 1))(ours.trainable_parameters(), mx.array(x))
    np.testing.assert_allclose(np.array(gx), xt.grad.numpy(), atol=1e-5)
    from mlx.utils import tree_flatten

    grads = dict(tree_flatten(gp))
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(np.array(grads[name]), p.grad.numpy(), atol=1e-5, err_msg=name)


def test_adaptive_softmax_errors_and_softmax_variant(adaptive_pair):
    _, ours = adaptive_pair
    with pytest.raises(ValueError, match=r"target values should be in \[0, 49\]"):
        ours(mx.zeros((2, 16)), mx.array([0, 50]))
    with pytest.raises(ValueError, match="same batch size"):
        ours(mx.zeros((2, 16)), mx.array([0]))
    with pytest.raises(ValueError, match="cutoffs"):
        mn.AdaptiveSoftmax(16, 50, [30, 10])
    # Softmax("adaptive") gives the adaptive softmax's probabilities
    torch.manual_seed(1)
    ref = torch.nn.AdaptiveLogSoftmaxWithLoss(16, 50, [10, 30], div_value=2.0)
    probs = mn.Softmax("adaptive", in_features=16, n_classes=50, cutoffs=[10, 30], div_value=2.0)
    probs.adaptive.load_weights([(k, mx.array(v.detach().numpy())) for k, v in ref.state_dict().items()])
    x = np.random.default_rng(4).normal(size=(3, 16)).astype(np.float32)
    p = probs(mx.array(x))
    assert p.shape == (3, 50)
    np.testing.assert_allclose(np.array(p), ref.log_prob(torch.tensor(x)).exp().detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(np.array(p).sum(-1), 1, atol=1e-5)


def test_parallel_grid_scatter_places_each_branch_in_its_cell():
    x = mx.array(np.random.default_rng(6).normal(size=(3, 4, 5)).astype(np.float32))   # B=3, T=4, F=5
    a, b = mn.Linear(2), mn.Layers(mn.Flatten(), mn.Linear(6))
    grid = mn.Parallel([a, b], combine="grid_scatter")
    out = grid.compile(None, mn.Data(x))
    assert out.dims == mn.MTLSize(4 * 2 + 6, 1, 3)
    ya, yb = a(x), b(x)
    want = np.concatenate([np.array(ya).reshape(3, -1), np.array(yb).reshape(3, -1)], axis=-1)
    np.testing.assert_allclose(np.array(out.array).reshape(3, -1), want, atol=1e-6)
    g = mx.grad(lambda v: grid.compile(None, mn.Data(v)).array.sum())(x)
    assert g.shape == x.shape and float(mx.abs(g).sum()) > 0
    bad = mn.Parallel([mn.Linear(2), mn.Layers(mn.Reshape((5, 2, 6)))], combine="grid_scatter")
    with pytest.raises(mn.ShapeError, match="branch 1"):
        bad.compile(None, mn.Data(x))       # branch 1 changes the batch (D): refused like other modes
    assert math.isclose(float(out.array.sum()), float(want.sum()), rel_tol=1e-5)
