"""The GGML kernels (``metal_kernels/ggml.metal``) on the emulator, for every type of `metalnn.ggml`.

Oracles: the type's MLX decoder (`metalnn.ggml.GGMLType.decode`, itself bit-exact with gguf-py) on
random valid blocks (`ggml_blocks.random_blocks`), and MLX's matmul of the decoded weight.

* ``dequantize`` equals the decoder bit for bit: both compute ggml's formulas operation for operation
  in float32, and the emulator contracts no ``a * b + c`` into an fma.
* The products (``matvec``, ``matmul``) and the input gradient differ from MLX's ``x @ decode(W).T`` /
  ``g @ decode(W)`` only by the order of a float32 sum of ``n`` products. Each of the two results is
  within ``gamma_n * S`` of the exact sum, ``S = sum |x_k w_k|`` and ``gamma_n = n u / (1 - n u)``,
  ``u = 2^-24`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1), whatever the order, so
  ``|got - want| <= 2 gamma_n S`` (per output element, `assert_sums_close`). A float16 / bfloat16 result is
  rounded once more to its type: ``+ u_T |want|`` (``u_T = 2^-11``, ``2^-8``). A wrong index, scale or
  bit moves an element by the size of a term, orders of magnitude beyond that bound.

Shapes: 1 row of 1 block; 5 rows (not a multiple of the 4 rows of a matvec threadgroup nor of the
32-row tile) of 2 blocks; x of 1, 2, 3 and 17 rows and with batch dims; each kernel also forced
outside its usual range (matvec on 17 rows: 3 batches of its 8 x rows; matmul on 1 row); and a larger
case, 40 rows of 256 values times x of 33 rows (2 x 2 tiles, both partial; 4 chunks of the reduction).
The float types (one value a block) use rows of 1, 7 and 256 values.
"""

import mlx.core as mx
import numpy as np
import pytest

from metalnn import functional as F
from metalnn import ggml
from metalnn.kernels import ggml as kernels

from ggml_blocks import random_blocks
from kernel_cases import emulate, reference, spy_launches

TYPES = sorted(ggml.TYPES)
U = {mx.float32: 2.0 ** -24, mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}


def row_values(cls, row):
    """Values in a row: ``"one"`` block, ``"two"`` blocks, ``"large"``: 256 (the float types: 1, 7, 256)."""
    if cls.block_size == 1:
        return {"one": 1, "two": 7, "large": 256}[row]
    return {"one": 1, "two": 2, "large": max(1, 256 // cls.block_size)}[row] * cls.block_size


def packed(qtype, rows, row, seed):
    """``uint8 [rows, row_bytes]`` of random valid blocks (rows of `row_values`) and its decoded
    ``float32 [rows, cols]``."""
    cls = ggml.get_type(qtype)
    blocks = row_values(cls, row) // cls.block_size
    data = random_blocks(qtype, rows * blocks, np.random.default_rng(seed)).reshape(rows, blocks * cls.type_size)
    w = mx.array(data)
    return cls, w, cls.decode(w)


def normal(shape, seed, dtype=mx.float32):
    return mx.array(np.random.default_rng(seed).normal(size=shape).astype(np.float32)).astype(dtype)


def as64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


def assert_sums_close(got, want, a, b, dtype=mx.float32, what=""):
    """``got`` and ``want`` are ``a @ b`` summed in two orders (``a [..., n]``, ``b [n, m]``): per element
    ``|got - want| <= 2 gamma_n (|a| @ |b|) + u_T |want|`` (see the module docstring)."""
    assert got.shape == want.shape, what
    assert got.dtype == dtype, what
    n = b.shape[0]
    gamma = n * U[mx.float32] / (1 - n * U[mx.float32])
    s = np.abs(as64(a)) @ np.abs(as64(b))
    g, w = as64(got), as64(want)
    bound = 2 * gamma * s + (U[dtype] * np.abs(w) if dtype != mx.float32 else 0)
    err = np.abs(g - w)
    assert np.all(np.isfinite(g)), what
    assert np.all(err <= bound), f"{what}: worst error {np.max(err - bound):.3g} beyond the bound"


def test_every_type_has_kernels():
    assert set(ggml.TYPES) <= set(kernels.TYPES)
    assert set(kernels.GRIDS) <= set(kernels.TYPES)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_bit_exact_with_the_decoder(qtype, monkeypatch):
    launches = spy_launches(monkeypatch)
    for rows, row in [(1, "one"), (5, "two"), (40, "large")]:
        cls, w, want = packed(qtype, rows, row, seed=rows)
        got = F.ggml_dequantize(w, cls, device=emulate())
        assert got.shape == want.shape and got.dtype == mx.float32
        np.testing.assert_array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32),
                                      err_msg=f"{qtype} {want.shape}")
    assert launches.names() == {"dequantize"} and len(launches) == 3


# (W rows, row length, x shape before the row length, forced kernel, gradient checked)
PRODUCT_CASES = [
    (1, "one", (1,), None, True),           # matvec: one row of one block
    (1, "one", (17,), None, False),         # matmul: one W row in a 32-row tile
    (5, "two", (1,), "matmul", False),      # matmul on one x row
    (5, "two", (2,), None, False),
    (5, "two", (3,), None, True),
    (5, "two", (17,), None, True),          # matmul
    (5, "two", (17,), "matvec", False),     # matvec over 3 batches of x rows
    (5, "two", (2, 3), None, True),         # batch dims: 6 rows, matvec
    (40, "large", (3, 11), None, True),     # larger, batch dims: 33 rows, 2 x 2 tiles, both partial
    (40, "large", (1,), None, False),       # larger: 10 matvec threadgroups
]


def _expected_kernel(lead, forced):
    return forced or ("matvec" if int(np.prod(lead)) <= kernels.MATVEC_MAX_ROWS else "matmul")


@pytest.mark.parametrize("qtype", TYPES)
def test_products_and_input_gradient(qtype, monkeypatch):
    launches = spy_launches(monkeypatch)
    for i, (rows, row, lead, forced, grad) in enumerate(PRODUCT_CASES):
        cls, w, W = packed(qtype, rows, row, seed=i)
        cols = W.shape[1]
        x = normal((*lead, cols), seed=i)
        what = f"{qtype}: W {rows} x {cols}, x {(*lead, cols)}, {forced or 'auto'}"
        launches.clear()
        fn = (lambda a: kernels.ggml_matmul(a, w, cls, "emulate", kernel=forced)) if forced else \
            (lambda a: F.ggml_matmul(a, w, cls, device=emulate()))
        kernel = _expected_kernel(lead, forced)
        if grad:
            g = normal((*lead, rows), seed=100 + i)
            (y,), (dx,) = mx.vjp(fn, [x], [g])
            assert [launch.name for launch in launches] == [kernel, "dequantize"], what
            assert_sums_close(dx, g @ W, g, W, what=what + " (dx)")
        else:
            y = fn(x)
            assert [launch.name for launch in launches] == [kernel], what
        assert_sums_close(y, x @ W.T, x, W.T, what=what)


HALF_CASES = [("Q4_K", mx.float16), ("Q8_0", mx.bfloat16), ("IQ2_XS", mx.float16), ("F16", mx.bfloat16)]


@pytest.mark.parametrize("qtype,dtype", HALF_CASES, ids=[f"{q}-{str(d).rpartition('.')[2]}" for q, d in HALF_CASES])
def test_half_inputs(qtype, dtype, monkeypatch):
    """float16 / bfloat16 x: accumulated in float32 on the values x holds, rounded once to x's dtype;
    the gradient likewise (g @ W in float32, rounded to x's dtype)."""
    launches = spy_launches(monkeypatch)
    for rows, row, lead in [(5, "two", (3,)), (40, "large", (2, 17))]:
        cls, w, W = packed(qtype, rows, row, seed=7)
        x = normal((*lead, W.shape[1]), seed=8, dtype=dtype)
        g = normal((*lead, rows), seed=9, dtype=dtype)
        fn = lambda a: F.ggml_matmul(a, w, cls, device=emulate())  # noqa: E731
        (y,), (dx,) = mx.vjp(fn, [x], [g])
        xf, gf = x.astype(mx.float32), g.astype(mx.float32)
        assert_sums_close(y, xf @ W.T, xf, W.T, dtype, what=f"{qtype} y")
        assert_sums_close(dx, gf @ W, gf, W, dtype, what=f"{qtype} dx")
    assert launches.names() == {"matvec", "matmul", "dequantize"}


def test_input_gradient_decodes_the_weight_in_slices(monkeypatch):
    """A weight beyond `BACKWARD_SLICE_VALUES` is decoded a slice of rows at a time (here 40 rows of 256
    values in slices of 3 rows: 14 dequantize launches), with the same gradient."""
    monkeypatch.setattr(kernels, "BACKWARD_SLICE_VALUES", 3 * 256 + 100)
    launches = spy_launches(monkeypatch)
    cls, w, W = packed("Q6_K", 40, "large", seed=5)
    x, g = normal((2, 3, 256), seed=6), normal((2, 3, 40), seed=7)
    _, (dx,) = mx.vjp(lambda a: kernels.ggml_matmul(a, w, cls, "emulate"), [x], [g])
    assert [launch.name for launch in launches] == ["matvec"] + ["dequantize"] * 14
    assert_sums_close(dx, g @ W, g, W, what="sliced dx")


def test_packed_weight_gets_a_zero_gradient_and_reference_runs_no_kernel(monkeypatch):
    launches = spy_launches(monkeypatch)
    cls, w, W = packed("Q4_K", 3, "one", seed=1)
    x = normal((2, W.shape[1]), seed=2)
    _, (gx, gw) = mx.vjp(lambda a, b: F.ggml_matmul(a, b, cls, device=emulate()), [x, w], [normal((2, 3), 3)])
    assert gw.dtype == mx.uint8 and gw.shape == w.shape and not np.array(gw).any()
    launches.clear()
    F.ggml_matmul(x, w, cls, device=reference())
    F.ggml_dequantize(w, cls)
    assert not launches


def test_calls_the_kernels_do_not_take_run_the_decoder(monkeypatch):
    """Empty x and integer x are left to the decoder path (same results as the reference)."""
    launches = spy_launches(monkeypatch)
    cls, w, W = packed("Q8_0", 3, "one", seed=4)
    empty = mx.zeros((0, 32))
    assert F.ggml_matmul(empty, w, cls, device=emulate()).shape == (0, 3)
    assert not kernels.supports(mx.zeros((2, 32), dtype=mx.int32), w, cls)
    assert not kernels.supports(mx.zeros((2, 64)), w, cls)
    assert not launches
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernels.ggml_matmul(mx.zeros((1, 32)), w, cls, "emulate", kernel="gemm")
