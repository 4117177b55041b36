"""Tests for metalnn.fastmath (native vectorised CPU primitives with MLX fallbacks)."""

import math

import numpy as np
import pytest

import metalnn.fastmath as fm
import mlx.core as mx

import platform
import sys

# The extension is built at install on Linux x86_64 (setup.py); there it must be present.
NATIVE_PLATFORM = sys.platform.startswith("linux") and platform.machine() == "x86_64"
native = pytest.mark.skipif(not NATIVE_PLATFORM, reason="the fastmath extension is built on Linux x86_64 only")


def test_extension_is_built_here():
    if NATIVE_PLATFORM:
        assert fm.available(), f"fastmath extension unavailable: {fm.unavailable_reason()}"

GELU_C = math.sqrt(2.0 / math.pi)


def ref_silu(x):
    return x * mx.sigmoid(x)


def ref_gelu_tanh(x):
    return 0.5 * x * (1 + mx.tanh(GELU_C * (x + 0.044715 * x**3)))


def ref_softmax(x):
    return mx.softmax(x, axis=-1)


# (name, fastmath op, MLX reference)
OPS = [
    ("exp", fm.exp, mx.exp),
    ("sigmoid", fm.sigmoid, mx.sigmoid),
    ("silu", fm.silu, ref_silu),
    ("tanh", fm.tanh, mx.tanh),
    ("gelu_tanh", fm.gelu_tanh, ref_gelu_tanh),
    ("softmax", fm.softmax, ref_softmax),
]
OP_IDS = [o[0] for o in OPS]


@pytest.fixture(params=[False, True], ids=["avx2", "scalar"])
def kernel_path(request):
    """Run a test with the AVX2 kernels and with the portable scalar kernels."""
    if not fm.available():
        yield request.param
        return
    ext = fm._ext
    if not request.param and not ext.has_avx2():
        pytest.skip("no AVX2/FMA on this CPU")
    old = ext.get_force_scalar()
    ext.set_force_scalar(request.param)
    try:
        yield request.param
    finally:
        ext.set_force_scalar(old)


def _np(a):
    return np.array(a, copy=True)


def _rand(shape, scale=3.0, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))


def test_available_reports_reason():
    assert fm.available() == (fm.unavailable_reason() is None)


@native
def test_ops_are_native_primitives():
    x = mx.ones((3,))
    # the native op builds a graph node whose primitive the compiled-graph printer shows
    assert fm.exp(x).dtype == mx.float32
    assert fm._ext.mlx_version


# ----------------------------------------------------------------------------- values
# (the accuracy/special-value tests are for the native kernels: MLX's own CPU exp
#  is ~4e-6 relative and overflows early, so they do not hold for the fallback)


@native
def test_exp_matches_float64(kernel_path):
    x = np.linspace(-80.0, 80.0, 200_003, dtype=np.float32)
    # plus random points and values right at the interesting spots
    extra = np.array([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 0.34657359, -0.34657359, 88.0, -87.0], np.float32)
    x = np.concatenate([x, extra, np.random.default_rng(1).uniform(-80, 80, 10_007).astype(np.float32)])
    y = _np(fm.exp(mx.array(x)))
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(y.astype(np.float64) - ref) / ref
    assert rel.max() < 2e-6, rel.max()


@native
def test_exp_special_values(kernel_path):
    x = mx.array([np.inf, -np.inf, np.nan, 100.0, -110.0, 88.72, -87.3, -100.0], dtype=mx.float32)
    y = _np(fm.exp(x))
    assert y[0] == np.inf
    assert y[1] == 0.0
    assert np.isnan(y[2])
    assert y[3] == np.inf
    assert y[4] == 0.0
    assert np.isfinite(y[5]) and abs(y[5] / np.exp(88.72) - 1) < 1e-5
    assert abs(y[6] / np.exp(np.float64(np.float32(-87.3))) - 1) < 1e-5  # just above the denormal range
    assert 0 < y[7] < 1e-38 and abs(float(y[7]) - np.exp(-100.0)) <= 1.5e-45  # denormal: within 1 ulp


@pytest.mark.parametrize("name,op,ref", OPS, ids=OP_IDS)
def test_values_vs_mlx(name, op, ref, kernel_path):
    # a mix of lengths to cover the 16/8-lane loops and the masked tails
    for shape in [(1,), (7,), (8,), (17,), (33, 129), (4, 5, 1000)]:
        x = _rand(shape, scale=4.0, seed=len(shape) + shape[-1])
        y, r = _np(op(x)), _np(ref(x))
        np.testing.assert_allclose(y, r, rtol=1e-6, atol=1e-6, err_msg=f"{name} {shape}")


def test_sigmoid_silu_tanh_extremes(kernel_path):
    x = mx.array([-100.0, -30.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 30.0, 100.0, np.inf, -np.inf], dtype=mx.float32)
    np.testing.assert_allclose(_np(fm.sigmoid(x)), _np(mx.sigmoid(x)), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(_np(fm.tanh(x)), _np(mx.tanh(x)), atol=1e-6, rtol=1e-6)
    finite = x[:9]
    np.testing.assert_allclose(_np(fm.silu(finite)), _np(ref_silu(finite)), atol=1e-6, rtol=1e-6)
    # tiny |x|: tanh must keep relative accuracy (polynomial branch)
    t = mx.array([1e-20, -1e-8, 1e-4], dtype=mx.float32)
    np.testing.assert_allclose(_np(fm.tanh(t)), np.tanh(_np(t).astype(np.float64)), rtol=1e-6)


def test_softmax_rows(kernel_path):
    x = _rand((64, 300), scale=10.0)
    y = _np(fm.softmax(x))
    np.testing.assert_allclose(y.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(y, _np(ref_softmax(x)), atol=1e-6)
    # large offsets (max subtraction) and -inf masking, as in attention
    x = mx.array([[1000.0, 1001.0, 999.0], [-np.inf, 0.0, 0.0], [5.0, -np.inf, -np.inf]], dtype=mx.float32)
    np.testing.assert_allclose(_np(fm.softmax(x)), _np(ref_softmax(x)), atol=1e-6)


def test_softmax_axis_argument():
    x = _rand((4, 6, 5))
    for axis in (0, 1, 2, -1, -2):
        np.testing.assert_allclose(_np(fm.softmax(x, axis=axis)), _np(mx.softmax(x, axis=axis)), atol=1e-6)
    with pytest.raises(ValueError):
        fm.softmax(x, axis=3)


def test_scalar_and_empty():
    s = mx.array(0.5)
    np.testing.assert_allclose(_np(fm.exp(s)), math.exp(0.5), rtol=1e-6)
    assert _np(fm.softmax(s)) == pytest.approx(1.0)
    e = mx.zeros((0, 4))
    assert fm.exp(e).shape == (0, 4)
    assert fm.softmax(e).shape == (0, 4)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("name,op,ref", OPS, ids=OP_IDS)
def test_non_contiguous_inputs(name, op, ref):
    base = _rand((6, 10, 12), seed=3)
    views = [
        base.transpose(2, 0, 1),  # col-major-ish permutation
        base[:, ::2, 1::3],  # strided slice
        base[..., ::-1],  # negative stride
        mx.broadcast_to(base[:, :1, :], (6, 10, 12)),  # stride-0 broadcast
        base.T,
    ]
    for v in views:
        np.testing.assert_allclose(_np(op(v)), _np(ref(v)), rtol=1e-6, atol=1e-6, err_msg=name)


def test_input_not_clobbered():
    # the output may reuse a donated input buffer, but never one that is still referenced
    x = _rand((100,))
    x_copy = _np(x)
    mx.eval(fm.exp(x), fm.softmax(x), fm.silu(x))
    np.testing.assert_array_equal(_np(x), x_copy)


# ----------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("name,op,ref", OPS, ids=OP_IDS)
def test_half_precision(name, op, ref, dtype):
    x = _rand((5, 37), scale=2.0).astype(dtype)
    y = op(x)
    assert y.dtype == dtype
    tol = 1e-2 if dtype == mx.bfloat16 else 2e-3
    r = ref(x.astype(mx.float32))
    np.testing.assert_allclose(_np(y.astype(mx.float32)), _np(r), rtol=tol, atol=tol)
    g = mx.grad(lambda t: op(t).astype(mx.float32).sum())(x)
    assert g.dtype == dtype


def test_float64_and_int_inputs():
    x64 = mx.array(np.linspace(-3, 3, 11), dtype=mx.float64) if hasattr(mx, "float64") else None
    if x64 is not None:
        try:
            y = fm.exp(x64, stream=mx.cpu)
            mx.eval(y)
        except Exception:
            pass  # float64 support in MLX itself is limited; it must only not crash
        else:
            assert y.dtype == mx.float64
    xi = mx.array([0, 1, 2])
    y = fm.exp(xi)
    assert y.dtype == mx.float32
    np.testing.assert_allclose(_np(y), np.exp([0, 1, 2]), rtol=1e-6)


# ----------------------------------------------------------------------------- autodiff


def _loss(op):
    w = _rand((9, 33), seed=11)

    def f(x):
        return (op(x) * w).sum()

    return f


@pytest.mark.parametrize("name,op,ref", OPS, ids=OP_IDS)
def test_grad_matches_mlx(name, op, ref, kernel_path):
    x = _rand((9, 33), scale=3.0, seed=5)
    g = _np(mx.grad(_loss(op))(x))
    r = _np(mx.grad(_loss(ref))(x))
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("name,op,ref", OPS, ids=OP_IDS)
def test_vjp_jvp(name, op, ref):
    x = _rand((4, 19), seed=6)
    ct = _rand((4, 19), seed=7)
    (o1,), (v1,) = mx.vjp(lambda t: op(t), [x], [ct])
    (o2,), (v2,) = mx.vjp(lambda t: ref(t), [x], [ct])
    np.testing.assert_allclose(_np(o1), _np(o2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_np(v1), _np(v2), rtol=1e-5, atol=1e-5)
    (_,), (j1,) = mx.jvp(lambda t: op(t), [x], [ct])
    (_,), (j2,) = mx.jvp(lambda t: ref(t), [x], [ct])
    np.testing.assert_allclose(_np(j1), _np(j2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,op,ref", OPS, ids=OP_IDS)
def test_second_order(name, op, ref):
    x = _rand((3, 8), scale=1.5, seed=8)
    gg = _np(mx.grad(lambda t: mx.grad(_loss2(op))(t).sum())(x))
    rr = _np(mx.grad(lambda t: mx.grad(_loss2(ref))(t).sum())(x))
    np.testing.assert_allclose(gg, rr, rtol=1e-4, atol=1e-4)


def _loss2(op):
    w = _rand((3, 8), seed=12)
    return lambda t: (op(t) * w).sum()


@pytest.mark.parametrize("name,op,ref", OPS, ids=OP_IDS)
def test_vmap(name, op, ref):
    x = _rand((5, 4, 7), seed=9)
    for ax in (0, 1, 2):
        y = mx.vmap(op, in_axes=ax)(x)
        r = mx.vmap(ref, in_axes=ax)(x)
        np.testing.assert_allclose(_np(y), _np(r), rtol=1e-6, atol=1e-6, err_msg=f"{name} axis {ax}")


def test_grad_with_broadcast_cotangent():
    # sum() gives a stride-0 broadcast cotangent; mean over a transposed view too
    x = _rand((8, 16))
    for op, ref in [(fm.softmax, ref_softmax), (fm.silu, ref_silu), (fm.exp, mx.exp)]:
        g = mx.grad(lambda t: op(t.T).mean())(x)
        r = mx.grad(lambda t: ref(t.T).mean())(x)
        np.testing.assert_allclose(_np(g), _np(r), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- compile


@pytest.mark.parametrize("name,op,ref", OPS, ids=OP_IDS)
def test_inside_compile(name, op, ref):
    x = _rand((16, 40), seed=10)

    def f(t):
        return (op(t * 0.5 + 0.1) * 2.0).sum(axis=-1)

    def fr(t):
        return (ref(t * 0.5 + 0.1) * 2.0).sum(axis=-1)

    cf = mx.compile(f)
    np.testing.assert_allclose(_np(cf(x)), _np(fr(x)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(cf(x + 1)), _np(fr(x + 1)), rtol=1e-5, atol=1e-5)  # cached graph
    cg = mx.compile(mx.grad(lambda t: f(t).sum()))
    np.testing.assert_allclose(_np(cg(x)), _np(mx.grad(lambda t: fr(t).sum())(x)), rtol=1e-5, atol=1e-5)


def test_compile_shapeless():
    f = mx.compile(lambda t: fm.softmax(fm.silu(t)), shapeless=True)
    for shape in [(3, 5), (4, 9)]:
        x = _rand(shape)
        np.testing.assert_allclose(_np(f(x)), _np(ref_softmax(ref_silu(x))), rtol=1e-6, atol=1e-6)


def test_attention_block_grad():
    # softmax attention forward+backward agrees with the MLX reference
    q, k, v = (_rand((2, 3, 16, 8), scale=1.0, seed=s) for s in (20, 21, 22))
    mask = mx.triu(mx.full((16, 16), -np.inf, dtype=mx.float32), k=1)

    def attn(sm, q, k, v):
        s = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(8) + mask
        return (sm(s) @ v).sum()

    g1 = mx.grad(lambda q, k, v: attn(fm.softmax, q, k, v), argnums=(0, 1, 2))(q, k, v)
    g2 = mx.grad(lambda q, k, v: attn(ref_softmax, q, k, v), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(_np(a), _np(b), rtol=1e-5, atol=1e-5)


def test_softmax_grad_function():
    y = fm.softmax(_rand((5, 11)))
    g = _rand((5, 11), seed=4)
    d = (_np(g) * _np(y)).sum(-1, keepdims=True)
    np.testing.assert_allclose(_np(fm.softmax_grad(y, g)), _np(y) * (_np(g) - d), rtol=1e-5, atol=1e-6)


def test_fallback_functions_match():
    # the pure-MLX fallbacks (used without the extension) agree with the references
    x = _rand((4, 9))
    np.testing.assert_allclose(_np(fm._mlx_silu(x)), _np(ref_silu(x)), atol=1e-6)
    np.testing.assert_allclose(_np(fm._mlx_gelu_tanh(x)), _np(ref_gelu_tanh(x)), atol=1e-6)
    y = mx.softmax(x, axis=-1)
    g = _rand((4, 9), seed=2)
    _, (vj,) = mx.vjp(ref_softmax, [x], [g])
    np.testing.assert_allclose(_np(fm._mlx_softmax_grad(y, g)), _np(vj), atol=1e-6)
