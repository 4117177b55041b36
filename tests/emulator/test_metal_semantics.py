"""Where a CPU would be more forgiving than a GPU: half/bfloat rounding, barrier memory flags, strided
inputs, MLX's launch checks, compile options, comments, and the names of Metal's and MLX's
libraries that valid kernels use. Expected values come from numpy."""

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels.emulator import EmulatorError, metal_kernel


def call(k, inputs, n_out, dtype=mx.float32, grid=(1, 1, 1), tg=(1, 1, 1), **kw):
    return k(inputs=inputs, output_shapes=[(n_out,)], output_dtypes=[dtype], grid=grid, threadgroup=tg, **kw)[0]


# ------------------------------------------------------------------ numerics
def test_half_arithmetic_rounds_at_every_operation():
    # a GPU computes a + a in half: 120000 overflows to inf; keeping float precision would give 60000
    k = metal_kernel("half_overflow", ["h"], ["out"], "half a = h[0];\nout[0] = (a + a) - a;\nout[1] = a * a / a;")
    out = call(k, [np.full(8, 60000, np.float16)], 2, mx.float16)
    assert np.isinf(out).all() and (out > 0).all(), out


def test_bfloat_arithmetic_rounds_at_every_operation():
    # 1 + 2^-9 is 1 in bfloat (8 significant bits), so (a + e) - a is 0 on a GPU
    k = metal_kernel("bf_round", ["x"], ["out"], "bfloat a = static_cast<bfloat>(x[0]);\n"
                     "bfloat e = static_cast<bfloat>(x[1]);\nout[0] = float((a + e) - a);")
    out = call(k, [np.array([1.0, 2.0 ** -9] + [0] * 6, np.float32)], 1)
    assert out[0] == 0.0, out


# ------------------------------------------------------------------ memory model
EXCHANGE = """
uint lid = thread_index_in_threadgroup;
threadgroup float t[64];
t[lid] = x[lid];
threadgroup_barrier(FLAGS);
out[lid] = t[63 - lid];
"""


@pytest.mark.parametrize("flags,ok", [
    ("mem_flags::mem_threadgroup", True),
    ("mem_flags::mem_device | mem_flags::mem_threadgroup", True),
    ("mem_flags::mem_none", False),
    ("mem_flags::mem_device", False),
])
def test_barrier_orders_threadgroup_memory_only_with_mem_threadgroup(flags, ok):
    k = metal_kernel("flags_" + flags.split("::")[-1], ["x"], ["out"], EXCHANGE.replace("FLAGS", flags))
    x = np.arange(64, dtype=np.float32)
    if ok:
        np.testing.assert_array_equal(call(k, [x], 64, grid=(64, 1, 1), tg=(64, 1, 1)), x[::-1])
        return
    with pytest.raises(EmulatorError, match=r"threadgroup memory race: reads threadgroup array 't'.*the "
                       r"threadgroup_barrier on line \d+ orders no threadgroup memory: its mem_flags lack "
                       r"mem_flags::mem_threadgroup"):
        call(k, [x], 64, grid=(64, 1, 1), tg=(64, 1, 1), lane_order="reversed")


@pytest.mark.parametrize("flags,ok", [("mem_flags::mem_threadgroup", True), ("mem_flags::mem_none", False)])
def test_simdgroup_barrier_flags(flags, ok):
    k = metal_kernel("sgbar_" + flags.split("::")[-1], ["x"], ["out"], f"""
        uint lane = thread_index_in_simdgroup;
        threadgroup float t[32];
        t[lane] = x[lane];
        simdgroup_barrier({flags});
        out[lane] = t[31 - lane];
    """)
    x = np.arange(32, dtype=np.float32)
    if ok:
        np.testing.assert_array_equal(call(k, [x], 32, grid=(32, 1, 1), tg=(32, 1, 1)), x[::-1])
    else:
        with pytest.raises(EmulatorError, match="threadgroup memory race"):
            call(k, [x], 32, grid=(32, 1, 1), tg=(32, 1, 1), lane_order="reversed")


# ------------------------------------------------------------------ inputs as MLX passes them
IGNORES_STRIDES = "uint i = thread_position_in_grid.x;\nout[i] = x[i];"
USES_STRIDES = "uint i = thread_position_in_grid.x;\nout[i] = x[elem_to_loc(i, x_shape, x_strides, x_ndim)];"


def test_strided_mx_input_keeps_its_layout_without_ensure_row_contiguous():
    base = mx.arange(48, dtype=mx.float32).reshape(6, 8)
    view = base[1:5, 1:7:2]  # 4 x 3, strides (8, 2), offset 9
    want = np.array(view).reshape(-1)
    for contiguous in (True, False):
        ignores = metal_kernel(f"ignores_{contiguous}", ["x"], ["out"], IGNORES_STRIDES,
                               ensure_row_contiguous=contiguous)
        uses = metal_kernel(f"uses_{contiguous}", ["x"], ["out"], USES_STRIDES, ensure_row_contiguous=contiguous)
        got_uses = call(uses, [view], 12, grid=(12, 1, 1), tg=(12, 1, 1))
        np.testing.assert_array_equal(got_uses, want)
        got_ignores = call(ignores, [view], 12, grid=(12, 1, 1), tg=(12, 1, 1))
        if contiguous:  # MLX copied the input into a row-contiguous buffer
            np.testing.assert_array_equal(got_ignores, want)
        else:  # the kernel read the buffer, not the view: wrong values, as on a GPU
            np.testing.assert_array_equal(got_ignores, np.array(base).reshape(-1)[9:21])
            assert not np.array_equal(got_ignores, want)


def test_broadcast_and_transposed_inputs():
    row = mx.array([1.0, 2.0, 3.0], dtype=mx.float32)
    bc = mx.broadcast_to(row, (4, 3))  # strides (0, 1)
    tr = mx.arange(12, dtype=mx.float32).reshape(3, 4).T
    for x in (bc, tr):
        k = metal_kernel("layout", ["x"], ["out"], USES_STRIDES, ensure_row_contiguous=False)
        np.testing.assert_array_equal(call(k, [x], 12, grid=(12, 1, 1), tg=(12, 1, 1)), np.array(x).reshape(-1))
    k = metal_kernel("bc_strides", ["x"], ["out"],
                     "uint i = thread_position_in_grid.x;\nout[i] = float(x_strides[i]);", ensure_row_contiguous=False)
    np.testing.assert_array_equal(call(k, [bc], 2, grid=(2, 1, 1), tg=(2, 1, 1)), [0, 1])


def test_bfloat16_view_input():
    base = mx.arange(16, dtype=mx.float32).reshape(4, 4).astype(mx.bfloat16)
    view = base[:, ::2]
    k = metal_kernel("bf_view", ["x"], ["out"],
                     "uint i = thread_position_in_grid.x;\n"
                     "out[i] = float(x[elem_to_loc(i, x_shape, x_strides, x_ndim)]);",
                     ensure_row_contiguous=False)
    np.testing.assert_array_equal(call(k, [view], 8, grid=(8, 1, 1), tg=(8, 1, 1)),
                                  np.array(view.astype(mx.float32)).reshape(-1))


def test_float64_is_refused():
    k = metal_kernel("f64", ["x"], ["out"], "out[0] = x[0];")
    with pytest.raises(EmulatorError, match="input 'x' is float64; Metal has no double"):
        call(k, [np.zeros(8)], 1)
    with pytest.raises(EmulatorError, match="output 'out' is float64"):
        call(k, [np.zeros(8, np.float32)], 1, dtype=mx.float64)


# ------------------------------------------------------------------ launch checks
def test_requested_threadgroup_size_is_checked_before_clamping_to_the_grid():
    k = metal_kernel("tg_big", ["x"], ["out"], "out[thread_position_in_grid.x] = x[0];")
    with pytest.raises(EmulatorError, match=r"Thread group size \(2048\) is greater than the maximum allowed threads "
                       r"per threadgroup \(1024\)"):
        call(k, [np.zeros(8, np.float32)], 16, grid=(16, 1, 1), tg=(2048, 1, 1))
    # MLX compiles before it checks the threadgroup: a compile error comes first
    bad = metal_kernel("tg_big_bad", ["x"], ["out"], "out[0] = max(x[0], 0);")
    with pytest.raises(EmulatorError, match="no matching function for call to 'max'"):
        call(bad, [np.zeros(8, np.float32)], 16, grid=(16, 1, 1), tg=(2048, 1, 1))


def test_compile_options():
    for mode in ("safe", "relaxed", "fast"):
        k = metal_kernel("opts", ["x"], ["out"], "out[0] = x[0] + 1.0f;", compile_options={"math_mode": mode})
        assert call(k, [np.ones(8, np.float32)], 1)[0] == 2.0
    with pytest.raises(EmulatorError, match=r"Expected math_mode to be 'safe', 'relaxed', or 'fast'"):
        metal_kernel("opts", ["x"], ["out"], "out[0] = 1;", compile_options={"math_mode": "turbo"})
    with pytest.raises(EmulatorError, match=r"Unknown compile option `fast_math`"):
        metal_kernel("opts", ["x"], ["out"], "out[0] = 1;", compile_options={"fast_math": True})
    with pytest.raises(EmulatorError, match=r"Expected `compile_options` to be a dict"):
        metal_kernel("opts", ["x"], ["out"], "out[0] = 1;", compile_options="fast")


# ------------------------------------------------------------------ text handling
def test_comments_and_strings_are_never_rewritten():
    k = metal_kernel("comments", ["x"], ["out"], """
        uint i = thread_position_in_grid.x;
        // sum across the threadgroup
        float acc = x[i];
        /* a device pointer would be: const device float* p; constant memory is read-only */
        // threadgroup float scratch[4];
        out[i] = acc * 2.0f; // device float* q = out;
    """)
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(call(k, [x], 8, grid=(8, 1, 1), tg=(8, 1, 1)), 2 * x)
    text = k.translated_source([x], [mx.float32])
    assert "// sum across the threadgroup" not in text  # comments are blanked, not translated


def test_unsuffixed_floating_literals_are_float():
    # Metal has no double: `x * 0.1` is a float product (a double one rounds differently)
    k = metal_kernel("literal", ["x"], ["out"], "out[0] = x[0] * 0.1;\nout[1] = metal::exp(x[0] * 0.5);")
    out = call(k, [np.full(8, 3.0, np.float32)], 2)
    assert out[0] == np.float32(3.0) * np.float32(0.1)
    np.testing.assert_allclose(out[1], np.exp(np.float32(1.5)), rtol=1e-6)


# ------------------------------------------------------------------ library names
def test_metal_library_functions():
    k = metal_kernel("library", ["x"], ["out"], """
        float a = x[0], b = x[1], c = x[2];
        out[0] = fmax3(a, b, c);
        out[1] = fmin3(a, b, c);
        out[2] = fmedian3(a, b, c);
        out[3] = ldexp(a, 3);
        int e;
        out[4] = frexp(b, e);
        out[5] = float(e);
        out[6] = nextafter(a, 10.0f) - a;
        out[7] = tanpi(0.25f);
        out[8] = divide(a, b);
        out[9] = isnormal(a) ? 1.0f : 0.0f;
        out[10] = isnormal(1e-40f) ? 1.0f : 0.0f;
        atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
        out[11] = float(max3(3, 9, 4));
        out[12] = float(median3(3u, 9u, 4u));
        float2 v = float2(a, b);
        out[13] = fmax3(v, v + 1.0f, v - 1.0f).y;
        out[14] = float(popcount(0xF0u)) + float(clz(1u)) + float(ctz(8u));
    """)
    x = np.array([1.5, 6.0, -2.0, 0, 0, 0, 0, 0], np.float32)
    out = call(k, [x], 15)
    m, e = np.frexp(np.float32(6.0))
    want = [6.0, -2.0, 1.5, 12.0, m, e, np.nextafter(np.float32(1.5), np.float32(10)) - np.float32(1.5),
            1.0, 0.25, 1.0, 0.0, 9.0, 4.0, 7.0, 4 + 31 + 3]
    np.testing.assert_allclose(out, np.array(want, np.float32), rtol=1e-6)


def test_simd_shuffle_and_fill():
    k = metal_kernel("fill", ["x"], ["out"], """
        uint i = thread_index_in_simdgroup;
        float v = x[i], f = x[i] + 100.0f;
        out[i] = simd_shuffle_and_fill_down(v, f, ushort(3));
        out[32 + i] = simd_shuffle_and_fill_up(v, f, ushort(2), ushort(8));
    """)
    x = np.arange(32, dtype=np.float32)
    out = call(k, [x], 64, grid=(32, 1, 1), tg=(32, 1, 1))
    lane = np.arange(32)
    down = np.where(lane + 3 < 32, x[(lane + 3) % 32], x[(lane + 3) % 32] + 100)
    seg, pos = lane // 8 * 8, lane % 8
    up = np.where(pos >= 2, x[seg + pos - 2], x[seg + (pos - 2) % 8] + 100)
    np.testing.assert_array_equal(out[:32], down)
    np.testing.assert_array_equal(out[32:], up)


def test_mlx_prelude_names():
    k = metal_kernel("prelude", ["a", "b", "c"], ["out"], """
        uint3 pos = uint3(thread_position_in_grid.x, 0, 0);
        uint i = pos.x;
        auto l2 = elem_to_loc_2_nd<int64_t>(uint3(i % 3, i / 3, 0), a_shape, a_strides, b_strides, a_ndim);
        auto l3 = elem_to_loc_3_nd<int64_t>(uint3(i % 3, i / 3, 0), a_shape, a_strides, b_strides, c_strides, a_ndim);
        out[i] = a[l2.x] + 10.0f * b[l2.y] + 100.0f * c[l3.z];
        LoopedElemToLoc<2, int64_t> looper(a_ndim);
        MLX_MTL_PRAGMA_UNROLL
        for (uint k = 0; k < i; ++k) looper.next(a_shape, a_strides);
        out[6 + i] = a[looper.location()];
        out[12] = float(WorkPerThread<half>::n) + float(bfloat16_to_uint16(bfloat16_t(1.0f)));
        complex64_t z = complex64_t(1.0f, 2.0f) * complex64_t(3.0f, -1.0f);
        out[13] = z.real;
        out[14] = z.imag;
        out[15] = Limits<float>::finite_max == FLT_MAX ? 1.0f : 0.0f;
    """, ensure_row_contiguous=False)
    a = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    b = mx.arange(6, dtype=mx.float32).reshape(3, 2).T  # strides (1, 2)
    c = mx.broadcast_to(mx.array([7.0, 8.0, 9.0]), (2, 3))
    out = call(k, [a, b, c], 16, grid=(6, 1, 1), tg=(6, 1, 1))
    an, bn, cn = (np.array(t).reshape(-1) for t in (a, b, c))
    np.testing.assert_array_equal(out[:6], an + 10 * bn + 100 * cn)
    np.testing.assert_array_equal(out[6:12], an)
    z = (1 + 2j) * (3 - 1j)
    np.testing.assert_array_equal(out[12:], [4 + 0x3F80, z.real, z.imag, 1.0])


def test_complex64_inputs_and_outputs():
    k = metal_kernel("cplx", ["z"], ["out"],
                     "uint i = thread_position_in_grid.x;\nout[i] = z[i] * z[i] + complex64_t(1.0f, 0.0f);")
    z = (np.arange(8) + 1j * np.arange(8)[::-1]).astype(np.complex64)
    np.testing.assert_allclose(call(k, [z], 8, dtype=mx.complex64, grid=(8, 1, 1), tg=(8, 1, 1)), z * z + 1, rtol=1e-6)
