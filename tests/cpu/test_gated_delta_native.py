"""The native gated delta primitive (`metalnn.cpu.gated_delta`) against a float64 PyTorch recurrence.

The oracle is the per-token recurrence of transformers' ``torch_recurrent_gated_delta_rule``
written in float64 torch ops, differentiated by torch autograd; the loss is
``(o * do).sum() + (state * dstate).sum()`` so every output and input gradient is checked.
Lengths run across several of the primitive's 64-token checkpoint blocks (and end inside one).

Tolerance: every element within rtol 1e-4, atol 2e-5. q and k are unit vectors and the decay
``exp(g)`` is at most 1, so each element is a float32 sum of at most a few hundred terms of order 1
(rounding error ~1e-6); a wrong index, decay or sign gives errors of order 1e-1.

The main case runs on the AVX2 kernels and, with ``set_force_scalar``, on the portable ones.
"""

import mlx.core as mx
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from metalnn.cpu import gated_delta as native
from metalnn.cpu import native_ext

from native_platform import require_native  # noqa: E402


@pytest.fixture(autouse=True)
def _native():
    require_native(native.available())


@pytest.fixture(params=["simd", "portable"])
def kernel_path(request):
    """Runs a test on the AVX2 kernels (where the CPU has them) and on the portable ones."""
    ext = native_ext.extension()
    old = ext.get_force_scalar()
    ext.set_force_scalar(request.param == "portable")
    yield request.param
    ext.set_force_scalar(old)

RTOL, ATOL = 1e-4, 2e-5


def make_inputs(B, T, H, K, V, seed, decay=(0.0, 1.0)):
    gen = torch.Generator().manual_seed(seed)
    q = TF.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) * K ** -0.5
    k = TF.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    lo, hi = decay
    g = torch.log(lo + (hi - lo) * torch.rand(B, T, H, generator=gen)).clamp(min=-30.0)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    dstate = torch.randn(B, H, K, V, generator=gen)
    return [q, k, v, g, beta, h0], do, dstate


def recurrence64(q, k, v, g, beta, h0):
    """o [B, T, H, V] and the final state [B, H, K, V], float64, token by token."""
    S = h0
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        kv = (S * k[:, t, :, :, None]).sum(-2)
        S = S + k[:, t, :, :, None] * ((v[:, t] - kv) * beta[:, t, :, None])[..., None, :]
        outs.append((S * q[:, t, :, :, None]).sum(-2))
    o = torch.stack(outs, 1) if outs else torch.zeros(v.shape, dtype=v.dtype)
    return o, S


def torch_grads(inputs, do, dstate):
    leaves = [x.double().requires_grad_() for x in inputs]
    o, S = recurrence64(*leaves)
    ((o * do.double()).sum() + (S * dstate.double()).sum()).backward()
    return o.detach().numpy(), S.detach().numpy(), [x.grad.numpy() for x in leaves]


def native_grads(inputs, do, dstate, compile=False):
    arrays = [mx.array(x.numpy()) for x in inputs]
    do_m, ds_m = mx.array(do.numpy()), mx.array(dstate.numpy())

    def loss(*a):
        o, S = native.gated_delta(*a)
        return (o * do_m).sum() + (S * ds_m).sum(), (o, S)

    fn = mx.value_and_grad(loss, argnums=tuple(range(6)))
    if compile:
        fn = mx.compile(fn)
    (_, (o, S)), grads = fn(*arrays)
    return np.array(o), np.array(S), [np.array(x) for x in grads]


def check(ref, got):
    names = ["o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, a, b in zip(names, [ref[0], ref[1], *ref[2]], [got[0], got[1], *got[2]]):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("B,T,H,K,V", [(1, 1, 1, 8, 4), (2, 63, 3, 16, 8), (1, 64, 2, 32, 32),
                                       (2, 150, 2, 24, 40), (1, 200, 1, 64, 64)])
def test_forward_and_backward_match_float64_recurrence(kernel_path, B, T, H, K, V):
    inputs, do, dstate = make_inputs(B, T, H, K, V, seed=T + K)
    check(torch_grads(inputs, do, dstate), native_grads(inputs, do, dstate))


def test_slow_decay_and_extreme_values():
    """Decay close to 1 (the state keeps its history across blocks), decay 0 (g = -30, it forgets),
    beta 0 and 1."""
    inputs, do, dstate = make_inputs(1, 130, 2, 16, 16, seed=5, decay=(0.98, 1.0))
    inputs[3][0, 10] = -30.0
    inputs[4][0, 20] = 0.0
    inputs[4][0, 21] = 1.0
    check(torch_grads(inputs, do, dstate), native_grads(inputs, do, dstate))


def test_inside_compile_and_with_strided_inputs():
    inputs, do, dstate = make_inputs(2, 70, 2, 8, 8, seed=9)
    check(torch_grads(inputs, do, dstate), native_grads(inputs, do, dstate, compile=True))
    # a transposed view of q: the primitive reads any layout
    q = mx.array(inputs[0].numpy().transpose(0, 2, 1, 3).copy()).transpose(0, 2, 1, 3)
    rest = [mx.array(x.numpy()) for x in inputs[1:]]
    o, S = native.gated_delta(q, *rest)
    o_ref, S_ref = recurrence64(*(x.double() for x in inputs))
    np.testing.assert_allclose(np.array(o), o_ref.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.array(S), S_ref.numpy(), rtol=RTOL, atol=ATOL)


def test_empty_sequence_keeps_the_state():
    inputs, _, _ = make_inputs(1, 0, 2, 8, 4, seed=1)
    o, S = native.gated_delta(*(mx.array(x.numpy()) for x in inputs))
    assert o.shape == (1, 0, 2, 4)
    np.testing.assert_array_equal(np.array(S), inputs[5].numpy())


def test_errors_are_clear():
    inputs, _, _ = make_inputs(1, 4, 1, 8, 4, seed=2)
    a = [mx.array(x.numpy()) for x in inputs]
    with pytest.raises(ValueError, match="float32"):
        native.gated_delta(a[0].astype(mx.float16), *a[1:])
    with pytest.raises(ValueError, match="k must have q's shape"):
        native.gated_delta(a[0], a[1][..., :4], *a[2:])
    with pytest.raises(ValueError, match="h0 must be"):
        native.gated_delta(*a[:5], a[5][..., :2])
    with pytest.raises(ValueError, match="g and beta must be"):
        native.gated_delta(*a[:3], a[3][:, :2], *a[4:])

    def second(q):
        return mx.grad(lambda x: native.gated_delta(x, *a[1:])[0].sum())(q).sum()

    with pytest.raises(Exception, match="second derivatives"):
        mx.grad(second)(a[0])
