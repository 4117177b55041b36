// The gated delta rule (Gated DeltaNet), forward and backward, float32.
//
// Per head, per token t, with the state S (K x V, K-first as in fla/transformers):
//   S = exp(g_t) S;   u = S^T k_t;   S += k_t ((v_t - u) beta_t)^T;   o_t = S^T q_t
// q arrives already scaled (and L2-normalised when asked): the wrappers do that in MLX ops.
//
// Layouts (row-contiguous float32): q, k [B, T, H, K]; v, o [B, T, H, V]; g, beta [B, T, H];
// states [B, H, K, V]; checkpoints [B, H, NC, K, V] with NC = ceil(T / CK), checkpoint c being
// the state entering token c * CK.
//
// Work split: the columns of S are independent in the forward recurrence (column j only needs
// k_t, q_t and v_t[j]), so one SIMD group owns one column j of one (batch, head): lane l holds rows
// l, l + 32, ... (NK = ceil(K / 32) registers), S^T k and S^T q are simd_sum's. The grid is
// (32, V, B * H) threads; a threadgroup is (32, SG, 1), SG simdgroups = SG columns of one head
// (the host picks SG dividing V, so no threadgroup is partial).
// The backward kernel uses the same split. dv and d_initial_state are per column; dq, dk, dg and
// dbeta sum over the columns: per token the SG simdgroups of a threadgroup reduce theirs in
// threadgroup memory and one atomic add per element and threadgroup goes to device memory
// (outputs are atomic and zero-initialised).
// Inputs are indexed from their own pointers (no derived `const device float*`): MLX passes inputs
// of fewer than 8 elements (e.g. q and k of one token with K < 8) in the `constant` address space.

// @header
// Index of the first element of row (b, t, h) in a [B, T, H, ...] tensor, in units of rows.
inline size_t gdn_row(uint b, int t, uint h, int n_tokens, int n_heads) {
  return (size_t(b) * size_t(n_tokens) + size_t(t)) * size_t(n_heads) + size_t(h);
}

// @kernel gated_delta_forward
// @inputs q, k, v, g, beta, h0, n_tokens, n_heads, dim_k, dim_v
// @outputs o, ht, ckpt
// Template: NK (registers per lane = ceil(K / 32)), CK (tokens between state checkpoints).
  uint lane = thread_index_in_simdgroup;
  uint j = thread_position_in_grid.y;
  uint bh = thread_position_in_grid.z;
  int T = n_tokens;
  int H = n_heads;
  int K = dim_k;
  int V = dim_v;
  uint b = bh / uint(H);
  uint h = bh % uint(H);
  int nc = (T + CK - 1) / CK;
  size_t state_base = size_t(bh) * size_t(K) * size_t(V) + j;
  size_t ckpt_base = size_t(bh) * size_t(nc) * size_t(K) * size_t(V) + j;

  float s[NK];
  for (int n = 0; n < NK; ++n) {
    int i = int(lane) + 32 * n;
    s[n] = i < K ? h0[state_base + size_t(i) * V] : 0.0f;
  }
  for (int t = 0; t < T; ++t) {
    if (t % CK == 0) {
      size_t cb = ckpt_base + size_t(t / CK) * size_t(K) * size_t(V);
      for (int n = 0; n < NK; ++n) {
        int i = int(lane) + 32 * n;
        if (i < K) {
          ckpt[cb + size_t(i) * V] = s[n];
        }
      }
    }
    size_t row = gdn_row(b, t, h, T, H);
    float a = metal::exp(g[row]);
    float bt = beta[row];
    size_t kq = row * size_t(K);
    float kk[NK];
    float acc = 0.0f;
    for (int n = 0; n < NK; ++n) {
      int i = int(lane) + 32 * n;
      kk[n] = i < K ? k[kq + i] : 0.0f;
      s[n] *= a;
      acc += kk[n] * s[n];
    }
    float u = simd_sum(acc);
    float d = bt * (v[row * size_t(V) + j] - u);
    acc = 0.0f;
    for (int n = 0; n < NK; ++n) {
      int i = int(lane) + 32 * n;
      s[n] += kk[n] * d;
      acc += (i < K ? q[kq + i] : 0.0f) * s[n];
    }
    float out = simd_sum(acc);
    if (lane == 0) {
      o[row * size_t(V) + j] = out;
    }
  }
  for (int n = 0; n < NK; ++n) {
    int i = int(lane) + 32 * n;
    if (i < K) {
      ht[state_base + size_t(i) * V] = s[n];
    }
  }

// @kernel gated_delta_backward
// @inputs q, k, v, g, beta, ckpt, d_o, d_ht, n_tokens, n_heads, dim_k, dim_v
// @outputs dq, dk, dv, dg, dbeta, dh0
// Template: NK, CK (as the forward), SG (simdgroups per threadgroup; divides V).
// Reverse-time recurrence. Per chunk of CK tokens (last chunk first) the states entering each token
// are recomputed from the chunk's checkpoint into a per-lane history, then the tokens are walked
// backwards carrying dS (column j of the state's gradient, NK registers per lane):
//   s_a = a s_prev, u = k.s_a, d = beta (v_j - u), s_t = s_a + k d         (recomputed)
//   dS += q do_j;  dq += s_t do_j;  dd = k.dS;  dk += dS d;  dbeta += dd (v_j - u);  dv_j = dd beta
//   du = -dd beta;  dk += du s_a;  dS_a = dS + du k;  dg += s_a.dS_a;  dS = a dS_a
// dS left at t = 0 is d_initial_state.
  threadgroup float red_q[SG][NK * 32];
  threadgroup float red_k[SG][NK * 32];
  threadgroup float red_s[SG][2];
  uint lane = thread_index_in_simdgroup;
  uint sg = simdgroup_index_in_threadgroup;
  uint tid = thread_index_in_threadgroup;
  uint j = thread_position_in_grid.y;
  uint bh = thread_position_in_grid.z;
  int T = n_tokens;
  int H = n_heads;
  int K = dim_k;
  int V = dim_v;
  uint b = bh / uint(H);
  uint h = bh % uint(H);
  int nc = (T + CK - 1) / CK;
  size_t state_base = size_t(bh) * size_t(K) * size_t(V) + j;
  size_t ckpt_base = size_t(bh) * size_t(nc) * size_t(K) * size_t(V) + j;

  float ds[NK];
  for (int n = 0; n < NK; ++n) {
    int i = int(lane) + 32 * n;
    ds[n] = i < K ? d_ht[state_base + size_t(i) * V] : 0.0f;
  }
  float hist[CK][NK];
  for (int c = nc - 1; c >= 0; --c) {
    int t0 = c * CK;
    int t1 = min(T, t0 + CK);
    // Recompute the states entering tokens t0 .. t1 - 1.
    float s[NK];
    size_t cb = ckpt_base + size_t(c) * size_t(K) * size_t(V);
    for (int n = 0; n < NK; ++n) {
      int i = int(lane) + 32 * n;
      s[n] = i < K ? ckpt[cb + size_t(i) * V] : 0.0f;
    }
    for (int t = t0; t < t1; ++t) {
      size_t row = gdn_row(b, t, h, T, H);
      float a = metal::exp(g[row]);
      size_t kq = row * size_t(K);
      float kk[NK];
      float acc = 0.0f;
      for (int n = 0; n < NK; ++n) {
        int i = int(lane) + 32 * n;
        hist[t - t0][n] = s[n];
        kk[n] = i < K ? k[kq + i] : 0.0f;
        s[n] *= a;
        acc += kk[n] * s[n];
      }
      float u = simd_sum(acc);
      float d = beta[row] * (v[row * size_t(V) + j] - u);
      for (int n = 0; n < NK; ++n) {
        s[n] += kk[n] * d;
      }
    }
    // Walk the chunk backwards.
    for (int t = t1 - 1; t >= t0; --t) {
      size_t row = gdn_row(b, t, h, T, H);
      float a = metal::exp(g[row]);
      float bt = beta[row];
      size_t kq = row * size_t(K);
      float kk[NK];
      float sa[NK];
      float acc = 0.0f;
      for (int n = 0; n < NK; ++n) {
        int i = int(lane) + 32 * n;
        kk[n] = i < K ? k[kq + i] : 0.0f;
        sa[n] = a * hist[t - t0][n];
        acc += kk[n] * sa[n];
      }
      float u = simd_sum(acc);
      float vj = v[row * size_t(V) + j];
      float d = bt * (vj - u);
      float doj = d_o[row * size_t(V) + j];
      acc = 0.0f;
      for (int n = 0; n < NK; ++n) {
        int i = int(lane) + 32 * n;
        float qv = i < K ? q[kq + i] : 0.0f;
        ds[n] += qv * doj;
        acc += kk[n] * ds[n];
        red_q[sg][i] = (sa[n] + kk[n] * d) * doj;
      }
      float dd = simd_sum(acc);
      float du = -dd * bt;
      acc = 0.0f;
      for (int n = 0; n < NK; ++n) {
        int i = int(lane) + 32 * n;
        red_k[sg][i] = ds[n] * d + du * sa[n];
        float dsa = ds[n] + du * kk[n];
        acc += sa[n] * dsa;
        ds[n] = a * dsa;
      }
      float dgp = simd_sum(acc);
      if (lane == 0) {
        red_s[sg][0] = dgp;
        red_s[sg][1] = dd * (vj - u);
        atomic_store_explicit(&dv[row * size_t(V) + j], dd * bt, memory_order_relaxed);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int idx = int(tid); idx < K; idx += 32 * SG) {
        float sq = 0.0f;
        float sk = 0.0f;
        for (int m = 0; m < SG; ++m) {
          sq += red_q[m][idx];
          sk += red_k[m][idx];
        }
        atomic_fetch_add_explicit(&dq[row * size_t(K) + idx], sq, memory_order_relaxed);
        atomic_fetch_add_explicit(&dk[row * size_t(K) + idx], sk, memory_order_relaxed);
      }
      if (tid < 2) {
        float sum = 0.0f;
        for (int m = 0; m < SG; ++m) {
          sum += red_s[m][tid];
        }
        if (tid == 0) {
          atomic_fetch_add_explicit(&dg[row], sum, memory_order_relaxed);
        } else {
          atomic_fetch_add_explicit(&dbeta[row], sum, memory_order_relaxed);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
  for (int n = 0; n < NK; ++n) {
    int i = int(lane) + 32 * n;
    if (i < K) {
      atomic_store_explicit(&dh0[state_base + size_t(i) * V], ds[n], memory_order_relaxed);
    }
  }
