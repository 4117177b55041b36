"""`metalnn.functional.ggml_int8_inputs`: GGML products with int8 inputs, as llama.cpp computes them.

Reference: gguf-py decodes the packed weight (`gguf.quants.dequantize`, independent of metalnn's
decoders) and NumPy quantizes the input in runs as llama.cpp's inputs are (Q8_0: every 32 values;
Q8_K for Q4_K, Q5_K and Q6_K: every 256; each run d = max|x| / 127, levels round(x / d)); the product
in float64. The formats with a minimum (Q4_1, Q5_1, Q2_K, Q4_K,
Q5_K) multiply their minimum terms by the exact input sums (a little more exact than llama.cpp's
Q8_1 / Q8_K sums), so their reference is ``(levels * d) @ (W - M).T + x @ M.T`` with M the minimum
terms (gguf-py's decoding of the blocks with their levels zeroed). Inside the context a decoding
product (up to `INT8_INPUT_ROWS` = 8 input rows) must equal the reference within float32 summation error (bound
4 K u sum|x_k w_k|, u = 2^-24: the order of the sums differs) and be farther than that from the float
product ``x @ W.T`` somewhere; outside it (restored), and for more rows than `INT8_INPUT_ROWS`, the
product is the float one within the same bound.

Split inputs (the default for one or two input rows of the types with an int8 loop; off inside
`ggml_exact_inputs`) have the same reference with each run's 16-bit levels X = round(x * 32258 / max|x|)
at d / 254 in place of the int8 levels at d (NumPy in float32 as the kernel computes them).
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest

import metalnn.functional as F
from metalnn import Device
from metalnn import ggml
from metalnn.cpu import ggml as cpu_ggml

U = 2.0 ** -24
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"]
# The formats with a minimum: the bytes of a block that hold its levels. With them zeroed, gguf-py
# decodes the block's minimum terms alone (Q4_1: m; the K-quants: -dmin * min_j per sub-block).
LEVEL_BYTES = {"Q4_1": (4, 20), "Q5_1": (4, 24), "Q4_K": (16, 144), "Q5_K": (16, 176), "Q2_K": (16, 80)}
N, K = 24, 512
# values per input scale: llama.cpp's Q8_K input of the K-quants with their own int8 loops (32 for the rest)
RUNS = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}

pytestmark = pytest.mark.skipif(not cpu_ggml.has_avx2(), reason="the int8 inputs are the AVX2 register kernels'")


def weight(qtype, seed=0):
    """Packed weight [N, row bytes] (metalnn's encoder), gguf-py's decoding of it [N, K] float64, and
    of its minimum terms alone (zeros for the formats without)."""
    cls = ggml.get_type(qtype)
    values = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    packed = np.array(cls.encode(mx.array(values)))
    gtype = gguf.GGMLQuantizationType[qtype]
    decoded = gguf.quants.dequantize(packed, gtype).reshape(N, K).astype(np.float64)
    minimums = np.zeros_like(decoded)
    if qtype in LEVEL_BYTES:
        lo, hi = LEVEL_BYTES[qtype]
        blocks = packed.reshape(-1, cls.type_size).copy()
        blocks[:, lo:hi] = 0
        minimums = gguf.quants.dequantize(blocks.reshape(packed.shape), gtype).reshape(N, K).astype(np.float64)
    return mx.array(packed), decoded, minimums


def quantized(x, run=32):
    """x [M, K] float32 as llama.cpp's Q8_0 (``run`` 32) or Q8_K (256) input: levels * d per run of
    values (float64)."""
    runs = x.astype(np.float32).reshape(x.shape[0], -1, run)
    amax = np.abs(runs).max(-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    levels = np.rint(runs * inv)  # float32 product, rounded half to even as nearbyint
    return (levels.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def split_quantized(x, run=32):
    """x [M, K] float32 as split inputs: X * d / 254 per run of values, X = round(x * 32258 / max|x|)
    (254 a + b of the kernel's two int8 levels; float64)."""
    runs = x.astype(np.float32).reshape(x.shape[0], -1, run)
    amax = np.abs(runs).max(-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127 * 254) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    levels = np.rint(runs * inv)  # |levels| <= 32258
    return (levels.astype(np.float64) * d.astype(np.float64) / 254).reshape(x.shape)


def product(x, w, qtype):
    return np.array(F.ggml_matmul(mx.array(x), w, ggml.get_type(qtype), device=Device()), dtype=np.float64)


def bound(x, wf):
    return 4 * K * U * (np.abs(x.astype(np.float64)) @ np.abs(wf).T) + 1e-30


@pytest.mark.parametrize("qtype", TYPES)
# 5-8: more rows than the float register kernels take; one pass over a weight row for the 32-value types,
# passes of 3 + 2, 4 + 4 for the K-quants
@pytest.mark.parametrize("rows", [1, 3, 5, 6, 8])
def test_decoding_products_take_int8_inputs_inside_the_context(qtype, rows):
    w, wf, minimums = weight(qtype)
    x = np.random.default_rng(1).standard_normal((rows, K)).astype(np.float32)
    # the minimum terms multiply the exact input sums (as the float path), the rest the int8 input
    exact = x.astype(np.float64) @ wf.T
    rounded = quantized(x, RUNS.get(qtype, 32)) @ (wf - minimums).T + x.astype(np.float64) @ minimums.T
    with F.ggml_int8_inputs():
        assert cpu_ggml.int8_input_rows() == F.ggml.INT8_INPUT_ROWS
        got = product(x, w, qtype)
    err = np.abs(got - rounded)
    assert (err <= bound(x, wf)).all(), f"{qtype}: max error {err.max():.3g} against the int8 reference"
    # not the float path: farther from x @ W.T than float32 summation can explain
    assert (np.abs(got - exact) > bound(x, wf)).any(), "the int8 rounding should show"
    # restored: the float product again
    after = product(x, w, qtype)
    assert (np.abs(after - exact) <= bound(x, wf)).all()


def test_more_rows_than_the_limit_stay_float():
    w, wf, _ = weight("Q4_K")
    x = np.random.default_rng(2).standard_normal((F.ggml.INT8_INPUT_ROWS + 1, K)).astype(np.float32)
    with F.ggml_int8_inputs():
        got = product(x, w, "Q4_K")
    assert (np.abs(got - x.astype(np.float64) @ wf.T) <= bound(x, wf)).all()


def test_disabled_context_changes_nothing_and_setting_is_restored_after_errors():
    old = cpu_ggml.int8_input_rows()
    with F.ggml_int8_inputs(False):
        assert cpu_ggml.int8_input_rows() == old
    with pytest.raises(RuntimeError, match="inside"):
        with F.ggml_int8_inputs():
            raise RuntimeError("inside")
    assert cpu_ggml.int8_input_rows() == old


SPLIT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def split_bound(x, wf):
    """64 u sum|x_k w_k|: the split kernel's integer sums are exact; each block's conversion, scaling
    and accumulation rounds at most twice in a lane (16 blocks of 32 here, 2 of 256), the lanes' sum
    3 times, the minimums' float32 sums of 32 inputs once a term (the errors seen: 0.2-1.2 u)."""
    return 64 * U * (np.abs(x.astype(np.float64)) @ np.abs(wf).T) + 1e-30


@pytest.mark.parametrize("qtype", SPLIT_TYPES)
@pytest.mark.parametrize("rows", [1, 2])
def test_decoding_products_take_split_inputs_by_default(qtype, rows):
    w, wf, minimums = weight(qtype, seed=3)
    x = np.random.default_rng(4).standard_normal((rows, K)).astype(np.float32)
    exact = x.astype(np.float64) @ wf.T
    rounded = split_quantized(x, RUNS.get(qtype, 32)) @ (wf - minimums).T + x.astype(np.float64) @ minimums.T
    old = cpu_ggml.split_inputs(), cpu_ggml.int8_input_rows()
    try:
        cpu_ggml.set_split_inputs(True)
        cpu_ggml.set_int8_input_rows(0)
        got = product(x, w, qtype)
        err = np.abs(got - rounded)
        assert (err <= split_bound(x, wf)).all(), f"{qtype}: max error {err.max():.3g} against the split reference"
        with F.ggml_exact_inputs():
            assert cpu_ggml.split_inputs() is False
            exact_got = product(x, w, qtype)
        assert cpu_ggml.split_inputs() is True
        assert (np.abs(exact_got - exact) <= bound(x, wf)).all()
        # the float32 kernel is the float product, ten times farther from the split reference (seen:
        # 50-230 u against 0.2-1.2 u, in units of u * sum|x_k w_k|)
        assert err.max() * 10 < np.abs(exact_got - rounded).max()
    finally:
        cpu_ggml.set_split_inputs(old[0])
        cpu_ggml.set_int8_input_rows(old[1])


def test_exact_inputs_context_is_restored_after_errors():
    old = cpu_ggml.split_inputs()
    with F.ggml_exact_inputs(False):
        assert cpu_ggml.split_inputs() is old
    with pytest.raises(RuntimeError, match="inside"):
        with F.ggml_exact_inputs():
            raise RuntimeError("inside")
    assert cpu_ggml.split_inputs() is old
