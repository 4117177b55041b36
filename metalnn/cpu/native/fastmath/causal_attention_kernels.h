// Kernels of the fused causal attention primitive (causal_attention.cpp), float32.
//
// One unit is a (batch, key/value head) pair with its `rep` query heads; q [rep, T, D], k and v
// [T, D], all row-major. Row i of a query head sees keys j <= i:
//
//   s_j = scale q_i . k_j;   p = softmax(s);   o_i = sum_j p_j v_j;   lse_i = log sum_j exp(s_j)
//
// backward, with delta_i = do_i . o_i and p recomputed from lse:
//
//   dp_j = do_i . v_j;   ds_j = p_j (dp_j - delta_i);   dq_i = scale sum_j ds_j k_j;
//   dk_j += scale ds_j q_i;   dv_j += p_j do_i
//
// Scores of a row are formed 32 keys at a time from the transposed keys (kT [D, T]) so the 32
// sums stay in registers; sums over keys of D-vectors keep the D-vector in registers (D is a
// template parameter). Compiled twice (AVX2+FMA by target attribute, and portable).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace metalnn_attn {

#define AT_BODY static inline __attribute__((always_inline))

constexpr int R = 4;    // query rows per block
constexpr int JB = 16;  // keys per block of scores
constexpr int DC = 16;  // head_dim entries per pass of the sums over keys

// s[r][0:n] = scale * (x_r . column j of kT) for the R rows x_r (row stride D); kT [D, ld] with
// ld a multiple of JB and n rounded up to JB inside; s has row stride ld.
template <int D>
AT_BODY void scores_body(const float* x, const float* kT, int64_t ld, int64_t n, float scale, float* s) {
  for (int64_t j0 = 0; j0 < n; j0 += JB) {
    float acc[R][JB] = {};
    for (int d = 0; d < D; ++d) {
      const float* kr = kT + d * ld + j0;
      for (int r = 0; r < R; ++r) {
        const float xd = x[r * D + d];
#pragma omp simd
        for (int jj = 0; jj < JB; ++jj) acc[r][jj] += xd * kr[jj];
      }
    }
    for (int r = 0; r < R; ++r) {
#pragma omp simd
      for (int jj = 0; jj < JB; ++jj) s[r * ld + j0 + jj] = scale * acc[r][jj];
    }
  }
}

// out_r[0:D] = sum_{j < n} w[r][j] * rows[j][0:D] for the R rows (w row stride ld, out row stride
// os); DC entries of D at a time so the R x DC sums stay in registers.
template <int D>
AT_BODY void weighted_rows_body(const float* w, int64_t ld, const float* rows, int64_t n, float* out, int64_t os) {
  for (int d0 = 0; d0 < D; d0 += DC) {
    float acc[R][DC] = {};
    for (int64_t j = 0; j < n; ++j) {
      const float* row = rows + j * D + d0;
      for (int r = 0; r < R; ++r) {
        const float wj = w[r * ld + j];
#pragma omp simd
        for (int d = 0; d < DC; ++d) acc[r][d] += wj * row[d];
      }
    }
    for (int r = 0; r < R; ++r) {
#pragma omp simd
      for (int d = 0; d < DC; ++d) out[r * os + d0 + d] = acc[r][d];
    }
  }
}

// rows[j][0:D] += sum_r w[r][j] * x_r[0:D] for j < n (w row stride ld, x row stride xs), DC
// entries of D at a time.
template <int D>
AT_BODY void rank_r_body(const float* w, int64_t ld, const float* x, int64_t xs, int64_t n, float* rows) {
  for (int d0 = 0; d0 < D; d0 += DC) {
    float xr[R][DC];
    for (int r = 0; r < R; ++r) {
#pragma omp simd
      for (int d = 0; d < DC; ++d) xr[r][d] = x[r * xs + d0 + d];
    }
    for (int64_t j = 0; j < n; ++j) {
      float* row = rows + j * D + d0;
      const float w0 = w[j], w1 = w[ld + j], w2 = w[2 * ld + j], w3 = w[3 * ld + j];
#pragma omp simd
      for (int d = 0; d < DC; ++d) row[d] += w0 * xr[0][d] + w1 * xr[1][d] + w2 * xr[2][d] + w3 * xr[3][d];
    }
  }
}

// kT [D, ldT] from k [T, D]; columns T..ldT-1 zero.
template <int D>
AT_BODY void transpose_body(const float* k, int64_t T, int64_t ldT, float* kT) {
  for (int d = 0; d < D; ++d) {
    float* row = kT + d * ldT;
    for (int64_t j = 0; j < T; ++j) row[j] = k[j * D + d];
    for (int64_t j = T; j < ldT; ++j) row[j] = 0.0f;
  }
}

// The R query rows of a block as a dense [R, D] copy (rows past T zero).
template <int D>
AT_BODY void gather_rows_body(const float* x, int64_t stride, int64_t rows, float* out) {
  for (int r = 0; r < R; ++r) {
#pragma omp simd
    for (int d = 0; d < D; ++d) out[r * D + d] = r < rows ? x[r * stride + d] : 0.0f;
  }
}

// Forward of one unit; o row (h, i) at o + i * o_st + h * o_sh; lse [rep, T].
template <int D, class Exp>
AT_BODY void forward_unit_body(const float* q, const float* k, const float* v, int64_t rep, int64_t T, float scale,
                               float* o, int64_t o_st, int64_t o_sh, float* lse) {
  const int64_t ld = (T + R + JB - 1) / JB * JB;
  std::vector<float> kT(static_cast<size_t>(D) * ld), s(R * ld), ob(R * D);
  transpose_body<D>(k, T, ld, kT.data());
  for (int64_t h = 0; h < rep; ++h) {
    for (int64_t i0 = 0; i0 < T; i0 += R) {
      const int64_t rows = std::min<int64_t>(R, T - i0), n = i0 + rows;
      scores_body<D>(q + (h * T + i0) * D, kT.data(), ld, n, scale, s.data());
      for (int64_t r = 0; r < R; ++r) {
        float* sr = s.data() + r * ld;
        if (r >= rows) {
          std::fill(sr, sr + n, 0.0f);
          continue;
        }
        const int64_t nr = i0 + r + 1;
        float m = sr[0];
#pragma omp simd reduction(max : m)
        for (int64_t j = 1; j < nr; ++j) m = std::max(m, sr[j]);
#pragma omp simd
        for (int64_t j = 0; j < nr; ++j) sr[j] -= m;
        Exp::run(sr, sr, static_cast<size_t>(nr));
        float l = 0.0f;
#pragma omp simd reduction(+ : l)
        for (int64_t j = 0; j < nr; ++j) l += sr[j];
        const float inv = 1.0f / l;
#pragma omp simd
        for (int64_t j = 0; j < nr; ++j) sr[j] *= inv;
        std::fill(sr + nr, sr + n, 0.0f);
        lse[h * T + i0 + r] = m + std::log(l);
      }
      weighted_rows_body<D>(s.data(), ld, v, n, ob.data(), D);
      for (int64_t r = 0; r < rows; ++r) std::copy(ob.data() + r * D, ob.data() + (r + 1) * D, o + (i0 + r) * o_st + h * o_sh);
    }
  }
}

// Backward of one unit: dq [rep, T, D], dk and dv [T, D] written.
template <int D, class Exp>
AT_BODY void backward_unit_body(const float* q, const float* k, const float* v, const float* o, const float* dout,
                                int64_t o_st, int64_t o_sh, const float* lse, int64_t rep, int64_t T, float scale,
                                float* dq, float* dk, float* dv) {
  const int64_t ld = (T + R + JB - 1) / JB * JB;
  std::vector<float> kT(static_cast<size_t>(D) * ld), vT(static_cast<size_t>(D) * ld), p(R * ld), ds(R * ld),
      qb(R * D), dob(R * D), dqb(R * D);
  transpose_body<D>(k, T, ld, kT.data());
  transpose_body<D>(v, T, ld, vT.data());
  std::fill(dk, dk + T * D, 0.0f);
  std::fill(dv, dv + T * D, 0.0f);
  for (int64_t h = 0; h < rep; ++h) {
    for (int64_t i0 = 0; i0 < T; i0 += R) {
      const int64_t rows = std::min<int64_t>(R, T - i0), n = i0 + rows;
      gather_rows_body<D>(q + (h * T + i0) * D, D, rows, qb.data());
      gather_rows_body<D>(dout + i0 * o_st + h * o_sh, o_st, rows, dob.data());
      scores_body<D>(qb.data(), kT.data(), ld, n, scale, p.data());
      scores_body<D>(dob.data(), vT.data(), ld, n, 1.0f, ds.data());  // dp
      for (int64_t r = 0; r < R; ++r) {
        float* pr = p.data() + r * ld;
        float* dr = ds.data() + r * ld;
        if (r >= rows) {
          std::fill(pr, pr + n, 0.0f);
          std::fill(dr, dr + n, 0.0f);
          continue;
        }
        const int64_t nr = i0 + r + 1;
        const float* oi = o + (i0 + r) * o_st + h * o_sh;
        const float* doi = dob.data() + r * D;
        float delta = 0.0f;
#pragma omp simd reduction(+ : delta)
        for (int d = 0; d < D; ++d) delta += doi[d] * oi[d];
        const float li = lse[h * T + i0 + r];
#pragma omp simd
        for (int64_t j = 0; j < nr; ++j) pr[j] -= li;
        Exp::run(pr, pr, static_cast<size_t>(nr));
#pragma omp simd
        for (int64_t j = 0; j < nr; ++j) dr[j] = pr[j] * (dr[j] - delta) * scale;
        std::fill(pr + nr, pr + n, 0.0f);
        std::fill(dr + nr, dr + n, 0.0f);
      }
      weighted_rows_body<D>(ds.data(), ld, k, n, dqb.data(), D);
      for (int64_t r = 0; r < rows; ++r) std::copy(dqb.data() + r * D, dqb.data() + (r + 1) * D, dq + (h * T + i0 + r) * D);
      rank_r_body<D>(ds.data(), ld, qb.data(), D, n, dk);
      rank_r_body<D>(p.data(), ld, dob.data(), D, n, dv);
    }
  }
}

struct ExpScalar {
  static void run(const float* x, float* y, size_t n) { metalnn_fastmath::unary_scalar(metalnn_fastmath::Kind::Exp, x, y, n); }
};

template <int D>
void forward_unit_generic(const float* q, const float* k, const float* v, int64_t rep, int64_t T, float scale,
                          float* o, int64_t o_st, int64_t o_sh, float* lse) {
  forward_unit_body<D, ExpScalar>(q, k, v, rep, T, scale, o, o_st, o_sh, lse);
}

template <int D>
void backward_unit_generic(const float* q, const float* k, const float* v, const float* o, const float* dout,
                           int64_t o_st, int64_t o_sh, const float* lse, int64_t rep, int64_t T, float scale,
                           float* dq, float* dk, float* dv) {
  backward_unit_body<D, ExpScalar>(q, k, v, o, dout, o_st, o_sh, lse, rep, T, scale, dq, dk, dv);
}

#if METALNN_FM_X86
struct ExpAvx2 {
  static void run(const float* x, float* y, size_t n) {
    metalnn_fastmath::unary_avx2_k<metalnn_fastmath::Kind::Exp>(x, y, n);
  }
};

template <int D>
__attribute__((target("avx2,fma"))) void forward_unit_avx2(const float* q, const float* k, const float* v,
                                                           int64_t rep, int64_t T, float scale, float* o,
                                                           int64_t o_st, int64_t o_sh, float* lse) {
  forward_unit_body<D, ExpAvx2>(q, k, v, rep, T, scale, o, o_st, o_sh, lse);
}

template <int D>
__attribute__((target("avx2,fma"))) void backward_unit_avx2(const float* q, const float* k, const float* v,
                                                            const float* o, const float* dout, int64_t o_st,
                                                            int64_t o_sh, const float* lse, int64_t rep, int64_t T,
                                                            float scale, float* dq, float* dk, float* dv) {
  backward_unit_body<D, ExpAvx2>(q, k, v, o, dout, o_st, o_sh, lse, rep, T, scale, dq, dk, dv);
}
#endif

#undef AT_BODY

}  // namespace metalnn_attn
