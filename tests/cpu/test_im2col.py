"""Tests for metalnn.cpu.im2col (native im2col / col2im primitives with MLX-op fallbacks).

References: torch.nn.functional.unfold / fold (2-D, and 1-D as 2-D with a unit axis) and
an independent numpy implementation for every rank; gradients against torch autograd and
the numpy adjoint. Every test runs on the native primitives (2 threads and 1 thread) and
on the MLX-op fallback.
"""

import io
import itertools
import math
import platform
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import metalnn.cpu.im2col as ic
import mlx.core as mx

NATIVE_PLATFORM = sys.platform.startswith("linux") and platform.machine() == "x86_64"

# col2im sums up to K = prod(kernel) float32 values of magnitude <= ~5: the float32 result
# differs from the float64 reference by at most K * 2^-24 * sum|terms| ~ 1e-5 for K = 27.
SUM_ATOL, SUM_RTOL = 1e-5, 1e-6


# ----------------------------------------------------------------------------- references


def np_out(size, k, s, p, d):
    return tuple((si + 2 * pi - di * (ki - 1) - 1) // st + 1 for si, ki, st, pi, di in zip(size, k, s, p, d))


def np_im2col(x, k, s, p, d):
    """numpy im2col for any rank: [N, C, *S] -> [N, C*K, L]."""
    n, c = x.shape[:2]
    out = np_out(x.shape[2:], k, s, p, d)
    xp = np.pad(x, [(0, 0), (0, 0)] + [(pi, pi) for pi in p])
    rows = []
    for offs in itertools.product(*[range(ki) for ki in k]):
        idx = (slice(None), slice(None)) + tuple(
            slice(o * di, o * di + si * (oi - 1) + 1, si) for o, di, si, oi in zip(offs, d, s, out)
        )
        rows.append(xp[idx].reshape(n, c, -1))
    return np.stack(rows, axis=2).reshape(n, c * len(rows), -1)


def np_col2im(cols, size, k, s, p, d):
    """numpy col2im (explicit scatter-add loops) in float64: [N, C*K, L] -> [N, C, *size]."""
    K = math.prod(k)
    n, ck, _ = cols.shape
    c = ck // K
    out = np_out(size, k, s, p, d)
    padded = np.zeros((n, c) + tuple(si + 2 * pi for si, pi in zip(size, p)))
    cols = cols.reshape(n, c, K, *out).astype(np.float64)
    for ki, offs in enumerate(itertools.product(*[range(kk) for kk in k])):
        for pos in itertools.product(*[range(o) for o in out]):
            target = tuple(q * st + o * di for q, st, o, di in zip(pos, s, offs, d))
            padded[(slice(None), slice(None)) + target] += cols[(slice(None), slice(None), ki) + pos]
    crop = (slice(None), slice(None)) + tuple(slice(pi, pi + si) for pi, si in zip(p, size))
    return padded[crop]


def torch_unfold(x, k, s, p, d):
    """torch reference for 1-D and 2-D (1-D as 2-D with a unit axis)."""
    t = torch.from_numpy(np.asarray(x, dtype=np.float64))
    if len(k) == 1:
        t, k, s, p, d = t[:, :, None, :], (1, *k), (1, *s), (0, *p), (1, *d)
    return F.unfold(t, k, dilation=d, padding=p, stride=s).numpy()


def torch_fold(cols, size, k, s, p, d):
    t = torch.from_numpy(np.asarray(cols, dtype=np.float64))
    if len(k) == 1:
        y = F.fold(t, (1, *size), (1, *k), dilation=(1, *d), padding=(0, *p), stride=(1, *s))
        return y[:, :, 0, :].numpy()
    return F.fold(t, size, k, dilation=d, padding=p, stride=s).numpy()


def primitives(*arrays) -> set[str]:
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return {line.split('label ="', 1)[1].split('"', 1)[0] for line in buf.getvalue().splitlines() if 'label ="' in line}


# (name, input shape [N, C, *S], kernel, stride, padding, dilation)
CASES = [
    ("1d", (2, 3, 17), (3,), (2,), (1,), (2,)),
    ("1d_k1", (1, 4, 9), (1,), (1,), (0,), (1,)),
    ("2d_3x3_same", (2, 3, 8, 9), (3, 3), (1, 1), (1, 1), (1, 1)),
    ("2d_mixed", (2, 2, 11, 10), (2, 3), (2, 1), (0, 2), (2, 1)),
    ("2d_stride_gt_kernel", (1, 3, 13, 12), (2, 2), (3, 4), (1, 0), (1, 1)),
    ("2d_wide_pad", (1, 2, 5, 6), (3, 3), (1, 2), (3, 2), (1, 2)),
    ("2d_1x1", (3, 5, 4, 7), (1, 1), (1, 1), (0, 0), (1, 1)),
    ("3d", (2, 2, 5, 6, 7), (2, 3, 2), (1, 2, 1), (1, 0, 1), (1, 1, 2)),
    ("3d_cube", (1, 3, 6, 6, 6), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1)),
]
CASE_IDS = [c[0] for c in CASES]


@pytest.fixture(params=["native", "native_1thread", "mlx_ops"])
def path(request, monkeypatch):
    if request.param == "mlx_ops":
        monkeypatch.setattr(ic, "_ext", None)  # as without the extension
        yield request.param
        return
    if not ic.available():
        if NATIVE_PLATFORM:
            pytest.fail(f"native im2col unavailable: {ic.unavailable_reason()}")
        pytest.skip(f"no native primitives on this platform ({ic.unavailable_reason()})")
    old = ic.get_num_threads()
    ic.set_num_threads(1 if request.param == "native_1thread" else 2)
    try:
        yield request.param
    finally:
        ic.set_num_threads(old)


def _rand(shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _check_native(path, arrays, names):
    found = primitives(*arrays)
    if path == "mlx_ops":
        assert not ({"Im2Col", "Col2Im"} & found), found
    else:
        assert set(names) <= found, found


def test_extension_is_built_here():
    if NATIVE_PLATFORM:
        assert ic.available(), ic.unavailable_reason()
    assert ic.available() == (ic.unavailable_reason() is None)


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("name,shape,k,s,p,d", CASES, ids=CASE_IDS)
def test_im2col_values(name, shape, k, s, p, d, path):
    x = _rand(shape, seed=1)
    cols = ic.im2col(mx.array(x), k, stride=s, padding=p, dilation=d)
    _check_native(path, [cols], ["Im2Col"])
    ref = np_im2col(x, k, s, p, d)
    np.testing.assert_array_equal(np.array(cols), ref)  # pure data movement: exact
    if len(k) <= 2:
        np.testing.assert_array_equal(np.array(cols), torch_unfold(x, k, s, p, d).astype(np.float32))


@pytest.mark.parametrize("name,shape,k,s,p,d", CASES, ids=CASE_IDS)
def test_col2im_values(name, shape, k, s, p, d, path):
    size = shape[2:]
    L = math.prod(np_out(size, k, s, p, d))
    cols = _rand((shape[0], shape[1] * math.prod(k), L), seed=2)
    y = ic.col2im(mx.array(cols), size, k, stride=s, padding=p, dilation=d)
    _check_native(path, [y], ["Col2Im"])
    assert y.shape == tuple(shape) and y.dtype == mx.float32
    ref = np_col2im(cols, size, k, s, p, d)
    np.testing.assert_allclose(np.array(y), ref, rtol=SUM_RTOL, atol=SUM_ATOL)
    if len(k) <= 2:
        np.testing.assert_allclose(np.array(y), torch_fold(cols, size, k, s, p, d), rtol=SUM_RTOL, atol=SUM_ATOL)


def test_floor_of_output_size(path):
    # windows that do not reach the end: the remainder is dropped (as in torch), and col2im
    # leaves those positions at zero
    x = _rand((1, 2, 10, 11), seed=3)
    k, s, p, d = (3, 4), (4, 3), (0, 0), (1, 1)
    cols = ic.im2col(mx.array(x), k, stride=s, padding=p, dilation=d)
    np.testing.assert_array_equal(np.array(cols), torch_unfold(x, k, s, p, d).astype(np.float32))
    y = np.array(ic.col2im(cols, (10, 11), k, stride=s, padding=p, dilation=d))
    np.testing.assert_allclose(y, torch_fold(np.array(cols), (10, 11), k, s, p, d), rtol=SUM_RTOL, atol=SUM_ATOL)
    # rows: windows start at 0 and 4 (3 high), so 3 and 7..9 are untouched; columns: at 0, 3
    # and 6 (4 wide), so 10 is untouched
    rows, cols_ = [0, 1, 2, 4, 5, 6], list(range(10))
    assert np.all(y[:, :, [3, 7, 8, 9], :] == 0) and np.all(y[:, :, :, 10:] == 0)
    assert np.all(y[:, :, rows][:, :, :, cols_] != 0)


# ----------------------------------------------------------------------------- layouts and dtypes


def test_non_contiguous_inputs(path):
    base = _rand((3, 7, 9, 4), seed=4)  # a channels-last batch
    xb = mx.array(base)
    views = {
        "nhwc_to_nchw": (xb.transpose(0, 3, 1, 2), base.transpose(0, 3, 1, 2)),
        "strided": (xb.transpose(0, 3, 1, 2)[:, ::2, ::2, 1::2], base.transpose(0, 3, 1, 2)[:, ::2, ::2, 1::2]),
        "reversed_w": (xb.transpose(0, 3, 1, 2)[..., ::-1], base.transpose(0, 3, 1, 2)[..., ::-1]),
        "broadcast_batch": (mx.broadcast_to(xb[:1].transpose(0, 3, 1, 2), (3, 4, 7, 9)),
                            np.broadcast_to(base[:1].transpose(0, 3, 1, 2), (3, 4, 7, 9))),
    }
    k, s, p, d = (3, 2), (1, 2), (1, 1), (2, 1)
    for label, (xm, xn) in views.items():
        cols = ic.im2col(xm, k, stride=s, padding=p, dilation=d)
        np.testing.assert_array_equal(np.array(cols), np_im2col(np.ascontiguousarray(xn), k, s, p, d), err_msg=label)
    # col2im of a transposed (non-contiguous) column matrix
    out = np_out((7, 9), k, s, p, d)
    c_t = _rand((math.prod(out), 3, 4 * 6), seed=5)
    cm = mx.array(c_t).transpose(1, 2, 0)
    y = ic.col2im(cm, (7, 9), k, stride=s, padding=p, dilation=d)
    ref = np_col2im(np.ascontiguousarray(c_t.transpose(1, 2, 0)), (7, 9), k, s, p, d)
    np.testing.assert_allclose(np.array(y), ref, rtol=SUM_RTOL, atol=SUM_ATOL)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float64, mx.int32, mx.uint8, mx.bool_],
                         ids=["float16", "bfloat16", "float64", "int32", "uint8", "bool"])
def test_im2col_dtypes(dtype, path):
    x = mx.array(_rand((2, 3, 6, 5), seed=6, scale=4.0)).astype(dtype)
    if dtype == mx.float64:  # all 64 bits significant, not a widened float32
        x = mx.array(np.random.default_rng(6).standard_normal((2, 3, 6, 5)), dtype=mx.float64)
    k, s, p, d = (2, 3), (1, 2), (1, 1), (1, 1)
    cols = ic.im2col(x, k, stride=s, padding=p, dilation=d, stream=mx.cpu)
    assert cols.dtype == dtype
    xn = np.array(x.astype(mx.float32) if dtype == mx.bfloat16 else x)
    np.testing.assert_array_equal(np.array(cols.astype(mx.float32) if dtype == mx.bfloat16 else cols),
                                  np_im2col(xn, k, s, p, d))


# float16 keeps 11 significant bits, bfloat16 8: col2im sums in float32 and rounds once,
# so the result is within half a unit (2^-11 / 2^-8 relative) of the exact sum, plus the
# float32 summation error.
HALF_RTOL = {mx.float16: 2**-11 * 1.01, mx.bfloat16: 2**-8 * 1.01}


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float64], ids=["float16", "bfloat16", "float64"])
def test_col2im_dtypes(dtype, path):
    k, s, p, d = (3, 3), (1, 1), (1, 1), (1, 1)
    cols32 = _rand((2, 2 * 9, 30), seed=7)
    if dtype == mx.float64:
        cols = mx.array(np.random.default_rng(7).standard_normal((2, 18, 30)), dtype=mx.float64)
    else:
        cols = mx.array(cols32).astype(dtype)
    y = ic.col2im(cols, (5, 6), k, stride=s, padding=p, dilation=d, stream=mx.cpu)
    assert y.dtype == dtype
    exact = np_col2im(np.array(cols.astype(mx.float32)) if dtype != mx.float64 else np.array(cols), (5, 6), k, s, p, d)
    got = np.array(y.astype(mx.float32)) if dtype != mx.float64 else np.array(y)
    if dtype == mx.float64:
        np.testing.assert_allclose(got, exact, rtol=1e-12, atol=1e-12)
    else:
        np.testing.assert_allclose(got, exact, rtol=HALF_RTOL[dtype], atol=1e-6)


def test_native_false_gives_the_mlx_op_form():
    x = mx.array(_rand((2, 3, 6, 7), seed=30))
    cols = ic.im2col(x, 3, padding=1, native=False)
    back = ic.col2im(cols, (6, 7), 3, padding=1, native=False)
    assert not ({"Im2Col", "Col2Im"} & primitives(cols, back))
    np.testing.assert_array_equal(np.array(cols), np_im2col(np.array(x), (3, 3), (1, 1), (1, 1), (1, 1)))
    ref = np_col2im(np.array(cols), (6, 7), (3, 3), (1, 1), (1, 1), (1, 1))
    np.testing.assert_allclose(np.array(back), ref, rtol=SUM_RTOL, atol=SUM_ATOL)


def test_col2im_rejects_integers():
    with pytest.raises(TypeError, match=r"col2im: sums overlapping windows, so cols must be floating point, got"):
        ic.col2im(mx.zeros((1, 9, 4), dtype=mx.int32), (2, 2), 3, padding=1)


# ----------------------------------------------------------------------------- autodiff


@pytest.mark.parametrize("name,shape,k,s,p,d", CASES, ids=CASE_IDS)
def test_im2col_grad(name, shape, k, s, p, d, path):
    x = _rand(shape, seed=8)
    L = math.prod(np_out(shape[2:], k, s, p, d))
    w = _rand((shape[0], shape[1] * math.prod(k), L), seed=9)
    g = mx.grad(lambda t: (ic.im2col(t, k, stride=s, padding=p, dilation=d) * mx.array(w)).sum())(mx.array(x))
    _check_native(path, [g], ["Col2Im"])
    # d/dx sum(im2col(x) * w) = col2im(w)
    np.testing.assert_allclose(np.array(g), np_col2im(w, shape[2:], k, s, p, d), rtol=SUM_RTOL, atol=SUM_ATOL)
    if len(k) <= 2:
        t = torch.from_numpy(x.astype(np.float64)).requires_grad_(True)
        tt = t[:, :, None, :] if len(k) == 1 else t
        kk, ss, pp, dd = ((1, *k), (1, *s), (0, *p), (1, *d)) if len(k) == 1 else (k, s, p, d)
        (tg,) = torch.autograd.grad((F.unfold(tt, kk, dd, pp, ss) * torch.from_numpy(w.astype(np.float64))).sum(), t)
        np.testing.assert_allclose(np.array(g), tg.numpy(), rtol=SUM_RTOL, atol=SUM_ATOL)


@pytest.mark.parametrize("name,shape,k,s,p,d", CASES, ids=CASE_IDS)
def test_col2im_grad(name, shape, k, s, p, d, path):
    size = shape[2:]
    L = math.prod(np_out(size, k, s, p, d))
    cols = _rand((shape[0], shape[1] * math.prod(k), L), seed=10)
    w = _rand(shape, seed=11)
    g = mx.grad(lambda c: (ic.col2im(c, size, k, stride=s, padding=p, dilation=d) * mx.array(w)).sum())(mx.array(cols))
    _check_native(path, [g], ["Im2Col"])
    # d/dcols sum(col2im(cols) * w) = im2col(w): exact copies of w
    np.testing.assert_array_equal(np.array(g), np_im2col(w, k, s, p, d))


def test_jvp_vjp_and_second_order(path):
    k, s, p, d = (3, 2), (2, 1), (1, 0), (1, 2)
    x = mx.array(_rand((2, 3, 7, 8), seed=12))
    tx = mx.array(_rand((2, 3, 7, 8), seed=13))
    (y,), (jy,) = mx.jvp(lambda t: ic.im2col(t, k, stride=s, padding=p, dilation=d), [x], [tx])
    np.testing.assert_array_equal(np.array(jy), np_im2col(np.array(tx), k, s, p, d))  # linear
    ct = mx.array(_rand(y.shape, seed=14))
    _, (vx,) = mx.vjp(lambda t: ic.im2col(t, k, stride=s, padding=p, dilation=d), [x], [ct])
    np.testing.assert_allclose(np.array(vx), np_col2im(np.array(ct), (7, 8), k, s, p, d), rtol=SUM_RTOL, atol=SUM_ATOL)
    # the gradient of a quadratic form goes through both primitives
    f = lambda t: (ic.im2col(t, k, stride=s, padding=p, dilation=d) ** 2).sum()  # noqa: E731
    hv = mx.jvp(mx.grad(f), [x], [tx])[1][0]
    # Hessian of sum(im2col(x)^2) is 2 col2im(im2col(.))
    ref = 2 * np_col2im(np_im2col(np.array(tx), k, s, p, d), (7, 8), k, s, p, d)
    np.testing.assert_allclose(np.array(hv), ref, rtol=SUM_RTOL, atol=SUM_ATOL)


def test_vmap(path):
    k, s, p, d = (2, 2), (1, 1), (0, 1), (1, 1)
    x = _rand((4, 2, 3, 5, 6), seed=15)  # mapped axis first, then [N, C, H, W]
    for axis in (0, 2):
        xs = np.moveaxis(x, 0, axis)
        y = mx.vmap(lambda t: ic.im2col(t, k, stride=s, padding=p, dilation=d), in_axes=axis)(mx.array(xs))
        ref = np.stack([np_im2col(x[i], k, s, p, d) for i in range(4)])
        np.testing.assert_array_equal(np.array(y), ref)
    cols = np.stack([np_im2col(x[i], k, s, p, d) for i in range(4)])
    y = mx.vmap(lambda c: ic.col2im(c, (5, 6), k, stride=s, padding=p, dilation=d), in_axes=1)(
        mx.array(np.moveaxis(cols, 0, 1)))
    ref = np.stack([np_col2im(cols[i], (5, 6), k, s, p, d) for i in range(4)])
    np.testing.assert_allclose(np.array(y), ref, rtol=SUM_RTOL, atol=SUM_ATOL)


def test_inside_compile(path):
    k, s, p, d = (3, 3), (2, 2), (1, 1), (1, 1)
    w = _rand((4, 2 * 9), seed=16)

    def conv_like(t):
        return (mx.array(w) @ ic.im2col(t, k, stride=s, padding=p, dilation=d)).sum()

    g = mx.compile(mx.grad(conv_like))
    # shapeless graphs need every op to infer its output shape; MLX's pad (in the fallback)
    # cannot, the native primitives can
    gs = mx.compile(mx.grad(conv_like), shapeless=True) if path != "mlx_ops" else g
    for n in (1, 3):  # a new batch size: retraced, and reused by the shapeless graph
        x = mx.array(_rand((n, 2, 8, 8), seed=17 + n))
        L = math.prod(np_out((8, 8), k, s, p, d))
        ref = np_col2im(np.broadcast_to(w.sum(0)[None, :, None], (n, 18, L)).copy(), (8, 8), k, s, p, d)
        np.testing.assert_allclose(np.array(g(x)), ref, rtol=SUM_RTOL, atol=SUM_ATOL)
        np.testing.assert_allclose(np.array(gs(x)), ref, rtol=SUM_RTOL, atol=SUM_ATOL)


# ----------------------------------------------------------------------------- threads and streams


@pytest.mark.skipif(not NATIVE_PLATFORM, reason="thread counts of the native primitives")
def test_threads_give_identical_results():
    if not ic.available():
        pytest.fail(ic.unavailable_reason())
    x = mx.array(_rand((8, 16, 33, 35), seed=20))
    k, s, p, d = (3, 3), (1, 1), (1, 1), (1, 1)
    old = ic.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            ic.set_num_threads(threads)
            assert ic.get_num_threads() == threads
            cols = ic.im2col(x, k, stride=s, padding=p, dilation=d)
            back = ic.col2im(cols, (33, 35), k, stride=s, padding=p, dilation=d)
            mx.eval(cols, back)
            results.append((np.array(cols), np.array(back)))
    finally:
        ic.set_num_threads(old)
    for cols, back in results[1:]:
        np.testing.assert_array_equal(cols, results[0][0])
        np.testing.assert_array_equal(back, results[0][1])  # each plane is summed by one thread


def test_two_cpu_streams_at_once(path):
    x = mx.array(_rand((4, 8, 30, 30), seed=21))
    k = (3, 3)
    s1, s2 = mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)
    outs = [ic.col2im(ic.im2col(x, k, padding=1, stream=st), (30, 30), k, padding=1, stream=st)
            for st in (s1, s2, s1, s2)]
    mx.eval(*outs)
    ref = np_col2im(np_im2col(np.array(x), k, (1, 1), (1, 1), (1, 1)), (30, 30), k, (1, 1), (1, 1), (1, 1))
    for o in outs:
        np.testing.assert_allclose(np.array(o), ref, rtol=SUM_RTOL, atol=SUM_ATOL)


# ----------------------------------------------------------------------------- convolution recipes


def test_conv2d_and_transpose_recipes_match_torch(path):
    """The formulations the conv reference path can use: conv = W @ im2col(x), transposed
    conv = col2im(W^T @ x); values and gradients (through MLX autodiff) against torch."""
    n, c, o, g = 2, 4, 6, 2
    k, s, p, d = (3, 2), (2, 1), (1, 1), (1, 2)
    x = _rand((n, c, 9, 8), seed=22)
    w = _rand((o, c // g, *k), seed=23)
    out = np_out((9, 8), k, s, p, d)

    def conv(xm, wm):
        cols = ic.im2col(xm, k, stride=s, padding=p, dilation=d).reshape(n, g, (c // g) * 6, -1)
        y = wm.reshape(g, o // g, -1) @ cols
        return y.reshape(n, o, *out)

    y, grads = mx.value_and_grad(lambda a, b: (conv(a, b) ** 2).sum(), argnums=(0, 1))(mx.array(x), mx.array(w))
    tx, tw = (torch.from_numpy(a.astype(np.float64)).requires_grad_(True) for a in (x, w))
    ty = F.conv2d(tx, tw, stride=s, padding=p, dilation=d, groups=g)
    tgrads = torch.autograd.grad((ty ** 2).sum(), (tx, tw))
    np.testing.assert_allclose(float(y), float((ty ** 2).sum().detach()), rtol=1e-5)
    for a, b in zip(grads, tgrads):
        np.testing.assert_allclose(np.array(a), b.numpy(), rtol=1e-4, atol=1e-4)  # sums over 100s of products

    # transposed conv: x2 [N, O, *out] -> [N, C, 9, 8] with weight [O, C/G, *k]
    x2 = _rand((n, o, *out), seed=24)
    wt = _rand((o, c // g, *k), seed=25)

    def tconv(xm, wm):
        wg = wm.reshape(g, o // g, (c // g) * 6).swapaxes(1, 2)  # [G, C/G*K, O/G]
        cols = (wg @ xm.reshape(n, g, o // g, -1)).reshape(n, c * 6, -1)
        return ic.col2im(cols, (9, 8), k, stride=s, padding=p, dilation=d)

    y2, grads2 = mx.value_and_grad(lambda a, b: (tconv(a, b) ** 2).sum(), argnums=(0, 1))(mx.array(x2), mx.array(wt))
    tx2, tw2 = (torch.from_numpy(a.astype(np.float64)).requires_grad_(True) for a in (x2, wt))
    # output_padding recovers the sizes the floor dropped
    opad = tuple(si - ((oi - 1) * st - 2 * pi + di * (ki - 1) + 1) for si, oi, st, pi, di, ki in
                 zip((9, 8), out, s, p, d, k))
    ty2 = F.conv_transpose2d(tx2, tw2, stride=s, padding=p, output_padding=opad, dilation=d, groups=g)
    tgrads2 = torch.autograd.grad((ty2 ** 2).sum(), (tx2, tw2))
    np.testing.assert_allclose(float(y2), float((ty2 ** 2).sum().detach()), rtol=1e-5)
    for a, b in zip(grads2, tgrads2):
        np.testing.assert_allclose(np.array(a), b.numpy(), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- errors


def test_bad_arguments_are_named():
    x = mx.zeros((1, 2, 5, 5))
    with pytest.raises(ValueError, match=r"im2col: x must be \[N, C, \*spatial\] with 1 to 3 spatial axes, got shape \(5, 5\)"):
        ic.im2col(mx.zeros((5, 5)), 3)
    with pytest.raises(ValueError, match=r"im2col: kernel_size must be an int or a tuple of 2 ints, got \(3, 3, 3\)"):
        ic.im2col(x, (3, 3, 3))
    with pytest.raises(ValueError, match=r"im2col: stride must be >= 1, got 0"):
        ic.im2col(x, 3, stride=0)
    with pytest.raises(ValueError, match=r"im2col: padding must be >= 0, got -1"):
        ic.im2col(x, 3, padding=-1)
    with pytest.raises(ValueError, match=r"im2col: a window of kernel_size \(7, 7\), dilation \(1, 1\) does not fit"):
        ic.im2col(x, 7)
    with pytest.raises(ValueError, match=r"col2im: expected cols \[N, C\*9, 25\] for output_size \(5, 5\)"):
        ic.col2im(mx.zeros((1, 9, 24)), (5, 5), 3, padding=1)
    with pytest.raises(ValueError, match=r"col2im: output_size must be a tuple of 1 to 3 spatial sizes, got 5"):
        ic.col2im(mx.zeros((1, 9, 25)), 5, 3, padding=1)
    with pytest.raises(TypeError, match=r"im2col: x must be an mx.array, got ndarray"):
        ic.im2col(np.zeros((1, 1, 3, 3)), 1)
