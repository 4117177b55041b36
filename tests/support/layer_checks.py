"""Checks of one layer against a PyTorch module computing the same function (float64 on the torch
side): the forward output and the gradients of the input and of every parameter, through a random
cotangent."""

import mlx.core as mx
import numpy as np
import torch
from mlx.utils import tree_flatten

import metalnn as mn


def rel_close(got, want, tol, name=""):
    """``got`` within ``tol`` of ``want``, relative to the largest ``|want|``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
    assert err < tol, f"{name}: max error {err:.3g} relative to max |ref|"


def assert_layer_matches_torch(layer, module, device, batch: int, length: int, width: int, tol: float, seed=None):
    """``layer`` (built for ``(width, length, batch)``, holding ``module``'s weights) on random
    ``[batch, length, width]`` inputs: its output, input gradient and the gradient of each parameter
    (named as ``module`` names them) within ``tol`` of ``module``'s in float64."""
    rng = np.random.default_rng(length if seed is None else seed)
    x = rng.normal(size=(batch, length, width)).astype(np.float32)
    cot = rng.normal(size=(batch, length, width)).astype(np.float32)

    out = layer.compile(device, mn.Data(mx.array(x)))
    assert tuple(out.dims) == (width, length, batch)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    yt = module(xt)
    rel_close(out.array, yt.detach().numpy(), tol, name="y")

    (yt * torch.tensor(cot, dtype=torch.float64)).sum().backward()

    def loss(params, x_):
        layer.update(params)
        return (layer.compile(device, mn.Data(x_)).array * mx.array(cot)).sum()

    gp, gx = mx.grad(loss, argnums=(0, 1))(layer.trainable_parameters(), mx.array(x))
    rel_close(gx, xt.grad.numpy(), tol, name="dx")
    ref_params = dict(module.named_parameters())
    assert len(tree_flatten(gp)) == len(ref_params)
    for name, g in tree_flatten(gp):
        rel_close(g, ref_params[name].grad.numpy(), tol, name=name)
