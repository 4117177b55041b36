// The SSD scan of Mamba2 (the selective state-space recurrence), forward and backward, float32.
//
// Per head, per token t, with the state S (P x N, head width x state size, as transformers keeps it):
//   S = exp(g_t) S + xd_t B_t^T;   y_t = S C_t
// g = dt * A (the log-decay) and xd = dt * x arrive precomputed, B and C already repeated from their
// groups to the heads, and the D skip is added outside: the wrappers do those in MLX ops.
//
// Layouts (row-contiguous float32): xd, y [B, T, H, P]; g [B, T, H]; b, c [B, T, H, N];
// states [B, H, P, N]; checkpoints [B, H, NC, P, N] with NC = ceil(T / CK), checkpoint k being the
// state entering token k * CK.
//
// Work split: the rows of S are independent (row j only needs xd_t[j], B_t and C_t), so one SIMD
// group owns one row j of one (batch, head): lane l holds columns l, l + 32, ... (NK = ceil(N / 32)
// registers) and S_j . C_t is a simd_sum. The grid is (32, P, B * H) threads; a threadgroup is
// (32, SG, 1), SG simdgroups = SG rows of one head (the host picks SG dividing P, so no threadgroup
// is partial).
// The backward kernel uses the same split. dxd and d_initial_state are per row; dB, dC and dg sum
// over the rows: per token the SG simdgroups of a threadgroup reduce theirs in threadgroup memory
// and one atomic add per element and threadgroup goes to device memory (outputs are atomic and
// zero-initialised).
// Inputs are indexed from their own pointers (no derived `const device float*`): MLX passes inputs
// of fewer than 8 elements in the `constant` address space.

// @header
// Index of row (b, t, h) in a [B, T, H, ...] tensor, in units of rows.
inline size_t ssd_row(uint b, int t, uint h, int n_tokens, int n_heads) {
  return (size_t(b) * size_t(n_tokens) + size_t(t)) * size_t(n_heads) + size_t(h);
}

// @kernel ssd_forward
// @inputs xd, g, b_in, c_in, h0, n_tokens, n_heads, dim_p, dim_n
// @outputs y, ht, ckpt
// Template: NK (registers per lane = ceil(N / 32)), CK (tokens between state checkpoints).
  uint lane = thread_index_in_simdgroup;
  uint j = thread_position_in_grid.y;
  uint bh = thread_position_in_grid.z;
  int T = n_tokens;
  int H = n_heads;
  int P = dim_p;
  int N = dim_n;
  uint b = bh / uint(H);
  uint h = bh % uint(H);
  int nc = (T + CK - 1) / CK;
  size_t state_base = (size_t(bh) * size_t(P) + j) * size_t(N);
  size_t ckpt_stride = size_t(P) * size_t(N);
  size_t ckpt_base = size_t(bh) * size_t(nc) * ckpt_stride + size_t(j) * size_t(N);

  float s[NK];
  for (int n = 0; n < NK; ++n) {
    int i = int(lane) + 32 * n;
    s[n] = i < N ? h0[state_base + i] : 0.0f;
  }
  for (int t = 0; t < T; ++t) {
    if (t % CK == 0) {
      size_t cb = ckpt_base + size_t(t / CK) * ckpt_stride;
      for (int n = 0; n < NK; ++n) {
        int i = int(lane) + 32 * n;
        if (i < N) {
          ckpt[cb + i] = s[n];
        }
      }
    }
    size_t row = ssd_row(b, t, h, T, H);
    float a = metal::exp(g[row]);
    float xj = xd[row * size_t(P) + j];
    size_t bc = row * size_t(N);
    float acc = 0.0f;
    for (int n = 0; n < NK; ++n) {
      int i = int(lane) + 32 * n;
      float bn = i < N ? b_in[bc + i] : 0.0f;
      float cn = i < N ? c_in[bc + i] : 0.0f;
      s[n] = a * s[n] + xj * bn;
      acc += s[n] * cn;
    }
    float out = simd_sum(acc);
    if (lane == 0) {
      y[row * size_t(P) + j] = out;
    }
  }
  for (int n = 0; n < NK; ++n) {
    int i = int(lane) + 32 * n;
    if (i < N) {
      ht[state_base + i] = s[n];
    }
  }

// @kernel ssd_backward
// @inputs xd, g, b_in, c_in, ckpt, d_y, d_ht, n_tokens, n_heads, dim_p, dim_n
// @outputs dxd, dg, db, dc, dh0
// Template: NK, CK (as the forward), SG (simdgroups per threadgroup; divides P).
// Reverse-time recurrence. Per chunk of CK tokens (last chunk first) the states entering each token
// are recomputed from the chunk's checkpoint into a per-lane history, then the tokens are walked
// backwards carrying dS (row j of the state's gradient, NK registers per lane):
//   s_t = a s_prev + xd_j B                                               (recomputed)
//   dC += s_t dy_j;  dS += dy_j C;  dxd_j = dS . B;  dB += dS xd_j;  dg += a s_prev . dS;  dS = a dS
// dS left at t = 0 is d_initial_state.
  threadgroup float red_b[SG][NK * 32];
  threadgroup float red_c[SG][NK * 32];
  threadgroup float red_g[SG];
  uint lane = thread_index_in_simdgroup;
  uint sg = simdgroup_index_in_threadgroup;
  uint tid = thread_index_in_threadgroup;
  uint j = thread_position_in_grid.y;
  uint bh = thread_position_in_grid.z;
  int T = n_tokens;
  int H = n_heads;
  int P = dim_p;
  int N = dim_n;
  uint b = bh / uint(H);
  uint h = bh % uint(H);
  int nc = (T + CK - 1) / CK;
  size_t state_base = (size_t(bh) * size_t(P) + j) * size_t(N);
  size_t ckpt_stride = size_t(P) * size_t(N);
  size_t ckpt_base = size_t(bh) * size_t(nc) * ckpt_stride + size_t(j) * size_t(N);

  float ds[NK];
  for (int n = 0; n < NK; ++n) {
    int i = int(lane) + 32 * n;
    ds[n] = i < N ? d_ht[state_base + i] : 0.0f;
  }
  float hist[CK][NK];
  for (int k = nc - 1; k >= 0; --k) {
    int t0 = k * CK;
    int t1 = min(T, t0 + CK);
    // Recompute the states entering tokens t0 .. t1 - 1.
    float s[NK];
    size_t cb = ckpt_base + size_t(k) * ckpt_stride;
    for (int n = 0; n < NK; ++n) {
      int i = int(lane) + 32 * n;
      s[n] = i < N ? ckpt[cb + i] : 0.0f;
    }
    for (int t = t0; t < t1; ++t) {
      size_t row = ssd_row(b, t, h, T, H);
      float a = metal::exp(g[row]);
      float xj = xd[row * size_t(P) + j];
      size_t bc = row * size_t(N);
      for (int n = 0; n < NK; ++n) {
        int i = int(lane) + 32 * n;
        hist[t - t0][n] = s[n];
        s[n] = a * s[n] + xj * (i < N ? b_in[bc + i] : 0.0f);
      }
    }
    // Walk the chunk backwards.
    for (int t = t1 - 1; t >= t0; --t) {
      size_t row = ssd_row(b, t, h, T, H);
      float a = metal::exp(g[row]);
      float xj = xd[row * size_t(P) + j];
      float dyj = d_y[row * size_t(P) + j];
      size_t bc = row * size_t(N);
      float acc_x = 0.0f;
      float acc_g = 0.0f;
      for (int n = 0; n < NK; ++n) {
        int i = int(lane) + 32 * n;
        float bn = i < N ? b_in[bc + i] : 0.0f;
        float cn = i < N ? c_in[bc + i] : 0.0f;
        float sp = hist[t - t0][n];
        red_c[sg][i] = (a * sp + xj * bn) * dyj;
        ds[n] += dyj * cn;
        acc_x += ds[n] * bn;
        red_b[sg][i] = ds[n] * xj;
        acc_g += sp * ds[n];
        ds[n] *= a;
      }
      float dxj = simd_sum(acc_x);
      float dgj = a * simd_sum(acc_g);
      if (lane == 0) {
        red_g[sg] = dgj;
        atomic_store_explicit(&dxd[row * size_t(P) + j], dxj, memory_order_relaxed);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int idx = int(tid); idx < N; idx += 32 * SG) {
        float sb = 0.0f;
        float sc = 0.0f;
        for (int m = 0; m < SG; ++m) {
          sb += red_b[m][idx];
          sc += red_c[m][idx];
        }
        atomic_fetch_add_explicit(&db[bc + idx], sb, memory_order_relaxed);
        atomic_fetch_add_explicit(&dc[bc + idx], sc, memory_order_relaxed);
      }
      if (tid == 0) {
        float sum = 0.0f;
        for (int m = 0; m < SG; ++m) {
          sum += red_g[m];
        }
        atomic_fetch_add_explicit(&dg[row], sum, memory_order_relaxed);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
  for (int n = 0; n < NK; ++n) {
    int i = int(lane) + 32 * n;
    if (i < N) {
      atomic_store_explicit(&dh0[state_base + i], ds[n], memory_order_relaxed);
    }
  }
