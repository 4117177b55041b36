"""Each core layer's forward and gradients against its torch.nn equivalent (weights copied across).

Tolerance: float32 throughout; outputs and gradients are sums of at most a few hundred products,
so 1e-5 absolute + 1e-5 relative covers the rounding of two independent fp32 implementations.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch

import metalnn as mn

ATOL = RTOL = 1e-5


def t(a):
    return torch.tensor(np.array(a), requires_grad=True)


def check_layer(layer, torch_fn, x, device, params_to_torch=None, atol=ATOL):
    """Compare forward, input gradient and parameter gradients of ``layer`` with ``torch_fn``.

    torch_fn(x_t, params_t) -> output; params_to_torch maps metalnn names to torch tensors
    (created from the metalnn values after the first compile).
    """
    out = layer.compile(device, mn.Data(x)).array
    cot = mx.array(np.random.default_rng(1).normal(size=out.shape).astype(np.float32))
    params = layer.for_update()
    tparams = {k: t(v) for k, v in params.items()}
    xt = t(x)
    ref = torch_fn(xt, tparams)
    np.testing.assert_allclose(np.array(out), ref.detach().numpy().reshape(out.shape), atol=atol, rtol=RTOL)

    def f(p, x_):
        layer.update(p)
        return (layer.compile(device, mn.Data(x_)).array * cot).sum()

    import mlx.utils as mu

    gp, gx = mx.grad(f, argnums=(0, 1))(mu.tree_unflatten(list(params.items())), x)
    (ref.reshape(out.shape) * torch.tensor(np.array(cot))).sum().backward()
    np.testing.assert_allclose(np.array(gx), xt.grad.numpy(), atol=atol, rtol=RTOL)
    for name, g in mu.tree_flatten(gp):
        np.testing.assert_allclose(np.array(g), tparams[name].grad.numpy(), atol=atol, rtol=RTOL, err_msg=name)
    return out


@pytest.fixture
def x(rng):
    return mx.array(rng.normal(size=(2, 5, 12)).astype(np.float32))


@pytest.mark.parametrize("bias", [True, False])
def test_linear(x, device, bias):
    layer = mn.Linear(7, bias=bias)
    out = check_layer(layer, lambda xt, p: torch.nn.functional.linear(xt, p["weight"], p.get("bias")), x, device)
    assert layer.weight.shape == (7, 12)
    assert tuple(mn.Data(out).dims) == (7, 5, 2)
    assert ("bias" in layer.for_update()) == bias


def test_linear_with_weights_follows_owner(x, device):
    owner = {"w": mx.array(np.random.default_rng(2).normal(size=(4, 12)).astype(np.float32))}
    layer = mn.LinearWithWeights(lambda: owner["w"])
    out = layer.compile(device, mn.Data(x)).array
    np.testing.assert_allclose(np.array(out), np.array(x) @ np.array(owner["w"]).T, atol=ATOL)
    assert layer.for_update() == {}
    # the owner's weight changes (as an optimizer step rebinds it): the layer uses the new one
    owner["w"] = owner["w"] * 2 + 1
    out = layer.compile(device, mn.Data(x)).array
    np.testing.assert_allclose(np.array(out), np.array(x) @ np.array(owner["w"]).T, atol=ATOL)


def test_mulrows(x, device):
    layer = mn.MulRows()
    layer.compile(device, mn.Data(x))
    layer.weight = mx.arange(12, dtype=mx.float32) / 7
    check_layer(layer, lambda xt, p: xt * p["weight"], x, device)


@pytest.mark.parametrize("layer,fn", [
    (mn.ReLU(), torch.relu),
    (mn.SiLU(), torch.nn.functional.silu),
    (mn.GELU(approx="tanh"), lambda v: torch.nn.functional.gelu(v, approximate="tanh")),
    (mn.GELU(), lambda v: torch.nn.functional.gelu(v)),
    (mn.GELU(approx="fast"), lambda v: v * torch.sigmoid(1.702 * v)),
    (mn.Activation("relu2"), lambda v: torch.relu(v) ** 2),
    (mn.Tanh(), torch.tanh),
    (mn.Sigmoid(), torch.sigmoid),
    (mn.LeakyReLU(0.2), lambda v: torch.nn.functional.leaky_relu(v, 0.2)),
])
def test_activations(layer, fn, x, device):
    check_layer(layer, lambda xt, p: fn(xt), x, device)


@pytest.mark.parametrize("affine", [True, False])
def test_rmsnorm(x, device, affine):
    layer = mn.RMSNorm(eps=1e-5, affine=affine)
    layer.compile(device, mn.Data(x))
    if affine:
        layer.weight = mx.linspace(0.5, 1.5, 12)
    check_layer(layer, lambda xt, p: torch.nn.functional.rms_norm(xt, (12,), p.get("weight"), eps=1e-5), x, device)


def test_layernorm(x, device):
    layer = mn.LayerNorm(eps=1e-5)
    layer.compile(device, mn.Data(x))
    layer.weight = mx.linspace(0.5, 1.5, 12)
    layer.bias = mx.linspace(-1, 1, 12)
    check_layer(layer, lambda xt, p: torch.nn.functional.layer_norm(xt, (12,), p["weight"], p["bias"], 1e-5),
                x, device)


def test_swiglu(x, device):
    layer = mn.SwiGLU(16)
    out = check_layer(layer, lambda xt, p: torch.nn.functional.linear(
        torch.nn.functional.silu(torch.nn.functional.linear(xt, p["gate_proj.weight"]))
        * torch.nn.functional.linear(xt, p["up_proj.weight"]), p["down_proj.weight"]), x, device)
    assert out.shape == x.shape
    assert sorted(layer.for_update()) == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]


def test_residual_and_chain(x, device):
    layer = mn.Residual([mn.Linear(12), mn.Tanh()])
    check_layer(layer, lambda xt, p: xt + torch.tanh(torch.nn.functional.linear(
        xt, p["inner.layers.0.weight"], p["inner.layers.0.bias"])), x, device)


def test_residual_dims_mismatch_is_reported(x, device):
    layer = mn.Residual([mn.Linear(5)])
    with pytest.raises(mn.ShapeError, match=r"Residual.*inner output dims"):
        layer.compile(device, mn.Data(x))


def test_embeddings(device):
    ids = mx.array([[1, 4, 4, 0], [9, 2, 3, 3]])
    layer = mn.Embedding(10, 6)
    out = layer.compile(device, mn.Data(ids))
    assert tuple(out.dims) == (6, 4, 2)
    table = np.array(layer.weight)
    np.testing.assert_array_equal(np.array(out.array), table[np.array(ids)])
    emb = torch.nn.Embedding(10, 6)
    emb.weight.data = torch.tensor(table)
    cot = np.random.default_rng(0).normal(size=(2, 4, 6)).astype(np.float32)
    (emb(torch.tensor(np.array(ids))) * torch.tensor(cot)).sum().backward()

    def f(p):
        layer.update(p)
        return (layer.compile(device, mn.Data(ids)).array * mx.array(cot)).sum()

    g = mx.grad(f)({"weight": layer.weight})["weight"]
    np.testing.assert_allclose(np.array(g), emb.weight.grad.numpy(), atol=ATOL)
    # float ids holding integers (seed convention) work too
    out2 = layer.compile(device, mn.Data(ids.astype(mx.float32)))
    np.testing.assert_array_equal(np.array(out2.array), np.array(out.array))


def test_reshape_and_flatten(device):
    x = mx.arange(24, dtype=mx.float32).reshape(2, 3, 4)
    out = mn.Reshape((6, -1, 2)).compile(device, mn.Data(x))
    assert tuple(out.dims) == (6, 2, 2)
    np.testing.assert_array_equal(np.array(out.array).ravel(), np.arange(24))
    with pytest.raises(mn.ShapeError, match="Reshape"):
        mn.Reshape((5, 5, 1)).compile(device, mn.Data(x))
    g = mx.grad(lambda v: (mn.Reshape((12, 2, 1)).compile(device, mn.Data(v)).array * 2).sum())(x)
    np.testing.assert_array_equal(np.array(g), np.full((2, 3, 4), 2.0))
    flat = mn.Flatten(channels=2).compile(device, mn.Data(mx.zeros((4, 3, 5))))
    assert tuple(flat.dims) == (30, 1, 2)


def test_dropout_train_vs_eval(device):
    x = mx.ones((4, 50, 40))
    layer = mn.Dropout(0.25)
    layer.eval()
    np.testing.assert_array_equal(np.array(layer.compile(device, mn.Data(x)).array), np.array(x))
    layer.train()
    y = np.array(layer.compile(device, mn.Data(x)).array)
    kept = y != 0
    assert abs(kept.mean() - 0.75) < 0.02, kept.mean()          # 8000 draws: 4.5 sigma is ~0.022
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)    # inverted dropout scaling
    y2 = np.array(layer.compile(device, mn.Data(x)).array)
    assert (y2 != y).any()                                      # a fresh mask each call
    g = np.array(mx.grad(lambda v: layer.compile(device, mn.Data(v)).array.sum())(x))
    assert set(np.unique(g)) <= {0.0, np.float32(1 / 0.75)}
    # same device seed, same mask
    a, b = mn.Device(seed=5), mn.Device(seed=5)
    np.testing.assert_array_equal(np.array(layer.compile(a, mn.Data(x)).array),
                                  np.array(layer.compile(b, mn.Data(x)).array))


def test_shape_error_names_layer_path_and_dims(device):
    model = mn.Layers([mn.Linear(8), mn.ReLU(), mn.Residual([mn.Linear(8)])])
    model.compile(device, mn.Data(mx.zeros((3, 4))))
    with pytest.raises(mn.ShapeError) as e:
        model.compile(device, mn.Data(mx.zeros((3, 5))))
    assert e.value.layer == "layers.0 (Linear)"
    assert "W=4" in str(e.value) and "W=5" in str(e.value)
    # rows and batch may change freely
    out = model.compile(device, mn.Data(mx.zeros((2, 9, 4))))
    assert tuple(out.dims) == (8, 9, 2)


def test_nested_paths_in_errors(device):
    inner = mn.Linear(8)
    model = mn.Layers([mn.Linear(8), mn.Residual([inner])])
    model.compile(device, mn.Data(mx.zeros((3, 4))))
    inner.weight = mx.zeros((8, 3))
    inner._built_dims = mn.MTLSize(3)
    with pytest.raises(mn.ShapeError, match=r"layers\.1\.inner\.layers\.0 \(Linear\)"):
        model.compile(device, mn.Data(mx.zeros((3, 4))))


def test_for_update_names_and_mlx_interop(device):
    model = mn.Layers([mn.Linear(8), mn.ReLU(), mn.Linear(3, bias=False)])
    model.compile(device, mn.Data(mx.zeros((2, 4))))
    assert sorted(model.for_update()) == ["layers.0.bias", "layers.0.weight", "layers.2.weight"]
    assert isinstance(model, nn.Module)
    assert model.num_parameters() == 8 * 4 + 8 + 3 * 8
    model.freeze(keys=["bias"])
    assert "layers.0.bias" not in model.for_update()


def test_plain_call_keeps_leading_shape(device):
    model = mn.Layers([mn.Linear(3)])
    assert model(mx.zeros((5, 4)), device=device).shape == (5, 3)
    assert model(mx.zeros((2, 5, 4)), device=device).shape == (2, 5, 3)
    assert model(mx.zeros((4,)), device=device).shape == (3,)
    assert model(mx.zeros((2, 1, 4)), device=device).shape == (2, 1, 3)  # a length-1 sequence stays one


def test_same_seed_same_model():
    def make(seed):
        m = mn.Layers([mn.Linear(8), mn.Linear(2)])
        m.compile(mn.Device(seed=seed), mn.Data(mx.zeros((1, 4))))
        return {k: np.array(v) for k, v in m.for_update().items()}

    a, b, c = make(1), make(1), make(2)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["layers.0.weight"], c["layers.0.weight"])
