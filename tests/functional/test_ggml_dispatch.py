"""Which CPU product `metalnn.functional.ggml_matmul` runs for how many input rows.

Up to `metalnn.cpu.ggml.MATMUL_MAX_ROWS` rows (all dims of x but the last) the native product, above
it the dequantized weight and MLX's BLAS product. Both must equal gguf-py's decoding of the same
blocks (`gguf.quants.dequantize`, independent of metalnn's decoders) times x in float64, within
float32 summation error: 4 K u sum_k |x_k w_k| per output (u = 2^-24; the two orders of the sums
differ from each other and from float64's).
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest

import metalnn.functional as F
from metalnn import ggml
from metalnn.cpu import ggml as cpu_ggml

pytestmark = pytest.mark.skipif(not cpu_ggml.available(), reason=f"native extension: {cpu_ggml.unavailable_reason()}")

U = 2.0 ** -24
N, K = 40, 256


def test_native_up_to_the_limit_and_blas_above(monkeypatch):
    qtype = ggml.get_type("Q4_K")
    rng = np.random.default_rng(3)
    packed = np.array(qtype.encode(mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05)))
    decoded = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q4_K).reshape(N, K).astype(np.float64)
    native_calls = []
    real = cpu_ggml.matmul
    monkeypatch.setattr(cpu_ggml, "matmul", lambda *a, **k: native_calls.append(a[0].shape) or real(*a, **k))
    limit = cpu_ggml.MATMUL_MAX_ROWS
    # [B, T] inputs as a batched prompt gives them: rows = B * T
    for shape, native in [((2, limit // 2), True), ((1, limit), True), ((1, limit + 1), False), ((3, limit), False)]:
        native_calls.clear()
        x = rng.standard_normal(shape + (K,)).astype(np.float32)
        got = np.array(F.ggml_matmul(mx.array(x), mx.array(packed), qtype))
        assert got.shape == shape + (N,)
        assert bool(native_calls) == native, (shape, native_calls)
        want = x.astype(np.float64) @ decoded.T
        bound = 4 * K * U * (np.abs(x.astype(np.float64)) @ np.abs(decoded).T)
        assert np.all(np.abs(got - want) <= bound), (shape, float(np.max(np.abs(got - want) - bound)))
