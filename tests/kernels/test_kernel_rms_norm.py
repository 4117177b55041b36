"""F.rms_norm on each implementation: the emulated Metal kernels, "auto" (mx.fast.rms_norm) and
the plain-MLX reference.

Oracles: the kernels are compared with the reference computed in float32 on the very values they
see (x, w and the cotangent rounded to the test dtype); the reference with ``mx.fast.rms_norm``
(an independent implementation); "auto" must be ``mx.fast.rms_norm`` itself (bit for bit), or for float32 on the CPU backend
`metalnn.cpu.fused.rms_norm` (see test_fused.py).

Tolerances: the kernels accumulate in float32 and round each output once to the dtype (y: two
roundings, ``T(w) * T(x * r)``, as MLX does), so a float16/bfloat16 result is within 1 ulp of the
float32 value: rtol = 2 ulps (2^-9 for float16, 2^-6 for bfloat16) leaves room for the float32
reduction order. Absolute 1e-4 covers float32 sums in another order (rows of up to 4096 terms of
order 1: ~sqrt(4096) * 6e-8 = 4e-6 typical). float32 uses 1e-4 (`kernel_cases.TOL`). A wrong
index or a missing row changes values by O(1e-1) at least.
"""

import mlx.core as mx
import numpy as np
import pytest

import metalnn as mn
from metalnn import functional as F
from metalnn.cpu import fused

from kernel_cases import DTYPES, RMS_NORM_SHAPES as SHAPES, close, emulate, f32, random, reference, spy_launches

RTOL = {mx.float32: 1e-4, mx.float16: 2 ** -9, mx.bfloat16: 2 ** -6}
KERNELS = {"rms_norm_forward", "rms_norm_backward_dx", "rms_norm_backward_dw"}


def value_and_grads(fn, x, w, cot):
    def loss(x, w):
        return (fn(x, w).astype(mx.float32) * cot).sum()

    return (fn(x, w), *mx.grad(loss, argnums=(0, 1))(x, w))


def inputs(shape, dtype):
    x = random(shape, dtype, 1)
    w = (random(shape[-1:], mx.float32, 2) * 0.3 + 1).astype(dtype)
    # The cotangent reaching the op is rounded to the dtype: give the oracle the rounded values.
    cot = random(shape, dtype, 3).astype(mx.float32)
    return x, w, cot


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_match_float32_reference(shape, dtype, monkeypatch):
    launches = spy_launches(monkeypatch)
    device = emulate()
    x, w, cot = inputs(shape, dtype)
    eps = 1e-5
    got = value_and_grads(lambda a, b: F.rms_norm(a, b, eps, device=device), x, w, cot)
    assert [g.dtype for g in got] == [dtype] * 3 and got[0].shape == x.shape
    want = value_and_grads(lambda a, b: F.rms_norm(a, b, eps, device=reference()),
                           x.astype(mx.float32), w.astype(mx.float32), cot)
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        np.testing.assert_allclose(f32(g), f32(r), atol=1e-4, rtol=RTOL[dtype], err_msg=name)
    assert launches.names() == KERNELS


@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_is_mlx_fast_or_the_fused_cpu_op(dtype, monkeypatch):
    """"auto" is mx.fast.rms_norm itself (bit for bit), except for float32 on the CPU backend with
    the native extension: there it is metalnn.cpu.fused.rms_norm (checked against torch in
    test_fused.py), equal to mx.fast.rms_norm within float32 rounding."""
    launches = spy_launches(monkeypatch)
    x, w, cot = inputs((3, 2, 5, 64), dtype)
    want = value_and_grads(lambda a, b: mx.fast.rms_norm(a, b, 1e-5), x, w, cot)
    calls = []
    real = mx.fast.rms_norm
    monkeypatch.setattr(mx.fast, "rms_norm", lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1])
    got = value_and_grads(lambda a, b: F.rms_norm(a, b, 1e-5, device=mn.Device()), x, w, cot)
    assert not launches
    if dtype == mx.float32 and fused.available() and mx.default_device() == mx.cpu:
        assert not calls
        for g, r in zip(got, want):
            close(g, r, dtype)
    else:
        assert calls
        for g, r in zip(got, want):
            assert mx.array_equal(g, r)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_mlx_fast(shape, dtype):
    x, w, cot = inputs(shape, dtype)
    got = value_and_grads(lambda a, b: F.rms_norm(a, b, 1e-5, device=reference()), x, w, cot)
    want = value_and_grads(lambda a, b: mx.fast.rms_norm(a, b, 1e-5), x, w, cot)
    for g, r in zip(got, want):
        close(g, r, dtype, scale=2)


@pytest.mark.parametrize("lane_order", ["reversed", "shuffled"])
def test_lane_order_does_not_change_result(lane_order, monkeypatch):
    launches = spy_launches(monkeypatch)
    x = random((4, 100), mx.float32)
    w = random((100,), mx.float32, 5)
    a = F.rms_norm(x, w, 1e-6, device=emulate())
    b = F.rms_norm(x, w, 1e-6, device=emulate(lane_order, seed=3))
    close(a, b, mx.float32)
    assert [launch.options for launch in launches] == [{"lane_order": "forward", "seed": 0},
                                                 {"lane_order": lane_order, "seed": 3}]


def test_no_weight_and_non_contiguous_input(monkeypatch):
    launches = spy_launches(monkeypatch)
    base = random((6, 40), mx.float32)
    x = base.T[:33]          # a transposed, sliced view: (33, 6) with strides (1, 40)
    want = mx.fast.rms_norm(x, None, 1e-5)
    want_g = mx.grad(lambda v: (mx.fast.rms_norm(v, None, 1e-5) ** 2).sum())(x)
    for device in (emulate(), reference()):
        close(F.rms_norm(x, None, 1e-5, device=device), want, mx.float32)
        close(mx.grad(lambda v: (F.rms_norm(v, None, 1e-5, device=device) ** 2).sum())(x), want_g, mx.float32)
    assert {"rms_norm_forward", "rms_norm_backward_dx"} <= launches.names()


def test_bad_weight_shape_is_reported():
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        F.rms_norm(mx.zeros((2, 8)), mx.ones((7,)), device=reference())


def test_rmsnorm_layer_runs_on_emulated_kernel(monkeypatch):
    launches = spy_launches(monkeypatch)
    x = random((2, 3, 16), mx.float32)
    layer = mn.RMSNorm()
    out_ref = layer.compile(reference(), mn.Data(x)).array
    assert not launches
    out_emu = layer.compile(emulate(), mn.Data(x)).array
    assert launches.names() == {"rms_norm_forward"}
    close(out_emu, out_ref, mx.float32)
