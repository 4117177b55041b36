"""The native causal attention (`metalnn.cpu.attention`) against PyTorch's
``scaled_dot_product_attention`` (``is_causal=True``, float64, autograd), forward and backward.

Shapes cover each compiled head_dim (32, 64, 128), grouped-query heads (rep 1, 2, 3), lengths that
are not a multiple of the 4-row / 16-key blocks (1, 5, 37, 70, 130), batch > 1 and the transposed
view of split heads as input.

Tolerance: every element within rtol 1e-4, atol 1e-5. Each output is a float32 softmax-weighted
mean of at most 130 values of order 1 and each gradient a sum of as many products, so the rounding
error is ~1e-6; a wrong mask, scale or head mapping gives errors of order 1e-1.

The main case runs on the AVX2 kernels and, with ``set_force_scalar``, on the portable ones.
"""

import mlx.core as mx
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from metalnn.cpu import attention as native
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

RTOL, ATOL = 1e-4, 1e-5


def make(B, Hq, Hkv, T, D, seed):
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, Hq, T, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, Hkv, T, D, generator=gen) for _ in range(2))
    return q, k, v, do


def torch_ref(q, k, v, do, scale):
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    rep = q.shape[1] // k.shape[1]
    kk, vv = (x.repeat_interleave(rep, 1) for x in leaves[1:])
    o = TF.scaled_dot_product_attention(leaves[0], kk, vv, is_causal=True, scale=scale)
    (o * do.double()).sum().backward()
    return o.detach().numpy(), [x.grad.numpy() for x in leaves]


def native_run(q, k, v, do, scale, transposed=False, compile=False):
    if transposed:  # the [B, T, H, D] memory of split heads, seen as [B, H, T, D]
        q, k, v = (mx.array(x.numpy().transpose(0, 2, 1, 3).copy()).transpose(0, 2, 1, 3) for x in (q, k, v))
    else:
        q, k, v = (mx.array(x.numpy()) for x in (q, k, v))
    do_m = mx.array(do.numpy())

    def loss(q, k, v):
        o = native.causal_attention(q, k, v, scale)
        return (o * do_m).sum(), o

    fn = mx.value_and_grad(loss, argnums=(0, 1, 2))
    if compile:
        fn = mx.compile(fn)
    (_, o), grads = fn(q, k, v)
    return np.array(o), [np.array(g) for g in grads]


@pytest.mark.parametrize("B,Hq,Hkv,T,D", [(1, 1, 1, 1, 32), (2, 4, 2, 37, 32), (1, 3, 1, 70, 64),
                                          (2, 2, 2, 5, 128), (1, 6, 2, 130, 32)])
def test_matches_torch_forward_and_backward(kernel_path, B, Hq, Hkv, T, D):
    q, k, v, do = make(B, Hq, Hkv, T, D, seed=T + D)
    scale = D ** -0.5
    o_ref, g_ref = torch_ref(q, k, v, do, scale)
    o, g = native_run(q, k, v, do, scale)
    np.testing.assert_allclose(o, o_ref, rtol=RTOL, atol=ATOL, err_msg="o")
    for name, a, b in zip(("dq", "dk", "dv"), g_ref, g):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL, err_msg=name)


def test_transposed_inputs_compile_and_other_scale():
    q, k, v, do = make(2, 4, 2, 45, 64, seed=3)
    o_ref, g_ref = torch_ref(q, k, v, do, 0.3)
    o, g = native_run(q, k, v, do, 0.3, transposed=True, compile=True)
    np.testing.assert_allclose(o, o_ref, rtol=RTOL, atol=ATOL)
    for a, b in zip(g_ref, g):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL)


def test_supports_and_errors():
    q = mx.zeros((1, 2, 8, 32))
    k = mx.zeros((1, 1, 8, 32))
    assert native.supports(q, k, k)
    assert not native.supports(q[..., :16], k[..., :16], k[..., :16])       # head_dim 16
    assert not native.supports(q, k[:, :, :4], k[:, :, :4])                 # keys of another length
    assert not native.supports(q.astype(mx.float16), k, k)
    assert not native.supports(mx.zeros((1, 3, 8, 32)), mx.zeros((1, 2, 8, 32)), mx.zeros((1, 2, 8, 32)))
    with pytest.raises(ValueError, match="head_dim in"):
        native.causal_attention(q[..., :16], k[..., :16], k[..., :16], 1.0)

    def second(x):
        return mx.grad(lambda y: native.causal_attention(y, k, k, 1.0).sum())(x).sum()

    with pytest.raises(Exception, match="second derivatives"):
        mx.grad(second)(q)
