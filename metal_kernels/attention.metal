// Fused scaled-dot-product attention (flash-attention style), forward and backward.
//
// Layout (row-contiguous): q, o, dout [B, Hq, Tq, D]; k, v, dk, dv [B, Hkv, Tk, D];
// lse, delta [B, Hq, Tq] float32. Query head h reads key/value head h / (Hq / Hkv) (grouped-query
// attention; K/V are never repeated in memory). Query i sits at position offset + i and, when
// `causal` is nonzero, sees the keys j <= offset + i.
//
// Mapping shared by the three kernels: one SIMD group (32 lanes) owns one row (a query row in
// `attention_forward` / `attention_backward_dq`, a key row in `attention_backward_dkv`). Its lanes
// split the head dimension: lane `lane` holds features d = lane + 32 * c for c < DL, masked by
// d < D, so any D <= 32 * DL works (80 = 32 + 32 + 16 leaves half of the third slot idle).
// Dot products over D are per-lane partial sums reduced with simd_sum. A threadgroup of NSG SIMD
// groups owns NSG consecutive rows of one (batch, head) and streams the other side in tiles of BK
// rows staged in threadgroup memory (as float), loaded cooperatively by all its threads.
// Grid: x = (number of row blocks) * 32 * NSG, y = heads (Hq for forward/dq, Hkv for dkv), z = B;
// threadgroup (32 * NSG, 1, 1).
//
// Softmax statistics: the forward keeps a running max m and sum l per query row (online softmax,
// rescaling the output accumulator when m grows), so no Tq x Tk matrix exists anywhere, and writes
// lse = m + log(l) (natural log). The backward recomputes P = exp(S - lse) tile by tile:
//   delta_i = sum_d dO[i, d] * O[i, d]
//   dS_ij  = P_ij * (dO_i . V_j - delta_i)
//   dQ_i   = scale * sum_j dS_ij K_j              (attention_backward_dq, per query row)
//   dK_j   = scale * sum_{h in group, i} dS_ij Q_i (attention_backward_dkv, per key row; the sum
//   dV_j   = sum_{h in group, i} P_ij dO_i          runs over every query head of the kv group)
// Each output element has exactly one owner, so no atomics are needed.
// A query row that sees no key at all (possible only with causal and offset < 0) gets O = 0 and
// lse = ATTENTION_BIG, which makes its P (and so its gradients) zero. The running max starts at
// -ATTENTION_BIG rather than -inf, so nothing depends on infinities (fast math may assume none).
//
// Barriers: every loop that contains a threadgroup_barrier has bounds that are uniform over the
// threadgroup; work for rows past the end is skipped with ifs, never with an early return.
// SIMD operations sit under conditions that are uniform over a SIMD group (they depend only on
// the row the group owns and on the loop position).
// Template: T (dtype of q, k, v, o, dout, dq, dk, dv), DL (ceil(D / 32)), BK (tile rows), with
// BK * 32 * DL floats per tile so that two tiles fit in threadgroup memory.

// @header
// A finite stand-in for infinity in the softmax statistics: exp(-ATTENTION_BIG - x) == 0.
#define ATTENTION_BIG 3.0e38f

// Load one row of features into this lane's DL registers (zero past D), multiplied by `mul`.
// `src` is a pointer into an input: `const device T*`, or `const constant T*` for an input of
// fewer than 8 elements (MLX passes those in the constant address space), hence a template.
template <int DL, typename SrcPtr>
inline void attention_load_row(thread float* dst, SrcPtr src, int D, uint lane, bool ok, float mul) {
  for (int c = 0; c < DL; ++c) {
    int d = int(lane) + 32 * c;
    dst[c] = (ok && d < D) ? float(src[d]) * mul : 0.0f;
  }
}

// This lane's part of the dot product of its DL registers with a tile row (length D).
template <int DL>
inline float attention_partial_dot(thread const float* x, const threadgroup float* row, int D,
                                   uint lane) {
  float acc = 0.0f;
  for (int c = 0; c < DL; ++c) {
    int d = int(lane) + 32 * c;
    if (d < D) {
      acc += x[c] * row[d];
    }
  }
  return acc;
}

// Cooperative copy of rows [first, first + n_rows) of two [*, D] matrices into two
// [BK, D] threadgroup tiles (as float); rows n_rows..BK-1 of the tiles are zero-filled.
// `a` and `b` point into inputs (device or constant memory, as attention_load_row's `src`).
template <int BK, typename PtrA, typename PtrB>
inline void attention_load_tiles(threadgroup float* ta, threadgroup float* tb, PtrA a, PtrB b,
                                 int first, int n_rows, int D, uint tid, uint n_threads) {
  uint n = uint(BK * D);
  for (uint e = tid; e < n; e += n_threads) {
    int r = int(e) / D;
    float xa = 0.0f;
    float xb = 0.0f;
    if (r < n_rows) {
      size_t g = size_t(first) * size_t(D) + size_t(e);
      xa = float(a[g]);
      xb = float(b[g]);
    }
    ta[e] = xa;
    tb[e] = xb;
  }
}

// @kernel attention_forward
// @inputs q, k, v, scale, causal, offset, n_q, n_k, head_dim, n_q_heads, n_kv_heads
// @outputs o, lse
  threadgroup float k_tile[BK * 32 * DL];
  threadgroup float v_tile[BK * 32 * DL];
  const uint lane = thread_index_in_simdgroup;
  const uint tid = thread_index_in_threadgroup;
  const uint n_threads = threads_per_threadgroup.x;
  const int nsg = int(simdgroups_per_threadgroup);
  const int D = head_dim;
  const int Tq = n_q;
  const int Tk = n_k;
  const uint h = threadgroup_position_in_grid.y;
  const uint b = threadgroup_position_in_grid.z;
  const uint kvh = h / uint(n_q_heads / n_kv_heads);
  const int row0 = int(threadgroup_position_in_grid.x) * nsg;
  const int i = row0 + int(simdgroup_index_in_threadgroup);
  const bool row_ok = i < Tq;
  const size_t q_row = (size_t(b) * size_t(n_q_heads) + h) * size_t(Tq) + size_t(row_ok ? i : 0);
  const size_t kv_base = (size_t(b) * size_t(n_kv_heads) + kvh) * size_t(Tk) * size_t(D);

  // Keys this row sees: [0, my_end); keys any row of the threadgroup sees: [0, tg_end).
  const int last_row = min(row0 + nsg, Tq) - 1;
  const int my_end = causal ? clamp(offset + i + 1, 0, Tk) : Tk;
  const int tg_end = causal ? clamp(offset + last_row + 1, 0, Tk) : Tk;

  float qv[DL];
  float acc[DL];
  attention_load_row<DL>(qv, q + q_row * size_t(D), D, lane, row_ok, scale);
  for (int c = 0; c < DL; ++c) {
    acc[c] = 0.0f;
  }
  float m = -ATTENTION_BIG;
  float l = 0.0f;
  float s[BK];

  for (int kb = 0; kb < tg_end; kb += BK) {
    const int n_tile = min(BK, tg_end - kb);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous tile is consumed
    attention_load_tiles<BK>(k_tile, v_tile, k + kv_base, v + kv_base, kb, n_tile, D, tid,
                                n_threads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int n_mine = row_ok ? min(n_tile, my_end - kb) : 0;  // uniform over the SIMD group
    if (n_mine > 0) {
      float tile_max = -ATTENTION_BIG;
      for (int jj = 0; jj < n_mine; ++jj) {
        s[jj] = simd_sum(attention_partial_dot<DL>(qv, k_tile + jj * D, D, lane));
        tile_max = max(tile_max, s[jj]);
      }
      const float m_new = max(m, tile_max);
      const float alpha = metal::exp(m - m_new);  // 0 on the first visible tile
      l *= alpha;
      for (int c = 0; c < DL; ++c) {
        acc[c] *= alpha;
      }
      for (int jj = 0; jj < n_mine; ++jj) {
        const float p = metal::exp(s[jj] - m_new);
        l += p;
        const threadgroup float* vr = v_tile + jj * D;
        for (int c = 0; c < DL; ++c) {
          int d = int(lane) + 32 * c;
          if (d < D) {
            acc[c] += p * vr[d];
          }
        }
      }
      m = m_new;
    }
  }

  if (row_ok) {
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
    device T* orow = o + q_row * size_t(D);
    for (int c = 0; c < DL; ++c) {
      int d = int(lane) + 32 * c;
      if (d < D) {
        orow[d] = static_cast<T>(acc[c] * inv_l);
      }
    }
    if (lane == 0) {
      lse[q_row] = l > 0.0f ? m + metal::log(l) : ATTENTION_BIG;
    }
  }

// @kernel attention_backward_dq
// @inputs q, k, v, o, dout, lse, scale, causal, offset, n_q, n_k, head_dim, n_q_heads, n_kv_heads
// @outputs dq, delta
// One SIMD group per query row (same mapping as the forward); also writes delta for the dkv kernel.
  threadgroup float k_tile[BK * 32 * DL];
  threadgroup float v_tile[BK * 32 * DL];
  const uint lane = thread_index_in_simdgroup;
  const uint tid = thread_index_in_threadgroup;
  const uint n_threads = threads_per_threadgroup.x;
  const int nsg = int(simdgroups_per_threadgroup);
  const int D = head_dim;
  const int Tq = n_q;
  const int Tk = n_k;
  const uint h = threadgroup_position_in_grid.y;
  const uint b = threadgroup_position_in_grid.z;
  const uint kvh = h / uint(n_q_heads / n_kv_heads);
  const int row0 = int(threadgroup_position_in_grid.x) * nsg;
  const int i = row0 + int(simdgroup_index_in_threadgroup);
  const bool row_ok = i < Tq;
  const size_t q_row = (size_t(b) * size_t(n_q_heads) + h) * size_t(Tq) + size_t(row_ok ? i : 0);
  const size_t kv_base = (size_t(b) * size_t(n_kv_heads) + kvh) * size_t(Tk) * size_t(D);

  const int last_row = min(row0 + nsg, Tq) - 1;
  const int my_end = causal ? clamp(offset + i + 1, 0, Tk) : Tk;
  const int tg_end = causal ? clamp(offset + last_row + 1, 0, Tk) : Tk;

  float qv[DL];
  float dov[DL];
  float ov[DL];
  float dqv[DL];
  attention_load_row<DL>(qv, q + q_row * size_t(D), D, lane, row_ok, scale);
  attention_load_row<DL>(dov, dout + q_row * size_t(D), D, lane, row_ok, 1.0f);
  attention_load_row<DL>(ov, o + q_row * size_t(D), D, lane, row_ok, 1.0f);
  float part = 0.0f;
  for (int c = 0; c < DL; ++c) {
    part += dov[c] * ov[c];
    dqv[c] = 0.0f;
  }
  float delta_i = 0.0f;
  float lse_i = ATTENTION_BIG;
  if (row_ok) {  // uniform over the SIMD group
    delta_i = simd_sum(part);
    lse_i = lse[q_row];
  }

  for (int kb = 0; kb < tg_end; kb += BK) {
    const int n_tile = min(BK, tg_end - kb);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    attention_load_tiles<BK>(k_tile, v_tile, k + kv_base, v + kv_base, kb, n_tile, D, tid,
                                n_threads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int n_mine = row_ok ? min(n_tile, my_end - kb) : 0;
    for (int jj = 0; jj < n_mine; ++jj) {
      const threadgroup float* kr = k_tile + jj * D;
      const float s_ij = simd_sum(attention_partial_dot<DL>(qv, kr, D, lane));
      const float dp = simd_sum(attention_partial_dot<DL>(dov, v_tile + jj * D, D, lane));
      const float ds = metal::exp(s_ij - lse_i) * (dp - delta_i);
      for (int c = 0; c < DL; ++c) {
        int d = int(lane) + 32 * c;
        if (d < D) {
          dqv[c] += ds * kr[d];
        }
      }
    }
  }

  if (row_ok) {
    device T* dqrow = dq + q_row * size_t(D);
    for (int c = 0; c < DL; ++c) {
      int d = int(lane) + 32 * c;
      if (d < D) {
        dqrow[d] = static_cast<T>(dqv[c] * scale);
      }
    }
    if (lane == 0) {
      delta[q_row] = delta_i;
    }
  }

// @kernel attention_backward_dkv
// @inputs q, k, v, dout, lse, delta, scale, causal, offset, n_q, n_k, head_dim, n_q_heads, n_kv_heads
// @outputs dk, dv
// One SIMD group per key row of one kv head; the threadgroup streams Q / dO tiles (with their
// lse and delta) of every query head in the kv group, starting at the first query that can see
// the threadgroup's first key.
  threadgroup float q_tile[BK * 32 * DL];
  threadgroup float do_tile[BK * 32 * DL];
  threadgroup float lse_tile[BK];
  threadgroup float delta_tile[BK];
  const uint lane = thread_index_in_simdgroup;
  const uint tid = thread_index_in_threadgroup;
  const uint n_threads = threads_per_threadgroup.x;
  const int nsg = int(simdgroups_per_threadgroup);
  const int D = head_dim;
  const int Tq = n_q;
  const int Tk = n_k;
  const uint kvh = threadgroup_position_in_grid.y;
  const uint b = threadgroup_position_in_grid.z;
  const int rep = n_q_heads / n_kv_heads;
  const int j0 = int(threadgroup_position_in_grid.x) * nsg;
  const int j = j0 + int(simdgroup_index_in_threadgroup);
  const bool key_ok = j < Tk;
  const size_t k_row = (size_t(b) * size_t(n_kv_heads) + kvh) * size_t(Tk) + size_t(key_ok ? j : 0);

  // Query i sees key j iff offset + i >= j: the first query any row here needs, and mine.
  const int q_begin = causal ? clamp(j0 - offset, 0, Tq) : 0;
  const int my_begin = causal ? max(j - offset, 0) : 0;

  float kv[DL];
  float vv[DL];
  float dkv[DL];
  float dvv[DL];
  attention_load_row<DL>(kv, k + k_row * size_t(D), D, lane, key_ok, scale);
  attention_load_row<DL>(vv, v + k_row * size_t(D), D, lane, key_ok, 1.0f);
  for (int c = 0; c < DL; ++c) {
    dkv[c] = 0.0f;
    dvv[c] = 0.0f;
  }

  for (int r = 0; r < rep; ++r) {
    const size_t hq_row0 = (size_t(b) * size_t(n_q_heads) + size_t(kvh) * size_t(rep) + size_t(r)) *
                           size_t(Tq);
    for (int qs = q_begin; qs < Tq; qs += BK) {
      const int n_tile = min(BK, Tq - qs);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      attention_load_tiles<BK>(q_tile, do_tile, q + hq_row0 * size_t(D), dout + hq_row0 * size_t(D),
                                  qs, n_tile, D, tid, n_threads);
      for (uint e = tid; e < uint(BK); e += n_threads) {
        const bool ok = int(e) < n_tile;
        lse_tile[e] = ok ? lse[hq_row0 + size_t(qs) + e] : ATTENTION_BIG;
        delta_tile[e] = ok ? delta[hq_row0 + size_t(qs) + e] : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const int first = key_ok ? max(my_begin - qs, 0) : n_tile;  // uniform over the SIMD group
      for (int ii = first; ii < n_tile; ++ii) {
        const threadgroup float* qr = q_tile + ii * D;
        const threadgroup float* dor = do_tile + ii * D;
        const float s_ij = simd_sum(attention_partial_dot<DL>(kv, qr, D, lane));
        const float dp = simd_sum(attention_partial_dot<DL>(vv, dor, D, lane));
        const float p = metal::exp(s_ij - lse_tile[ii]);
        const float ds = p * (dp - delta_tile[ii]);
        for (int c = 0; c < DL; ++c) {
          int d = int(lane) + 32 * c;
          if (d < D) {
            dvv[c] += p * dor[d];
            dkv[c] += ds * qr[d];
          }
        }
      }
    }
  }

  if (key_ok) {
    device T* dkrow = dk + k_row * size_t(D);
    device T* dvrow = dv + k_row * size_t(D);
    for (int c = 0; c < DL; ++c) {
      int d = int(lane) + 32 * c;
      if (d < D) {
        dkrow[d] = static_cast<T>(dkv[c] * scale);
        dvrow[d] = static_cast<T>(dvv[c]);
      }
    }
  }
