"""MLP / SwiGLU / GPT2MLP against torch equivalents with the same weights, and MLP.flop_count.

Tolerance: float32, hidden widths <= 48: 1e-5 absolute and relative.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch

import metalnn as mn
from metalnn.llm.models.gpt2 import GPT2MLP

ACTS = {
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
    "gelu_approx": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "sigmoid": torch.sigmoid,
}
GATES = {"swiglu": "silu", "glu": "sigmoid", "geglu": "gelu"}


def torch_mlp(x, p, activation, bias):
    def lin(name, h):
        return h @ p[f"{name}.weight"].T + (p[f"{name}.bias"] if bias else 0)

    if activation in GATES:
        h = ACTS[GATES[activation]](lin("gate_proj", x)) * lin("up_proj", x)
    else:
        h = ACTS[activation](lin("up_proj", x))
    return lin("down_proj", h)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_approx", "silu", "glu", "swiglu", "geglu"])
@pytest.mark.parametrize("bias", [False, True])
def test_mlp_matches_torch(activation, bias, device):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 12)).astype(np.float32)
    gated = activation in GATES
    mlp = mn.MLP(12, activation=activation, expansion_factor=4 / 3 if gated else 2.0, bias=bias)
    out = mlp.compile(device, mn.Data(mx.array(x))).array
    hidden = 16 if gated else 24
    assert mlp.hidden_dims == hidden and mlp.is_gated == gated
    assert mlp.up_proj.weight.shape == (hidden, 12) and mlp.down_proj.weight.shape == (12, hidden)
    assert ("gate_proj" in mlp) == gated
    params = {k: torch.tensor(np.array(v), requires_grad=True) for k, v in mlp.for_update().items()}
    xt = torch.tensor(x, requires_grad=True)
    ref = torch_mlp(xt, params, activation, bias)
    np.testing.assert_allclose(np.array(out), ref.detach().numpy(), atol=1e-5, rtol=1e-5)
    gx = mx.grad(lambda a: mlp.compile(device, mn.Data(a)).array.sum())(mx.array(x))
    ref.sum().backward()
    np.testing.assert_allclose(np.array(gx), xt.grad.numpy(), atol=1e-5, rtol=1e-5)


def test_swiglu_is_the_gated_mlp(device):
    """SwiGLU, MLP("swiglu") and a Llama MLP are one layer with Hugging Face's names."""
    a = mn.SwiGLU(24)
    b = mn.MLP(activation="swiglu", hidden_dims=24)
    assert isinstance(a, mn.MLP)
    x = mx.array(np.random.default_rng(1).standard_normal((3, 4, 16)).astype(np.float32))
    a.compile(device, mn.Data(x))
    b.compile(device, mn.Data(x))
    assert set(a.for_update()) == set(b.for_update()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    b.update(a.parameters())
    np.testing.assert_array_equal(np.array(a(x, device=device)), np.array(b(x, device=device)))
    with pytest.raises(ValueError, match="gate activation"):
        mn.SwiGLU(8, activation="tanh")


def test_default_init_is_mlx_nn_like():
    # as mlx.nn.Linear: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias
    mlp = mn.MLP(64, activation="relu", expansion_factor=4.0, bias=True)
    for w, fan_in in ((mlp.up_proj.weight, 64), (mlp.up_proj.bias, 64), (mlp.down_proj.weight, 256)):
        w = np.array(w)
        bound = 1 / math.sqrt(fan_in)
        # 256+ uniform draws: the extremes come within 10% of the bound, the std is bound/sqrt(3) +- 15%
        assert np.abs(w).max() <= bound + 1e-6 and np.abs(w).max() > 0.9 * bound
        assert abs(w.std() - bound / math.sqrt(3)) < 0.15 * bound / math.sqrt(3)
    mlp2 = mn.MLP(8, activation="gelu", init="zeros", init_out=nn.init.constant(0.5))
    assert float(mx.abs(mlp2.up_proj.weight).sum()) == 0 and float(mlp2.down_proj.weight[0, 0]) == 0.5


def test_mlp_dropout_only_in_training_mode(device):
    x = mx.ones((2, 4, 8))
    mlp = mn.MLP(8, activation="relu", dropout=0.5, init="ones", init_out="ones")
    mlp.eval()
    a = mlp.compile(device, mn.Data(x)).array
    b = mlp.compile(device, mn.Data(x)).array
    np.testing.assert_array_equal(np.array(a), np.array(b))
    mlp.train()
    c = mlp.compile(device, mn.Data(x)).array
    assert not np.allclose(np.array(c), np.array(a))


@pytest.mark.parametrize("activation,expected", [
    # 2*T*C*H + T*H + 2*T*H*C with C=8, H=16, T=10
    ("relu", 2 * 10 * 8 * 16 + 10 * 16 + 2 * 10 * 16 * 8),
    # gate and up projections C -> H each; activation and gate product count 1 each per hidden element
    ("swiglu", 2 * 10 * 8 * 32 + 2 * 10 * 16 + 2 * 10 * 16 * 8),
    ("glu", 2 * 10 * 8 * 32 + 2 * 10 * 16 + 2 * 10 * 16 * 8),
])
def test_mlp_flop_count(activation, expected):
    assert mn.MLP(8, activation=activation, expansion_factor=2.0).flop_count(10) == expected


def test_mlp_errors(device):
    with pytest.raises(ValueError, match="unknown activation 'tanhh'"):
        mn.MLP(8, activation="tanhh")
    mlp = mn.MLP(8)
    with pytest.raises(mn.ShapeError, match="MLP"):
        mlp.compile(device, mn.Data(mx.zeros((1, 2, 6))))
    with pytest.raises(ValueError, match="width is not known"):
        mn.MLP().flop_count(3)


def test_gpt2_mlp_matches_torch(device):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    xt = torch.tensor(x)
    mlp = GPT2MLP(32)
    out = mlp.compile(device, mn.Data(mx.array(x))).array
    p = {k: torch.tensor(np.array(v)) for k, v in mlp.for_update().items()}
    h = torch.nn.functional.gelu(xt @ p["c_fc.weight"].T + p["c_fc.bias"], approximate="tanh")
    np.testing.assert_allclose(np.array(out), (h @ p["c_proj.weight"].T + p["c_proj.bias"]).numpy(), atol=1e-5,
                               rtol=1e-5)
