"""Tests for metalnn.cpu.ggml (native products with GGML-packed weights, dequantize, MLX fallbacks).

References: each type's MLX decoder (`metalnn.ggml.get_type(t).decode`, itself checked bit for bit
against gguf-py in tests/ggml) and products of its floats in float64 (NumPy) and in float32 (MLX).
Weights are random valid blocks (random quantized bytes, finite random scales). Every test runs on
the AVX2 register kernels (1 and 2 threads; float32 inputs, and inputs quantized to int8 as decoding
runs them), the decoded-rows kernels (1 and 3 threads), the portable kernels and the MLX-op fallback.

Tolerances: `dequantize` is bit-exact (compared as bits). A product sums K float32 terms in another
order than the reference (and, in the register kernels, as scale * sum(q x) + bias * sum(x) per
sub-block), so it is within the float32 summation bound ~K * 2^-24 * sum|x_k w_k| of the exact
value; the tests allow 4 K * 2^-24 * (|x| @ |W|.T) elementwise (the errors seen are ~100x smaller).
Half-precision results are that float32 sum rounded once (float16 2^-11, bfloat16 2^-8 relative).
With int8 inputs every 32 inputs x_k (256 for Q4_K, Q5_K and Q6_K, as llama.cpp's Q8_K) are replaced
by d * round(x_k / d), d = max|x| / 127 over the run, so each moves by at most d / 2: the product
moves by at most sum_k |w_k| d_k / 2 more (added to the bound; the errors seen are 20-50x smaller). With split inputs (the types with an int8 loop on the
register kernels, up to 2 input rows: the default, on the "registers_2threads" path; "registers_1thread"
runs the float kernels) every run of inputs becomes d / 254 * (254 a + b), each within d / 508 of x_k:
the bound gains sum_k |w_k| d_k / 508.
"""

import io

import numpy as np
import pytest

import metalnn.cpu.ggml as cg
import metalnn.cpu.im2col as ic
import mlx.core as mx
from ggml_blocks import random_blocks
from native_platform import NATIVE_PLATFORM
from native_platform import require_native as require_native_extension
from metalnn import ggml
from metalnn.ggml import grids

BLOCK_TYPES = sorted(name for name, cls in ggml.TYPES.items() if cls.block_size > 1)
U = 2.0 ** -24
REGISTER_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                  "IQ4_XS", "MXFP4", "TQ2_0"}


def primitives(*arrays) -> set:
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return {line.split('label ="', 1)[1].split('"', 1)[0] for line in buf.getvalue().splitlines() if 'label ="' in line}


PATHS = ["registers_2threads", "registers_1thread", "int8_registers", "decoded_3threads", "decoded_1thread", "portable",
         "mlx_ops"]

# whether the current path quantizes the inputs to int8, or splits them into two int8 levels (set by
# the `path` fixture)
INT8 = {"on": False, "split": False}
# uses_split / kSplitRows in ggml_kernels.h; the K-quants quantize runs of 256 inputs, the others of 32
SPLIT_TYPES, SPLIT_ROWS = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}, 2
RUN_256 = {"Q4_K", "Q5_K", "Q6_K"}


def input_run(qtype, k):
    """Inputs per int8 scale: 256 for the K-quants' loops, else 32 (int8_input_run)."""
    return 256 if qtype in RUN_256 and k % 256 == 0 else 32


def require_native():
    """The native primitives must be loaded on the platform they are built for (a failed build is a
    defect there); elsewhere the test does not apply."""
    require_native_extension(cg.available(), "the native GGML kernels")


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "mlx_ops":
        monkeypatch.setattr(cg, "_ext", None)  # as without the extension
        yield request.param
        return
    require_native()
    ext = cg._ext
    threads = {"registers_1thread": 1, "decoded_3threads": 3, "decoded_1thread": 1}.get(request.param, 2)
    old = (ic.get_num_threads(), ext.ggml_get_force_scalar(), ext.ggml_get_register_rows(), ext.ggml_get_int8_rows(),
           ext.ggml_get_split_inputs())
    ic.set_num_threads(threads)
    ext.ggml_set_force_scalar(request.param == "portable")
    ext.ggml_set_register_rows(1 << 20 if "registers" in request.param else 0)
    INT8["on"] = request.param == "int8_registers"
    ext.ggml_set_int8_rows(1 << 20 if INT8["on"] else 0)
    INT8["split"] = request.param == "registers_2threads"
    ext.ggml_set_split_inputs(INT8["split"])
    try:
        yield request.param
    finally:
        INT8["on"] = INT8["split"] = False
        ext.ggml_set_split_inputs(old[4])
        ic.set_num_threads(old[0])
        ext.ggml_set_force_scalar(old[1])
        ext.ggml_set_register_rows(old[2])
        ext.ggml_set_int8_rows(old[3])


def packed(qtype, rows, blocks, seed=0):
    """A random valid weight uint8 [rows, blocks * type_size] and its decoded floats (MLX decoder)."""
    cls = ggml.get_type(qtype)
    data = random_blocks(qtype, rows * blocks, np.random.default_rng(seed)).reshape(rows, blocks * cls.type_size)
    w = mx.array(data)
    return w, np.array(cls.decode(w))


def rand(shape, seed):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def int8_bound(xn, wf, qtype=None):
    """sum_k |w_k| d_k / 2 for inputs xn [M, K] quantized to int8 in runs of 32 (256 for the K-quants
    with their own loops; 0 unless the path quantizes, and for types without a register kernel), or
    sum_k |w_k| d_k / 508 for split inputs (qtype given)."""
    if INT8["split"] and qtype in SPLIT_TYPES and xn.shape[0] <= SPLIT_ROWS and xn.shape[-1] % 32 == 0:
        run = input_run(qtype, xn.shape[-1])
        d = np.abs(xn).reshape(xn.shape[0], -1, run).max(-1) / 127
        return (np.repeat(d, run, axis=1) / 508) @ np.abs(wf.astype(np.float64)).T
    if not INT8["on"] or (qtype is not None and qtype not in REGISTER_TYPES) or xn.shape[-1] % 32:
        return 0.0
    run = input_run(qtype, xn.shape[-1])
    d = np.abs(xn).reshape(xn.shape[0], -1, run).max(-1) / 127
    return (np.repeat(d, run, axis=1) / 2) @ np.abs(wf.astype(np.float64)).T


def check_product(y, x, wf, *, scale=1.0, qtype=None):
    """y ~ x @ wf.T within the float32 summation bound (plus the int8 inputs' bound on that path;
    see the module docstring)."""
    xn = np.array(x.astype(mx.float32), dtype=np.float64)
    exact = xn @ wf.astype(np.float64).T
    bound = 4 * wf.shape[1] * U * (np.abs(xn) @ np.abs(wf.astype(np.float64)).T) * scale + 1e-30
    bound = bound + 1.0001 * int8_bound(xn, wf, qtype)
    got = np.array(y.astype(mx.float32), dtype=np.float64)
    assert got.shape == exact.shape
    err = np.abs(got - exact)
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


def test_extension_is_built_here():
    if NATIVE_PLATFORM:
        assert cg.available(), cg.unavailable_reason()
        assert cg.has_avx2() == bool(cg._ext.ggml_has_avx2())
        assert sorted(cg.native_types()) == BLOCK_TYPES
        ids = set(cg._ext.ggml_register_type_ids())
        assert {n for n in BLOCK_TYPES if ggml.get_type(n).type_id in ids} == REGISTER_TYPES
    assert cg.available() == (cg.unavailable_reason() is None)


@pytest.mark.parametrize("name,table,dtype", [
    ("iq2xxs_grid", grids.iq2xxs_grid, np.uint8), ("iq2xs_grid", grids.iq2xs_grid, np.uint8),
    ("iq2s_grid", grids.iq2s_grid, np.uint8), ("iq3xxs_grid", grids.iq3xxs_grid, np.uint8),
    ("iq3s_grid", grids.iq3s_grid, np.uint8), ("iq1s_grid", grids.iq1s_grid, np.int8),
    ("ksigns_iq2xs", grids.ksigns_iq2xs, np.uint8)])
def test_compiled_tables_equal_metalnn_grids(name, table, dtype):
    require_native()
    expected = np.asarray(table())
    got = np.frombuffer(cg._ext.ggml_table(name), dtype=dtype).reshape(expected.shape)
    np.testing.assert_array_equal(got, expected)


def test_compiled_value_tables_equal_metalnn():
    require_native()
    from metalnn.ggml import nonlinear

    for name, values in [("kvalues_iq4nl", nonlinear.KVALUES_IQ4NL), ("kvalues_mxfp4", nonlinear.KVALUES_MXFP4)]:
        assert tuple(np.frombuffer(cg._ext.ggml_table(name), dtype=np.int8)) == values
    with pytest.raises(ValueError, match="unknown table"):
        cg._ext.ggml_table("nope")


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_dequantize_is_bit_exact(path, qtype):
    for rows, blocks in [(1, 1), (5, 3), (2, 7)]:
        w, wf = packed(qtype, rows, blocks, seed=rows * 10 + blocks)
        d = cg.dequantize(w, qtype)
        assert d.dtype == mx.float32 and d.shape == wf.shape
        np.testing.assert_array_equal(np.array(d).view(np.uint32), wf.view(np.uint32))
    assert cg.dequantize(w, qtype, mx.float16).dtype == mx.float16


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_products_match_the_decoder(path, qtype):
    cls = ggml.get_type(qtype)
    w1, wf1 = packed(qtype, 1, 1, seed=1)  # one row of one block
    w, wf = packed(qtype, 5, 3, seed=2)  # odd rows, odd blocks
    k = 3 * cls.block_size
    names = primitives(cg.matmul(rand((2, k), 0), w, qtype), cg.dequantize(w, qtype))  # before any evaluation
    if path == "mlx_ops":
        assert not ({"GGMLMatmul", "GGMLDequantize"} & names), names
    else:
        assert {"GGMLMatmul", "GGMLDequantize"} <= names, names
    for shape in [(1,), (2,), (3,), (17,), (2, 3), (1, 1, 4)]:
        x = rand((*shape, k), sum(shape))
        y = cg.matmul(x, w, qtype)
        assert y.shape == (*shape, 5) and y.dtype == mx.float32
        check_product(y.reshape(-1, 5), x.reshape(-1, k), wf, qtype=qtype)
        ref = x.reshape(-1, k) @ mx.array(wf).T  # MLX's float32 product of the decoded weight
        check_product(ref, x.reshape(-1, k), wf)
        x1 = rand((*shape, cls.block_size), 7)
        check_product(cg.matmul(x1, w1, qtype).reshape(-1, 1), x1.reshape(-1, cls.block_size), wf1, qtype=qtype)
    xv = rand((k,), 3)  # a vector
    yv = cg.matmul(xv, w, qtype)
    assert yv.shape == (5,)
    check_product(yv[None], xv[None], wf, qtype=qtype)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0", "IQ2_XS", "Q2_K"])
def test_products_large_enough_to_split_across_threads(path, qtype):
    cls = ggml.get_type(qtype)
    k = 2 * 256
    w, wf = packed(qtype, 2051, k // cls.block_size, seed=5)
    for m in (1, 2, 5):
        x = rand((m, k), m)
        check_product(cg.matmul(x, w, qtype), x, wf, qtype=qtype)
    np.testing.assert_array_equal(np.array(cg.dequantize(w, qtype)).view(np.uint32), wf.view(np.uint32))


def test_non_contiguous_inputs(path):
    w, wf = packed("Q4_K", 12, 2, seed=9)
    for x in (rand((512, 6), 4).T, rand((6, 1024), 5)[:, ::2], rand((3, 4, 512), 6)[:, 1:3].swapaxes(0, 1)):
        y = cg.matmul(x, w, "Q4_K")
        check_product(y.reshape(-1, 12), x.reshape(-1, 512), wf, qtype="Q4_K")
    # a strided weight (every other row, and a column slice of whole blocks)
    x = rand((3, 512), 8)
    check_product(cg.matmul(x, w[::2], "Q4_K"), x, wf[::2], qtype="Q4_K")
    np.testing.assert_array_equal(np.array(cg.dequantize(w[::2], "Q4_K")), wf[::2])
    np.testing.assert_array_equal(np.array(cg.dequantize(w[:, 144:], "Q4_K")), wf[:, 256:])


@pytest.mark.parametrize("xdtype", [mx.float16, mx.bfloat16])
def test_half_inputs(path, xdtype):
    w, wf = packed("Q6_K", 7, 2, seed=3)
    x = rand((3, 512), 1).astype(xdtype)
    y = cg.matmul(x, w, "Q6_K")
    assert y.dtype == xdtype
    half = {mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}[xdtype]
    xn = np.array(x.astype(mx.float32), dtype=np.float64)
    exact = xn @ wf.T
    bound = 4 * 512 * U * (np.abs(xn) @ np.abs(wf).T) + half * np.abs(exact) + 1.0001 * int8_bound(xn, wf, "Q6_K")
    assert (np.abs(np.array(y.astype(mx.float32)) - exact) <= bound).all()


def test_empty_input(path):
    w, _ = packed("Q8_0", 4, 2, seed=0)
    y = cg.matmul(mx.zeros((0, 64)), w, "Q8_0")
    assert y.shape == (0, 4)
    mx.eval(y)


# ----------------------------------------------------------------------------- gradients and transforms


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "IQ4_XS", "IQ1_M"])
def test_input_gradient(path, qtype):
    cls = ggml.get_type(qtype)
    k = 256
    w, wf = packed(qtype, 9, k // cls.block_size, seed=4)
    x, c = rand((2, 3, k), 1), rand((2, 3, 9), 2)

    def f(v):
        return (cg.matmul(v, w, qtype) * c).sum()

    dx = mx.grad(f)(x)
    assert dx.shape == x.shape and dx.dtype == mx.float32
    cn = np.array(c, dtype=np.float64).reshape(-1, 9)
    exact = cn @ wf
    bound = 4 * 9 * U * (np.abs(cn) @ np.abs(wf)) + 1e-30
    assert (np.abs(np.array(dx).reshape(-1, k) - exact) <= bound).all()
    # the same through mx.vjp, half-precision input: the gradient in x's dtype
    xh = x.astype(mx.bfloat16)
    _, (dxh,) = mx.vjp(lambda v: cg.matmul(v, w, qtype), [xh], [c.astype(mx.bfloat16)])
    assert dxh.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(dxh.astype(mx.float32)).reshape(-1, k),
                               np.array(c.astype(mx.bfloat16).astype(mx.float32), dtype=np.float64).reshape(-1, 9)
                               @ wf, rtol=2e-2, atol=2e-2 * np.abs(exact).max())


def test_input_gradient_of_a_large_weight():
    # more than 2^24 values: the backward pass decodes the weight in row slices, never whole
    require_native()
    w, wf = packed("Q4_0", 4100, 128, seed=3)  # 4100 x 4096 values
    x, c = rand((2, 4096), 0), rand((2, 4100), 1)
    _, (dx,) = mx.vjp(lambda v: cg.matmul(v, w, "Q4_0"), [x], [c])
    buf = io.StringIO()
    mx.export_to_dot(buf, dx)
    assert buf.getvalue().count('label ="GGMLDequantize"') == 2
    cn = np.array(c, dtype=np.float64)
    exact = cn @ wf
    assert (np.abs(np.array(dx) - exact) <= 4 * 4100 * U * (np.abs(cn) @ np.abs(wf)) + 1e-30).all()


def test_jvp_vmap_and_compile(path):
    w, wf = packed("Q3_K", 6, 1, seed=6)
    x, t = rand((2, 256), 1), rand((2, 256), 2)
    _, (jt,) = mx.jvp(lambda v: cg.matmul(v, w, "Q3_K"), [x], [t])
    check_product(jt, t, wf)
    xs = rand((4, 2, 256), 3)
    ys = mx.vmap(lambda v: cg.matmul(v, w, "Q3_K"), in_axes=1)(xs)
    assert ys.shape == (2, 4, 6)
    check_product(ys.reshape(-1, 6), xs.swapaxes(0, 1).reshape(-1, 256), wf)
    compiled = mx.compile(lambda v: cg.matmul(v, w, "Q3_K") + 1.0)
    check_product(compiled(x) - 1.0, x, wf, scale=2.0)


# ----------------------------------------------------------------------------- arguments


def test_supports():
    w, _ = packed("Q4_K", 3, 2, seed=0)
    native = cg.available()
    assert cg.supports(w, "Q4_K") == native
    assert cg.supports(w, ggml.get_type("Q4_K"), rand((2, 512), 0)) == native
    assert cg.supports(w, 12) == native  # the GGUF type id
    assert not cg.supports(w, "Q4_K", rand((2, 256), 0))  # x is not [..., K]
    assert not cg.supports(w, "Q4_K", mx.zeros((2, 512), dtype=mx.int32))
    assert not cg.supports(w, "F16")  # float types: the MLX decoder
    assert not cg.supports(w.astype(mx.int8), "Q4_K")
    assert not cg.supports(w[:, :100], "Q4_K")  # not whole blocks
    with pytest.raises(KeyError):
        cg.supports(w, "Q9_Z")


def test_native_errors():
    require_native()
    ext = cg._ext
    w, _ = packed("Q4_K", 3, 2, seed=0)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 512\]"):
        ext.ggml_matmul(rand((2, 256), 0), w, 12)
    with pytest.raises(ValueError, match="not whole 144-byte blocks"):
        ext.ggml_matmul(rand((2, 256), 0), w[:, :100], 12)
    with pytest.raises(ValueError, match="no native kernel"):
        ext.ggml_dequantize(w, 1)
    with pytest.raises(ValueError, match="packed uint8"):
        ext.ggml_dequantize(w.astype(mx.int32), 12)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ext.ggml_matmul(mx.zeros((2, 512), dtype=mx.int32), w, 12)


def test_fallback_for_float_types(path):
    data = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float16)
    w = mx.array(data.view(np.uint8))
    x = rand((2, 8), 1)
    np.testing.assert_allclose(np.array(cg.matmul(x, w, "F16")), np.array(x) @ data.astype(np.float32).T,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.array(cg.dequantize(w, "F16")), data.astype(np.float32))


def test_int8_input_rows_setting():
    require_native()
    old = cg.int8_input_rows()
    try:
        cg.set_int8_input_rows(4)
        assert cg.int8_input_rows() == 4 == cg._ext.ggml_get_int8_rows()
        for bad in (-1, 1.5, True, "4"):
            with pytest.raises(ValueError, match="rows must be an int >= 0"):
                cg.set_int8_input_rows(bad)
        assert cg.int8_input_rows() == 4
    finally:
        cg.set_int8_input_rows(old)


def test_split_inputs_setting():
    require_native()
    old = cg.split_inputs()
    try:
        cg.set_split_inputs(False)
        assert cg.split_inputs() is False and cg._ext.ggml_get_split_inputs() is False
        for bad in (0, 1, None, "yes"):
            with pytest.raises(ValueError, match="enabled must be a bool"):
                cg.set_split_inputs(bad)
        assert cg.split_inputs() is False
    finally:
        cg.set_split_inputs(old)


@pytest.mark.parametrize("qtype", sorted(SPLIT_TYPES))
def test_split_inputs_within_their_bound(qtype):
    """The types with an int8 loop, with one or two input rows, take split inputs: the product differs from
    the float kernel's and is within the split bound sum_k |w_k| d_k / 508 plus 256 * 2^-24 * sum|w x|
    (each block's integer sums are exact; their conversion, scaling and accumulation over the 8-64
    blocks, and the minimums' float sums of 32 inputs, round well under 64 times), and its largest
    error is under a hundredth of one int8 level's (the int8 inputs of the same product); with three
    rows the float kernel runs (the same bits as with split inputs switched off)."""
    require_native()
    old = cg._ext.ggml_get_register_rows(), cg.split_inputs(), cg.int8_input_rows()
    w, wf = packed(qtype, 96, 2048 // ggml.get_type(qtype).block_size, seed=11)  # K = 2048
    wa = np.abs(wf.astype(np.float64))
    rng = np.random.default_rng(12)
    try:
        cg._ext.ggml_set_register_rows(4)
        for m in (1, 2, 3):
            x = mx.array((rng.standard_normal((m, 2048)) * rng.exponential(1.0, (m, 2048))).astype(np.float32))
            got = {}
            for mode in ("float", "split", "int8"):
                cg.set_split_inputs(mode == "split")
                cg.set_int8_input_rows(4 if mode == "int8" else 0)
                got[mode] = np.array(cg.matmul(x, w, qtype), dtype=np.float64)
            if m > SPLIT_ROWS or not cg.has_avx2():  # (split inputs are the AVX2 int8 loops')
                np.testing.assert_array_equal(got["split"], got["float"])
                continue
            assert (got["split"] != got["float"]).any()
            xn = np.array(x, dtype=np.float64)
            exact = xn @ wf.astype(np.float64).T
            run = input_run(qtype, 2048)
            d = np.repeat(np.abs(xn).reshape(m, -1, run).max(-1) / 127, run, axis=1)
            err = np.abs(got["split"] - exact)
            assert (err <= 1.0001 * (d / 508) @ wa.T + 256 * U * (np.abs(xn) @ wa.T)).all()
            assert err.max() <= np.abs(got["int8"] - exact).max() / 100
    finally:
        cg._ext.ggml_set_register_rows(old[0])
        cg.set_split_inputs(old[1])
        cg.set_int8_input_rows(old[2])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q8_0"])
def test_split_inputs_at_the_largest_levels(qtype):
    """Every weight level and sub-block scale at its largest and inputs at the largest levels (a =
    +-127, b up to +-127): the integer sums reach their bound (Q5_K: 255 * 8 * 2 * 7874 * 63 per lane,
    2.02e9 < 2^31) and must not wrap; the product is checked against float64 as above."""
    require_native()
    cls = ggml.get_type(qtype)
    block = np.full(cls.type_size, 0xFF, dtype=np.uint8)
    block[:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)  # d = 1
    if qtype != "Q8_0":
        block[2:4] = 0  # dmin = 0: no minimum term
    else:
        block[2:] = 0x81  # levels -127
    w = mx.array(np.tile(block, (4, 2048 // cls.block_size)).reshape(4, -1))
    wf = np.array(cls.decode(w), dtype=np.float64)
    x = np.ones((2, 2048), dtype=np.float32)
    x[1, 1::2] = -1 + 1 / 300  # the second row: b at its extremes
    x[1, 0] = -1
    old = cg._ext.ggml_get_register_rows(), cg.split_inputs(), cg.int8_input_rows()
    try:
        cg._ext.ggml_set_register_rows(4)
        cg.set_int8_input_rows(0)
        cg.set_split_inputs(True)
        got = np.array(cg.matmul(mx.array(x), w, qtype), dtype=np.float64)
    finally:
        cg._ext.ggml_set_register_rows(old[0])
        cg.set_split_inputs(old[1])
        cg.set_int8_input_rows(old[2])
    xn = x.astype(np.float64)
    exact = xn @ wf.T
    wa = np.abs(wf)
    d = np.repeat(np.abs(xn).reshape(2, -1, input_run(qtype, 2048)).max(-1) / 127, input_run(qtype, 2048), axis=1)
    assert (np.abs(got - exact) <= 1.0001 * (d / 508) @ wa.T + 256 * U * (np.abs(xn) @ wa.T)).all(), (got, exact)
