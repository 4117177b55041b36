// Vectorised float32 kernels for metalnn.cpu.fastmath (CPU).
//
// Every kernel has an AVX2+FMA version (compiled with a per-function target
// attribute, so the translation unit itself needs no -march flag) and a
// portable scalar version. The scalar versions use the same polynomial
// approximations so results do not depend (beyond rounding) on the code path.
// `use_avx2()` decides once, at run time, which one runs.

#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#define METALNN_FM_X86 1
#include <immintrin.h>
#else
#define METALNN_FM_X86 0
#endif

namespace metalnn_fastmath {

enum class Kind : int { Exp = 0, Sigmoid = 1, Silu = 2, Tanh = 3, GeluTanh = 4 };

// Constants shared by the scalar and vector paths.
constexpr float kExpHi = 89.0f;  // exp(89) overflows to +inf after scaling
constexpr float kExpLo = -104.0f;  // exp(-104) rounds to 0
constexpr float kExpLoNormal = -87.0f;  // exp(x >= -87) is a normal float
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
// Cephes expf minimax polynomial on [-ln2/2, ln2/2].
constexpr float kP0 = 1.9875691500e-4f;
constexpr float kP1 = 1.3981999507e-3f;
constexpr float kP2 = 8.3334519073e-3f;
constexpr float kP3 = 4.1665795894e-2f;
constexpr float kP4 = 1.6666665459e-1f;
constexpr float kP5 = 5.0000001201e-1f;
// Cephes tanhf polynomial for |x| < 0.625.
constexpr float kT0 = -5.70498872745e-3f;
constexpr float kT1 = 2.06390887954e-2f;
constexpr float kT2 = -5.37397155531e-2f;
constexpr float kT3 = 1.33314422036e-1f;
constexpr float kT4 = -3.33332819422e-1f;
constexpr float kTanhSmall = 0.625f;
// gelu_tanh(x) = 0.5 x (1 + tanh(c (x + a x^3))) = x * sigmoid(2c (x + a x^3))
constexpr float kGeluA = 0.044715f;
constexpr float kGeluK = 1.5957691216057308f;  // 2 * sqrt(2 / pi)

// ---------------------------------------------------------------------------
// Scalar reference path
// ---------------------------------------------------------------------------

inline float exp_s(float x) {
  if (x != x) return x;
  float xc = std::fmin(std::fmax(x, kExpLo), kExpHi);
  float n = std::nearbyint(xc * kLog2e);
  float r = std::fma(-n, kLn2Hi, xc);
  r = std::fma(-n, kLn2Lo, r);
  float p = kP0;
  p = std::fma(p, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  float y = std::fma(p, r * r, r) + 1.0f;
  int32_t ni = static_cast<int32_t>(n);
  int32_t n1 = ni >> 1;
  int32_t n2 = ni - n1;
  uint32_t b1 = static_cast<uint32_t>(n1 + 127) << 23;
  uint32_t b2 = static_cast<uint32_t>(n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  return y * s1 * s2;
}

inline float sigmoid_s(float x) {
  return 1.0f / (1.0f + exp_s(-x));
}

inline float tanh_s(float x) {
  float ax = std::fabs(x);
  if (ax < kTanhSmall) {
    float z = x * x;
    float p = kT0;
    p = std::fma(p, z, kT1);
    p = std::fma(p, z, kT2);
    p = std::fma(p, z, kT3);
    p = std::fma(p, z, kT4);
    return std::fma(p * z, x, x);
  }
  float t = 1.0f - 2.0f / (exp_s(2.0f * ax) + 1.0f);
  return std::copysign(t, x);
}

inline float gelu_arg_s(float x) {
  return kGeluK * std::fma(kGeluA * x * x, x, x);
}

inline float unary_s(Kind k, float x) {
  switch (k) {
    case Kind::Exp:
      return exp_s(x);
    case Kind::Sigmoid:
      return sigmoid_s(x);
    case Kind::Silu:
      return x * sigmoid_s(x);
    case Kind::Tanh:
      return tanh_s(x);
    case Kind::GeluTanh:
      return x * sigmoid_s(gelu_arg_s(x));
  }
  return 0.0f;
}

// Gradient of the unary op: `a` is the output y for Exp/Sigmoid/Tanh and the
// input x for Silu/GeluTanh; g is the cotangent (or tangent).
inline float unary_grad_s(Kind k, float a, float g) {
  switch (k) {
    case Kind::Exp:
      return g * a;
    case Kind::Sigmoid:
      return g * a * (1.0f - a);
    case Kind::Tanh:
      return g * (1.0f - a * a);
    case Kind::Silu: {
      float s = sigmoid_s(a);
      return g * s * (1.0f + a * (1.0f - s));
    }
    case Kind::GeluTanh: {
      float s = sigmoid_s(gelu_arg_s(a));
      float dv = kGeluK * (1.0f + 3.0f * kGeluA * a * a);
      return g * (s + a * s * (1.0f - s) * dv);
    }
  }
  return 0.0f;
}

inline void unary_scalar(Kind k, const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = unary_s(k, x[i]);
}

inline void unary_grad_scalar(
    Kind k, const float* a, const float* g, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = unary_grad_s(k, a[i], g[i]);
}

inline void softmax_row_scalar(const float* x, float* y, size_t n) {
  float m = -INFINITY;
  for (size_t i = 0; i < n; ++i) m = std::fmax(m, x[i]);
  // keep NaN semantics of the vector path: a NaN anywhere poisons the row
  float s = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    float d = x[i] - m;
    float e = d < kExpLoNormal ? 0.0f : exp_s(d);
    y[i] = e;
    s += e;
  }
  float inv = 1.0f / s;
  for (size_t i = 0; i < n; ++i) y[i] *= inv;
}

inline void softmax_grad_row_scalar(
    const float* y, const float* g, float* out, size_t n) {
  float d = 0.0f;
  for (size_t i = 0; i < n; ++i) d += g[i] * y[i];
  for (size_t i = 0; i < n; ++i) out[i] = y[i] * (g[i] - d);
}

// ---------------------------------------------------------------------------
// AVX2 + FMA path
// ---------------------------------------------------------------------------
#if METALNN_FM_X86

#define FM_TARGET __attribute__((target("avx2,fma")))
#define FM_INLINE FM_TARGET static inline __attribute__((always_inline))

// FTZ=false: full float32 range, denormal results rounded correctly (inputs
// that produce denormals take an x86 microcode assist, ~100x slower per lane).
// FTZ=true: results below FLT_MIN (x < -87) are flushed to +0 without ever
// computing a denormal; used by softmax, where masked (-inf) logits are common.
template <bool FTZ>
FM_INLINE __m256 exp8_impl(__m256 x) {
  const __m256 nanmask = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 lo = _mm256_set1_ps(FTZ ? kExpLoNormal : kExpLo);
  __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(kExpHi));
  __m256 n = _mm256_round_ps(
      _mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  __m256 y = _mm256_add_ps(
      _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  __m256i ni = _mm256_cvtps_epi32(n);
  __m256i n1 = _mm256_srai_epi32(ni, 1);
  __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  __m256 s1 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  __m256 s2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  y = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
  if constexpr (FTZ) {
    y = _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), y);
  }
  return _mm256_blendv_ps(y, x, nanmask);
}

FM_INLINE __m256 exp8(__m256 x) {
  return exp8_impl<false>(x);
}

FM_INLINE __m256 exp8_ftz(__m256 x) {
  return exp8_impl<true>(x);
}

FM_INLINE __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_div_ps(one, _mm256_add_ps(one, e));
}

FM_INLINE __m256 tanh8(__m256 x) {
  const __m256 signmask = _mm256_set1_ps(-0.0f);
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 ax = _mm256_andnot_ps(signmask, x);
  __m256 sign = _mm256_and_ps(signmask, x);
  // large branch: 1 - 2 / (exp(2|x|) + 1)
  __m256 e = exp8(_mm256_add_ps(ax, ax));
  __m256 big = _mm256_sub_ps(
      one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  big = _mm256_or_ps(big, sign);
  // small branch: polynomial
  __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(kT0);
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kT1));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kT2));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kT3));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kT4));
  __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
  __m256 is_small = _mm256_cmp_ps(ax, _mm256_set1_ps(kTanhSmall), _CMP_LT_OQ);
  __m256 res = _mm256_blendv_ps(big, small, is_small);
  // NaN in -> NaN out (big branch already propagates NaN through exp8)
  return res;
}

FM_INLINE __m256 gelu_arg8(__m256 x) {
  __m256 x2 = _mm256_mul_ps(x, x);
  __m256 inner =
      _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kGeluA), x2), x, x);
  return _mm256_mul_ps(_mm256_set1_ps(kGeluK), inner);
}

template <Kind K>
FM_INLINE __m256 unary8(__m256 x) {
  if constexpr (K == Kind::Exp) {
    return exp8(x);
  } else if constexpr (K == Kind::Sigmoid) {
    return sigmoid8(x);
  } else if constexpr (K == Kind::Silu) {
    return _mm256_mul_ps(x, sigmoid8(x));
  } else if constexpr (K == Kind::Tanh) {
    return tanh8(x);
  } else {
    return _mm256_mul_ps(x, sigmoid8(gelu_arg8(x)));
  }
}

template <Kind K>
FM_INLINE __m256 unary_grad8(__m256 a, __m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  if constexpr (K == Kind::Exp) {
    return _mm256_mul_ps(g, a);
  } else if constexpr (K == Kind::Sigmoid) {
    return _mm256_mul_ps(_mm256_mul_ps(g, a), _mm256_sub_ps(one, a));
  } else if constexpr (K == Kind::Tanh) {
    return _mm256_mul_ps(g, _mm256_fnmadd_ps(a, a, one));
  } else if constexpr (K == Kind::Silu) {
    __m256 s = sigmoid8(a);
    __m256 t = _mm256_fmadd_ps(a, _mm256_sub_ps(one, s), one);
    return _mm256_mul_ps(_mm256_mul_ps(g, s), t);
  } else {
    __m256 s = sigmoid8(gelu_arg8(a));
    __m256 dv = _mm256_mul_ps(
        _mm256_set1_ps(kGeluK),
        _mm256_fmadd_ps(_mm256_set1_ps(3.0f * kGeluA), _mm256_mul_ps(a, a), one));
    __m256 t = _mm256_mul_ps(
        _mm256_mul_ps(a, s), _mm256_mul_ps(_mm256_sub_ps(one, s), dv));
    return _mm256_mul_ps(g, _mm256_add_ps(s, t));
  }
}

FM_INLINE __m256i tail_mask(size_t r) {
  // lanes [0, r) active
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(r)), idx);
}

template <Kind K>
FM_TARGET void unary_avx2_k(const float* x, float* y, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm256_loadu_ps(x + i);
    __m256 b = _mm256_loadu_ps(x + i + 8);
    _mm256_storeu_ps(y + i, unary8<K>(a));
    _mm256_storeu_ps(y + i + 8, unary8<K>(b));
  }
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, unary8<K>(_mm256_loadu_ps(x + i)));
  }
  if (i < n) {
    __m256i m = tail_mask(n - i);
    __m256 a = _mm256_maskload_ps(x + i, m);
    _mm256_maskstore_ps(y + i, m, unary8<K>(a));
  }
}

template <Kind K>
FM_TARGET void unary_grad_avx2_k(
    const float* a, const float* g, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(
        out + i,
        unary_grad8<K>(_mm256_loadu_ps(a + i), _mm256_loadu_ps(g + i)));
  }
  if (i < n) {
    __m256i m = tail_mask(n - i);
    __m256 va = _mm256_maskload_ps(a + i, m);
    __m256 vg = _mm256_maskload_ps(g + i, m);
    _mm256_maskstore_ps(out + i, m, unary_grad8<K>(va, vg));
  }
}

FM_INLINE float hmax8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_max_ps(lo, hi);
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

FM_INLINE float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

FM_TARGET inline void softmax_row_avx2(const float* x, float* y, size_t n) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  // pass 1: max (NaN-propagating via an unordered flag)
  __m256 vm0 = ninf, vm1 = ninf;
  __m256 nan_acc = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm256_loadu_ps(x + i);
    __m256 b = _mm256_loadu_ps(x + i + 8);
    vm0 = _mm256_max_ps(vm0, a);
    vm1 = _mm256_max_ps(vm1, b);
    nan_acc = _mm256_or_ps(nan_acc, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_loadu_ps(x + i);
    vm0 = _mm256_max_ps(vm0, a);
    nan_acc = _mm256_or_ps(nan_acc, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  __m256i tm = tail_mask(n - i);
  if (i < n) {
    __m256 a = _mm256_blendv_ps(
        ninf, _mm256_maskload_ps(x + i, tm), _mm256_castsi256_ps(tm));
    vm0 = _mm256_max_ps(vm0, a);
    nan_acc = _mm256_or_ps(nan_acc, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  float m = hmax8(_mm256_max_ps(vm0, vm1));
  if (_mm256_movemask_ps(nan_acc)) m = NAN;
  const __m256 vmax = _mm256_set1_ps(m);
  // pass 2: exp and sum
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = exp8_ftz(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
    __m256 b = exp8_ftz(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vmax));
    _mm256_storeu_ps(y + i, a);
    _mm256_storeu_ps(y + i + 8, b);
    s0 = _mm256_add_ps(s0, a);
    s1 = _mm256_add_ps(s1, b);
  }
  for (; i + 8 <= n; i += 8) {
    __m256 a = exp8_ftz(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
    _mm256_storeu_ps(y + i, a);
    s0 = _mm256_add_ps(s0, a);
  }
  if (i < n) {
    __m256 a = exp8_ftz(_mm256_sub_ps(_mm256_maskload_ps(x + i, tm), vmax));
    a = _mm256_and_ps(a, _mm256_castsi256_ps(tm));
    _mm256_maskstore_ps(y + i, tm, a);
    s0 = _mm256_add_ps(s0, a);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum8(_mm256_add_ps(s0, s1)));
  // pass 3: normalise
  i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), inv));
  }
  if (i < n) {
    _mm256_maskstore_ps(
        y + i, tm, _mm256_mul_ps(_mm256_maskload_ps(y + i, tm), inv));
  }
}

FM_TARGET inline void softmax_grad_row_avx2(
    const float* y, const float* g, float* out, size_t n) {
  __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    d0 = _mm256_fmadd_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(g + i), d0);
    d1 = _mm256_fmadd_ps(
        _mm256_loadu_ps(y + i + 8), _mm256_loadu_ps(g + i + 8), d1);
  }
  for (; i + 8 <= n; i += 8) {
    d0 = _mm256_fmadd_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(g + i), d0);
  }
  __m256i tm = tail_mask(n - i);
  if (i < n) {
    d0 = _mm256_fmadd_ps(
        _mm256_maskload_ps(y + i, tm), _mm256_maskload_ps(g + i, tm), d0);
  }
  const __m256 d = _mm256_set1_ps(hsum8(_mm256_add_ps(d0, d1)));
  i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 vy = _mm256_loadu_ps(y + i);
    __m256 vg = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(vy, _mm256_sub_ps(vg, d)));
  }
  if (i < n) {
    __m256 vy = _mm256_maskload_ps(y + i, tm);
    __m256 vg = _mm256_maskload_ps(g + i, tm);
    _mm256_maskstore_ps(out + i, tm, _mm256_mul_ps(vy, _mm256_sub_ps(vg, d)));
  }
}

inline bool cpu_has_avx2_fma() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
}

#else  // !METALNN_FM_X86

inline bool cpu_has_avx2_fma() {
  return false;
}

#endif

// Global switch (for tests/benchmarks): force the scalar path.
inline bool& force_scalar_flag() {
  static bool flag = false;
  return flag;
}

inline bool use_avx2() {
  return cpu_has_avx2_fma() && !force_scalar_flag();
}

// ---------------------------------------------------------------------------
// Dispatchers used by the primitives
// ---------------------------------------------------------------------------

inline void unary_kernel(Kind k, const float* x, float* y, size_t n) {
#if METALNN_FM_X86
  if (use_avx2()) {
    switch (k) {
      case Kind::Exp:
        return unary_avx2_k<Kind::Exp>(x, y, n);
      case Kind::Sigmoid:
        return unary_avx2_k<Kind::Sigmoid>(x, y, n);
      case Kind::Silu:
        return unary_avx2_k<Kind::Silu>(x, y, n);
      case Kind::Tanh:
        return unary_avx2_k<Kind::Tanh>(x, y, n);
      case Kind::GeluTanh:
        return unary_avx2_k<Kind::GeluTanh>(x, y, n);
    }
  }
#endif
  unary_scalar(k, x, y, n);
}

inline void unary_grad_kernel(
    Kind k, const float* a, const float* g, float* out, size_t n) {
#if METALNN_FM_X86
  if (use_avx2()) {
    switch (k) {
      case Kind::Exp:
        return unary_grad_avx2_k<Kind::Exp>(a, g, out, n);
      case Kind::Sigmoid:
        return unary_grad_avx2_k<Kind::Sigmoid>(a, g, out, n);
      case Kind::Silu:
        return unary_grad_avx2_k<Kind::Silu>(a, g, out, n);
      case Kind::Tanh:
        return unary_grad_avx2_k<Kind::Tanh>(a, g, out, n);
      case Kind::GeluTanh:
        return unary_grad_avx2_k<Kind::GeluTanh>(a, g, out, n);
    }
  }
#endif
  unary_grad_scalar(k, a, g, out, n);
}

inline void softmax_row(const float* x, float* y, size_t n) {
#if METALNN_FM_X86
  if (use_avx2()) return softmax_row_avx2(x, y, n);
#endif
  softmax_row_scalar(x, y, n);
}

inline void softmax_grad_row(
    const float* y, const float* g, float* out, size_t n) {
#if METALNN_FM_X86
  if (use_avx2()) return softmax_grad_row_avx2(y, g, out, n);
#endif
  softmax_grad_row_scalar(y, g, out, n);
}

}  // namespace metalnn_fastmath
