// Row kernels of metalnn's fused training primitives (train_ops.cpp), float32.
//
// Each kernel handles one row (the last axis) and comes twice: an AVX2+FMA
// version (per-function target attribute, chosen at run time by use_avx2())
// and a portable one; both compute the same formula with the same
// association, so results differ by rounding only. The elementwise loops are
// written once (always_inline bodies, vectorised by the compiler inside the
// AVX2 wrapper with `omp simd`); the loops with exp use kernels.h's exp8 /
// exp_s.
//
//   rms_norm      y = x * r * w,  r = 1 / sqrt(mean(x^2) + eps)
//   rms_norm_vjp  dx = r * gw - x * (r^3 / n) * <gw, x>,  gw = g * w;
//                 dw += g * x * r
//   rope          (x1, x2) -> (x1 c - x2 s, x1 s + x2 c) per rotated pair
//   gated         y = act(a) * b;  da = g b act'(a), db = g act(a)
//   cross_entropy loss = lse(x) - (1 - ls) x[t] - ls mean(x)
//                 dx = g (softmax(x) - (1 - ls) onehot(t) - ls / n)
//   causal softmax of x * scale over the first m entries of a row (zeros after)

#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels.h"

namespace metalnn_train {

using metalnn_fastmath::Kind;

#define TK_BODY static inline __attribute__((always_inline))

// ---------------------------------------------------------------------------
// Elementwise bodies (compiled twice: generic and AVX2)
// ---------------------------------------------------------------------------

TK_BODY float sum_squares_body(const float* x, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

TK_BODY float dot_body(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

TK_BODY void rms_row_body(const float* x, const float* w, float* y, int64_t n, float eps) {
  const float r = 1.0f / std::sqrt(sum_squares_body(x, n) / static_cast<float>(n) + eps);
  if (w) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r;
  }
}

// dx for one row; adds g * x * r into dw_acc (when not null). gw: scratch[n].
TK_BODY void rms_grad_row_body(
    const float* x, const float* w, const float* g, float* dx, float* dw_acc, float* gw, int64_t n, float eps) {
  const float r = 1.0f / std::sqrt(sum_squares_body(x, n) / static_cast<float>(n) + eps);
  const float* gg = g;
  if (w) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) gw[i] = g[i] * w[i];
    gg = gw;
  }
  const float c = dot_body(gg, x, n) * r * r * r / static_cast<float>(n);
  if (dw_acc) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dw_acc[i] += g[i] * x[i] * r;
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dx[i] = r * gg[i] - x[i] * c;
}

// One row of rope: x (unit stride) -> y; cs = cos, sn = sin for the `half`
// rotated pairs (sn already negated for the inverse rotation).
TK_BODY void rope_row_body(
    const float* x, float* y, const float* cs, const float* sn, int64_t half, int64_t n, bool traditional) {
  if (traditional) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      y[2 * i] = a * cs[i] - b * sn[i];
      y[2 * i + 1] = a * sn[i] + b * cs[i];
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      y[i] = a * cs[i] - b * sn[i];
      y[i + half] = a * sn[i] + b * cs[i];
    }
  }
  for (int64_t i = 2 * half; i < n; ++i) y[i] = x[i];
}

// ---------------------------------------------------------------------------
// Portable versions of the exp-based rows
// ---------------------------------------------------------------------------

// log(sum(exp(x))) of a row in two parts: returns log(sum(exp(x - max))) and stores the max in
// *m_out (so a caller can form differences with the row's values before adding the max back).
// A row with a NaN: NaN for both; a row whose max is infinite: 0 and the max.
inline float lse_row_scalar(const float* x, int64_t n, float* m_out) {
  float m = -INFINITY;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    nan |= x[i] != x[i];
    m = std::fmax(m, x[i]);
  }
  *m_out = nan ? NAN : m;
  if (nan) return NAN;
  if (std::isinf(m)) return 0.0f;  // all -inf: -inf; any +inf: +inf
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float d = x[i] - m;
    s += d < metalnn_fastmath::kExpLoNormal ? 0.0f : metalnn_fastmath::exp_s(d);
  }
  return std::log(s);
}

// out = g * (exp(x - lse) - hot * [i == t] - cold)
inline void ce_grad_row_scalar(
    const float* x, float lse, int64_t t, float g, float hot, float cold, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = x[i] - lse;
    const float p = d < metalnn_fastmath::kExpLoNormal ? 0.0f : metalnn_fastmath::exp_s(d);
    out[i] = g * (p - cold - (i == t ? hot : 0.0f));
  }
}

// y[0:m] = softmax(scale * x[0:m]), y[m:n] = 0
inline void scaled_softmax_row_scalar(const float* x, float* y, int64_t m, int64_t n, float scale) {
  float mx_ = -INFINITY;
  bool nan = false;
  for (int64_t i = 0; i < m; ++i) {
    const float v = x[i] * scale;
    nan |= v != v;
    mx_ = std::fmax(mx_, v);
  }
  if (nan) mx_ = NAN;
  float s = 0.0f;
  for (int64_t i = 0; i < m; ++i) {
    const float d = x[i] * scale - mx_;
    const float e = d < metalnn_fastmath::kExpLoNormal ? 0.0f : metalnn_fastmath::exp_s(d);
    y[i] = e;
    s += e;
  }
  const float inv = 1.0f / s;
  for (int64_t i = 0; i < m; ++i) y[i] *= inv;
  for (int64_t i = m; i < n; ++i) y[i] = 0.0f;
}

// ---------------------------------------------------------------------------
// AVX2 + FMA versions
// ---------------------------------------------------------------------------
#if METALNN_FM_X86

using metalnn_fastmath::exp8_ftz;
using metalnn_fastmath::hmax8;
using metalnn_fastmath::hsum8;
using metalnn_fastmath::tail_mask;

FM_TARGET inline float lse_row_avx2(const float* x, int64_t n, float* m_out) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 vm = ninf, nan_acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_loadu_ps(x + i);
    vm = _mm256_max_ps(vm, a);
    nan_acc = _mm256_or_ps(nan_acc, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  const __m256i tm = tail_mask(static_cast<size_t>(n - i));
  if (i < n) {
    __m256 a = _mm256_blendv_ps(ninf, _mm256_maskload_ps(x + i, tm), _mm256_castsi256_ps(tm));
    vm = _mm256_max_ps(vm, a);
    nan_acc = _mm256_or_ps(nan_acc, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan_acc)) {
    *m_out = NAN;
    return NAN;
  }
  const float m = hmax8(vm);
  *m_out = m;
  if (std::isinf(m)) return 0.0f;
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_add_ps(s0, exp8_ftz(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax)));
    s1 = _mm256_add_ps(s1, exp8_ftz(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vmax)));
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_add_ps(s0, exp8_ftz(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax)));
  if (i < n) {
    __m256 a = exp8_ftz(_mm256_sub_ps(_mm256_maskload_ps(x + i, tm), vmax));
    s0 = _mm256_add_ps(s0, _mm256_and_ps(a, _mm256_castsi256_ps(tm)));
  }
  return std::log(hsum8(_mm256_add_ps(s0, s1)));
}

FM_TARGET inline void ce_grad_row_avx2(
    const float* x, float lse, int64_t t, float g, float hot, float cold, float* out, int64_t n) {
  const __m256 vl = _mm256_set1_ps(lse), vg = _mm256_set1_ps(g), vc = _mm256_set1_ps(cold);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 p = exp8_ftz(_mm256_sub_ps(_mm256_loadu_ps(x + i), vl));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(vg, _mm256_sub_ps(p, vc)));
  }
  if (i < n) {
    const __m256i tm = tail_mask(static_cast<size_t>(n - i));
    __m256 p = exp8_ftz(_mm256_sub_ps(_mm256_maskload_ps(x + i, tm), vl));
    _mm256_maskstore_ps(out + i, tm, _mm256_mul_ps(vg, _mm256_sub_ps(p, vc)));
  }
  if (t >= 0 && t < n) out[t] -= g * hot;
}

FM_TARGET inline void scaled_softmax_row_avx2(const float* x, float* y, int64_t m, int64_t n, float scale) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY), vs = _mm256_set1_ps(scale);
  __m256 vm = ninf, nan_acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + i), vs);
    vm = _mm256_max_ps(vm, a);
    nan_acc = _mm256_or_ps(nan_acc, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  const __m256i tm = tail_mask(static_cast<size_t>(m - i));
  if (i < m) {
    __m256 a = _mm256_mul_ps(_mm256_maskload_ps(x + i, tm), vs);
    a = _mm256_blendv_ps(ninf, a, _mm256_castsi256_ps(tm));
    vm = _mm256_max_ps(vm, a);
    nan_acc = _mm256_or_ps(nan_acc, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  float mval = hmax8(vm);
  if (_mm256_movemask_ps(nan_acc)) mval = NAN;
  const __m256 vmax = _mm256_set1_ps(mval);
  __m256 s0 = _mm256_setzero_ps();
  i = 0;
  for (; i + 8 <= m; i += 8) {
    __m256 e = exp8_ftz(_mm256_fmsub_ps(_mm256_loadu_ps(x + i), vs, vmax));
    _mm256_storeu_ps(y + i, e);
    s0 = _mm256_add_ps(s0, e);
  }
  if (i < m) {
    __m256 e = exp8_ftz(_mm256_fmsub_ps(_mm256_maskload_ps(x + i, tm), vs, vmax));
    e = _mm256_and_ps(e, _mm256_castsi256_ps(tm));
    _mm256_maskstore_ps(y + i, tm, e);
    s0 = _mm256_add_ps(s0, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum8(s0));
  i = 0;
  for (; i + 8 <= m; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), inv));
  if (i < m) _mm256_maskstore_ps(y + i, tm, _mm256_mul_ps(_mm256_maskload_ps(y + i, tm), inv));
  for (i = m; i < n; ++i) y[i] = 0.0f;
}

#endif  // METALNN_FM_X86

// The scaled-softmax row uses x * scale - max computed with one rounding (fma)
// on AVX2; keep the portable path within rounding of it.

}  // namespace metalnn_train
