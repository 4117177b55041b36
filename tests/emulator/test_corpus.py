"""A corpus of real kernels written by others for ``mx.fast.metal_kernel``, run on the strict emulator
against independent oracles (numpy ports of their reference functions, PyTorch, MLX's own ops).

Each kernel's source is the text of the repository and path named above it (MIT-licensed; the
generator functions are reproduced where the source is built from parts).
"""

import mlx.core as mx
import numpy as np
import pytest
import torch

from metal_kernels.emulator import EmulatorError, metal_kernel

ORDERS = ["forward", "reversed", "shuffled"]


def f32(a):
    return np.array(mx.array(a).astype(mx.float32)) if isinstance(a, mx.array) else np.asarray(a, np.float32)


# ---------------------------------------------------------------- ml-explore/mlx docs/src/dev/custom_metal_kernels.rst
MYEXP = """
    uint elem = thread_position_in_grid.x;
    T tmp = inp[elem];
    out[elem] = metal::exp(tmp);
"""
MYEXP_STRIDED = """
    uint elem = thread_position_in_grid.x;
    // Utils from `mlx/backend/metal/kernels/utils.h` are automatically included
    uint loc = elem_to_loc(elem, inp_shape, inp_strides, inp_ndim);
    T tmp = inp[loc];
    // Output arrays are always row contiguous
    out[elem] = metal::exp(tmp);
"""


@pytest.mark.parametrize("strided", [False, True])
def test_docs_exp_elementwise(strided):
    a = mx.array(np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32)).astype(mx.float16)
    if strided:
        a = a[::2]  # the docs' non-contiguous input
        kernel = metal_kernel("myexp_strided", ["inp"], ["out"], MYEXP_STRIDED, ensure_row_contiguous=False)
    else:
        kernel = metal_kernel("myexp", ["inp"], ["out"], MYEXP)
    (b,) = kernel(inputs=[a], template=[("T", mx.float16)], grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
                  output_shapes=[a.shape], output_dtypes=[a.dtype])
    # half exp: one rounding of a float exp, compared with float32 exp (half has ~1e-3 relative precision)
    np.testing.assert_allclose(b.astype(np.float32), np.exp(f32(a)), rtol=2e-3)


GRID_SAMPLE = """
    uint elem = thread_position_in_grid.x;
    int H = x_shape[1];
    int W = x_shape[2];
    int C = x_shape[3];
    int gH = grid_shape[1];
    int gW = grid_shape[2];

    int w_stride = C;
    int h_stride = W * w_stride;
    int b_stride = H * h_stride;

    uint grid_idx = elem / C * 2;
    float ix = ((grid[grid_idx] + 1) * W - 1) / 2;
    float iy = ((grid[grid_idx + 1] + 1) * H - 1) / 2;

    int ix_nw = floor(ix);
    int iy_nw = floor(iy);

    int ix_ne = ix_nw + 1;
    int iy_ne = iy_nw;

    int ix_sw = ix_nw;
    int iy_sw = iy_nw + 1;

    int ix_se = ix_nw + 1;
    int iy_se = iy_nw + 1;

    T nw = (ix_se - ix)    * (iy_se - iy);
    T ne = (ix    - ix_sw) * (iy_sw - iy);
    T sw = (ix_ne - ix)    * (iy    - iy_ne);
    T se = (ix    - ix_nw) * (iy    - iy_nw);

    int batch_idx = elem / C / gH / gW * b_stride;
    int channel_idx = elem % C;
    int base_idx = batch_idx + channel_idx;

    T I_nw = x[base_idx + iy_nw * h_stride + ix_nw * w_stride];
    T I_ne = x[base_idx + iy_ne * h_stride + ix_ne * w_stride];
    T I_sw = x[base_idx + iy_sw * h_stride + ix_sw * w_stride];
    T I_se = x[base_idx + iy_se * h_stride + ix_se * w_stride];

    I_nw = iy_nw >= 0 && iy_nw <= H - 1 && ix_nw >= 0 && ix_nw <= W - 1 ? I_nw : 0;
    I_ne = iy_ne >= 0 && iy_ne <= H - 1 && ix_ne >= 0 && ix_ne <= W - 1 ? I_ne : 0;
    I_sw = iy_sw >= 0 && iy_sw <= H - 1 && ix_sw >= 0 && ix_sw <= W - 1 ? I_sw : 0;
    I_se = iy_se >= 0 && iy_se <= H - 1 && ix_se >= 0 && ix_se <= W - 1 ? I_se : 0;

    out[elem] = nw * I_nw + ne * I_ne + sw * I_sw + se * I_se;
"""

GRID_SAMPLE_GRAD = """
    uint elem = thread_position_in_grid.x;
    int H = x_shape[1];
    int W = x_shape[2];
    int C = x_shape[3];
    // Pad C to the nearest larger simdgroup size multiple
    int C_padded = ceildiv(C, threads_per_simdgroup) * threads_per_simdgroup;

    int gH = grid_shape[1];
    int gW = grid_shape[2];

    int w_stride = C;
    int h_stride = W * w_stride;
    int b_stride = H * h_stride;

    uint grid_idx = elem / C_padded * 2;
    float ix = ((grid[grid_idx] + 1) * W - 1) / 2;
    float iy = ((grid[grid_idx + 1] + 1) * H - 1) / 2;

    int ix_nw = floor(ix);
    int iy_nw = floor(iy);

    int ix_ne = ix_nw + 1;
    int iy_ne = iy_nw;

    int ix_sw = ix_nw;
    int iy_sw = iy_nw + 1;

    int ix_se = ix_nw + 1;
    int iy_se = iy_nw + 1;

    T nw = (ix_se - ix)    * (iy_se - iy);
    T ne = (ix    - ix_sw) * (iy_sw - iy);
    T sw = (ix_ne - ix)    * (iy    - iy_ne);
    T se = (ix    - ix_nw) * (iy    - iy_nw);

    int batch_idx = elem / C_padded / gH / gW * b_stride;
    int channel_idx = elem % C_padded;
    int base_idx = batch_idx + channel_idx;

    T gix = T(0);
    T giy = T(0);
    if (channel_idx < C) {
        int cot_index = elem / C_padded * C + channel_idx;
        T cot = cotangent[cot_index];
        if (iy_nw >= 0 && iy_nw <= H - 1 && ix_nw >= 0 && ix_nw <= W - 1) {
            int offset = base_idx + iy_nw * h_stride + ix_nw * w_stride;
            atomic_fetch_add_explicit(&x_grad[offset], nw * cot, memory_order_relaxed);

            T I_nw = x[offset];
            gix -= I_nw * (iy_se - iy) * cot;
            giy -= I_nw * (ix_se - ix) * cot;
        }
        if (iy_ne >= 0 && iy_ne <= H - 1 && ix_ne >= 0 && ix_ne <= W - 1) {
            int offset = base_idx + iy_ne * h_stride + ix_ne * w_stride;
            atomic_fetch_add_explicit(&x_grad[offset], ne * cot, memory_order_relaxed);

            T I_ne = x[offset];
            gix += I_ne * (iy_sw - iy) * cot;
            giy -= I_ne * (ix - ix_sw) * cot;
        }
        if (iy_sw >= 0 && iy_sw <= H - 1 && ix_sw >= 0 && ix_sw <= W - 1) {
            int offset = base_idx + iy_sw * h_stride + ix_sw * w_stride;
            atomic_fetch_add_explicit(&x_grad[offset], sw * cot, memory_order_relaxed);

            T I_sw = x[offset];
            gix -= I_sw * (iy - iy_ne) * cot;
            giy += I_sw * (ix_ne - ix) * cot;
        }
        if (iy_se >= 0 && iy_se <= H - 1 && ix_se >= 0 && ix_se <= W - 1) {
            int offset = base_idx + iy_se * h_stride + ix_se * w_stride;
            atomic_fetch_add_explicit(&x_grad[offset], se * cot, memory_order_relaxed);

            T I_se = x[offset];
            gix += I_se * (iy - iy_nw) * cot;
            giy += I_se * (ix - ix_nw) * cot;
        }
    }

    T gix_mult = W / 2;
    T giy_mult = H / 2;

    // Reduce across each simdgroup first.
    // This is much faster than relying purely on atomics.
    gix = simd_sum(gix);
    giy = simd_sum(giy);

    if (thread_index_in_simdgroup == 0) {
        atomic_fetch_add_explicit(&grid_grad[grid_idx], gix * gix_mult, memory_order_relaxed);
        atomic_fetch_add_explicit(&grid_grad[grid_idx + 1], giy * giy_mult, memory_order_relaxed);
    }
"""


def _torch_grid_sample(x, grid, cot):
    """torch's bilinear grid_sample (zero padding, align_corners=False): the docs' formula."""
    xt = torch.tensor(x).permute(0, 3, 1, 2).requires_grad_()
    gt = torch.tensor(grid).requires_grad_()
    y = torch.nn.functional.grid_sample(xt, gt, mode="bilinear", padding_mode="zeros", align_corners=False)
    y = y.permute(0, 2, 3, 1)
    (y * torch.tensor(cot)).sum().backward()
    return y.detach().numpy(), xt.grad.permute(0, 2, 3, 1).numpy(), gt.grad.numpy()


def _grid_sample_case(margin):
    rng = np.random.default_rng(1)
    B, H, W, C, gN, gM = 2, 5, 6, 3, 4, 3
    x = rng.normal(size=(B, H, W, C)).astype(np.float32)
    # margin > 0: every sample's four neighbours are inside the image
    lim = 1 - 1 / min(H, W) - margin
    grid = rng.uniform(-lim, lim, size=(B, gN, gM, 2)).astype(np.float32)
    cot = rng.normal(size=(B, gN, gM, C)).astype(np.float32)
    return x, grid, cot


def _grid_sample_forward(x, grid, order="forward"):
    fwd = metal_kernel("grid_sample", ["x", "grid"], ["out"], GRID_SAMPLE)
    out_shape = grid.shape[:3] + x.shape[3:]
    return fwd(inputs=[x, grid], template=[("T", mx.float32)], output_shapes=[out_shape],
               output_dtypes=[mx.float32], grid=(int(np.prod(out_shape)), 1, 1), threadgroup=(256, 1, 1),
               lane_order=order)[0]


@pytest.mark.parametrize("order", ORDERS)
def test_docs_grid_sample_forward_and_vjp(order):
    x, grid, cot = _grid_sample_case(margin=0.02)
    y_ref, _, _ = _torch_grid_sample(x, grid, cot)
    # float32 bilinear interpolation of O(1) values: a few ulps
    np.testing.assert_allclose(_grid_sample_forward(x, grid, order), y_ref, rtol=1e-5, atol=1e-5)

    # the VJP guards its reads, so samples may fall outside the image
    x, grid, cot = _grid_sample_case(margin=-0.3)
    B, H, W, C = x.shape
    _, dx_ref, dgrid_ref = _torch_grid_sample(x, grid, cot)
    bwd = metal_kernel("grid_sample_grad", ["x", "grid", "cotangent"], ["x_grad", "grid_grad"], GRID_SAMPLE_GRAD,
                       atomic_outputs=True)
    c_padded = (C + 31) // 32 * 32
    dx, dgrid = bwd(inputs=[x, grid, cot], template=[("T", mx.float32)], output_shapes=[x.shape, grid.shape],
                    output_dtypes=[mx.float32, mx.float32], grid=(int(np.prod(grid.shape[:3])) * c_padded, 1, 1),
                    threadgroup=(256, 1, 1), init_value=0, lane_order=order)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-5)
    # the docs' kernel scales by W / 2 and H / 2 in integer arithmetic (here W = 6, H = 5 -> 2, not 2.5):
    # the x component is exact, the y component is off by the factor (H // 2) / (H / 2)
    np.testing.assert_allclose(dgrid[..., 0], dgrid_ref[..., 0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dgrid[..., 1], dgrid_ref[..., 1] * (H // 2) / (H / 2), rtol=1e-4, atol=1e-5)


def test_docs_grid_sample_forward_reads_out_of_bounds_at_the_border():
    # The forward kernel loads all four neighbours before masking them: a sample near the border
    # reads outside `x` (undefined behaviour on a GPU, harmless-looking because the value is masked).
    x, grid, cot = _grid_sample_case(margin=0.02)
    grid[0, 0, 0] = [-1.0, -1.0]
    with pytest.raises(EmulatorError, match=r"kernel 'grid_sample', thread_position_in_grid=\(\d+, 0, 0\).*"
                       r"out-of-bounds access to device buffer 'x': element index -\d+"):
        _grid_sample_forward(x, grid)


def test_docs_grid_sample_vjp_with_half_outputs_is_refused():
    # atomic_outputs with float16 outputs declares `device atomic<float16_t>*`: Metal has no atomic<half>
    bwd = metal_kernel("grid_sample_grad", ["x", "grid", "cotangent"], ["x_grad", "grid_grad"], GRID_SAMPLE_GRAD,
                       atomic_outputs=True)
    x = np.zeros((1, 2, 2, 1), np.float16)
    grid = np.zeros((1, 2, 2, 2), np.float16)
    with pytest.raises(EmulatorError, match=r"atomic<half>.*Metal's atomic types"):
        bwd(inputs=[x, grid, np.zeros((1, 2, 2, 1), np.float16)], template=[("T", mx.float16)],
            output_shapes=[x.shape, grid.shape], output_dtypes=[mx.float16, mx.float16], grid=(128, 1, 1),
            threadgroup=(128, 1, 1), init_value=0)


# ---------------------------------------------------------------- ml-explore/mlx python/tests/test_fast.py
def test_mlx_tests_custom_kernel_args():
    # test_custom_kernel_args: a float, an int input of 3 and a bfloat16 input of 4 elements (both
    # `const constant`), a float scalar, bool/int/dtype template arguments
    source = """
        uint elem = thread_position_in_grid.x;
        T tmp = a[0];
        if (e) {
            out1[elem] = a[1] + b[2] + c[3] + d + f;
        } else {
            out1[elem] = 1;
        }
        out2[elem] = a[1] + b[2] + c[1] - d;
    """
    a = mx.array(np.random.default_rng(7).normal(size=(3, 6)).astype(np.float32))
    c = mx.array(np.random.default_rng(8).normal(size=(2, 2)).astype(np.float32)).astype(mx.bfloat16)
    kernel = metal_kernel("arg_test", ["a", "b", "c", "d"], ["out1", "out2"], source)
    out1, out2 = kernel(inputs=[a, mx.array([3, 4, 5]), c, 7.3], template=[("e", True), ("f", 3), ("T", mx.float16)],
                        grid=(6, 1, 1), threadgroup=(2, 1, 1), output_shapes=[(3, 2), (3, 2)],
                        output_dtypes=[mx.float32, mx.int32])
    an, cn = f32(a).reshape(-1), f32(c).reshape(-1)
    np.testing.assert_allclose(out1, np.full((3, 2), an[1] + 5 + cn[3] + np.float32(7.3) + 3), rtol=1e-6)
    np.testing.assert_array_equal(out2, np.full((3, 2), np.trunc(an[1] + 5 + cn[1] - np.float32(7.3))))


@pytest.mark.parametrize("contig", [True, False])
def test_mlx_tests_custom_kernel_strides(contig):
    source = """
        uint elem = thread_position_in_grid.x;
        uint loc = elem_to_loc(elem, inp_shape, inp_strides, inp_ndim);
        T tmp = inp[loc];
        out[elem] = metal::precise::exp(tmp) * threads_per_simdgroup;
    """
    source_contig = """
        uint elem = thread_position_in_grid.x;
        T tmp = inp[elem];
        out[elem] = metal::precise::exp(tmp) * threads_per_simdgroup;
    """
    a = mx.array(np.random.default_rng(7).normal(size=(3, 6)).astype(np.float32))
    a = mx.tile(a[::2], [4, 1])
    kernel = metal_kernel("myexp" + str(contig), ["inp"], ["out"], source_contig if contig else source,
                          ensure_row_contiguous=contig)
    (out,) = kernel(inputs=[a], template=[("T", mx.float32)], grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[a.shape], output_dtypes=[a.dtype])
    np.testing.assert_allclose(out, np.exp(f32(a)) * 32, rtol=1e-6)


def test_mlx_tests_custom_kernel_helper_and_attributes():
    header = """
    template <typename T>
    T do_exp(T x) {
        return metal::precise::exp(x);
    }
    """
    source = """
        uint elem = thread_position_in_grid.x;
        out1[elem] = do_exp(a[elem]);
    """
    a = np.random.default_rng(7).normal(size=(2, 2)).astype(np.float32)  # 4 elements: constant memory
    kernel = metal_kernel("helper", ["a"], ["out1"], source, header=header)
    (out,) = kernel(inputs=[a], grid=(4, 1, 1), threadgroup=(2, 1, 1), output_shapes=[(2, 2)],
                    output_dtypes=[mx.float32])
    np.testing.assert_allclose(out, np.exp(a), rtol=1e-6)
    kernel = metal_kernel("test_fun", ["a"], ["out"], "out[0] = threads_per_threadgroup.x;")
    (out,) = kernel(inputs=[np.zeros((1, 1), np.float32)], grid=(2, 1, 1), threadgroup=(2, 1, 1),
                    output_shapes=[(1, 1)], output_dtypes=[mx.uint32])
    assert out.item() == 2


def test_mlx_tests_math_mode_macro():
    # test_custom_metal_kernel_math_mode: __FAST_MATH__ is defined only in the "fast" math mode
    source = """
        uint elem = thread_position_in_grid.x;
        #if defined(__FAST_MATH__) && __FAST_MATH__
        out[elem] = 1.0f;
        #else
        out[elem] = 0.0f;
        #endif
    """
    for mode, want in (("safe", 0.0), ("fast", 1.0)):
        kernel = metal_kernel("math_mode", ["inp"], ["out"], source, compile_options={"math_mode": mode})
        (out,) = kernel(inputs=[np.zeros(4, np.float32)], grid=(4, 1, 1), threadgroup=(4, 1, 1),
                        output_shapes=[(4,)], output_dtypes=[mx.float32])
        np.testing.assert_array_equal(out, want)


# ---------------------------------------------------------------- ml-explore/mlx-lm mlx_lm/models/gated_delta.py
def _make_gated_delta_source(has_mask=False, vectorized=False):
    """`_make_gated_delta_kernel`'s source text."""
    mask_source = "mask[b_idx * T + t]" if has_mask else "true"
    if vectorized:
        g_comment = "// g: [B, T, Hv, Dk]"
        g_setup = "auto g_ = g + (b_idx * T * Hv + hv_idx) * Dk;"
        g_access = "g_[s_idx]"
        g_advance = "g_ += Hv * Dk;"
    else:
        g_comment = "// g: [B, T, Hv]"
        g_setup = "auto g_ = g + b_idx * T * Hv;"
        g_access = "g_[hv_idx]"
        g_advance = "g_ += Hv;"
    return f"""
        auto n = thread_position_in_grid.z;
        auto b_idx = n / Hv;
        auto hv_idx = n % Hv;
        auto hk_idx = hv_idx / (Hv / Hk);
        constexpr int n_per_t = Dk / 32;

        // q, k: [B, T, Hk, Dk]
        auto q_ = q + b_idx * T * Hk * Dk + hk_idx * Dk;
        auto k_ = k + b_idx * T * Hk * Dk + hk_idx * Dk;

        // v, y: [B, T, Hv, Dv]
        auto v_ = v + b_idx * T * Hv * Dv + hv_idx * Dv;
        y += b_idx * T * Hv * Dv + hv_idx * Dv;

        auto dk_idx = thread_position_in_threadgroup.x;
        auto dv_idx = thread_position_in_grid.y;

        // state_in, state_out: [B, Hv, Dv, Dk]
        auto i_state = state_in + (n * Dv + dv_idx) * Dk;
        auto o_state = state_out + (n * Dv + dv_idx) * Dk;

        float state[n_per_t];
        for (int i = 0; i < n_per_t; ++i) {{
          auto s_idx = n_per_t * dk_idx + i;
          state[i] = static_cast<float>(i_state[s_idx]);
        }}

        {g_comment}
        {g_setup}
        auto beta_ = beta + b_idx * T * Hv;

        for (int t = 0; t < T; ++t) {{
          if ({mask_source}) {{
            float kv_mem = 0.0f;
            for (int i = 0; i < n_per_t; ++i) {{
              auto s_idx = n_per_t * dk_idx + i;
              state[i] = state[i] * {g_access};
              kv_mem += state[i] * k_[s_idx];
            }}
            kv_mem = simd_sum(kv_mem);

            auto delta = (v_[dv_idx] - kv_mem) * beta_[hv_idx];

            float out = 0.0f;
            for (int i = 0; i < n_per_t; ++i) {{
              auto s_idx = n_per_t * dk_idx + i;
              state[i] = state[i] + k_[s_idx] * delta;
              out += state[i] * q_[s_idx];
            }}
            out = simd_sum(out);
            if (thread_index_in_simdgroup == 0) {{
              y[dv_idx] = static_cast<InT>(out);
            }}
          }} else {{
            y[dv_idx] = static_cast<InT>(0);
          }}
          // Increment data pointers to next time step
          q_ += Hk * Dk;
          k_ += Hk * Dk;
          v_ += Hv * Dv;
          y += Hv * Dv;
          {g_advance}
          beta_ += Hv;
        }}
        for (int i = 0; i < n_per_t; ++i) {{
          auto s_idx = n_per_t * dk_idx + i;
          o_state[s_idx] = static_cast<StT>(state[i]);
        }}
    """


def _gated_delta_ops(q, k, v, g, beta, state, mask=None):
    """numpy port of mlx-lm's `gated_delta_ops` / `_gated_delta_step_ops` (float64)."""
    q, k, v, g, beta, state = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
    B, T, Hk, Dk = q.shape
    Hv = v.shape[2]
    q, k = np.repeat(q, Hv // Hk, axis=2), np.repeat(k, Hv // Hk, axis=2)
    ys = []
    for t in range(T):
        old = state
        decay = g[:, t, :, None, None] if g.ndim == 3 else g[:, t, :, None, :]
        state = state * decay
        kv_mem = (state * k[:, t, :, None, :]).sum(-1)
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        state = state + k[:, t, :, None, :] * delta[..., None]
        ys.append((state * q[:, t, :, None, :]).sum(-1))
        if mask is not None:
            state = np.where(mask[:, t, None, None, None], state, old)
    return np.stack(ys, 1), state


@pytest.mark.parametrize("vectorized", [False, True])
@pytest.mark.parametrize("has_mask", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 1, 2, 64, 8), (1, 1, 1, 1, 32, 4)])  # B, T, Hk, Hv, Dk, Dv
def test_mlx_lm_gated_delta_step(vectorized, has_mask, shape):
    B, T, Hk, Hv, Dk, Dv = shape
    rng = np.random.default_rng(3)
    q = (rng.normal(size=(B, T, Hk, Dk)) / np.sqrt(Dk)).astype(np.float32)
    k = (rng.normal(size=(B, T, Hk, Dk)) / np.sqrt(Dk)).astype(np.float32)
    v = rng.normal(size=(B, T, Hv, Dv)).astype(np.float32)
    g = rng.uniform(0.5, 1.0, size=(B, T, Hv, Dk) if vectorized else (B, T, Hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(B, T, Hv)).astype(np.float32)
    state = rng.normal(size=(B, Hv, Dv, Dk)).astype(np.float32)
    mask = rng.uniform(size=(B, T)) > 0.3
    inputs = [q, k, v, g, beta, state, T] + ([mask] if has_mask else [])
    names = ["q", "k", "v", "g", "beta", "state_in", "T"] + (["mask"] if has_mask else [])
    kernel = metal_kernel("gated_delta_step" + ("_vec" if vectorized else "") + ("_mask" if has_mask else ""), names,
                          ["y", "state_out"], _make_gated_delta_source(has_mask, vectorized))
    y, st = kernel(inputs=inputs, template=[("InT", mx.float32), ("StT", mx.float32), ("Dk", Dk), ("Dv", Dv),
                                            ("Hk", Hk), ("Hv", Hv)],
                   grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1), output_shapes=[(B, T, Hv, Dv), state.shape],
                   output_dtypes=[mx.float32, mx.float32], lane_order="shuffled")
    y_ref, st_ref = _gated_delta_ops(q, k, v, g, beta, state, mask if has_mask else None)
    if has_mask:  # masked steps write 0 (the reference's y there is not used)
        y_ref = np.where(mask[:, :, None, None], y_ref, 0.0)
    # float32 recurrence of T steps over Dk terms: relative error ~1e-6 per step
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(st, st_ref, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- ml-explore/mlx-lm mlx_lm/models/ssm.py
SSM = """
        auto n = thread_position_in_grid.z;
        auto h_idx = n % H;
        auto g_idx = n / G;
        constexpr int n_per_t = Ds / 32;

        auto x = X + n * Dh;
        out += n * Dh;
        auto i_state = state_in + n * Dh * Ds;
        auto o_state = state_out + n * Dh * Ds;

        // C and B have shape [batch, group, state_dim]
        // C and B need to be offset by group size
        auto C_ = C + g_idx * Ds;
        auto B_ = B + g_idx * Ds;

        auto ds_idx = thread_position_in_threadgroup.x;
        auto d_idx = thread_position_in_grid.y;

        auto dt_ = static_cast<float>(dt[n]);
        auto A = -fast::exp(static_cast<float>(A_log[h_idx]));
        auto dA = fast::exp(A * dt_);

        float acc = 0.0;
        auto x_ = static_cast<float>(x[d_idx]);

        for (int i = 0; i < n_per_t; ++i) {
            auto s_idx = n_per_t * ds_idx + i;
            auto idx = d_idx * Ds + s_idx;
            auto dB_by_x = x_ * dt_ * static_cast<float>(B_[s_idx]);
            auto state = dA * i_state[idx] + dB_by_x;
            o_state[idx] = static_cast<U>(state);
            acc += state * C_[s_idx];
        }
        acc = simd_sum(acc);
        if (thread_index_in_simdgroup == 0) {
            out[d_idx] = static_cast<T>(acc + x_ * D[h_idx]);
        }
"""


def test_mlx_lm_ssm_update():
    n, h, d, hb, ds = 2, 4, 8, 2, 64
    rng = np.random.default_rng(4)
    x = rng.normal(size=(n, 1, h, d)).astype(np.float32)
    A_log = rng.normal(size=(h,)).astype(np.float32)  # 4 elements: constant memory
    Bm = rng.normal(size=(n, 1, hb, ds)).astype(np.float32)
    Cm = rng.normal(size=(n, 1, hb, ds)).astype(np.float32)
    D = rng.normal(size=(h,)).astype(np.float32)
    dt = rng.uniform(0.01, 0.5, size=(n, 1, h)).astype(np.float32)  # already through compute_dt
    state = rng.normal(size=(n, h, d, ds)).astype(np.float32)
    kernel = metal_kernel("ssm_kernel", ["X", "A_log", "B", "C", "D", "dt", "state_in"], ["out", "state_out"], SSM)
    out, st = kernel(inputs=[x, A_log, Bm, Cm, D, dt, state],
                     template=[("T", mx.float32), ("U", mx.float32), ("Dh", d), ("Ds", ds), ("H", h), ("G", h // hb)],
                     grid=(32, d, h * n), threadgroup=(32, 8, 1), output_shapes=[(n, 1, h, d), state.shape],
                     output_dtypes=[mx.float32, mx.float32])
    # the one-step recurrence of ssm_attn: state' = exp(dt A) state + dt x B,  y = C . state' + D x
    g = np.arange(h) // (h // hb)
    dA = np.exp(-np.exp(A_log.astype(np.float64))[None, :] * dt[:, 0])  # [n, h]
    st_ref = dA[:, :, None, None] * state + (dt[:, 0, :, None] * x[:, 0])[..., None] * Bm[:, 0][:, g][:, :, None, :]
    y_ref = (st_ref * Cm[:, 0][:, g][:, :, None, :]).sum(-1) + x[:, 0] * D[None, :, None]
    np.testing.assert_allclose(st, st_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:, 0], y_ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- ml-explore/mlx-lm mlx_lm/models/rwkv7.py
WKV7 = """
        auto n = thread_position_in_grid.z;
        auto b_idx = n / H;
        auto h_idx = n % H;
        constexpr int n_per_t = D / 32;

        // [B, T, H, D]
        auto r_ = r + b_idx * T * H * D + h_idx * D;
        auto w_ = w + b_idx * T * H * D + h_idx * D;
        auto k_ = k + b_idx * T * H * D + h_idx * D;
        auto v_ = v + b_idx * T * H * D + h_idx * D;
        auto a_ = a + b_idx * T * H * D + h_idx * D;
        auto b_ = b + b_idx * T * H * D + h_idx * D;
        y += b_idx * T * H * D + h_idx * D;

        auto dk_idx = thread_position_in_threadgroup.x;
        auto dv_idx = thread_position_in_grid.y;

        // state_in, state_out: [B, H, D, D]
        auto i_state = state_in  + (n * D + dv_idx) * D;
        auto o_state = state_out + (n * D + dv_idx) * D;

        float state[n_per_t];
        for (int i = 0; i < n_per_t; ++i) {
          auto s_idx = n_per_t * dk_idx + i;
          state[i] = static_cast<float>(i_state[s_idx]);
        }

        for (int t = 0; t < T; ++t) {
          float sa = 0.0f;
          for (int i = 0; i < n_per_t; ++i) {
            auto s_idx = n_per_t * dk_idx + i;
            sa += state[i] * a_[s_idx];
            state[i] = state[i] * w_[s_idx];
          }
          sa = simd_sum(sa);

          float out = 0.0f;
          for (int i = 0; i < n_per_t; ++i) {
            auto s_idx = n_per_t * dk_idx + i;
            state[i] = state[i] + k_[s_idx] * v_[dv_idx] + sa * b_[s_idx];
            out += state[i] * r_[s_idx];
          }
          out = simd_sum(out);
          if (thread_index_in_simdgroup == 0) {
            y[dv_idx] = static_cast<InT>(out);
          }

          // Increment data pointers to next time step
          r_ += H * D;
          w_ += H * D;
          k_ += H * D;
          v_ += H * D;
          a_ += H * D;
          b_ += H * D;
          y  += H * D;
        }
        for (int i = 0; i < n_per_t; ++i) {
          auto s_idx = n_per_t * dk_idx + i;
          o_state[s_idx] = static_cast<InT>(state[i]);
        }
"""


def test_mlx_lm_wkv7():
    B, T, H, D = 1, 3, 2, 32
    rng = np.random.default_rng(5)
    r, k, v = (rng.normal(size=(B, T, H, D)).astype(np.float32) * 0.3 for _ in range(3))
    w = rng.uniform(0.8, 1.0, size=(B, T, H, D)).astype(np.float32)
    a = rng.normal(size=(B, T, H, D)).astype(np.float32) * 0.1
    b = rng.normal(size=(B, T, H, D)).astype(np.float32) * 0.1
    state = rng.normal(size=(B, H, D, D)).astype(np.float32)
    kernel = metal_kernel("wkv7_kernel", ["r", "w", "k", "v", "a", "b", "state_in", "T"], ["y", "state_out"], WKV7)
    y, st = kernel(inputs=[r, w, k, v, a, b, state, T], template=[("InT", mx.float32), ("H", H), ("D", D)],
                   grid=(32, D, B * H), threadgroup=(32, 4, 1), output_shapes=[(B, T, H, D), state.shape],
                   output_dtypes=[mx.float32, mx.float32], lane_order="reversed")
    # numpy port of `_wkv7_step_ops`, looped over T as RWKV7's `_wkv7`
    S = state.astype(np.float64)
    ys = []
    for t in range(T):
        rt, wt, kt, vt, at, bt = (z[:, t].astype(np.float64) for z in (r, w, k, v, a, b))
        sab = (S @ at[..., None]) @ bt[..., None, :]
        S = S * wt[:, :, None, :] + vt[..., None] @ kt[..., None, :] + sab
        ys.append((S @ rt[..., None])[..., 0])
    np.testing.assert_allclose(y, np.stack(ys, 1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(st, S, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- ml-explore/mlx-lm mlx_lm/models/bitlinear_layers.py
BITLINEAR = """
    constexpr int M = 4;
    constexpr int BLOCK = 32;

    uint tid = thread_position_in_grid.y;
    uint in_offset = thread_position_in_grid.x;

    uint batch_idx = tid / (out_features / 4);
    uint row_idx = tid % (out_features / 4);

    float sum[4] = {0.0};

    for (uint i = in_offset * M; i < in_features; i += BLOCK * M) {
        float v[M];
        for (int j=0; j<M; j++) {
            v[j] = x[batch_idx * in_features + i + j];
        }

        for (int j=0; j<M; j++) {
            uint8_t w = packed_weights[row_idx * in_features + i + j];
            sum[0] += v[j] * ((w & 3) - 1);
            sum[1] += v[j] * (((w >> 2) & 3) - 1);
            sum[2] += v[j] * (((w >> 4) & 3) - 1);
            sum[3] += v[j] * (((w >> 6) & 3) - 1);
        }
    }

    for (int j=0; j<4; j++) {
        sum[j] = simd_sum(sum[j]);
    }

    // Apply weight scaling by diving them or multiplying them
    if (in_offset == 0) {
        float scale = invert_weight_scales ? 1 / weight_scale[0] : weight_scale[0];
        for (int i=0; i<4; i++) {
            out[batch_idx * out_features + row_idx + i * (out_features/4)] = static_cast<T>(sum[i] * scale);
        }
    }
"""


@pytest.mark.parametrize("invert", [False, True])
def test_mlx_lm_bitlinear(invert):
    batch, in_features, out_features = 3, 256, 16
    rng = np.random.default_rng(6)
    x = rng.normal(size=(batch, in_features)).astype(np.float32)
    packed = rng.integers(0, 256, size=(out_features // 4, in_features)).astype(np.uint8)
    scale = np.array([0.5], np.float32)  # one element: constant memory
    kernel = metal_kernel("bitlinear_matmul", ["x", "packed_weights", "weight_scale"], ["out"], BITLINEAR)
    (out,) = kernel(inputs=[x, packed, scale], template=[("T", mx.float32), ("invert_weight_scales", invert),
                                                         ("in_features", in_features), ("out_features", out_features)],
                    grid=(32, batch * out_features // 4, 1), threadgroup=(32, 1, 1),
                    output_shapes=[(batch, out_features)], output_dtypes=[mx.float32])
    # the packing: output row r + i * (out_features / 4) holds bits 2i..2i+1 of byte r, as value - 1
    w = np.concatenate([((packed >> (2 * i)) & 3).astype(np.float64) - 1 for i in range(4)], axis=0)
    want = x.astype(np.float64) @ w.T * (1 / 0.5 if invert else 0.5)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- ml-explore/mlx-lm mlx_lm/tuner/losses.py
KL_FORWARD = """
    constexpr int M = 4;
    constexpr int block = 1024 * M;
    constexpr int full_blocks = V / block;
    constexpr int extra = V - full_blocks * block;

    threadgroup float shared[32 * 2];

    uint out_idx = threadgroup_position_in_grid.y;
    uint simd_lane_id = thread_index_in_simdgroup;
    uint simd_group_id = simdgroup_index_in_threadgroup;

    logits_q += out_idx * V;
    logits_p += out_idx * V;
    out += out_idx;

    float lse_q_minus_p;
    float lse_p;

    {
        float max_q = -1e30;
        float max_p = -1e30;
        float sum_exp_q = 0;
        float sum_exp_p = 0;

        int offset = thread_index_in_threadgroup * M;
        for (int i = 0; i < full_blocks; i++) {
            // Read and update q and p
            float vals_q[M];
            float vals_p[M];
            for (int j=0; j<M; j++) {
                vals_q[j] = logits_q[offset + j];
                vals_p[j] = logits_p[offset + j];
            }
            float prev_max_q = max_q;
            float prev_max_p = max_p;
            for (int j=0; j<M; j++) {
                max_q = max(max_q, vals_q[j]);
                max_p = max(max_p, vals_p[j]);
            }
            sum_exp_q *= metal::fast::exp(prev_max_q - max_q);
            sum_exp_p *= metal::fast::exp(prev_max_p - max_p);
            for (int j=0; j<M; j++) {
                sum_exp_q += metal::fast::exp(vals_q[j] - max_q);
                sum_exp_p += metal::fast::exp(vals_p[j] - max_p);
            }

            // Move to the next block
            offset += block;
        }
        if (extra > 0) {
            // Read and update q and p
            float vals_q[M];
            float vals_p[M];
            for (int j=0; j < M; j++) {
                vals_q[j] = (offset + j < V) ? logits_q[offset + j] : -1e30;
                vals_p[j] = (offset + j < V) ? logits_p[offset + j] : -1e30;
            }
            float prev_max_q = max_q;
            float prev_max_p = max_p;
            for (int j=0; j<M; j++) {
                max_q = max(max_q, vals_q[j]);
                max_p = max(max_p, vals_p[j]);
            }
            sum_exp_q *= metal::fast::exp(prev_max_q - max_q);
            sum_exp_p *= metal::fast::exp(prev_max_p - max_p);
            for (int j=0; j<M; j++) {
                sum_exp_q += metal::fast::exp(vals_q[j] - max_q);
                sum_exp_p += metal::fast::exp(vals_p[j] - max_p);
            }
        }

        // Share the maxs across the threadgroup
        float prev_max_q = max_q;
        float prev_max_p = max_p;
        max_q = simd_max(max_q);
        max_p = simd_max(max_p);
        if (simd_lane_id == 0) {
            shared[simd_group_id * 2 + 0] = max_q;
            shared[simd_group_id * 2 + 1] = max_p;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        max_q = shared[simd_lane_id * 2 + 0];
        max_p = shared[simd_lane_id * 2 + 1];
        max_q = simd_max(max_q);
        max_p = simd_max(max_p);

        // Share the sum_exp across the threadgroup
        sum_exp_q *= metal::fast::exp(prev_max_q - max_q);
        sum_exp_p *= metal::fast::exp(prev_max_p - max_p);
        sum_exp_q = simd_sum(sum_exp_q);
        sum_exp_p = simd_sum(sum_exp_p);
        if (simd_lane_id == 0) {
            shared[simd_group_id * 2 + 0] = sum_exp_q;
            shared[simd_group_id * 2 + 1] = sum_exp_p;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        sum_exp_q = shared[simd_lane_id * 2 + 0];
        sum_exp_p = shared[simd_lane_id * 2 + 1];
        sum_exp_q = simd_sum(sum_exp_q);
        sum_exp_p = simd_sum(sum_exp_p);

        lse_p = max_p + metal::fast::log(sum_exp_p);
        lse_q_minus_p = max_q + metal::fast::log(sum_exp_q) - lse_p;
    }

    threadgroup_barrier(mem_flags::mem_none);

    {
        float kl = 0;

        int offset = thread_index_in_threadgroup * M;
        for (int i = 0; i < full_blocks; i++) {
            // Read and add to the kl
            float vals_q[M];
            float vals_p[M];
            for (int j=0; j<M; j++) {
                vals_q[j] = logits_q[offset + j];
                vals_p[j] = logits_p[offset + j];
            }

            for (int j=0; j<M; j++) {
                kl += metal::fast::exp(vals_p[j] - lse_p) * (vals_p[j] - vals_q[j] + lse_q_minus_p);
            }

            // Move to the next block
            offset += block;
        }
        if (extra > 0) {
            float vals_q[M];
            float vals_p[M];
            for (int j=0; j<M; j++) {
                vals_q[j] = (offset + j < V) ? logits_q[offset + j] : -1e30;
                vals_p[j] = (offset + j < V) ? logits_p[offset + j] : -1e30;
            }

            for (int j=0; j<M; j++) {
                kl += metal::fast::exp(vals_p[j] - lse_p) * (vals_p[j] - vals_q[j] + lse_q_minus_p);
            }
        }

        // Add the kl across the threadgroup
        kl = simd_sum(kl);
        if (simd_lane_id == 0) {
            shared[simd_group_id] = kl;
        }
        threadgroup_barrier(mem_flags::mem_none);
        kl = shared[simd_lane_id];
        kl = simd_sum(kl);

        if (thread_index_in_threadgroup == 0) {
            out[0] = static_cast<T>(kl);
        }
    }
"""


def _kl_inputs(rows=2, V=300):
    rng = np.random.default_rng(9)
    return rng.normal(size=(rows, V)).astype(np.float32), rng.normal(size=(rows, V)).astype(np.float32)


def test_mlx_lm_kl_forward_races_are_reported():
    # The kernel overwrites `shared` (the sums) while other SIMD groups may still read it (the maxima),
    # with no barrier between, and orders its last exchange with threadgroup_barrier(mem_none), which
    # orders no memory: both are threadgroup-memory races under Metal's memory model.
    q, p = _kl_inputs()
    kernel = metal_kernel("kl_forward", ["logits_q", "logits_p"], ["out"], KL_FORWARD)
    kw = dict(inputs=[q, p], output_shapes=[q.shape[:-1]], output_dtypes=[mx.float32],
              template=[("T", mx.float32), ("V", q.shape[-1])], grid=(1024, q.shape[0], 1), threadgroup=(1024, 1, 1))
    with pytest.raises(EmulatorError, match=r"kernel 'kl_forward'.*threadgroup memory race: writes threadgroup "
                       r"array 'shared'.*read by thread"):
        kernel(**kw)
    # with a barrier before the second exchange, the mem_none barrier is what is left
    fixed = KL_FORWARD.replace("        sum_exp_p = simd_sum(sum_exp_p);\n        if (simd_lane_id == 0) {",
                               "        sum_exp_p = simd_sum(sum_exp_p);\n"
                               "        threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                               "        if (simd_lane_id == 0) {", 1)
    assert fixed != KL_FORWARD
    with pytest.raises(EmulatorError, match=r"threadgroup memory race.*'shared'.*orders no threadgroup memory: its "
                       r"mem_flags lack mem_flags::mem_threadgroup"):
        metal_kernel("kl_forward_barrier", ["logits_q", "logits_p"], ["out"], fixed)(**kw)
    # with the race checker off, the emulator's schedule happens to give the intended value:
    # KL(p || q) of the softmaxes (nn.losses.kl_div_loss on log-softmaxes, as mlx-lm's fallback)
    (out,) = kernel(**kw, check_races=False)
    lq = q - np.log(np.exp(q.astype(np.float64)).sum(-1, keepdims=True))
    lp = p - np.log(np.exp(p.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(out, (np.exp(lp) * (lp - lq)).sum(-1), rtol=1e-4)
