"""Recurrent layers against torch.nn (weights copied), containers, softmax variants, KMeans.

Tolerance: float32, sequences of <= 6 steps of small matrix products: 1e-5.
"""

import mlx.core as mx
import numpy as np
import pytest
import torch

import metalnn as mn
from metalnn.layers.softmax import entmax

ATOL = 1e-5


def seq(rng, batch=3, T=6, features=5):
    return mx.array(rng.normal(size=(batch, T, features)).astype(np.float32))


@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
def test_recurrent_matches_torch(kind, rng, device):
    x = seq(rng)
    layer = getattr(mn, kind)(7)
    out = layer.compile(device, mn.Data(x))
    assert tuple(out.dims) == (7, 6, 3)
    ref = getattr(torch.nn, kind)(5, 7, batch_first=True)
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(ref, f"{name}_l0").copy_(torch.tensor(np.array(getattr(layer, name))))
    xt = torch.tensor(np.array(x), requires_grad=True)
    yt, _ = ref(xt)
    np.testing.assert_allclose(np.array(out.array), yt.detach().numpy(), atol=ATOL)
    cot = rng.normal(size=yt.shape).astype(np.float32)
    (yt * torch.tensor(cot)).sum().backward()

    def f(params, x_):
        layer.update(params)
        return (layer.compile(device, mn.Data(x_)).array * mx.array(cot)).sum()

    gp, gx = mx.grad(f, argnums=(0, 1))(layer.trainable_parameters(), x)
    np.testing.assert_allclose(np.array(gx), xt.grad.numpy(), atol=ATOL)
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        np.testing.assert_allclose(np.array(gp[name]), getattr(ref, f"{name}_l0").grad.numpy(), atol=ATOL,
                                   err_msg=name)


def test_recurrent_last_state_only(rng, device):
    x = seq(rng)
    full = mn.LSTM(4)
    a = full.compile(device, mn.Data(x)).array
    last = mn.LSTM(4, return_sequences=False)
    last.build_for((5, 6, 3), device=device)
    last.update(full.parameters())
    b = last.compile(device, mn.Data(x))
    assert tuple(b.dims) == (4, 1, 3)
    np.testing.assert_allclose(np.array(b.array[:, 0]), np.array(a[:, -1]), atol=ATOL)


def test_parallel_modes(rng, device):
    x = mx.array(rng.normal(size=(4, 6)).astype(np.float32))
    a, b = mn.Linear(3), mn.Linear(3)
    cat = mn.Parallel([a, b], combine="concat")
    y = cat.compile(device, mn.Data(x))
    assert tuple(y.dims) == (6, 1, 4)
    ya, yb = a(x, device=device), b(x, device=device)
    np.testing.assert_allclose(np.array(y.array[:, 0]), np.concatenate([np.array(ya), np.array(yb)], -1),
                               atol=ATOL)
    add = mn.Parallel([a, b], combine="add")
    np.testing.assert_allclose(np.array(add(x, device=device)), np.array(ya + yb), atol=ATOL)
    avg = mn.Parallel([a, b], combine="avg")
    np.testing.assert_allclose(np.array(avg(x, device=device)), np.array((ya + yb) / 2), atol=ATOL)
    moe = mn.Parallel([a, b], combine="filter")
    out = moe(x, device=device)
    gate = mx.softmax(moe.gate(x, device=device), -1)
    np.testing.assert_allclose(np.array(out), np.array(gate[:, :1] * ya + gate[:, 1:] * yb), atol=ATOL)
    assert "gate.weight" in moe.for_update()
    with pytest.raises(mn.ShapeError, match="branch 1"):
        mn.Parallel([mn.Linear(3), mn.Linear(4)], combine="add").compile(device, mn.Data(x))
    assert mn.Sequential is mn.Layers


def test_softmax_variants(rng, device):
    x = mx.array(rng.normal(size=(5, 8)).astype(np.float32))
    xt = torch.tensor(np.array(x))
    np.testing.assert_allclose(np.array(mn.Softmax()(x, device=device)), torch.softmax(xt, -1).numpy(), atol=1e-6)
    np.testing.assert_allclose(np.array(mn.Softmax("temperature", temperature=0.5)(x, device=device)),
                               torch.softmax(xt / 0.5, -1).numpy(), atol=1e-6)
    np.testing.assert_allclose(np.array(mn.Softmax("log")(x, device=device)), torch.log_softmax(xt, -1).numpy(), atol=1e-6)
    mask = np.array([True, False] * 4)
    p = np.array(mn.Softmax("masked", mask=mask)(x, device=device))
    masked_ref = torch.softmax(xt.masked_fill(~torch.tensor(mask), float("-inf")), -1).numpy()
    np.testing.assert_allclose(p, masked_ref, atol=1e-6)
    g = np.array(mn.Softmax("grid", groups=2)(x, device=device))
    np.testing.assert_allclose(g, torch.softmax(xt.view(5, 2, 4), -1).view(5, 8).numpy(), atol=1e-6)
    sm = np.array(mn.Softmax("sparsemax")(x * 3, device=device))
    np.testing.assert_allclose(sm.sum(-1), 1, atol=1e-5)
    assert (sm == 0).any() and (sm >= 0).all()
    # sparsemax of two values (a, b): p_a = clip((1 + a - b) / 2, 0, 1)
    two = np.array(mn.Softmax("sparsemax")(mx.array([[0.3, 0.0], [2.0, 0.0]]), device=device))
    np.testing.assert_allclose(two, [[0.65, 0.35], [1.0, 0.0]], atol=1e-6)
    # entmax: alpha -> 1 approaches softmax, alpha = 2 equals sparsemax
    np.testing.assert_allclose(np.array(entmax(x * 3, 2.0)), sm, atol=1e-4)
    np.testing.assert_allclose(np.array(entmax(x, 1.001)), torch.softmax(xt, -1).numpy(), atol=2e-3)
    gumbel = mn.Softmax("gumbel")
    gumbel.eval()
    np.testing.assert_allclose(np.array(gumbel(x, device=device)), torch.softmax(xt, -1).numpy(), atol=1e-6)
    gumbel.train()
    assert not np.allclose(np.array(gumbel(x, device=device)), torch.softmax(xt, -1).numpy(), atol=1e-3)
    with pytest.raises(ValueError, match="variant must be one of"):
        mn.Softmax("nope")


def test_kmeans(rng, device):
    centers = np.array([[0, 0], [5, 5], [-5, 5]], np.float32)
    pts = np.concatenate([c + 0.1 * rng.normal(size=(40, 2)) for c in centers]).astype(np.float32)
    km = mn.KMeans(3, temperature=0.1).fit(mx.array(pts), iterations=15)
    found = np.array(km.centroids)
    for c in centers:
        assert np.min(np.linalg.norm(found - c, axis=1)) < 0.1
    p = km.compile(device, mn.Data(mx.array(pts)))
    assert tuple(p.dims) == (3, 1, 120)
    # the soft assignment and its gradient in the centroids, against torch autograd of the formula
    # softmax(-||x - c||^2 / T); float32 distances of ~50 with T = 0.1: atol 1e-4
    x_t = torch.tensor(pts)
    c_t = torch.tensor(np.array(km.centroids), requires_grad=True)
    p_t = torch.softmax(-torch.cdist(x_t, c_t) ** 2 / 0.1, -1)
    np.testing.assert_allclose(np.array(p.array).reshape(120, 3), p_t.detach().numpy(), atol=1e-4)
    cot = np.random.default_rng(1).normal(size=(120, 3)).astype(np.float32)
    (p_t * torch.tensor(cot)).sum().backward()

    def loss(params):
        km.update(params)
        return (km.compile(device, mn.Data(mx.array(pts))).array.reshape(120, 3) * mx.array(cot)).sum()

    g = mx.grad(loss)(km.trainable_parameters())["centroids"]
    np.testing.assert_allclose(np.array(g), c_t.grad.numpy(), rtol=1e-3, atol=1e-3)
    # "features" replaces each row by its soft centroid p @ centroids
    feats = mn.KMeans(3, temperature=0.1, output="features")
    feats.compile(device, mn.Data(mx.array(pts)))
    feats.centroids = km.centroids
    y = feats.compile(device, mn.Data(mx.array(pts)))
    assert tuple(y.dims) == (2, 1, 120)
    np.testing.assert_allclose(np.array(y.array).reshape(120, 2), (p_t @ c_t).detach().numpy(), atol=1e-4)
