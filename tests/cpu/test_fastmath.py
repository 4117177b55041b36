"""Tests for metalnn.cpu.fastmath (native vectorised CPU primitives with MLX fallbacks).

Every value and gradient is checked against PyTorch in float64 (an independent
reference), on each code path: the AVX2+FMA kernels, the portable scalar kernels and the
MLX-op fallback used when the extension is missing. That the native primitives really
ran is checked on the graph (``mx.export_to_dot`` names each node's primitive).
"""

import io
import json
import math
import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import metalnn.cpu.fastmath as fm
import mlx.core as mx

# The extension is built at install on Linux x86_64 (setup.py); there it must be present.
NATIVE_PLATFORM = sys.platform.startswith("linux") and platform.machine() == "x86_64"
native = pytest.mark.skipif(not NATIVE_PLATFORM, reason="the fastmath extension is built on Linux x86_64 only")

# Tolerances against float64. Values: float32 rounding is 6e-8 relative, the native kernels
# stay within a few ulps, MLX's own CPU exp/sigmoid (the fallback path) within ~1e-6 relative,
# and a 1000-wide float32 softmax row within ~1e-6; rtol 2e-6 covers all with margin.
# atol 1e-6 absorbs results that round to tiny values (sigmoid(-30), exp near 0).
RTOL, ATOL = 2e-6, 1e-6
# Gradients chain two such float32 results (e.g. g * y * (1 - y)): twice the error, and the
# second-order ones one more product.
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-6


def test_extension_is_built_here():
    if NATIVE_PLATFORM:
        assert fm.available(), f"fastmath extension unavailable: {fm.unavailable_reason()}"
    else:
        assert not fm.available() and fm.unavailable_reason()


# ----------------------------------------------------------------------------- references

TORCH_REF = {
    "exp": torch.exp,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "tanh": torch.tanh,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "softmax": lambda t: torch.softmax(t, dim=-1),
}
OPS = {
    "exp": fm.exp,
    "sigmoid": fm.sigmoid,
    "silu": fm.silu,
    "tanh": fm.tanh,
    "gelu_tanh": fm.gelu_tanh,
    "softmax": fm.softmax,
}
NAMES = list(OPS)
PRIMITIVE = {
    "exp": "FastExp",
    "sigmoid": "FastSigmoid",
    "silu": "FastSilu",
    "tanh": "FastTanh",
    "gelu_tanh": "FastGeluTanh",
    "softmax": "FastSoftmax",
}


def _np(a):
    return np.array(a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a, copy=True)


def _t(a) -> torch.Tensor:
    """float64 torch tensor of an mx.array (or numpy array)."""
    return torch.from_numpy(np.asarray(_np(a) if isinstance(a, mx.array) else a, dtype=np.float64).copy())


def _rand(shape, scale=3.0, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))


def ref_value(name, x) -> np.ndarray:
    return TORCH_REF[name](_t(x)).numpy()


def ref_vjp(name, x, ct) -> np.ndarray:
    """d/dx sum(f(x) * ct), by torch autograd in float64."""
    t = _t(x).requires_grad_(True)
    (g,) = torch.autograd.grad((TORCH_REF[name](t) * _t(ct)).sum(), t)
    return g.numpy()


def ref_jvp(name, x, tangent) -> np.ndarray:
    _, jv = torch.func.jvp(TORCH_REF[name], (_t(x),), (_t(tangent),))
    return jv.numpy()


def primitives(*arrays) -> set[str]:
    """Names of the primitives in the (unevaluated) graph of ``arrays``."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return {line.split('label ="', 1)[1].split('"', 1)[0] for line in buf.getvalue().splitlines() if 'label ="' in line}


def _use_path(path, monkeypatch):
    """Make fastmath run on ``path``; returns a function restoring the previous state."""
    if path == "mlx_ops":
        monkeypatch.setattr(fm, "_ext", None)  # what every function sees without the extension
        return lambda: None
    if not fm.available():
        if NATIVE_PLATFORM:
            pytest.fail(f"fastmath extension unavailable: {fm.unavailable_reason()}")
        pytest.skip(f"no native fastmath kernels on this platform ({fm.unavailable_reason()})")
    ext = fm._ext
    if path == "avx2" and not ext.has_avx2():
        pytest.skip("the CPU has no AVX2/FMA, so the AVX2 kernels never run here")
    old = ext.get_force_scalar()
    ext.set_force_scalar(path == "scalar")
    return lambda: ext.set_force_scalar(old)


@pytest.fixture(params=["avx2", "scalar", "mlx_ops"])
def kernel_path(request, monkeypatch):
    """Run a test on the AVX2 kernels, the portable scalar kernels and the MLX-op fallback."""
    restore = _use_path(request.param, monkeypatch)
    try:
        yield request.param
    finally:
        restore()


@pytest.fixture(params=["avx2", "scalar"])
def native_path(request, monkeypatch):
    """Run a test on each of the native kernel sets (accuracy bounds the MLX ops do not meet)."""
    restore = _use_path(request.param, monkeypatch)
    try:
        yield request.param
    finally:
        restore()


def _check_path(path, *arrays, expect: set[str]):
    """The graph of ``arrays`` holds the native primitives ``expect`` exactly when the path is native."""
    found = primitives(*arrays)
    if path == "mlx_ops":
        assert not any(p.startswith("Fast") for p in found), found
    else:
        assert expect <= found, f"expected {expect} in the graph, found {found}"


def test_available_reports_reason():
    assert fm.available() == (fm.unavailable_reason() is None)


@native
@pytest.mark.parametrize("name", NAMES)
def test_ops_are_native_primitives(name):
    """Forward and backward build the extension's primitives, not MLX's ops."""
    x = _rand((3, 5))
    y = OPS[name](x)
    assert PRIMITIVE[name] in primitives(y)
    g = mx.grad(lambda t: OPS[name](t).sum())(x)
    assert PRIMITIVE[name] + "Grad" in primitives(g)


# ----------------------------------------------------------------------------- values
# (the accuracy/special-value tests are for the native kernels: MLX's own CPU exp
#  is ~1e-6 relative and overflows early, so they do not hold for the fallback)


@native
def test_exp_matches_float64(native_path):
    x = np.linspace(-80.0, 80.0, 200_003, dtype=np.float32)
    # plus random points and values right at the interesting spots
    extra = np.array([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 0.34657359, -0.34657359, 88.0, -87.0], np.float32)
    x = np.concatenate([x, extra, np.random.default_rng(1).uniform(-80, 80, 10_007).astype(np.float32)])
    y = _np(fm.exp(mx.array(x)))
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(y.astype(np.float64) - ref) / ref
    assert rel.max() < 2e-7, rel.max()  # ~3 float32 ulps


@native
def test_exp_special_values(native_path):
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


@pytest.mark.parametrize("name", NAMES)
def test_values(name, kernel_path):
    # a mix of lengths to cover the 16/8-lane loops and the masked tails
    for shape in [(1,), (7,), (8,), (17,), (33, 129), (4, 5, 1000)]:
        x = _rand(shape, scale=4.0, seed=len(shape) + shape[-1])
        y = OPS[name](x)
        _check_path(kernel_path, y, expect={PRIMITIVE[name]})
        np.testing.assert_allclose(_np(y), ref_value(name, x), rtol=RTOL, atol=ATOL, err_msg=f"{name} {shape}")


def test_sigmoid_silu_tanh_extremes(kernel_path):
    x = mx.array([-100.0, -30.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 30.0, 100.0, np.inf, -np.inf], dtype=mx.float32)
    np.testing.assert_allclose(_np(fm.sigmoid(x)), ref_value("sigmoid", x), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(_np(fm.tanh(x)), ref_value("tanh", x), atol=ATOL, rtol=RTOL)
    finite = x[:9]
    np.testing.assert_allclose(_np(fm.silu(finite)), ref_value("silu", finite), atol=ATOL, rtol=RTOL)
    # tiny |x|: tanh must keep relative accuracy (polynomial branch)
    t = mx.array([1e-20, -1e-8, 1e-4], dtype=mx.float32)
    np.testing.assert_allclose(_np(fm.tanh(t)), ref_value("tanh", t), rtol=RTOL, atol=0)


def test_softmax_rows(kernel_path):
    x = _rand((64, 300), scale=10.0)
    y = _np(fm.softmax(x))
    np.testing.assert_allclose(y.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(y, ref_value("softmax", x), rtol=RTOL, atol=ATOL)
    # large offsets (max subtraction) and -inf masking, as in attention
    x = mx.array([[1000.0, 1001.0, 999.0], [-np.inf, 0.0, 0.0], [5.0, -np.inf, -np.inf]], dtype=mx.float32)
    np.testing.assert_allclose(_np(fm.softmax(x)), ref_value("softmax", x), rtol=RTOL, atol=ATOL)


def test_softmax_axis_argument(kernel_path):
    x = _rand((4, 6, 5))
    for axis in (0, 1, 2, -1, -2):
        ref = torch.softmax(_t(x), dim=axis).numpy()
        np.testing.assert_allclose(_np(fm.softmax(x, axis=axis)), ref, rtol=RTOL, atol=ATOL, err_msg=str(axis))
    with pytest.raises(ValueError, match=r"\[softmax\] axis 3 out of range for 3-d input"):
        fm.softmax(x, axis=3)
    with pytest.raises(ValueError, match=r"\[softmax\] axis -4 out of range for 3-d input"):
        fm.softmax(x, axis=-4)


def test_scalar_and_empty(kernel_path):
    s = mx.array(0.5)
    np.testing.assert_allclose(_np(fm.exp(s)), math.exp(0.5), rtol=RTOL)
    assert _np(fm.softmax(s)) == pytest.approx(1.0)
    e = mx.zeros((0, 4))
    assert fm.exp(e).shape == (0, 4)
    assert fm.softmax(e).shape == (0, 4)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_inputs(name, kernel_path):
    base = _rand((6, 10, 12), seed=3)
    views = {
        "transpose": base.transpose(2, 0, 1),  # col-major-ish permutation
        "strided": base[:, ::2, 1::3],
        "reversed": base[..., ::-1],  # negative stride
        "broadcast": mx.broadcast_to(base[:, :1, :], (6, 10, 12)),  # stride 0
        "T": base.T,
    }
    for label, v in views.items():
        ref = TORCH_REF[name](_t(np.array(v))).numpy()
        np.testing.assert_allclose(_np(OPS[name](v)), ref, rtol=RTOL, atol=ATOL, err_msg=f"{name} {label}")


def test_input_not_clobbered(kernel_path):
    # the output may reuse a donated input buffer, but never one that is still referenced
    x = _rand((100,))
    x_copy = _np(x)
    mx.eval(fm.exp(x), fm.softmax(x), fm.silu(x))
    np.testing.assert_array_equal(_np(x), x_copy)


# ----------------------------------------------------------------------------- dtypes

# float16 keeps 11 significant bits (relative rounding 4.9e-4), bfloat16 8 (3.9e-3); the
# result and the rounding of intermediate results each add up to one such step.
HALF_TOL = {mx.float16: 2e-3, mx.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", NAMES)
def test_half_precision(name, dtype, kernel_path):
    x = _rand((5, 37), scale=2.0).astype(dtype)
    w = _rand((5, 37), seed=13)
    y = OPS[name](x)
    assert y.dtype == dtype
    tol = HALF_TOL[dtype]
    # the reference sees the same (rounded) half-precision inputs, in float64
    np.testing.assert_allclose(_np(y), ref_value(name, x), rtol=tol, atol=tol)
    g = mx.grad(lambda t: (OPS[name](t).astype(mx.float32) * w).sum())(x)
    assert g.dtype == dtype
    np.testing.assert_allclose(_np(g), ref_vjp(name, x, w), rtol=tol, atol=tol)


def test_float64_and_int_inputs(kernel_path):
    """float64 goes through MLX's own float64 ops (not the float32 kernels); integers are
    promoted to float32 like mx.exp does."""
    x64 = mx.array(np.linspace(-3, 3, 11), dtype=mx.float64)
    for name in NAMES:
        y = OPS[name](x64, stream=mx.cpu)
        assert y.dtype == mx.float64, name
        assert not any(p.startswith("Fast") for p in primitives(y)), name
        # MLX's CPU backend evaluates exp/tanh/sigmoid of float64 with float32 accuracy
        # (1.3e-7 relative measured for exp), so the float32 tolerance applies
        np.testing.assert_allclose(np.array(y), ref_value(name, np.array(x64)), rtol=RTOL, atol=ATOL, err_msg=name)
    xi = mx.array([0, 1, 2])
    for name in NAMES:
        y = OPS[name](xi)
        assert y.dtype == mx.float32, name
        np.testing.assert_allclose(_np(y), ref_value(name, np.array([0.0, 1.0, 2.0])), rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- autodiff


@pytest.mark.parametrize("name", NAMES)
def test_grad(name, kernel_path):
    x = _rand((9, 33), scale=3.0, seed=5)
    w = _rand((9, 33), seed=11)
    g = mx.grad(lambda t: (OPS[name](t) * w).sum())(x)
    _check_path(kernel_path, g, expect={PRIMITIVE[name] + "Grad"})
    np.testing.assert_allclose(_np(g), ref_vjp(name, x, w), rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=name)


@pytest.mark.parametrize("name", NAMES)
def test_vjp_jvp(name, kernel_path):
    x = _rand((4, 19), seed=6)
    ct = _rand((4, 19), seed=7)
    (o,), (v,) = mx.vjp(OPS[name], [x], [ct])
    np.testing.assert_allclose(_np(o), ref_value(name, x), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_np(v), ref_vjp(name, x, ct), rtol=GRAD_RTOL, atol=GRAD_ATOL)
    (_,), (j,) = mx.jvp(OPS[name], [x], [ct])
    np.testing.assert_allclose(_np(j), ref_jvp(name, x, ct), rtol=GRAD_RTOL, atol=GRAD_ATOL)


@pytest.mark.parametrize("name", NAMES)
def test_second_order(name, kernel_path):
    x = _rand((3, 8), scale=1.5, seed=8)
    w = _rand((3, 8), seed=12)
    gg = mx.grad(lambda t: mx.grad(lambda u: (OPS[name](u) * w).sum())(t).sum())(x)
    t = _t(x).requires_grad_(True)
    (g1,) = torch.autograd.grad((TORCH_REF[name](t) * _t(w)).sum(), t, create_graph=True)
    (g2,) = torch.autograd.grad(g1.sum(), t)
    # one more float32 product chain than first order
    np.testing.assert_allclose(_np(gg), g2.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_vmap(name, kernel_path):
    x = _rand((5, 4, 7), seed=9)
    for ax in (0, 1, 2):
        y = mx.vmap(OPS[name], in_axes=ax)(x)
        # vmap maps the op over axis ax and stacks the results on axis 0
        ref = TORCH_REF[name](torch.movedim(_t(x), ax, 0)).numpy()
        np.testing.assert_allclose(_np(y), ref, rtol=RTOL, atol=ATOL, err_msg=f"{name} axis {ax}")


def test_grad_with_broadcast_cotangent(kernel_path):
    # mean() gives a stride-0 broadcast cotangent, over a transposed view
    x = _rand((8, 16))
    for name in ("softmax", "silu", "exp"):
        g = mx.grad(lambda t: OPS[name](t.T).mean())(x)
        ct = np.full((16, 8), 1.0 / 128)
        ref = ref_vjp(name, np.array(x).T, ct).T
        np.testing.assert_allclose(_np(g), ref, rtol=GRAD_RTOL, atol=1e-8, err_msg=name)


# ----------------------------------------------------------------------------- compile


@pytest.mark.parametrize("name", NAMES)
def test_inside_compile(name, kernel_path):
    x = _rand((16, 40), seed=10)

    def f(t):
        return (OPS[name](t * 0.5 + 0.1) * 2.0).sum(axis=-1)

    def f_ref(t):
        return (TORCH_REF[name](t * 0.5 + 0.1) * 2.0).sum(dim=-1)

    def ref_grad(a):
        t = _t(a).requires_grad_(True)
        (g,) = torch.autograd.grad(f_ref(t).sum(), t)
        return g.numpy()

    cf = mx.compile(f)
    # sums of 40 float32 terms: 40x the element tolerance, relative to the row sum
    np.testing.assert_allclose(_np(cf(x)), f_ref(_t(x)).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(cf(x + 1)), f_ref(_t(x + 1)).numpy(), rtol=1e-5, atol=1e-5)  # cached graph
    cg = mx.compile(mx.grad(lambda t: f(t).sum()))
    np.testing.assert_allclose(_np(cg(x)), ref_grad(x), rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_compile_shapeless(kernel_path):
    f = mx.compile(lambda t: fm.softmax(fm.silu(t)), shapeless=True)
    for shape in [(3, 5), (4, 9)]:
        x = _rand(shape)
        ref = torch.softmax(F.silu(_t(x)), dim=-1).numpy()
        np.testing.assert_allclose(_np(f(x)), ref, rtol=RTOL, atol=ATOL)


def test_attention_block_grad(kernel_path):
    # softmax attention forward+backward agrees with torch
    q, k, v = (_rand((2, 3, 16, 8), scale=1.0, seed=s) for s in (20, 21, 22))
    mask = np.triu(np.full((16, 16), -np.inf), k=1)

    def attn(q, k, v):
        s = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(8) + mx.array(mask, dtype=mx.float32)
        return (fm.softmax(s) @ v).sum()

    grads = mx.grad(attn, argnums=(0, 1, 2))(q, k, v)
    tq, tk, tv = (_t(a).requires_grad_(True) for a in (q, k, v))
    s = tq @ tk.transpose(-1, -2) / math.sqrt(8) + torch.from_numpy(mask)
    refs = torch.autograd.grad((torch.softmax(s, -1) @ tv).sum(), (tq, tk, tv))
    for a, b in zip(grads, refs):
        np.testing.assert_allclose(_np(a), b.numpy(), rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_softmax_grad_function(kernel_path):
    y = fm.softmax(_rand((5, 11)))
    g = _rand((5, 11), seed=4)
    d = (_np(g) * _np(y)).sum(-1, keepdims=True)
    np.testing.assert_allclose(_np(fm.softmax_grad(y, g)), _np(y) * (_np(g) - d), rtol=1e-5, atol=1e-6)


def test_fallback_functions_match_torch():
    """The pure-MLX fallback formulas (used without the extension) against torch."""
    x = _rand((4, 9))
    np.testing.assert_allclose(_np(fm._mlx_silu(x)), ref_value("silu", x), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_np(fm._mlx_gelu_tanh(x)), ref_value("gelu_tanh", x), rtol=RTOL, atol=ATOL)
    y = mx.softmax(x, axis=-1)
    g = _rand((4, 9), seed=2)
    np.testing.assert_allclose(_np(fm._mlx_softmax_grad(y, g)), ref_vjp("softmax", x, g), rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_env_var_disables_the_extension():
    """METALNN_FASTMATH=0 gives the MLX fallback, says why, and the results still match."""
    code = textwrap.dedent(
        """
        import json, io
        import mlx.core as mx
        import metalnn.cpu.fastmath as fm
        x = mx.array([[-2.0, 0.0, 1.5]])
        y = fm.silu(x)
        buf = io.StringIO(); mx.export_to_dot(buf, y)
        print(json.dumps({"available": fm.available(), "reason": fm.unavailable_reason(),
                          "y": y.tolist(), "native": "FastSilu" in buf.getvalue()}))
        """
    )
    env = {**os.environ, "METALNN_FASTMATH": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["available"] is False and out["native"] is False
    assert "METALNN_FASTMATH" in out["reason"]
    np.testing.assert_allclose(out["y"], ref_value("silu", np.array([[-2.0, 0.0, 1.5]])), rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- loading

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOAD_REPORT = textwrap.dedent(
    """
    import json, sys, warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import mlx.core as mx
        import metalnn.cpu.fastmath as fm
    y = fm.silu(mx.array([[-2.0, 0.0, 1.5]]))
    print(json.dumps({"available": fm.available(), "reason": fm.unavailable_reason(), "y": y.tolist(),
                      "imported": "metalnn.cpu._fastmath" in sys.modules, "file": fm.__file__,
                      "warnings": [str(w.message) for w in caught if "metalnn" in str(w.message)]}))
    """
)


def _run_report(prelude: str = "", pythonpath: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "METALNN_FASTMATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
        # an editable install's finder would still serve the checkout's modules
        prelude = (
            "import sys\nsys.meta_path[:] = [f for f in sys.meta_path "
            "if not getattr(f, '__module__', '').startswith('__editable__')]\n" + prelude
        )
    proc = subprocess.run([sys.executable, "-c", prelude + LOAD_REPORT], capture_output=True, text=True,
                          env=env, timeout=300, cwd=os.path.dirname(REPO))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # whatever happened, the functions work (fallback or not)
    np.testing.assert_allclose(out["y"], ref_value("silu", np.array([[-2.0, 0.0, 1.5]])), rtol=RTOL, atol=ATOL)
    return out


def _package_copy(tmp_path, patch=None) -> str:
    """A copy of the metalnn package (with its built libraries) under tmp_path; ``patch``
    maps the extension file's bytes to new bytes (None: leave the extension out)."""
    import shutil

    dest = tmp_path / "site" / "metalnn"
    shutil.copytree(os.path.join(REPO, "metalnn"), dest, ignore=shutil.ignore_patterns("__pycache__", "_fastmath*"))
    shutil.copytree(os.path.join(REPO, "metal_kernels"), tmp_path / "site" / "metal_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))  # metalnn's kernels package
    if patch is not None:
        cpu = os.path.join(REPO, "metalnn", "cpu")
        (ext,) = [f for f in os.listdir(cpu) if f.startswith("_fastmath") and f.endswith(".so")]
        data = open(os.path.join(cpu, ext), "rb").read()
        (dest / "cpu" / ext).write_bytes(patch(data))
    return str(tmp_path / "site")


@native
def test_loads_in_a_fresh_process():
    out = _run_report()
    assert out["available"] is True and out["reason"] is None and out["imported"] is True
    assert out["warnings"] == []


def test_missing_extension_falls_back(tmp_path):
    out = _run_report(pythonpath=_package_copy(tmp_path, patch=None))
    assert out["file"].startswith(str(tmp_path))  # the copy, not the checkout
    assert out["available"] is False and out["imported"] is False
    assert "not built" in out["reason"]
    assert out["warnings"] == []  # a missing optional extension is not an error


@native
def test_other_mlx_version_is_refused_before_import(tmp_path):
    """An extension built for another mlx is never imported; the reason names both versions."""
    installed = mx.__version__.encode()
    other = b"0.31.9"[: len(installed)].ljust(len(installed), b"9")
    assert other != installed

    def patch(data):
        tag = b"metalnn_fastmath_mlx_version=" + installed + b"\0"
        assert data.count(tag) == 1
        return data.replace(tag, b"metalnn_fastmath_mlx_version=" + other + b"\0")

    out = _run_report(pythonpath=_package_copy(tmp_path, patch))
    assert out["available"] is False and out["imported"] is False
    assert f"built against mlx {other.decode()} but mlx {installed.decode()} is installed" in out["reason"]
    assert len(out["warnings"]) == 1 and out["reason"] in out["warnings"][0]


@native
def test_other_nanobind_abi_is_refused_before_import(tmp_path):
    def patch(data):
        import re

        keys = set(re.findall(rb"nanobind_[A-Za-z0-9_]+_a\d+_v\d+", data))
        assert len(keys) == 1, keys
        (key,) = keys
        head, version = key.rsplit(b"_v", 1)
        other = head + b"_v" + str(int(version) - 1).encode().rjust(len(version), b"0")
        return data.replace(key, other)

    out = _run_report(pythonpath=_package_copy(tmp_path, patch))
    assert out["available"] is False and out["imported"] is False
    assert "nanobind internals" in out["reason"] and len(out["warnings"]) == 1


def test_never_loaded_on_macos():
    """On macOS the extension is not even looked for (simulated: sys.platform is read at import)."""
    out = _run_report(prelude="import sys\nsys.platform = 'darwin'\n")
    assert out["available"] is False and out["imported"] is False
    assert "macOS" in out["reason"]
