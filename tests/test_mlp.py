"""MLP / SwiGluFfn / GPT2MLP against torch equivalents with the same weights, and MLP.flop_count."""

import math

import mlx.core as mx
import numpy as np
import pytest
import torch

import metalnn as mn

ACTS = {
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu,
}


def torch_mlp(x, p, activation, bias):
    h = x @ p["layer1.weight"].T + (p["layer1.bias"] if bias else 0)
    if activation in ("glu", "swiglu"):
        a, b = h.chunk(2, dim=-1)
        h = (torch.sigmoid(a) if activation == "glu" else torch.nn.functional.silu(a)) * b
    else:
        h = ACTS[activation](h)
    return h @ p["layer2.weight"].T + (p["layer2.bias"] if bias else 0)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "glu", "swiglu"])
@pytest.mark.parametrize("bias", [False, True])
def test_mlp_matches_torch(activation, bias, device):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 12)).astype(np.float32)
    mlp = mn.MLP(12, activation, expansion_factor=4 / 3 if activation in ("glu", "swiglu") else 2.0, bias=bias)
    out = mlp.compile(device, mn.Data(mx.array(x))).array
    hidden = 16 if activation in ("glu", "swiglu") else 24
    assert mlp.hidden_dim == hidden
    assert mlp.layer1.weight.shape == ((2 if mlp.is_glu_variant else 1) * hidden, 12)
    assert mlp.layer2.weight.shape == (12, hidden)
    params = {k: torch.tensor(np.array(v), requires_grad=True) for k, v in mlp.for_update().items()}
    if bias:  # non-zero biases so they are exercised
        mlp.update({"layer1": {"bias": mx.ones(mlp.layer1.bias.shape) * 0.1}})
        params["layer1.bias"] = torch.full(tuple(mlp.layer1.bias.shape), 0.1, requires_grad=True)
        out = mlp.compile(device, mn.Data(mx.array(x))).array
    xt = torch.tensor(x, requires_grad=True)
    ref = torch_mlp(xt, params, activation, bias)
    np.testing.assert_allclose(np.array(out), ref.detach().numpy(), atol=1e-5, rtol=1e-5)
    gx = mx.grad(lambda a: mlp.compile(device, mn.Data(a)).array.sum())(mx.array(x))
    ref.sum().backward()
    np.testing.assert_allclose(np.array(gx), xt.grad.numpy(), atol=1e-5, rtol=1e-5)


def test_mlp_default_init_is_torch_like(device):
    mlp = mn.MLP(64, "relu", expansion_factor=4.0)
    mlp.compile(device, mn.Data(mx.zeros((1, 1, 64))))
    w = np.array(mlp.layer1.weight)
    assert np.abs(w).max() <= 1 / math.sqrt(64) + 1e-6 and w.std() > 0.5 / math.sqrt(3 * 64)
    mlp2 = mn.MLP(8, "gelu", init_method_in="zeros", init_method_out=mn.init.Constant(0.5))
    mlp2.compile(device, mn.Data(mx.zeros((1, 1, 8))))
    assert float(mx.abs(mlp2.layer1.weight).sum()) == 0 and float(mlp2.layer2.weight[0, 0]) == 0.5


def test_mlp_dropout_only_while_training(device):
    x = mx.ones((2, 4, 8))
    mlp = mn.MLP(8, "relu", dropout=0.5, init_method_in="ones", init_method_out="ones")
    a = mlp.compile(device, mn.Data(x)).array
    b = mlp.compile(device, mn.Data(x)).array
    np.testing.assert_array_equal(np.array(a), np.array(b))
    device.train()
    c = mlp.compile(device, mn.Data(x)).array
    assert not np.allclose(np.array(c), np.array(a))


@pytest.mark.parametrize("activation,expected", [
    # 2*T*C*H + T*H + 2*T*H*C with C=8, H=16, T=10
    ("relu", 2 * 10 * 8 * 16 + 10 * 16 + 2 * 10 * 16 * 8),
    # layer1 is C -> 2H; activation and gate product count 1 each per hidden element
    ("swiglu", 2 * 10 * 8 * 32 + 2 * 10 * 16 + 2 * 10 * 16 * 8),
    ("glu", 2 * 10 * 8 * 32 + 2 * 10 * 16 + 2 * 10 * 16 * 8),
])
def test_mlp_flop_count(activation, expected):
    assert mn.MLP(8, activation, expansion_factor=2.0).flop_count(10) == expected


def test_mlp_errors(device):
    with pytest.raises(ValueError, match="activation"):
        mn.MLP(8, "tanhh")
    mlp = mn.MLP(8)
    with pytest.raises(mn.ShapeError, match="MLP"):
        mlp.compile(device, mn.Data(mx.zeros((1, 2, 6))))


def test_swiglu_ffn_and_gpt2_mlp_match_torch(device):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    ffn = mn.SwiGluFfn(24)
    out = ffn.compile(device, mn.Data(mx.array(x))).array
    p = {k: torch.tensor(np.array(v)) for k, v in ffn.for_update().items()}
    assert set(p) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    xt = torch.tensor(x)
    ref = (torch.nn.functional.silu(xt @ p["gate_proj.weight"].T) * (xt @ p["up_proj.weight"].T)) @ \
        p["down_proj.weight"].T
    np.testing.assert_allclose(np.array(out), ref.numpy(), atol=1e-5, rtol=1e-5)
    assert ffn.flop_count(4) == 2 * 4 * 16 * 48 + 2 * 4 * 24 + 2 * 4 * 24 * 16

    mlp = mn.GPT2MLP(32)
    out = mlp.compile(device, mn.Data(mx.array(x))).array
    p = {k: torch.tensor(np.array(v)) for k, v in mlp.for_update().items()}
    h = torch.nn.functional.gelu(xt @ p["c_fc.weight"].T + p["c_fc.bias"], approximate="tanh")
    np.testing.assert_allclose(np.array(out), (h @ p["c_proj.weight"].T + p["c_proj.bias"]).numpy(), atol=1e-5,
                               rtol=1e-5)
