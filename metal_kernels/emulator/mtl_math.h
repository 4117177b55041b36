// mtl_math.h: the functions of Metal's standard library that work on values, as the overload sets
// the Metal Shading Language Specification 3.1 gives (one non-template overload per type, so that
// mixed arguments such as `max(x, 0)` with a float `x`, or `exp(int)`, are ambiguous as on Metal):
//   §6.2 Common Functions      clamp, mix, saturate, sign, smoothstep, step      (half, float)
//   §6.3 Integer Functions     abs, absdiff, addsat, clamp, clz, ctz, extract_bits, hadd,
//                              insert_bits, mad24, madhi, madsat, max, max3, median3, min, min3,
//                              mul24, mulhi, popcount, reverse_bits, rhadd, rotate, subsat
//                              (char, uchar, short, ushort, int, uint, long, ulong)
//   §6.4 Relational Functions  all, any, isfinite, isinf, isnan, isnormal, isordered,
//                              isunordered, select, signbit
//   §6.5 Math Functions        (half, float; scalars and 2-, 3-, 4-vectors)
//   §6.8 Geometric Functions   cross, distance, distance_squared, dot, length, length_squared,
//                              normalize, faceforward, reflect, refract  (half, float vectors)
// plus the scalar bfloat overloads MLX's prelude adds (mlx/backend/metal/kernels/bf16_math.h).
// Metal has no log1p / expm1 (MLX's prelude defines a global `log1p`, see mtl_mlx.h).
//
// Numerics: float functions use the CPU's libm (correctly rounded or nearly); half and bfloat
// functions compute in float and round once. `metal::fast::` and `metal::precise::` are the same
// functions: fast math (math_mode "fast", the default of Metal but not of MLX) is not modelled;
// the GPU's fast variants differ in the last bits and may assume no NaN/Inf.
#pragma once
#pragma clang system_header  // warnings are the kernel's, not the prelude's

#include "mtl_core.h"

namespace mtl {
template <class T>
inline T imax(T a, T b) { return a > b ? a : b; }
template <class T>
inline T imin(T a, T b) { return a < b ? a : b; }
template <class T>
constexpr T int_max() {
  return mtl_std::is_signed_v<T> ? (T)(((uint64_t)1 << (8 * sizeof(T) - 1)) - 1) : (T)~(T)0;
}
template <class T>
constexpr T int_min() {
  return mtl_std::is_signed_v<T> ? (T)(-int_max<T>() - 1) : (T)0;
}
template <class T>
inline T sat_add(T a, T b) {
  T r;
  if (!__builtin_add_overflow(a, b, &r)) return r;
  return b > 0 ? int_max<T>() : int_min<T>();
}
template <class T>
inline T sat_sub(T a, T b) {
  T r;
  if (!__builtin_sub_overflow(a, b, &r)) return r;
  return b < 0 ? int_max<T>() : int_min<T>();
}
template <class T>
inline T sat_mul(T a, T b) {
  T r;
  if (!__builtin_mul_overflow(a, b, &r)) return r;
  return ((a < 0) != (b < 0)) ? int_min<T>() : int_max<T>();
}
template <class U>
inline U reverse_bits_u(U u) {
  U r = 0;
  for (unsigned i = 0; i < 8 * sizeof(U); ++i) r |= (U)(((u >> i) & 1u) << (8 * sizeof(U) - 1 - i));
  return r;
}
}  // namespace mtl

namespace metal {
using mtl::enable_if_t;

// ------------------------------------------------------------------ generators
#define MTL_FLOAT_VECS(X, NAME) \
  X(NAME, float, 2) X(NAME, float, 3) X(NAME, float, 4) X(NAME, half, 2) X(NAME, half, 3) X(NAME, half, 4)
#define MTL_INT_SCALARS(X, NAME) \
  X(NAME, char) X(NAME, uchar) X(NAME, short) X(NAME, ushort) X(NAME, int) X(NAME, uint) X(NAME, long) X(NAME, ulong)
#define MTL_INT_VECS(X, NAME)                                                                          \
  X(NAME, char, 2) X(NAME, char, 3) X(NAME, char, 4) X(NAME, uchar, 2) X(NAME, uchar, 3) X(NAME, uchar, 4)     \
  X(NAME, short, 2) X(NAME, short, 3) X(NAME, short, 4) X(NAME, ushort, 2) X(NAME, ushort, 3)                  \
  X(NAME, ushort, 4) X(NAME, int, 2) X(NAME, int, 3) X(NAME, int, 4) X(NAME, uint, 2) X(NAME, uint, 3)         \
  X(NAME, uint, 4) X(NAME, long, 2) X(NAME, long, 3) X(NAME, long, 4) X(NAME, ulong, 2) X(NAME, ulong, 3)      \
  X(NAME, ulong, 4)

#define MTL_MAP1(NAME, E, N)                                        \
  inline vec<E, N> NAME(vec<E, N> x) {                              \
    vec<E, N> r;                                                    \
    for (int i = 0; i < N; ++i) r[i] = NAME((E)x[i]);               \
    return r;                                                       \
  }
#define MTL_MAP2(NAME, E, N)                                        \
  inline vec<E, N> NAME(vec<E, N> x, vec<E, N> y) {                 \
    vec<E, N> r;                                                    \
    for (int i = 0; i < N; ++i) r[i] = NAME((E)x[i], (E)y[i]);      \
    return r;                                                       \
  }
#define MTL_MAP3(NAME, E, N)                                                  \
  inline vec<E, N> NAME(vec<E, N> x, vec<E, N> y, vec<E, N> z) {              \
    vec<E, N> r;                                                              \
    for (int i = 0; i < N; ++i) r[i] = NAME((E)x[i], (E)y[i], (E)z[i]);       \
    return r;                                                                 \
  }

// float from an expression in `a` (and `b`, `c`); half and scalar bfloat round the float result
#define MTL_F1(NAME, EXPR)                                                    \
  inline float NAME(float a) { return EXPR; }                                 \
  inline half NAME(half x) { return (half)NAME((float)x); }                   \
  MTL_FLOAT_VECS(MTL_MAP1, NAME)
#define MTL_F2(NAME, EXPR)                                                    \
  inline float NAME(float a, float b) { return EXPR; }                        \
  inline half NAME(half x, half y) { return (half)NAME((float)x, (float)y); } \
  MTL_FLOAT_VECS(MTL_MAP2, NAME)
#define MTL_F3(NAME, EXPR)                                                    \
  inline float NAME(float a, float b, float c) { return EXPR; }               \
  inline half NAME(half x, half y, half z) {                                  \
    return (half)NAME((float)x, (float)y, (float)z);                          \
  }                                                                           \
  MTL_FLOAT_VECS(MTL_MAP3, NAME)
#define MTL_BF1(NAME) \
  inline bfloat NAME(bfloat x) { return (bfloat)NAME((float)x); }
#define MTL_BF2(NAME) \
  inline bfloat NAME(bfloat x, bfloat y) { return (bfloat)NAME((float)x, (float)y); }
#define MTL_BF3(NAME)                                         \
  inline bfloat NAME(bfloat x, bfloat y, bfloat z) {          \
    return (bfloat)NAME((float)x, (float)y, (float)z);        \
  }

// integer functions: EXPR in `a` (`b`, `c`) of type T; U is its unsigned type, W a wider type
#define MTL_I1_ONE(NAME, TY)                                                  \
  inline TY NAME(TY a) {                                  \
    using T = TY;                                                             \
    using U = mtl_std::make_unsigned_t<T>;                                    \
    (void)sizeof(U);                                                          \
    return (T)(MTL_I_EXPR_##NAME);                                            \
  }
#define MTL_I2_ONE(NAME, TY)                                                  \
  inline TY NAME(TY a, TY b) {                                  \
    using T = TY;                                                             \
    using U = mtl_std::make_unsigned_t<T>;                                    \
    (void)sizeof(U);                                                          \
    return (T)(MTL_I_EXPR_##NAME);                                            \
  }
#define MTL_I3_ONE(NAME, TY)                                                  \
  inline TY NAME(TY a, TY b, TY c) {                                  \
    using T = TY;                                                             \
    using U = mtl_std::make_unsigned_t<T>;                                    \
    (void)sizeof(U);                                                          \
    return (T)(MTL_I_EXPR_##NAME);                                            \
  }
#define MTL_I1(NAME) MTL_INT_SCALARS(MTL_I1_ONE, NAME) MTL_INT_VECS(MTL_MAP1, NAME)
#define MTL_I2(NAME) MTL_INT_SCALARS(MTL_I2_ONE, NAME) MTL_INT_VECS(MTL_MAP2, NAME)
#define MTL_I3(NAME) MTL_INT_SCALARS(MTL_I3_ONE, NAME) MTL_INT_VECS(MTL_MAP3, NAME)

namespace detail {
inline float fract(float a) {
  float f = a - __builtin_floorf(a);
  return f < 0x1.fffffep-1f ? f : 0x1.fffffep-1f;
}
inline float sign(float a) { return a > 0.0f ? 1.0f : (a < 0.0f ? -1.0f : (a != a ? 0.0f : a)); }
inline float clampf(float x, float lo, float hi) { return __builtin_fminf(__builtin_fmaxf(x, lo), hi); }
inline float median3(float a, float b, float c) {
  return __builtin_fmaxf(__builtin_fminf(a, b), __builtin_fminf(__builtin_fmaxf(a, b), c));
}
inline float tanpi(float a) {
  // exact zeros and poles at integers and half-integers, like the GPU
  float r = __builtin_fmodf(a, 1.0f);
  if (r == 0.0f) return __builtin_copysignf(0.0f, a);
  if (__builtin_fabsf(r) == 0.5f) return __builtin_copysignf(__builtin_huge_valf(), r);
  return __builtin_tanf(a * 3.14159265358979323846f);
}
}  // namespace detail

// ------------------------------------------------------------------ §6.5 math (+ §6.2 common)
MTL_F1(acos, __builtin_acosf(a))
MTL_F1(acosh, __builtin_acoshf(a))
MTL_F1(asin, __builtin_asinf(a))
MTL_F1(asinh, __builtin_asinhf(a))
MTL_F1(atan, __builtin_atanf(a))
MTL_F1(atanh, __builtin_atanhf(a))
MTL_F1(ceil, __builtin_ceilf(a))
MTL_F1(cos, __builtin_cosf(a))
MTL_F1(cosh, __builtin_coshf(a))
MTL_F1(cospi, __builtin_cosf(a * 3.14159265358979323846f))
MTL_F1(exp, __builtin_expf(a))
MTL_F1(exp2, __builtin_exp2f(a))
MTL_F1(exp10, __builtin_powf(10.0f, a))
MTL_F1(fabs, __builtin_fabsf(a))
MTL_F1(floor, __builtin_floorf(a))
MTL_F1(fract, detail::fract(a))
MTL_F1(log, __builtin_logf(a))
MTL_F1(log2, __builtin_log2f(a))
MTL_F1(log10, __builtin_log10f(a))
MTL_F1(rint, __builtin_rintf(a))
MTL_F1(round, __builtin_roundf(a))
MTL_F1(rsqrt, 1.0f / __builtin_sqrtf(a))
MTL_F1(sin, __builtin_sinf(a))
MTL_F1(sinh, __builtin_sinhf(a))
MTL_F1(sinpi, __builtin_sinf(a * 3.14159265358979323846f))
MTL_F1(sqrt, __builtin_sqrtf(a))
MTL_F1(tan, __builtin_tanf(a))
MTL_F1(tanh, __builtin_tanhf(a))
MTL_F1(tanpi, detail::tanpi(a))
MTL_F1(trunc, __builtin_truncf(a))
MTL_F1(saturate, detail::clampf(a, 0.0f, 1.0f))
MTL_F1(sign, detail::sign(a))
MTL_F2(atan2, __builtin_atan2f(a, b))
MTL_F2(copysign, __builtin_copysignf(a, b))
MTL_F2(divide, a / b)
MTL_F2(fdim, a > b ? a - b : (a != a || b != b ? __builtin_nanf("") : 0.0f))
MTL_F2(fmax, __builtin_fmaxf(a, b))
MTL_F2(fmin, __builtin_fminf(a, b))
MTL_F2(fmod, __builtin_fmodf(a, b))
MTL_F2(pow, __builtin_powf(a, b))
MTL_F2(powr, __builtin_powf(a, b))
MTL_F2(step, b < a ? 0.0f : 1.0f)
MTL_F3(fma, __builtin_fmaf(a, b, c))
MTL_F3(mad, a * b + c)
MTL_F3(fmax3, __builtin_fmaxf(__builtin_fmaxf(a, b), c))
MTL_F3(fmin3, __builtin_fminf(__builtin_fminf(a, b), c))
MTL_F3(fmedian3, detail::median3(a, b, c))
MTL_F3(mix, a + (b - a) * c)
MTL_F3(smoothstep, (detail::clampf((c - a) / (b - a), 0.0f, 1.0f) * detail::clampf((c - a) / (b - a), 0.0f, 1.0f) *
                    (3.0f - 2.0f * detail::clampf((c - a) / (b - a), 0.0f, 1.0f))))
// abs, max, min, clamp, max3, min3, median3 exist for floating-point and integer types
MTL_F1(abs, __builtin_fabsf(a))
MTL_F2(max, __builtin_fmaxf(a, b))
MTL_F2(min, __builtin_fminf(a, b))
MTL_F3(clamp, detail::clampf(a, b, c))
MTL_F3(max3, __builtin_fmaxf(__builtin_fmaxf(a, b), c))
MTL_F3(min3, __builtin_fminf(__builtin_fminf(a, b), c))
MTL_F3(median3, detail::median3(a, b, c))

// nextafter steps one unit in the last place of the argument's own type
namespace detail {
template <class F, class B>
inline F next_toward(F x, F y) {
  if (x != x || y != y) return x + y;
  if (x == y) return y;
  B u = __builtin_bit_cast(B, x);
  const B sign = (B)((B)1 << (8 * sizeof(B) - 1));
  if ((u & (B)~sign) == 0) return __builtin_bit_cast(F, (B)((y > x ? 0 : sign) | 1));
  bool away = (x < y) == !(u & sign);
  return __builtin_bit_cast(F, (B)(away ? u + 1 : u - 1));
}
}  // namespace detail
inline float nextafter(float x, float y) { return detail::next_toward<float, uint32_t>(x, y); }
inline half nextafter(half x, half y) { return detail::next_toward<half, uint16_t>(x, y); }
MTL_FLOAT_VECS(MTL_MAP2, nextafter)
inline bfloat nextafter(bfloat x, bfloat y) { return detail::next_toward<bfloat, uint16_t>(x, y); }

// ldexp(x, k), frexp(x, thread int& e), modf(x, thread T& i), sincos(x, thread T& c)
inline float ldexp(float x, int k) { return __builtin_ldexpf(x, k); }
inline half ldexp(half x, int k) { return (half)__builtin_ldexpf((float)x, k); }
inline bfloat ldexp(bfloat x, int k) { return (bfloat)__builtin_ldexpf((float)x, k); }
inline float frexp(float x, thread int& e) { return __builtin_frexpf(x, &e); }
inline half frexp(half x, thread int& e) { return (half)__builtin_frexpf((float)x, &e); }
inline bfloat frexp(bfloat x, thread int& e) { return (bfloat)__builtin_frexpf((float)x, &e); }
inline float modf(float x, thread float& i) { return __builtin_modff(x, &i); }
inline half modf(half x, thread half& i) {
  float fi;
  float r = __builtin_modff((float)x, &fi);
  i = (half)fi;
  return (half)r;
}
inline float sincos(float x, thread float& c) { c = __builtin_cosf(x); return __builtin_sinf(x); }
inline half sincos(half x, thread half& c) { c = (half)__builtin_cosf((float)x); return (half)__builtin_sinf((float)x); }
#define MTL_LDEXP_V(NAME, E, N)                                                          \
  inline vec<E, N> ldexp(vec<E, N> x, vec<int, N> k) {                                  \
    vec<E, N> r;                                                                         \
    for (int i = 0; i < N; ++i) r[i] = ldexp((E)x[i], (int)k[i]);                        \
    return r;                                                                            \
  }                                                                                      \
  inline vec<E, N> frexp(vec<E, N> x, thread vec<int, N>& e) {                           \
    vec<E, N> r;                                                                         \
    for (int i = 0; i < N; ++i) {                                                        \
      int k;                                                                             \
      r[i] = frexp((E)x[i], k);                                                          \
      e[i] = k;                                                                          \
    }                                                                                    \
    return r;                                                                            \
  }                                                                                      \
  inline vec<E, N> modf(vec<E, N> x, thread vec<E, N>& ip) {                             \
    vec<E, N> r;                                                                         \
    for (int i = 0; i < N; ++i) {                                                        \
      E k;                                                                               \
      r[i] = modf((E)x[i], k);                                                           \
      ip[i] = k;                                                                         \
    }                                                                                    \
    return r;                                                                            \
  }                                                                                      \
  inline vec<E, N> sincos(vec<E, N> x, thread vec<E, N>& c) {                            \
    vec<E, N> r;                                                                         \
    for (int i = 0; i < N; ++i) {                                                        \
      E k;                                                                               \
      r[i] = sincos((E)x[i], k);                                                         \
      c[i] = k;                                                                          \
    }                                                                                    \
    return r;                                                                            \
  }
MTL_FLOAT_VECS(MTL_LDEXP_V, _)
#undef MTL_LDEXP_V

// MLX's prelude (bf16_math.h) adds scalar bfloat overloads of these
MTL_BF1(abs) MTL_BF1(acos) MTL_BF1(acosh) MTL_BF1(asin) MTL_BF1(asinh) MTL_BF1(atan) MTL_BF1(atanh)
MTL_BF1(ceil) MTL_BF1(cos) MTL_BF1(cosh) MTL_BF1(cospi) MTL_BF1(exp) MTL_BF1(exp10) MTL_BF1(exp2)
MTL_BF1(fabs) MTL_BF1(floor) MTL_BF1(fract) MTL_BF1(log) MTL_BF1(log10) MTL_BF1(log2) MTL_BF1(rint)
MTL_BF1(round) MTL_BF1(rsqrt) MTL_BF1(sin) MTL_BF1(sinh) MTL_BF1(sinpi) MTL_BF1(sqrt) MTL_BF1(tan)
MTL_BF1(tanh) MTL_BF1(tanpi) MTL_BF1(trunc)
MTL_BF2(atan2) MTL_BF2(divide) MTL_BF2(fdim) MTL_BF2(fmax) MTL_BF2(fmin) MTL_BF2(fmod) MTL_BF2(max)
MTL_BF2(min) MTL_BF2(pow) MTL_BF2(powr)
MTL_BF3(fma) MTL_BF3(fmax3) MTL_BF3(fmedian3) MTL_BF3(fmin3) MTL_BF3(max3) MTL_BF3(median3) MTL_BF3(min3)

// ------------------------------------------------------------------ §6.3 integer functions
#define MTL_I_EXPR_abs (a < 0 ? (U)0 - (U)a : (U)a)
#define MTL_I_EXPR_clz (a == 0 ? 8 * (int)sizeof(T) : __builtin_clzll((uint64_t)(U)a) - (64 - 8 * (int)sizeof(T)))
#define MTL_I_EXPR_ctz (a == 0 ? 8 * (int)sizeof(T) : __builtin_ctzll((uint64_t)(U)a))
#define MTL_I_EXPR_popcount __builtin_popcountll((uint64_t)(U)a)
#define MTL_I_EXPR_reverse_bits (mtl::reverse_bits_u<U>((U)a))
#define MTL_I_EXPR_max (a > b ? a : b)
#define MTL_I_EXPR_min (a < b ? a : b)
#define MTL_I_EXPR_absdiff (a > b ? (U)a - (U)b : (U)b - (U)a)
#define MTL_I_EXPR_addsat (mtl::sat_add<T>(a, b))
#define MTL_I_EXPR_subsat (mtl::sat_sub<T>(a, b))
#define MTL_I_EXPR_hadd ((T)(((__int128)a + (__int128)b) >> 1))
#define MTL_I_EXPR_rhadd ((T)(((__int128)a + (__int128)b + 1) >> 1))
#define MTL_I_EXPR_mulhi ((T)(((__int128)a * (__int128)b) >> (8 * sizeof(T))))
#define MTL_I_EXPR_mul24 (a * b)
#define MTL_I_EXPR_rotate ((U)(((U)a << ((U)b % (8 * sizeof(T)))) | ((U)a >> ((8 * sizeof(T) - (U)b % (8 * sizeof(T))) % (8 * sizeof(T))))))
#define MTL_I_EXPR_clamp (a < b ? b : (a > c ? c : a))
#define MTL_I_EXPR_max3 (mtl::imax(mtl::imax(a, b), c))
#define MTL_I_EXPR_min3 (mtl::imin(mtl::imin(a, b), c))
#define MTL_I_EXPR_median3 (mtl::imax(mtl::imin(a, b), mtl::imin(mtl::imax(a, b), c)))
#define MTL_I_EXPR_madhi ((T)((((__int128)a * (__int128)b) >> (8 * sizeof(T))) + c))
#define MTL_I_EXPR_mad24 (a * b + c)
#define MTL_I_EXPR_madsat (mtl::sat_add<T>(mtl::sat_mul<T>(a, b), c))
MTL_I1(abs) MTL_I1(clz) MTL_I1(ctz) MTL_I1(popcount) MTL_I1(reverse_bits)
MTL_I2(max) MTL_I2(min) MTL_I2(absdiff) MTL_I2(addsat) MTL_I2(subsat) MTL_I2(hadd) MTL_I2(rhadd)
MTL_I2(mulhi) MTL_I2(mul24) MTL_I2(rotate)
MTL_I3(clamp) MTL_I3(max3) MTL_I3(min3) MTL_I3(median3) MTL_I3(madhi) MTL_I3(mad24) MTL_I3(madsat)

// extract_bits(x, offset, bits), insert_bits(base, insert, offset, bits)
#define MTL_BITS_ONE(NAME, T)                                                            \
  inline T extract_bits(T x, uint offset, uint bits) {                                   \
    using U = mtl_std::make_unsigned_t<T>;                                               \
    if (bits == 0) return 0;                                                             \
    U v = (U)((U)x >> offset);                                                           \
    unsigned w = 8 * sizeof(T);                                                          \
    if (bits < w) {                                                                      \
      v &= (U)(((U)1 << bits) - 1);                                                      \
      if (mtl_std::is_signed_v<T> && (v >> (bits - 1) & 1)) v |= (U)~(((U)1 << bits) - 1); \
    }                                                                                    \
    return (T)v;                                                                         \
  }                                                                                      \
  inline T insert_bits(T base, T insert, uint offset, uint bits) {                       \
    using U = mtl_std::make_unsigned_t<T>;                                               \
    unsigned w = 8 * sizeof(T);                                                          \
    U mask = bits >= w ? (U)~(U)0 : (U)((((U)1 << bits) - 1) << offset);                 \
    return (T)(((U)base & (U)~mask) | (((U)insert << offset) & mask));                   \
  }
MTL_INT_SCALARS(MTL_BITS_ONE, _)
#undef MTL_BITS_ONE

// ------------------------------------------------------------------ §6.4 relational functions
#define MTL_PRED_ONE(NAME, EXPR)                                                      \
  inline bool NAME(float a) { return EXPR; }                                          \
  inline bool NAME(half x) { return NAME((float)x); }                                 \
  inline bool NAME(bfloat x) { return NAME((float)x); }                               \
  template <class E, int N, enable_if_t<mtl::is_fp<E>, int> = 0>                      \
  inline vec<bool, N> NAME(vec<E, N> x) {                                             \
    vec<bool, N> r;                                                                   \
    for (int i = 0; i < N; ++i) r[i] = NAME((E)x[i]);                                 \
    return r;                                                                         \
  }
MTL_PRED_ONE(isnan, a != a)
MTL_PRED_ONE(isinf, __builtin_isinf(a))
MTL_PRED_ONE(isfinite, __builtin_isfinite(a))
MTL_PRED_ONE(isnormal, __builtin_isnormal(a))
MTL_PRED_ONE(signbit, __builtin_signbit(a))
#undef MTL_PRED_ONE
inline bool isordered(float a, float b) { return a == a && b == b; }
inline bool isordered(half a, half b) { return a == a && b == b; }
inline bool isunordered(float a, float b) { return !isordered(a, b); }
inline bool isunordered(half a, half b) { return !isordered(a, b); }

inline bool all(bool x) { return x; }
inline bool any(bool x) { return x; }
template <int N>
inline bool all(vec<bool, N> x) {
  for (int i = 0; i < N; ++i)
    if (!x[i]) return false;
  return true;
}
template <int N>
inline bool any(vec<bool, N> x) {
  for (int i = 0; i < N; ++i)
    if (x[i]) return true;
  return false;
}
// select(a, b, c): c ? b : a (element-wise for vectors)
template <class T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T, int N>
inline vec<T, N> select(vec<T, N> a, vec<T, N> b, vec<bool, N> c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}

// ------------------------------------------------------------------ §6.8 geometric functions
template <class E, int N, enable_if_t<mtl::is_fp<E>, int> = 0>
inline E dot(vec<E, N> a, vec<E, N> b) {
  float s = 0.0f;
  for (int i = 0; i < N; ++i) s += (float)a[i] * (float)b[i];
  return (E)s;
}
template <class E, int N, enable_if_t<mtl::is_fp<E>, int> = 0>
inline E length_squared(vec<E, N> a) { return dot(a, a); }
template <class E, int N, enable_if_t<mtl::is_fp<E>, int> = 0>
inline E length(vec<E, N> a) { return (E)__builtin_sqrtf((float)dot(a, a)); }
template <class E, int N, enable_if_t<mtl::is_fp<E>, int> = 0>
inline E distance(vec<E, N> a, vec<E, N> b) { return length(a - b); }
template <class E, int N, enable_if_t<mtl::is_fp<E>, int> = 0>
inline E distance_squared(vec<E, N> a, vec<E, N> b) { return length_squared(a - b); }
template <class E, int N, enable_if_t<mtl::is_fp<E>, int> = 0>
inline vec<E, N> normalize(vec<E, N> a) { return a * (E)(1.0f / __builtin_sqrtf((float)dot(a, a))); }
template <class E, enable_if_t<mtl::is_fp<E>, int> = 0>
inline vec<E, 3> cross(vec<E, 3> a, vec<E, 3> b) {
  return vec<E, 3>{a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x};
}
template <class E, int N, enable_if_t<mtl::is_fp<E>, int> = 0>
inline vec<E, N> faceforward(vec<E, N> n, vec<E, N> i, vec<E, N> nref) {
  return dot(nref, i) < (E)0 ? n : -n;
}
template <class E, int N, enable_if_t<mtl::is_fp<E>, int> = 0>
inline vec<E, N> reflect(vec<E, N> i, vec<E, N> n) { return i - (E)2 * dot(n, i) * n; }
template <class E, int N, enable_if_t<mtl::is_fp<E>, int> = 0>
inline vec<E, N> refract(vec<E, N> i, vec<E, N> n, E eta) {
  E d = dot(n, i);
  E k = (E)1 - eta * eta * ((E)1 - d * d);
  return k < (E)0 ? vec<E, N>((E)0) : eta * i - (eta * d + (E)__builtin_sqrtf((float)k)) * n;
}

// ------------------------------------------------------------------ fast:: and precise::
#define MTL_FAST_NAMES(X)                                                                        \
  X(abs) X(acos) X(acosh) X(asin) X(asinh) X(atan) X(atan2) X(atanh) X(ceil) X(clamp) X(copysign) \
  X(cos) X(cosh) X(cospi) X(divide) X(exp) X(exp10) X(exp2) X(fabs) X(fdim) X(floor) X(fma)       \
  X(fmax) X(fmax3) X(fmedian3) X(fmin) X(fmin3) X(fmod) X(fract) X(frexp) X(ldexp) X(log)        \
  X(log10) X(log2) X(max) X(max3) X(median3) X(min) X(min3) X(modf) X(nextafter) X(pow) X(powr)  \
  X(rint) X(round) X(rsqrt) X(saturate) X(sign) X(sin) X(sincos) X(sinh) X(sinpi) X(sqrt)        \
  X(step) X(tan) X(tanh) X(tanpi) X(trunc) X(distance) X(length) X(normalize) X(smoothstep)     \
  X(mix)
#define MTL_USING(NAME) using metal::NAME;
namespace fast {
MTL_FAST_NAMES(MTL_USING)
}
namespace precise {
MTL_FAST_NAMES(MTL_USING)
}
#undef MTL_USING
#undef MTL_FAST_NAMES

// ------------------------------------------------------------------ numeric limits
template <class T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static constexpr bool is_specialized = true;
  static constexpr float infinity() { return __builtin_huge_valf(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float max() { return 3.40282346638528859812e+38f; }
  static constexpr float min() { return 1.17549435082228750797e-38f; }
  static constexpr float lowest() { return -3.40282346638528859812e+38f; }
  static constexpr float epsilon() { return 1.1920928955078125e-07f; }
  static constexpr float denorm_min() { return 1.40129846432481707092e-45f; }
};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr half infinity() { return (half)__builtin_huge_valf(); }
  static constexpr half quiet_NaN() { return (half)__builtin_nanf(""); }
  static constexpr half max() { return (half)65504.0f; }
  static constexpr half min() { return (half)6.103515625e-05f; }
  static constexpr half lowest() { return (half)-65504.0f; }
  static constexpr half epsilon() { return (half)0.0009765625f; }
  static constexpr half denorm_min() { return (half)5.9604644775390625e-08f; }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bfloat infinity() { return (bfloat)__builtin_huge_valf(); }
  static constexpr bfloat quiet_NaN() { return (bfloat)__builtin_nanf(""); }
  static constexpr bfloat max() { return (bfloat)3.38953139e38f; }
  static constexpr bfloat min() { return (bfloat)1.17549435e-38f; }
  static constexpr bfloat lowest() { return (bfloat)-3.38953139e38f; }
  static constexpr bfloat epsilon() { return (bfloat)0.0078125f; }
};
#define MTL_INT_LIMITS(T)                                              \
  template <>                                                          \
  struct numeric_limits<T> {                                           \
    static constexpr bool is_specialized = true;                       \
    static constexpr T max() { return mtl::int_max<T>(); }             \
    static constexpr T min() { return mtl::int_min<T>(); }             \
    static constexpr T lowest() { return mtl::int_min<T>(); }          \
  };
MTL_INT_LIMITS(bool)
MTL_INT_LIMITS(char)
MTL_INT_LIMITS(signed char)
MTL_INT_LIMITS(unsigned char)
MTL_INT_LIMITS(short)
MTL_INT_LIMITS(unsigned short)
MTL_INT_LIMITS(int)
MTL_INT_LIMITS(unsigned int)
MTL_INT_LIMITS(long)
MTL_INT_LIMITS(unsigned long)
#undef MTL_INT_LIMITS

// as_type<T>(x): reinterpret the bits (sizes must match)
template <class T, class U>
inline T as_type(const thread U& x) {
  static_assert(sizeof(T) == sizeof(U), "as_type: the source and destination types must have the same size");
  T r;
  __builtin_memcpy(&r, &x, sizeof(T));
  return r;
}

}  // namespace metal
