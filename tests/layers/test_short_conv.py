"""`ShortConv` (LFM2's gated short convolution) against a PyTorch reference written from its formula,
and its `ShortConvCache`: decoding in pieces equals one pass, rows stack and split.

The reference is transformers' ``Lfm2ShortConv`` without a cache, rewritten in torch: ``B, C, x =
in_proj(x).chunk(3)``, a depthwise ``conv1d`` of ``B * x`` padded by ``L - 1`` and cut to the input
length, ``out_proj(C * conv)``.

Tolerances: 1e-5 relative plus 1e-5 absolute (outputs reach O(10); float32 on both sides, the same
products summed in another order) for the torch formula, for decoding in pieces against one pass (the
same ops on other shapes) and for the emulated Metal kernels against the reference path; their input
gradients 1e-5 relative to the largest entry.
"""

import mlx.core as mx
import numpy as np
import pytest
import torch

import metalnn as mn
from metalnn.layers import ShortConv, ShortConvCache
from metalnn.layers.batch_cache import keep_rows, merge_rows

TOL = 1e-5
C = 12


def built(kernel, bias, seed=0):
    mx.random.seed(seed)
    layer = ShortConv(kernel, bias=bias)
    layer(mx.zeros((1, 1, C)))  # builds the parameters
    rng = np.random.default_rng(seed)
    params = {k: mx.array(rng.normal(scale=0.5, size=v.shape).astype(np.float32))
              for k, v in layer.named_parameters().items()}
    layer.load_weights(list(params.items()))
    return layer


def torch_reference(layer, x):
    """The formula of transformers' ``Lfm2ShortConv`` (no cache) in torch, on ``layer``'s parameters."""
    p = {k: torch.tensor(np.array(v)) for k, v in layer.named_parameters().items()}
    x = torch.tensor(np.array(x))
    t = x.shape[1]
    bcx = torch.nn.functional.linear(x, p["in_proj.weight"], p.get("in_proj.bias")).transpose(-1, -2)
    b, c, h = bcx.chunk(3, dim=-2)
    kernel = p["conv.weight"]                                                     # [C, 1, L]
    y = torch.nn.functional.conv1d(b * h, kernel, p.get("conv.bias"), padding=kernel.shape[-1] - 1,
                                   groups=kernel.shape[0])[..., :t]
    y = (c * y).transpose(-1, -2)
    return torch.nn.functional.linear(y, p["out_proj.weight"], p.get("out_proj.bias")).numpy()


@pytest.mark.parametrize("kernel, bias", [(3, True), (4, False), (1, True)])
def test_matches_the_torch_formula(kernel, bias):
    layer = built(kernel, bias)
    assert layer.conv.weight.shape == (C, 1, kernel) and ("bias" in layer.in_proj) is bias
    x = mx.array(np.random.default_rng(1).normal(size=(2, 9, C)).astype(np.float32))
    np.testing.assert_allclose(np.array(layer(x)), torch_reference(layer, x), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kernel", [3, 4])
def test_decoding_in_pieces_equals_one_pass(kernel):
    layer = built(kernel, True, seed=2)
    x = mx.array(np.random.default_rng(3).normal(size=(2, 10, C)).astype(np.float32))
    full = np.array(layer(x))
    cache = ShortConvCache()
    pieces = [np.array(layer(x[:, a:b], cache=cache)) for a, b in ((0, 1), (1, 5), (5, 6), (6, 10))]
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=TOL, atol=TOL)
    assert cache.offset == 10 and cache.conv_state.shape == (2, kernel - 1, C)


def test_rows_merge_and_split_through_the_batch_caches():
    """Two sequences decoded alone, then their states stacked (`merge_rows`) and decoded together,
    give each sequence's own outputs; `keep_rows` keeps one of them."""
    layer = built(3, True, seed=4)
    rng = np.random.default_rng(5)
    a, b = (mx.array(rng.normal(size=(1, n, C)).astype(np.float32)) for n in (5, 2))
    nxt = mx.array(rng.normal(size=(2, 1, C)).astype(np.float32))
    ca, cb = ShortConvCache(), ShortConvCache()
    layer(a, cache=ca), layer(b, cache=cb)
    merged = merge_rows([[ca.copy()], [cb.copy()]])[0]
    together = np.array(layer(nxt, cache=merged))
    alone = [np.array(layer(nxt[i:i + 1], cache=c)) for i, c in enumerate((ca, cb))]
    np.testing.assert_allclose(together, np.concatenate(alone), rtol=TOL, atol=TOL)
    kept = keep_rows([merged], [1])[0]
    np.testing.assert_array_equal(np.array(kept.conv_state), np.array(cb.conv_state))


def test_emulated_kernels_give_the_reference_outputs_and_gradients(monkeypatch):
    from kernel_cases import spy_launches

    launches = spy_launches(monkeypatch)
    layer = built(3, True, seed=6)
    x = mx.array(np.random.default_rng(7).normal(size=(2, 6, C)).astype(np.float32))
    ref, emu = mn.Device(kernels="reference"), mn.Device(kernels="emulate")
    np.testing.assert_allclose(np.array(layer(x, device=emu)), np.array(layer(x, device=ref)), rtol=TOL, atol=TOL)

    def loss(dev):
        return mx.grad(lambda z: (layer(z, device=dev) ** 2).sum())(x)

    g_emu, g_ref = np.array(loss(emu)), np.array(loss(ref))
    assert np.abs(g_emu - g_ref).max() < TOL * np.abs(g_ref).max()
    assert {"conv2d_forward", "conv2d_dgrad"} <= launches.names()  # the convolution ran as Metal kernels


def test_bad_kernel_size_is_refused():
    with pytest.raises(ValueError, match="kernel_size must be a positive int, got 0"):
        ShortConv(0)
