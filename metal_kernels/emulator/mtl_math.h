// mtl_math.h: the functions of Metal's standard library that work on values, with the signatures
// the Metal Shading Language Specification 3.1 gives:
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
// plus the scalar bfloat versions MLX's prelude adds (mlx/backend/metal/kernels/bf16_math.h) for
// the functions it lists. As in Metal's headers, each function is a template whose one type T is
// deduced from every argument and must be a type the function takes: mixed arguments such as
// `max(x, 0)` with a float `x`, `pow(x, 2)` or `exp(i)` with an int `i` match no function.
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
}  // namespace metal
namespace mtl {
template <class E>
constexpr bool is_int_elem = is_int<E> && !mtl_std::is_same_v<E, bool>;
// the types a floating-point function takes: half, float (scalars, vectors); bfloat scalars for the
// functions MLX's prelude extends (BF = true)
template <class T, bool BF>
constexpr bool fp_arg = (is_vec<T> ? (mtl_std::is_same_v<elem_t<T>, float> || mtl_std::is_same_v<elem_t<T>, half>)
                                   : (mtl_std::is_same_v<T, float> || mtl_std::is_same_v<T, half> ||
                                      (BF && mtl_std::is_same_v<T, bfloat>)));
// the types an integer function takes: 8- to 64-bit integers, scalars and vectors (not bool)
template <class T>
constexpr bool int_arg = is_int_elem<elem_t<T>> && !mtl_std::is_same_v<T, bool>;

// element-wise application, computing in float for floating-point types
template <class T, class F>
inline T fmap(F f, T x) {
  if constexpr (is_vec<T>) {
    T r;
    for (int i = 0; i < vinfo<T>::n; ++i) r[i] = (elem_t<T>)f((float)x[i]);
    return r;
  } else {
    return (T)f((float)x);
  }
}
template <class T, class F>
inline T fmap(F f, T x, T y) {
  if constexpr (is_vec<T>) {
    T r;
    for (int i = 0; i < vinfo<T>::n; ++i) r[i] = (elem_t<T>)f((float)x[i], (float)y[i]);
    return r;
  } else {
    return (T)f((float)x, (float)y);
  }
}
template <class T, class F>
inline T fmap(F f, T x, T y, T z) {
  if constexpr (is_vec<T>) {
    T r;
    for (int i = 0; i < vinfo<T>::n; ++i) r[i] = (elem_t<T>)f((float)x[i], (float)y[i], (float)z[i]);
    return r;
  } else {
    return (T)f((float)x, (float)y, (float)z);
  }
}
template <class T, class F, class... X>
inline T imap(F f, T x, X... xs) {
  if constexpr (is_vec<T>) {
    T r;
    for (int i = 0; i < vinfo<T>::n; ++i) r[i] = f(x[i], xs[i]...);
    return r;
  } else {
    return f(x, xs...);
  }
}
}  // namespace mtl
namespace metal {

#define MTL_FP(BF) enable_if_t<mtl::fp_arg<T, BF>, int> = 0
#define MTL_F1_(NAME, BF, EXPR) \
  template <class T, MTL_FP(BF)> \
  inline T NAME(T x) { return mtl::fmap([](float a) -> float { return EXPR; }, x); }
#define MTL_F2_(NAME, BF, EXPR) \
  template <class T, MTL_FP(BF)> \
  inline T NAME(T x, T y) { return mtl::fmap([](float a, float b) -> float { return EXPR; }, x, y); }
#define MTL_F3_(NAME, BF, EXPR)                                                                      \
  template <class T, MTL_FP(BF)>                                                                     \
  inline T NAME(T x, T y, T z) {                                                                     \
    return mtl::fmap([](float a, float b, float c) -> float { return EXPR; }, x, y, z);              \
  }
// with / without the scalar bfloat version MLX's prelude adds
#define MTL_F1(NAME, EXPR) MTL_F1_(NAME, true, EXPR)
#define MTL_F2(NAME, EXPR) MTL_F2_(NAME, true, EXPR)
#define MTL_F3(NAME, EXPR) MTL_F3_(NAME, true, EXPR)
#define MTL_F1_NOBF(NAME, EXPR) MTL_F1_(NAME, false, EXPR)
#define MTL_F2_NOBF(NAME, EXPR) MTL_F2_(NAME, false, EXPR)
#define MTL_F3_NOBF(NAME, EXPR) MTL_F3_(NAME, false, EXPR)

// integer functions: EXPR in `a` (`b`, `c`) of type T (the element type); U is its unsigned type
#define MTL_ILAMBDA(NAME, ...)                        \
  [](__VA_ARGS__) {                                   \
    using U = mtl_std::make_unsigned_t<T>;            \
    (void)sizeof(U);                                  \
    return (T)(MTL_I_EXPR_##NAME);                    \
  }
#define MTL_I1(NAME)                                                                        \
  template <class V, enable_if_t<mtl::int_arg<V>, int> = 0>                                 \
  inline V NAME(V x) {                                                                      \
    using T = mtl::elem_t<V>;                                                               \
    return mtl::imap(MTL_ILAMBDA(NAME, T a), x);                                            \
  }
#define MTL_I2(NAME)                                                                        \
  template <class V, enable_if_t<mtl::int_arg<V>, int> = 0>                                 \
  inline V NAME(V x, V y) {                                                                 \
    using T = mtl::elem_t<V>;                                                               \
    return mtl::imap(MTL_ILAMBDA(NAME, T a, T b), x, y);                                    \
  }
#define MTL_I3(NAME)                                                                        \
  template <class V, enable_if_t<mtl::int_arg<V>, int> = 0>                                 \
  inline V NAME(V x, V y, V z) {                                                            \
    using T = mtl::elem_t<V>;                                                               \
    return mtl::imap(MTL_ILAMBDA(NAME, T a, T b, T c), x, y, z);                            \
  }

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
MTL_F1_NOBF(saturate, detail::clampf(a, 0.0f, 1.0f))
MTL_F1_NOBF(sign, detail::sign(a))
MTL_F2(atan2, __builtin_atan2f(a, b))
MTL_F2_NOBF(copysign, __builtin_copysignf(a, b))
MTL_F2(divide, a / b)
MTL_F2(fdim, a > b ? a - b : (a != a || b != b ? __builtin_nanf("") : 0.0f))
MTL_F2(fmax, __builtin_fmaxf(a, b))
MTL_F2(fmin, __builtin_fminf(a, b))
MTL_F2(fmod, __builtin_fmodf(a, b))
MTL_F2(pow, __builtin_powf(a, b))
MTL_F2(powr, __builtin_powf(a, b))
MTL_F2_NOBF(step, b < a ? 0.0f : 1.0f)
MTL_F3(fma, __builtin_fmaf(a, b, c))
MTL_F3_NOBF(mad, a * b + c)
MTL_F3(fmax3, __builtin_fmaxf(__builtin_fmaxf(a, b), c))
MTL_F3(fmin3, __builtin_fminf(__builtin_fminf(a, b), c))
MTL_F3(fmedian3, detail::median3(a, b, c))
MTL_F3_NOBF(mix, a + (b - a) * c)
MTL_F3_NOBF(smoothstep, (detail::clampf((c - a) / (b - a), 0.0f, 1.0f) * detail::clampf((c - a) / (b - a), 0.0f, 1.0f) *
                    (3.0f - 2.0f * detail::clampf((c - a) / (b - a), 0.0f, 1.0f))))
// abs, max, min, clamp, max3, min3, median3 exist for floating-point and integer types
MTL_F1(abs, __builtin_fabsf(a))
MTL_F2(max, __builtin_fmaxf(a, b))
MTL_F2(min, __builtin_fminf(a, b))
MTL_F3_NOBF(clamp, detail::clampf(a, b, c))
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
}  // namespace metal
namespace mtl {
template <class T, int N = vinfo<T>::n>
using int_like_t = mtl_std::conditional_t<is_vec<T>, metal::vec<int, N>, int>;
template <class E>
inline E next_elem(E x, E y) {
  if constexpr (sizeof(E) == 4)
    return metal::detail::next_toward<E, uint32_t>(x, y);
  else
    return metal::detail::next_toward<E, uint16_t>(x, y);
}
}  // namespace mtl
namespace metal {
template <class T, MTL_FP(true)>
inline T nextafter(T x, T y) {
  return mtl::imap([](auto a, auto b) { return mtl::next_elem(a, b); }, x, y);
}
// ldexp(x, k), frexp(x, thread int& e), modf(x, thread T& i), sincos(x, thread T& c); for vectors
// the int arguments are int vectors of the same length
template <class T, MTL_FP(true)>
inline T ldexp(T x, mtl::int_like_t<T> k) {
  return mtl::imap([](auto a, int e) { return (decltype(a))__builtin_ldexpf((float)a, e); }, x, k);
}
template <class T, MTL_FP(true)>
inline T frexp(T x, thread mtl::int_like_t<T>& e) {
  if constexpr (mtl::is_vec<T>) {
    T r;
    for (int i = 0; i < mtl::vinfo<T>::n; ++i) {
      int k;
      r[i] = (mtl::elem_t<T>)__builtin_frexpf((float)x[i], &k);
      e[i] = k;
    }
    return r;
  } else {
    int k;
    T r = (T)__builtin_frexpf((float)x, &k);
    e = k;
    return r;
  }
}
template <class T, MTL_FP(false)>
inline T modf(T x, thread T& ip) {
  T w = trunc(x);
  ip = w;
  return x - w;
}
template <class T, MTL_FP(false)>
inline T sincos(T x, thread T& c) {
  c = cos(x);
  return sin(x);
}

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
template <class V, enable_if_t<mtl::int_arg<V>, int> = 0>
inline V extract_bits(V x, uint offset, uint bits) {
  return mtl::imap([offset, bits](auto e) {
    using T = decltype(e);
    using U = mtl_std::make_unsigned_t<T>;
    if (bits == 0) return (T)0;
    U v = (U)((U)e >> offset);
    if (bits < 8 * sizeof(T)) {
      v &= (U)(((U)1 << bits) - 1);
      if (mtl_std::is_signed_v<T> && (v >> (bits - 1) & 1)) v |= (U)~(((U)1 << bits) - 1);
    }
    return (T)v;
  }, x);
}
template <class V, enable_if_t<mtl::int_arg<V>, int> = 0>
inline V insert_bits(V base, V insert, uint offset, uint bits) {
  return mtl::imap([offset, bits](auto b, auto i) {
    using T = decltype(b);
    using U = mtl_std::make_unsigned_t<T>;
    U mask = bits >= 8 * sizeof(T) ? (U)~(U)0 : (U)((((U)1 << bits) - 1) << offset);
    return (T)(((U)b & (U)~mask) | (((U)i << offset) & mask));
  }, base, insert);
}

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
