"""Tests for metalnn.cpu.qmatmul (native affine-quantized products and dequantize, MLX-op fallbacks).

References: a numpy decoding of the packed words (each row a little-endian bit stream, values
``scales * q + biases``) with float64 products; MLX's own ``mx.dequantize`` and
``mx.quantized_matmul`` (values and gradients through ``mx.grad``). Every test runs on the AVX2
kernels with 1, 2 and 3 threads, on the portable kernels, and on the MLX-op fallback.

Tolerances: the products sum K <= 384 float32 terms of size ~|x| |w| ~ 1 in a different order
(and group by group) than float64, so they agree to ~K * 2^-24 * sum|terms| ~ 2e-4 absolute at
most; 1e-4 relative and 5e-4 absolute. Half-precision results are rounded once at the end
(float16 ~5e-4, bfloat16 ~4e-3 relative) from a float32 sum, against MLX's own half products.
Dequantized values are ``s * q + b`` rounded once (fused or not): within an ulp of the larger
term (|s q|, |b| < 4 here), so 1e-6 absolute where the two cancel, 2e-7 relative elsewhere.
"""

import io
import platform
import sys

import numpy as np
import pytest

import metalnn as mn
import metalnn.cpu.im2col as ic
import metalnn.cpu.qmatmul as qm
import mlx.core as mx

NATIVE_PLATFORM = sys.platform.startswith("linux") and platform.machine() == "x86_64"
ATOL, RTOL = 5e-4, 1e-4
DQ_ATOL, DQ_RTOL = 1e-6, 2e-7
BITS = [1, 2, 3, 4, 5, 6, 8]
GROUPS = [32, 64, 128]


def primitives(*arrays) -> set[str]:
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return {line.split('label ="', 1)[1].split('"', 1)[0] for line in buf.getvalue().splitlines() if 'label ="' in line}


@pytest.fixture(params=["avx2_2threads", "avx2_1thread", "avx2_3threads", "portable", "mlx_ops"])
def path(request, monkeypatch):
    if request.param == "mlx_ops":
        monkeypatch.setattr(qm, "_ext", None)  # as without the extension
        yield request.param
        return
    if not qm.available():
        if NATIVE_PLATFORM:
            pytest.fail(f"native quantized kernels unavailable: {qm.unavailable_reason()}")
        pytest.skip(f"no native primitives on this platform ({qm.unavailable_reason()})")
    ext = qm._ext
    threads = {"avx2_1thread": 1, "avx2_3threads": 3}.get(request.param, 2)
    old_threads, old_scalar = ic.get_num_threads(), ext.get_quantized_force_scalar()
    ic.set_num_threads(threads)
    ext.set_quantized_force_scalar(request.param == "portable")
    try:
        yield request.param
    finally:
        ic.set_num_threads(old_threads)
        ext.set_quantized_force_scalar(old_scalar)


def quantized(n, k, group, bits, seed=0, dtype=mx.float32):
    """Packed weight, scales, biases (scales/biases in ``dtype``) and the float64 matrix they stand for."""
    w = mx.array(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32))
    wq, s, b = mx.quantize(w, group, bits)
    s, b = s.astype(dtype), b.astype(dtype)
    return wq, s, b, np_dequantize(wq, s, b, group, bits)


def np_dequantize(wq, s, b, group, bits):
    """Independent decoding: bit ``j`` of value ``i`` is bit ``i * bits + j`` of the row's bytes."""
    raw = np.array(wq).view(np.uint8)
    stream = np.unpackbits(raw, axis=1, bitorder="little").astype(np.int64)
    k = raw.shape[1] * 8 // bits
    q = (stream[:, : k * bits].reshape(raw.shape[0], k, bits) << np.arange(bits)).sum(-1)
    s64 = np.repeat(np.array(s.astype(mx.float32), dtype=np.float64), group, axis=1)
    b64 = np.repeat(np.array(b.astype(mx.float32), dtype=np.float64), group, axis=1)
    return s64 * q + b64


def rand(shape, seed):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def check(y, expected, scale=1.0):
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), expected, atol=ATOL * scale, rtol=RTOL * scale)


def test_extension_is_built_here():
    if NATIVE_PLATFORM:
        assert qm.available(), qm.unavailable_reason()
    assert qm.available() == (qm.unavailable_reason() is None)


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_products_and_dequantize_match_numpy(path, bits, group):
    wq, s, b, W = quantized(37, 384, group, bits, seed=bits * group)
    x = rand((2, 384), 0)
    names = primitives(qm.quantized_matmul(x, wq, s, b, group_size=group, bits=bits),
                       qm.dequantize(wq, s, b, group_size=group, bits=bits))  # before any evaluation
    if path == "mlx_ops":
        assert not ({"AffineQuantizedMatmul", "AffineDequantize"} & names), names
    else:
        assert {"AffineQuantizedMatmul", "AffineDequantize"} <= names, names
    for m in (1, 3, 5, 13):
        x = rand((m, 384), m)
        y = qm.quantized_matmul(x, wq, s, b, group_size=group, bits=bits)
        assert y.shape == (m, 37) and y.dtype == mx.float32
        check(y, np.array(x, dtype=np.float64) @ W.T)
        g = rand((m, 37), m + 100)
        yt = qm.quantized_matmul(g, wq, s, b, transpose=False, group_size=group, bits=bits)
        assert yt.shape == (m, 384)
        check(yt, np.array(g, dtype=np.float64) @ W)
    d = qm.dequantize(wq, s, b, group_size=group, bits=bits)
    assert d.dtype == mx.float32
    np.testing.assert_allclose(np.array(d), W, rtol=DQ_RTOL, atol=DQ_ATOL)
    np.testing.assert_allclose(np.array(d), np.array(mx.dequantize(wq, s, b, group, bits)), rtol=DQ_RTOL, atol=DQ_ATOL)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_products_large_enough_to_split_across_threads(path, bits):
    # 2^18 multiply-adds or more per product are shared among the threads (rows of W for x @ W.T,
    # column groups for g @ W, rows for dequantize); an odd number of rows.
    wq, s, b, W = quantized(2051, 512, 64, bits, seed=bits)
    for m in (1, 2):
        x, g = rand((m, 512), m), rand((m, 2051), m + 10)
        check(qm.quantized_matmul(x, wq, s, b, group_size=64, bits=bits), np.array(x, dtype=np.float64) @ W.T)
        check(qm.quantized_matmul(g, wq, s, b, transpose=False, group_size=64, bits=bits),
              np.array(g, dtype=np.float64) @ W, scale=4)  # sums of 2051 terms
    np.testing.assert_allclose(np.array(qm.dequantize(wq, s, b, group_size=64, bits=bits)), W, rtol=DQ_RTOL,
                               atol=DQ_ATOL)


def test_matches_mlx_quantized_matmul_on_odd_shapes(path):
    # leading axes, a single output row, widths of one group
    for (n, k, group, bits, xshape) in [(1, 32, 32, 4, (2, 3, 32)), (5, 64, 64, 8, (1, 64)), (129, 128, 128, 3, (7, 128)),
                                        (3, 96, 32, 6, (4, 1, 96)), (64, 256, 64, 2, (256,))]:
        wq, s, b, W = quantized(n, k, group, bits, seed=n)
        x = rand(xshape, k)
        y = qm.quantized_matmul(x, wq, s, b, group_size=group, bits=bits)
        ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits)
        assert y.shape == ref.shape == (*xshape[:-1], n)
        check(y, np.array(ref))
        check(y, np.array(x, dtype=np.float64) @ W.T)


def test_non_contiguous_inputs(path):
    wq, s, b, W = quantized(40, 256, 64, 4, seed=3)
    base = rand((256, 6), 4)
    for x in (base.T, rand((6, 512), 5)[:, ::2], rand((3, 4, 256), 6)[:, 1:3].swapaxes(0, 1)):
        y = qm.quantized_matmul(x, wq, s, b, group_size=64, bits=4)
        check(y, np.array(x, dtype=np.float64) @ W.T)
    # a strided weight / scales / biases (every other row)
    wq2, s2, b2, W2 = quantized(80, 256, 64, 4, seed=7)
    x = rand((3, 256), 8)
    y = qm.quantized_matmul(x, wq2[::2], s2[::2], b2[::2], group_size=64, bits=4)
    check(y, np.array(x, dtype=np.float64) @ W2[::2].T)
    d = qm.dequantize(wq2[::2], s2[::2], b2[::2], group_size=64, bits=4)
    np.testing.assert_allclose(np.array(d), W2[::2], rtol=DQ_RTOL, atol=DQ_ATOL)


@pytest.mark.parametrize("xdtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("sdtype", [mx.float32, mx.float16, mx.bfloat16])
def test_dtypes_follow_mlx(path, xdtype, sdtype):
    wq, s, b, W = quantized(33, 128, 32, 4, seed=11, dtype=sdtype)
    x = rand((2, 128), 12).astype(xdtype)
    y = qm.quantized_matmul(x, wq, s, b, group_size=32, bits=4)
    ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=32, bits=4)
    assert y.dtype == ref.dtype
    if path == "mlx_ops":  # the fallback is MLX's op itself (which accumulates half inputs in half)
        assert mx.array_equal(y, ref)
    else:  # half-precision results: one rounding of the float32 sum (see the module docstring)
        scale = {mx.float32: 1.0, mx.float16: 10.0, mx.bfloat16: 80.0}[y.dtype]
        check(y, np.array(x.astype(mx.float32), dtype=np.float64) @ W.T, scale=scale)
    d = qm.dequantize(wq, s, b, group_size=32, bits=4)
    assert d.dtype == sdtype == mx.dequantize(wq, s, b, 32, 4).dtype


# ----------------------------------------------------------------------------- gradients and transforms


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (3, 128), (2, 32)])
def test_input_gradient_matches_mlx_and_numpy(path, bits, group):
    wq, s, b, W = quantized(45, 256, group, bits, seed=bits)
    x, c = rand((3, 256), 1), rand((3, 45), 2)

    def f(v):
        return (qm.quantized_matmul(v, wq, s, b, group_size=group, bits=bits) * c).sum()

    def ref(v):
        return (mx.quantized_matmul(v, wq, s, b, transpose=True, group_size=group, bits=bits) * c).sum()

    dx = mx.grad(f)(x)
    check(dx, np.array(c, dtype=np.float64) @ W)
    check(dx, np.array(mx.grad(ref)(x)))
    # the transposed product's input gradient is the direct product
    g = rand((3, 256), 3)
    dg = mx.grad(lambda v: (qm.quantized_matmul(v, wq, s, b, transpose=False, group_size=group, bits=bits) * g).sum())(c)
    check(dg, np.array(g, dtype=np.float64) @ W.T)


def test_scale_and_bias_gradients_are_mlx_ones(path):
    wq, s, b, _ = quantized(20, 128, 64, 4, seed=5)
    x = rand((2, 128), 6)

    def f(sv, bv, fn):
        return (fn(sv, bv) ** 2).sum()

    ours = mx.grad(f, argnums=(0, 1))(s, b, lambda sv, bv: qm.quantized_matmul(x, wq, sv, bv, group_size=64, bits=4))
    theirs = mx.grad(f, argnums=(0, 1))(s, b, lambda sv, bv: mx.quantized_matmul(x, wq, sv, bv, True, 64, 4))
    for a, r in zip(ours, theirs):
        check(a, np.array(r), scale=10)  # squares of sums of 128 terms: larger magnitudes
    dq = mx.grad(lambda sv: qm.dequantize(wq, sv, b, group_size=64, bits=4).sum())(s)
    check(dq, np.array(mx.grad(lambda sv: mx.dequantize(wq, sv, b, 64, 4).sum())(s)))
    with pytest.raises(RuntimeError, match="no gradient wrt the quantized weights"):
        mx.grad(lambda w: qm.quantized_matmul(x, w, s, b, group_size=64, bits=4).sum())(wq)


def test_jvp_vmap_and_compile(path):
    wq, s, b, W = quantized(24, 128, 32, 8, seed=9)
    x, t = rand((2, 128), 1), rand((2, 128), 2)

    def f(v):
        return qm.quantized_matmul(v, wq, s, b, group_size=32, bits=8)

    _, (jv,) = mx.jvp(f, [x], [t])
    check(jv, np.array(t, dtype=np.float64) @ W.T)
    xs = rand((5, 2, 128), 3)
    if path != "mlx_ops":  # MLX's own QuantizedMatmul has no vmap
        check(mx.vmap(f, in_axes=1)(xs.swapaxes(0, 1)), np.array(xs, dtype=np.float64) @ W.T)
    compiled = mx.compile(f)
    check(compiled(x), np.array(x, dtype=np.float64) @ W.T)
    check(compiled(t), np.array(t, dtype=np.float64) @ W.T)


# ----------------------------------------------------------------------------- errors and dispatch


def test_bad_arguments_are_named():
    if not qm.available():
        if NATIVE_PLATFORM:
            pytest.fail(f"native quantized kernels unavailable: {qm.unavailable_reason()}")
        pytest.skip(qm.unavailable_reason())
    ext = qm._ext
    wq, s, b, _ = quantized(8, 64, 32, 4)
    x = rand((1, 64), 0)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        ext.quantized_matmul(rand((1, 63), 0), wq, s, b, group_size=32, bits=4)
    with pytest.raises(ValueError, match="bits must be one of"):
        ext.quantized_matmul(x, wq, s, b, group_size=32, bits=7)
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        ext.dequantize(wq, s, b, group_size=16, bits=4)
    with pytest.raises(ValueError, match=r"scales and biases must have shape \(8,2\)"):
        ext.quantized_matmul(x, wq, s[:, :1], b[:, :1], group_size=32, bits=4)
    with pytest.raises(ValueError, match="packed uint32 weight"):
        ext.dequantize(wq.astype(mx.int32), s, b, group_size=32, bits=4)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ext.quantized_matmul(x.astype(mx.int32), wq, s, b, group_size=32, bits=4)


def test_other_modes_and_missing_biases_use_mlx():
    w = rand((8, 64), 0)
    wq, s = mx.quantize(w, 32, 4, mode="mxfp4")
    x = rand((2, 64), 1)
    y = qm.quantized_matmul(x, wq, s, None, group_size=32, bits=4, mode="mxfp4")
    assert "AffineQuantizedMatmul" not in primitives(y)
    check(y, np.array(mx.quantized_matmul(x, wq, s, None, True, 32, 4, mode="mxfp4")))


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_quantized_linear_dispatch(kernels):
    layer = mn.QuantizedLinear(48, in_features=128, group_size=32, bits=4)
    W = np_dequantize(layer.weight, layer.scales, layer.biases, 32, 4)
    device = mn.Device(kernels=kernels)
    for rows in (1, 4, 30):
        x = rand((rows, 128), rows)
        y = layer(x, device=device)
        names = primitives(y)
        check(y, np.array(x, dtype=np.float64) @ W.T + np.array(layer.bias))
        native = {"AffineQuantizedMatmul", "AffineDequantize"} & names
        if kernels == "reference" or not qm.available():
            assert not native, names
        else:
            assert native == ({"AffineQuantizedMatmul"} if rows < 12 else {"AffineDequantize"}), names
