"""Kernels with known answers, run on the emulator."""

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels.emulator import EmulatorError, as_mx, metal_kernel

ORDERS = ["forward", "reversed", "shuffled"]


def test_elementwise_template_and_scalars():
    k = metal_kernel("axpb", ["x", "alpha", "beta"], ["out"], """
        uint i = thread_position_in_grid.x;
        if (i >= N) return;
        T v = x[i];
        out[i] = B ? metal::exp(v) * alpha + beta : v;
    """)
    x = np.linspace(-1, 1, 37).astype(np.float32)
    tpl = [("T", mx.float32), ("N", 37), ("B", True)]
    (o,) = k(inputs=[x, 2.0, 3], output_shapes=[x.shape], output_dtypes=[mx.float32],
             grid=(40, 1, 1), threadgroup=(16, 1, 1), template=tpl)
    np.testing.assert_allclose(o, np.exp(x) * 2 + 3, rtol=1e-6)
    (o,) = k(inputs=[x, 2.0, 3], output_shapes=[x.shape], output_dtypes=[mx.float32],
             grid=(40, 1, 1), threadgroup=(16, 1, 1), template=[("T", mx.float32), ("N", 37), ("B", False)])
    np.testing.assert_array_equal(o, x)


def test_shape_strides_elem_to_loc_non_contiguous():
    src = """
        uint e = thread_position_in_grid.x;
        auto loc = elem_to_loc(e, inp_shape, inp_strides, inp_ndim);
        out[e] = inp[loc] + 100.0f * inp_ndim;
    """
    base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    view = base.transpose(2, 0, 1)  # not row-contiguous
    for contig in (True, False):
        k = metal_kernel("e2l", ["inp"], ["out"], src, ensure_row_contiguous=contig)
        (o,) = k(inputs=[view], output_shapes=[(24,)], output_dtypes=[mx.float32],
                 grid=(24, 1, 1), threadgroup=(32, 1, 1))
        np.testing.assert_array_equal(o, view.reshape(-1) + 300)


ROWSUM = """
    uint row = threadgroup_position_in_grid.y;
    uint lid = thread_index_in_threadgroup;
    uint sg = simdgroup_index_in_threadgroup;
    uint lane = thread_index_in_simdgroup;
    threadgroup float partial[32];
    float acc = 0.0f;
    for (uint c = lid; c < N; c += threads_per_threadgroup.x) acc += x[row * N + c];
    acc = simd_sum(acc);
    if (lane == 0) partial[sg] = acc;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0) {
        float v = lane < simdgroups_per_threadgroup ? partial[lane] : 0.0f;
        v = simd_sum(v);
        if (lane == 0) out[row] = v;
    }
"""


@pytest.mark.parametrize("order", ORDERS)
def test_row_sum_simd_and_threadgroup_memory(order):
    x = np.random.default_rng(0).standard_normal((3, 300)).astype(np.float32)
    k = metal_kernel("rowsum", ["x"], ["out"], ROWSUM)
    (o,) = k(inputs=[x], output_shapes=[(3,)], output_dtypes=[mx.float32], grid=(96, 3, 1),
             threadgroup=(96, 1, 1), template=[("N", 300)], lane_order=order, seed=3)
    np.testing.assert_allclose(o, x.sum(1), rtol=1e-5, atol=1e-5)


def test_simd_shuffles_and_prefix():
    k = metal_kernel("shuf", ["x"], ["o"], """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        o[i * 8 + 0] = simd_shuffle_down(v, 1);
        o[i * 8 + 1] = simd_shuffle_up(v, 2);
        o[i * 8 + 2] = simd_shuffle_xor(v, 5);
        o[i * 8 + 3] = simd_broadcast(v, 7);
        o[i * 8 + 4] = simd_prefix_inclusive_sum(v);
        o[i * 8 + 5] = simd_prefix_exclusive_sum(v);
        o[i * 8 + 6] = simd_max(v) + simd_min(v);
        o[i * 8 + 7] = simd_is_first() ? 1.0f : 0.0f;
    """)
    x = np.arange(64, dtype=np.float32) ** 1.5
    (o,) = k(inputs=[x], output_shapes=[(64 * 8,)], output_dtypes=[mx.float32],
             grid=(64, 1, 1), threadgroup=(64, 1, 1), lane_order="reversed")
    o = o.reshape(64, 8)
    for i in range(64):
        b, lane = i - i % 32, i % 32
        g = x[b:b + 32]
        assert o[i, 0] == (g[lane + 1] if lane + 1 < 32 else g[lane])  # no wrap
        assert o[i, 1] == (g[lane - 2] if lane >= 2 else g[lane])
        assert o[i, 2] == g[lane ^ 5]
        assert o[i, 3] == g[7]
        np.testing.assert_allclose(o[i, 4], g[:lane + 1].sum(), rtol=1e-6)
        np.testing.assert_allclose(o[i, 5], g[:lane].sum(), rtol=1e-6)
        assert o[i, 6] == g.max() + g.min()
        assert o[i, 7] == (1.0 if lane == 0 else 0.0)


def test_histogram_device_atomics():
    k = metal_kernel("hist", ["x"], ["h"], """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&h[x[i]], 1u, memory_order_relaxed);
    """, atomic_outputs=True)
    x = np.random.default_rng(1).integers(0, 10, 500).astype(np.uint32)
    for order in ORDERS:
        (h,) = k(inputs=[x], output_shapes=[(10,)], output_dtypes=[mx.uint32],
                 grid=(500, 1, 1), threadgroup=(128, 1, 1), init_value=0, lane_order=order)
        np.testing.assert_array_equal(h, np.bincount(x, minlength=10))


def test_float_atomic_add_and_threadgroup_atomics():
    k = metal_kernel("tgatomic", ["x"], ["total", "hist"], """
        uint i = thread_position_in_grid.x;
        uint lid = thread_index_in_threadgroup;
        threadgroup atomic<uint> local[4];
        if (lid < 4) atomic_store_explicit(&local[lid], 0u, memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        atomic_fetch_add_explicit(&local[uint(x[i]) % 4], 1u, memory_order_relaxed);
        atomic_fetch_add_explicit(&total[0], x[i], memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (lid < 4) {
            uint c = atomic_load_explicit(&local[lid], memory_order_relaxed);
            atomic_fetch_add_explicit(&hist[lid], float(c), memory_order_relaxed);
        }
    """, atomic_outputs=True)
    x = np.arange(200, dtype=np.float32)
    total, hist = k(inputs=[x], output_shapes=[(1,), (4,)], output_dtypes=[mx.float32, mx.float32],
                    grid=(200, 1, 1), threadgroup=(64, 1, 1), init_value=0, lane_order="shuffled")
    assert total[0] == x.sum()
    np.testing.assert_array_equal(hist, np.bincount(x.astype(int) % 4, minlength=4))


MATMUL = """
    // one simdgroup computes an 8x8 tile of C = A @ B, staging tiles in threadgroup memory
    uint lane = thread_index_in_simdgroup;
    uint tm = threadgroup_position_in_grid.y * 8, tn = threadgroup_position_in_grid.x * 8;
    threadgroup float As[64];
    threadgroup float Bs[64];
    simdgroup_float8x8 acc = simdgroup_float8x8(0);
    for (uint k0 = 0; k0 < K; k0 += 8) {
        for (uint e = lane; e < 64; e += 32) {
            As[e] = a[(tm + e / 8) * K + k0 + e % 8];
            Bs[e] = b[(k0 + e / 8) * N + tn + e % 8];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_float8x8 ma, mb;
        simdgroup_load(ma, As, 8);
        simdgroup_load(mb, Bs, 8);
        simdgroup_multiply_accumulate(acc, ma, mb, acc);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    simdgroup_store(acc, c + tm * N + tn, N);
"""


@pytest.mark.parametrize("order", ["forward", "shuffled"])
def test_tiled_matmul_simdgroup_matrix(order):
    rng = np.random.default_rng(2)
    M, N, K = 16, 24, 32
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    k = metal_kernel("mm", ["a", "b"], ["c"], MATMUL)
    (c,) = k(inputs=[a, b], output_shapes=[(M, N)], output_dtypes=[mx.float32],
             grid=(32 * N // 8, M // 8, 1), threadgroup=(32, 1, 1),
             template=[("N", N), ("K", K)], lane_order=order)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)


def test_half_and_bfloat_inputs_and_outputs():
    k = metal_kernel("hb", ["h", "b"], ["of", "oh", "ob"], """
        uint i = thread_position_in_grid.x;
        float p = float(h[i]) * float(b[i]);
        of[i] = p;
        oh[i] = half(p) + 1.0h;
        ob[i] = static_cast<bfloat16_t>(p) * bfloat16_t(2.0f);
    """)
    rng = np.random.default_rng(3)
    hv = rng.standard_normal(50).astype(np.float16)
    bv = mx.array(rng.standard_normal(50).astype(np.float32)).astype(mx.bfloat16)
    text = k.generated_source([hv, bv], [mx.float32, mx.float16, mx.bfloat16])
    assert "const device float16_t* h" in text and "const device bfloat16_t* b" in text
    of, oh, ob = k(inputs=[hv, bv], output_shapes=[(50,)] * 3,
                   output_dtypes=[mx.float32, mx.float16, mx.bfloat16],
                   grid=(50, 1, 1), threadgroup=(32, 1, 1))
    bf = np.array(bv.astype(mx.float32))
    ref = hv.astype(np.float32) * bf
    np.testing.assert_allclose(of, ref, rtol=1e-6)
    assert oh.dtype == np.float16
    np.testing.assert_allclose(oh, (ref.astype(np.float16) + np.float16(1)), rtol=1e-3)
    assert ob.dtype == np.float32  # bfloat16 outputs come back as float32
    np.testing.assert_allclose(ob, np.array(mx.array(ref).astype(mx.bfloat16).astype(mx.float32)) * 2, rtol=1e-2)
    assert as_mx(ob, mx.bfloat16).dtype == mx.bfloat16


def test_vector_types_swizzles_and_conversions():
    k = metal_kernel("vec", ["x"], ["o"], """
        uint i = thread_position_in_grid.x;
        const device float4* x4 = (const device float4*)x;
        device float4* o4 = reinterpret_cast<device float4*>(o);
        float4 v = x4[i];
        half2 h = half2(v.xy);
        float2 back = static_cast<float2>(h);
        float3 s = v.wzy;
        o4[2 * i] = float4(s, back.x + back.y);
        o4[2 * i + 1] = float4(dot(v, float4(1.0f)), length(v.xy) * length(v.xy), as_type<float>(as_type<uint>(v.x)), select(0.0f, 1.0f, v.x < v.w));
    """)
    x = np.arange(32, dtype=np.float32) / 4
    (o,) = k(inputs=[x], output_shapes=[(64,)], output_dtypes=[mx.float32],
             grid=(8, 1, 1), threadgroup=(8, 1, 1))
    v = x.reshape(8, 4)
    o = o.reshape(8, 2, 4)
    np.testing.assert_allclose(o[:, 0, :3], v[:, [3, 2, 1]])
    np.testing.assert_allclose(o[:, 0, 3], v[:, 0] + v[:, 1], rtol=1e-3)
    np.testing.assert_allclose(o[:, 1, 0], v.sum(1), rtol=1e-6)
    np.testing.assert_allclose(o[:, 1, 1], v[:, 0] ** 2 + v[:, 1] ** 2, rtol=1e-5)
    np.testing.assert_array_equal(o[:, 1, 2], v[:, 0])
    np.testing.assert_array_equal(o[:, 1, 3], 1.0)


def test_partial_threadgroups_and_attributes():
    k = metal_kernel("attrs", ["x"], ["o"], """
        uint3 g = thread_position_in_grid;
        uint idx = g.y * 10 + g.x;
        o[idx * 4 + 0] = threads_per_threadgroup.x * 100 + threads_per_threadgroup.y;
        o[idx * 4 + 1] = threadgroup_position_in_grid.x * 10 + threadgroup_position_in_grid.y;
        o[idx * 4 + 2] = thread_index_in_threadgroup;
        o[idx * 4 + 3] = threadgroups_per_grid.x * 10 + threads_per_grid.y + x[0];
    """)
    (o,) = k(inputs=[np.zeros(1, np.int32)], output_shapes=[(3 * 10 * 4,)], output_dtypes=[mx.int32],
             grid=(10, 3, 1), threadgroup=(4, 2, 1))
    o = o.reshape(3, 10, 4)
    assert o[0, 0, 0] == 402 and o[0, 9, 0] == 202 and o[2, 0, 0] == 401 and o[2, 9, 0] == 201
    assert o[2, 9, 1] == 21
    assert o[1, 9, 2] == 3  # (1, 1) in a 2x2 threadgroup
    assert (o[..., 3] == 33).all()


def test_unwritten_outputs_are_poisoned_and_init_value():
    k = metal_kernel("half_write", ["x"], ["f", "n"], """
        uint i = thread_position_in_grid.x;
        if (i % 2 == 0) { f[i] = x[i]; n[i] = 1; }
    """)
    x = np.ones(8, np.float32)
    f, n = k(inputs=[x], output_shapes=[(8,), (8,)], output_dtypes=[mx.float32, mx.int32],
             grid=(8, 1, 1), threadgroup=(8, 1, 1))
    assert np.isnan(f[1::2]).all() and (f[::2] == 1).all()
    assert (n[1::2].view(np.uint32) == 0xDEADBEEF).all()
    f, n = k(inputs=[x], output_shapes=[(8,), (8,)], output_dtypes=[mx.float32, mx.int32],
             grid=(8, 1, 1), threadgroup=(8, 1, 1), init_value=5)
    assert (f[1::2] == 5).all() and (n[1::2] == 5).all()


def test_too_large_threadgroup_and_compile_error():
    k = metal_kernel("big", ["x"], ["o"], "o[thread_position_in_grid.x] = x[0];")
    with pytest.raises(EmulatorError, match="1024"):
        k(inputs=[np.zeros(1, np.float32)], output_shapes=[(2048,)], output_dtypes=[mx.float32],
          grid=(2048, 1, 1), threadgroup=(2048, 1, 1))
    bad = metal_kernel("bad", ["x"], ["o"], "o[0] = undefined_thing(x[0]);")
    with pytest.raises(EmulatorError, match="undefined_thing"):
        bad(inputs=[np.zeros(1, np.float32)], output_shapes=[(1,)], output_dtypes=[mx.float32],
            grid=(1, 1, 1), threadgroup=(1, 1, 1))


def test_mlx_prelude_names_softmax(capsys):
    k = metal_kernel("softmax", ["x"], ["out"], """
        uint row = threadgroup_position_in_grid.x;
        uint lane = thread_index_in_simdgroup;
        float m = Limits<float>::min;
        for (uint c = lane; c < N; c += 32) m = metal::max(m, float(x[row * N + c]));
        m = simd_max(m);
        float s = 0;
        for (uint c = lane; c < N; c += 32) s += metal::fast::exp(float(x[row * N + c]) - m);
        s = simd_sum(s);
        for (uint c = lane; c < N; c += 32)
            out[row * N + c] = static_cast<T>(metal::precise::exp(float(x[row * N + c]) - m) / s * 1.0h);
        if (lane == 0 && row == 0) out[0] = out[0] + T(ceildiv(N, 32) - ceildiv(N, 32));
    """)
    x = np.random.default_rng(5).standard_normal((4, 70)).astype(np.float16)
    (o,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float16], grid=(128, 1, 1),
             threadgroup=(32, 1, 1), template=[("T", mx.float16), ("N", 70)], verbose=True)
    xf = x.astype(np.float32)
    ref = np.exp(xf - xf.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    np.testing.assert_allclose(o.astype(np.float32), ref, rtol=2e-3, atol=1e-4)
    printed = capsys.readouterr().out
    assert "Generated source code for `softmax`" in printed and "custom_kernel_softmax__float16_t_70" in printed
    cpp = k.translated_source([x], [mx.float16], [("T", mx.float16), ("N", 70)])
    assert "::mtl::DevPtr<float16_t> x" in cpp and "mtl_kernel_entry" in cpp
