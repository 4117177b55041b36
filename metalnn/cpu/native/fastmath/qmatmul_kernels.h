// Kernels for products with an MLX affine-quantized matrix (CPU, float32 math).
//
// Format (mx.quantize, mode "affine"): a weight row of K values is a
// little-endian bit stream of K * BITS bits (BITS in 1..8), stored as uint32
// words; every group of G consecutive values (G in 32, 64, 128) has a float
// scale s and bias b, and value k stands for s * q_k + b. Eight values always
// take BITS whole bytes, so the kernels decode chunks of 8 (or more) values.
//
// For a row w of the matrix and an input row x:
//
//   w . x = sum_g ( s_g * sum_{k in g} q_k x_k  +  b_g * sum_{k in g} x_k )
//
// so the group sums of x ("xsum") are computed once per input row and the
// inner loop is just decode + FMA.
//
// Decoding order. The AVX2 kernels for 2 and 4 bits read 8 bytes with one
// zero-extending load (8 x int32) and take the fields out with shifts and
// masks; that yields the values of a 16 (4-bit) or 32 (2-bit) value block in a
// permuted "kernel order". The input rows are permuted the same way once per
// call (prepare_x), and results that are indexed by k (the transposed product,
// dequantize) are written back in natural order. All other paths decode in
// natural order. `block_perm` describes the permutation.
//
// Every routine has an AVX2+FMA version (per-function target attributes, the
// translation unit needs no -march) and a portable scalar one; `use_avx2()`
// picks at run time.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define METALNN_QMM_X86 1
#include <immintrin.h>
#else
#define METALNN_QMM_X86 0
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the quantized kernels assume a little-endian host"
#endif

namespace metalnn_qmm {

inline bool cpu_has_avx2_fma() {
#if METALNN_QMM_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
#else
  return false;
#endif
}

// Switch for tests and benchmarks: run the portable kernels even where AVX2 is available.
inline std::atomic<bool>& force_scalar_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}

inline bool use_avx2() {
  return cpu_has_avx2_fma() && !force_scalar_flag().load();
}

// Shape of one product: K values per weight row in groups of G, BITS bits each.
struct Layout {
  int bits = 4;
  int group = 64;
  int64_t K = 0;

  int64_t row_bytes() const {
    return K * bits / 8;
  }
  int64_t groups() const {
    return K / group;
  }
};

// Everything one product needs, with the input rows already prepared
// (float32, contiguous, kernel order) and their group sums.
struct MatvecArgs {
  Layout L;
  const uint8_t* w;  // [N, row_bytes]
  const float* s;  // [N, groups] (float32, contiguous)
  const float* b;  // [N, groups]
  int64_t N;
  int64_t M;  // input rows
  const float* x;  // [M, K] kernel order
  const float* xsum;  // [M, groups]
  float* out;  // [M, N]
};

// The transposed product out[m, k] = sum_n g[m, n] * W[n, k].
struct AxpyArgs {
  Layout L;
  const uint8_t* w;
  const float* s;
  const float* b;
  int64_t N;
  int64_t M;
  const float* g;  // [M, N] float32 contiguous
  float* out;  // [M, K] natural order
};

// Size of the permuted block (in values) for the AVX2 kernels, 0 when the
// AVX2 kernels decode in natural order. Scalar kernels never permute.
inline int block_perm(int bits, bool avx2) {
  if (!avx2) return 0;
  if (bits == 4) return 16;
  if (bits == 2) return 32;
  return 0;
}

// Position in natural order of the value at kernel-order position i of a
// permuted block of `bits`-bit values (see block_perm): the block comes from
// 8 bytes, vector f holds field f of each byte.
inline int perm_source(int i, int bits) {
  const int per_byte = 8 / bits;  // values per byte
  const int lane = i % 8, field = i / 8;
  return lane * per_byte + field;
}

// ---------------------------------------------------------------------------
// Scalar path (natural order)
// ---------------------------------------------------------------------------

// The B bytes at p as a little-endian integer, read with whole-register loads
// (a byte-wise copy into a wider variable would stall the wide read after it).
template <int B>
inline uint64_t load_bytes(const uint8_t* p) {
  uint64_t lo = 0, hi = 0;
  if constexpr (B >= 4) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    lo = v;
  } else if constexpr (B >= 2) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    lo = v;
  } else {
    lo = p[0];
  }
  constexpr int first = B >= 4 ? 4 : (B >= 2 ? 2 : 1);
  if constexpr (B - first >= 4) {
    uint32_t v;
    std::memcpy(&v, p + first, 4);
    hi = v;
  } else if constexpr (B - first >= 2) {
    uint16_t v;
    std::memcpy(&v, p + first, 2);
    hi = v;
    if constexpr (B - first == 3) hi |= static_cast<uint64_t>(p[first + 2]) << 16;
  } else if constexpr (B - first == 1) {
    hi = p[first];
  }
  return lo | (hi << (8 * first));
}

template <int B>
inline void decode8_scalar(const uint8_t* p, float* q) {
  const uint64_t v = load_bytes<B>(p);
  constexpr uint64_t mask = (uint64_t(1) << B) - 1;
  for (int j = 0; j < 8; ++j) q[j] = static_cast<float>((v >> (j * B)) & mask);
}

// out[m] = w . x_m for MB input rows (xsum: group sums of each row).
template <int B>
void dot_rows_scalar(
    const uint8_t* w,
    const float* s,
    const float* bias,
    const Layout& L,
    int mb,
    const float* x,
    int64_t x_stride,
    const float* xsum,
    int64_t xsum_stride,
    float* out,
    int64_t out_stride) {
  float q[8];
  const int64_t ng = L.groups();
  for (int m = 0; m < mb; ++m) out[m * out_stride] = 0.0f;
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wg = w + g * L.group * B / 8;
    for (int m = 0; m < mb; ++m) {
      const float* xg = x + m * x_stride + g * L.group;
      float acc = 0.0f;
      for (int c = 0; c < L.group; c += 8) {
        decode8_scalar<B>(wg + c * B / 8, q);
        for (int j = 0; j < 8; ++j) acc += q[j] * xg[c + j];
      }
      out[m * out_stride] += s[g] * acc + bias[g] * xsum[m * xsum_stride + g];
    }
  }
}

// acc[m][k - k0] += coef[m] * s_g * q_k for the groups [g0, g1) of one row;
// bacc[m][g - g0] += coef[m] * b_g.
template <int B>
void axpy_row_scalar(
    const uint8_t* w,
    const float* s,
    const float* bias,
    const Layout& L,
    int64_t g0,
    int64_t g1,
    int M,
    const float* coef,
    int64_t coef_stride,
    float* acc,
    int64_t acc_stride,
    float* bacc,
    int64_t bacc_stride) {
  float q[8];
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * L.group * B / 8;
    const int64_t off = (g - g0) * L.group;
    for (int c = 0; c < L.group; c += 8) {
      decode8_scalar<B>(wg + c * B / 8, q);
      for (int m = 0; m < M; ++m) {
        const float a = coef[m * coef_stride] * s[g];
        float* dst = acc + m * acc_stride + off + c;
        for (int j = 0; j < 8; ++j) dst[j] += a * q[j];
      }
    }
    for (int m = 0; m < M; ++m) bacc[m * bacc_stride + (g - g0)] += coef[m * coef_stride] * bias[g];
  }
}

template <int B>
void dequantize_row_scalar(const uint8_t* w, const float* s, const float* bias, const Layout& L, float* out) {
  float q[8];
  for (int64_t g = 0; g < L.groups(); ++g) {
    const uint8_t* wg = w + g * L.group * B / 8;
    float* o = out + g * L.group;
    for (int c = 0; c < L.group; c += 8) {
      decode8_scalar<B>(wg + c * B / 8, q);
      for (int j = 0; j < 8; ++j) o[c + j] = s[g] * q[j] + bias[g];
    }
  }
}

// ---------------------------------------------------------------------------
// AVX2 + FMA path
// ---------------------------------------------------------------------------
#if METALNN_QMM_X86

#define QMM_TARGET __attribute__((target("avx2,fma")))
#ifndef QMM_PREFETCH_AHEAD
#define QMM_PREFETCH_AHEAD 8
#endif
#define QMM_INLINE QMM_TARGET static inline __attribute__((always_inline))

// Values decoded per step and the vectors they fill.
template <int B>
struct Step {
  // 2 and 4 bits: 8 bytes -> 32 / 16 values (permuted); 8 bits: 8 values;
  // others: 8 values (natural order) from B bytes.
  static constexpr int values = (B == 2 || B == 4) ? 64 / B : 8;
  static constexpr int vectors = values / 8;
  static constexpr int bytes = values * B / 8;
};

QMM_INLINE float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Shuffle / shift tables of the generic decoder: lane j takes the four bytes
// starting at byte (j * B) / 8 and is shifted right by (j * B) % 8.
template <int B>
QMM_INLINE __m256i generic_shuffle() {
  alignas(32) int8_t idx[32];
  for (int j = 0; j < 8; ++j) {
    const int first = (j * B) / 8;
    for (int k = 0; k < 4; ++k) {
      const int byte = first + k;
      idx[(j % 4) * 4 + k + (j / 4) * 16] = byte < 8 ? static_cast<int8_t>(byte) : static_cast<int8_t>(0x80);
    }
  }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
}

template <int B>
QMM_INLINE __m256i generic_shift() {
  return _mm256_setr_epi32(0, B % 8, (2 * B) % 8, (3 * B) % 8, (4 * B) % 8, (5 * B) % 8, (6 * B) % 8,
                           (7 * B) % 8);
}

// Decoder with its constants kept in registers across a loop.
template <int B>
struct Decoder {
  __m256i shuf, shift, mask;

  QMM_TARGET Decoder() {
    mask = _mm256_set1_epi32((1 << B) - 1);
    if constexpr (!(B == 2 || B == 4 || B == 8)) {
      shuf = generic_shuffle<B>();
      shift = generic_shift<B>();
    } else {
      shuf = shift = _mm256_setzero_si256();
    }
  }

  // Decodes Step<B>::values values at p into q[Step<B>::vectors].
  QMM_TARGET inline __attribute__((always_inline)) void operator()(const uint8_t* p, __m256* q) const {
    if constexpr (B == 8) {
      q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    } else if constexpr (B == 2 || B == 4) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      for (int f = 0; f < Step<B>::vectors; ++f) {
        const __m256i field = f == 0 ? v : _mm256_srli_epi32(v, f * B);
        q[f] = _mm256_cvtepi32_ps(f == Step<B>::vectors - 1 ? field : _mm256_and_si256(field, mask));
      }
    } else {
      __m256i v = _mm256_set1_epi64x(static_cast<long long>(load_bytes<B>(p)));
      v = _mm256_shuffle_epi8(v, shuf);
      v = _mm256_and_si256(_mm256_srlv_epi32(v, shift), mask);
      q[0] = _mm256_cvtepi32_ps(v);
    }
  }
};

// Natural-order decoder of 8 values (dequantize of 2/4-bit uses it too).
template <int B>
struct NaturalDecoder {
  __m256i shuf, shift, mask;

  QMM_TARGET NaturalDecoder() {
    mask = _mm256_set1_epi32((1 << B) - 1);
    shuf = generic_shuffle<B>();
    shift = generic_shift<B>();
  }

  QMM_TARGET inline __attribute__((always_inline)) __m256 operator()(const uint8_t* p) const {
    if constexpr (B == 8) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    } else {
      __m256i v = _mm256_set1_epi64x(static_cast<long long>(load_bytes<B>(p)));
      v = _mm256_shuffle_epi8(v, shuf);
      v = _mm256_and_si256(_mm256_srlv_epi32(v, shift), mask);
      return _mm256_cvtepi32_ps(v);
    }
  }
};

// Sum of bias[g] * xsum[g] over ng groups.
QMM_INLINE float bias_dot(const float* bias, const float* xsum, int64_t ng) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= ng; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(bias + g), _mm256_loadu_ps(xsum + g), acc);
  float r = hsum(acc);
  for (; g < ng; ++g) r += bias[g] * xsum[g];
  return r;
}

// out[r * N + m * out_stride] = w_r . x_m for R consecutive weight rows (rows
// `row_bytes` apart) and MB input rows given in kernel order. Several rows at
// once share the loads of x (R > 1) or of the packed weights (MB > 1) and keep
// independent FMA chains in flight.
template <int B, int MB, int R>
QMM_TARGET void dot_rows_avx2(
    const Decoder<B>& dec,
    const uint8_t* w,
    const float* s,
    const float* bias,
    const Layout& L,
    const float* x,
    int64_t x_stride,
    const float* xsum,
    int64_t xsum_stride,
    float* out,
    int64_t out_stride) {
  constexpr int V = Step<B>::vectors;
  const int64_t ng = L.groups(), rb = L.row_bytes();
  const int G = L.group;
  __m256 tot[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) tot[r][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const float* xg = x + g * G;
    __m256 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int c = 0; c < G; c += Step<B>::values) {
      __m256 q[R][V];
      for (int r = 0; r < R; ++r) dec(w + r * rb + (g * G + c) * B / 8, q[r]);
      for (int v = 0; v < V; ++v)
        for (int m = 0; m < MB; ++m) {
          const __m256 xv = _mm256_loadu_ps(xg + m * x_stride + c + 8 * v);
          for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(q[r][v], xv, acc[r][m]);
        }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 sv = _mm256_broadcast_ss(s + r * ng + g);
      for (int m = 0; m < MB; ++m) tot[r][m] = _mm256_fmadd_ps(sv, acc[r][m], tot[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m)
      out[r + m * out_stride] = hsum(tot[r][m]) + bias_dot(bias + r * ng, xsum + m * xsum_stride, ng);
}

// acc[m][k - k0] += coef[m] * s_g * q_k over the groups [g0, g1) of one row
// (acc in kernel order); bacc[m][g - g0] += coef[m] * b_g.
template <int B>
QMM_TARGET void axpy_row_avx2(
    const Decoder<B>& dec,
    const uint8_t* w,
    const float* s,
    const float* bias,
    const Layout& L,
    int64_t g0,
    int64_t g1,
    int M,
    const float* coef,
    int64_t coef_stride,
    float* acc,
    int64_t acc_stride,
    float* bacc,
    int64_t bacc_stride) {
  constexpr int V = Step<B>::vectors;
  const int G = L.group;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * G * B / 8;
    const int64_t off = (g - g0) * G;
    for (int c = 0; c < G; c += Step<B>::values) {
      __m256 q[V];
      dec(wg + c * B / 8, q);
      for (int m = 0; m < M; ++m) {
        const float cm = coef[m * coef_stride];
        if (cm == 0.0f) continue;
        const __m256 a = _mm256_set1_ps(cm * s[g]);
        float* dst = acc + m * acc_stride + off + c;
        for (int v = 0; v < V; ++v)
          _mm256_storeu_ps(dst + 8 * v, _mm256_fmadd_ps(a, q[v], _mm256_loadu_ps(dst + 8 * v)));
      }
    }
    for (int m = 0; m < M; ++m) bacc[m * bacc_stride + (g - g0)] += coef[m * coef_stride] * bias[g];
  }
}

template <int B>
QMM_TARGET void dequantize_row_avx2(
    const NaturalDecoder<B>& dec,
    const uint8_t* w,
    const float* s,
    const float* bias,
    const Layout& L,
    float* out) {
  const int G = L.group;
  for (int64_t g = 0; g < L.groups(); ++g) {
    const uint8_t* wg = w + g * G * B / 8;
    const __m256 sv = _mm256_set1_ps(s[g]), bv = _mm256_set1_ps(bias[g]);
    float* o = out + g * G;
    for (int c = 0; c < G; c += 8) _mm256_storeu_ps(o + c, _mm256_fmadd_ps(sv, dec(wg + c * B / 8), bv));
  }
}

// Specialisation of the 4-bit dequantize: 8 bytes -> 16 values, fields
// interleaved back into natural order with byte unpacks.
template <>
QMM_TARGET inline void dequantize_row_avx2<4>(
    const NaturalDecoder<4>&,
    const uint8_t* w,
    const float* s,
    const float* bias,
    const Layout& L,
    float* out) {
  const int G = L.group;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < L.groups(); ++g) {
    const uint8_t* wg = w + g * G / 2;
    const __m256 sv = _mm256_set1_ps(s[g]), bv = _mm256_set1_ps(bias[g]);
    float* o = out + g * G;
    for (int c = 0; c < G; c += 32) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + c / 2));
      const __m128i lo = _mm_and_si128(v, m4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
      const __m128i a = _mm_unpacklo_epi8(lo, hi);  // values 0..15
      const __m128i b = _mm_unpackhi_epi8(lo, hi);  // values 16..31
      const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
      const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
      const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
      const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
      _mm256_storeu_ps(o + c, _mm256_fmadd_ps(sv, q0, bv));
      _mm256_storeu_ps(o + c + 8, _mm256_fmadd_ps(sv, q1, bv));
      _mm256_storeu_ps(o + c + 16, _mm256_fmadd_ps(sv, q2, bv));
      _mm256_storeu_ps(o + c + 24, _mm256_fmadd_ps(sv, q3, bv));
    }
  }
}

// Weight rows [r, r + R) against all input rows.
template <int B, int R>
QMM_TARGET void matvec_block_avx2(const Decoder<B>& dec, const MatvecArgs& a, int64_t r) {
  const Layout& L = a.L;
  const int64_t rb = L.row_bytes(), ng = L.groups(), K = L.K, N = a.N;
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4)
    for (int i = 0; i < R; ++i)
      dot_rows_avx2<B, 4, 1>(dec, a.w + (r + i) * rb, a.s + (r + i) * ng, a.b + (r + i) * ng, L, a.x + m * K, K,
                             a.xsum + m * ng, ng, a.out + m * N + r + i, N);
  switch (a.M - m) {
    case 3:
      for (int i = 0; i < R; ++i)
        dot_rows_avx2<B, 3, 1>(dec, a.w + (r + i) * rb, a.s + (r + i) * ng, a.b + (r + i) * ng, L, a.x + m * K, K,
                               a.xsum + m * ng, ng, a.out + m * N + r + i, N);
      break;
    case 2:
      for (int i = 0; i < R; ++i)
        dot_rows_avx2<B, 2, 1>(dec, a.w + (r + i) * rb, a.s + (r + i) * ng, a.b + (r + i) * ng, L, a.x + m * K, K,
                               a.xsum + m * ng, ng, a.out + m * N + r + i, N);
      break;
    case 1:  // one input row: R weight rows at once
      dot_rows_avx2<B, 1, R>(dec, a.w + r * rb, a.s + r * ng, a.b + r * ng, L, a.x + m * K, K, a.xsum + m * ng, ng,
                             a.out + m * N + r, N);
      break;
  }
}

// Asks for the bytes [p, p + n) to be brought into the cache.
QMM_INLINE void prefetch_range(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

template <int B>
QMM_TARGET void matvec_rows_avx2(const MatvecArgs& a, int64_t r0, int64_t r1) {
  constexpr int R = 4;
  // Rows ahead whose packed values, scales and biases are requested while the current block
  // computes, so that streaming the weights from memory overlaps the arithmetic.
  constexpr int kAhead = QMM_PREFETCH_AHEAD;
  const int64_t rb = a.L.row_bytes(), ng = a.L.groups();
  const Decoder<B> dec;
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    if (kAhead > 0 && r + kAhead + R <= r1) {
      prefetch_range(a.w + (r + kAhead) * rb, R * rb);
      prefetch_range(a.s + (r + kAhead) * ng, R * ng * 4);
      prefetch_range(a.b + (r + kAhead) * ng, R * ng * 4);
    }
    matvec_block_avx2<B, R>(dec, a, r);
  }
  for (; r < r1; ++r) matvec_block_avx2<B, 1>(dec, a, r);
}

template <int B>
QMM_TARGET void axpy_columns_avx2(const AxpyArgs& a, int64_t g0, int64_t g1, float* acc, int64_t width,
                                  float* bacc, int64_t span) {
  const int64_t rb = a.L.row_bytes(), ng = a.L.groups();
  const Decoder<B> dec;
  for (int64_t n = 0; n < a.N; ++n)
    axpy_row_avx2<B>(dec, a.w + n * rb, a.s + n * ng, a.b + n * ng, a.L, g0, g1, static_cast<int>(a.M), a.g + n,
                     a.N, acc, width, bacc, span);
}

template <int B>
QMM_TARGET void dequantize_rows_avx2(const Layout& L, const uint8_t* w, const float* s, const float* b, float* out,
                                     int64_t r0, int64_t r1) {
  const int64_t rb = L.row_bytes(), ng = L.groups(), K = L.K;
  const NaturalDecoder<B> dec;
  for (int64_t r = r0; r < r1; ++r) dequantize_row_avx2<B>(dec, w + r * rb, s + r * ng, b + r * ng, L, out + r * K);
}

#endif  // METALNN_QMM_X86

// ---------------------------------------------------------------------------
// Range drivers (one call per thread chunk)
// ---------------------------------------------------------------------------

// out[m, r] = W[r] . x_m for the weight rows [r0, r1).
template <int B>
void matvec_rows(const MatvecArgs& a, int64_t r0, int64_t r1, bool avx2) {
#if METALNN_QMM_X86
  if (avx2) return matvec_rows_avx2<B>(a, r0, r1);
#endif
  (void)avx2;
  const Layout& L = a.L;
  const int64_t rb = L.row_bytes(), ng = L.groups(), K = L.K, N = a.N;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t m = 0; m < a.M; m += 4) {
      const int mb = static_cast<int>(std::min<int64_t>(4, a.M - m));
      dot_rows_scalar<B>(a.w + r * rb, a.s + r * ng, a.b + r * ng, L, mb, a.x + m * K, K, a.xsum + m * ng, ng,
                         a.out + m * N + r, N);
    }
  }
}

// The columns of the groups [g0, g1) of the transposed product.
template <int B>
void axpy_columns(const AxpyArgs& a, int64_t g0, int64_t g1, bool avx2) {
  const Layout& L = a.L;
  const int64_t rb = L.row_bytes(), ng = L.groups(), K = L.K;
  const int64_t width = (g1 - g0) * L.group, span = g1 - g0;
  std::vector<float> acc(static_cast<size_t>(a.M * width), 0.0f);
  std::vector<float> bacc(static_cast<size_t>(a.M * span), 0.0f);
  const int block = block_perm(B, avx2);
#if METALNN_QMM_X86
  if (avx2) {
    axpy_columns_avx2<B>(a, g0, g1, acc.data(), width, bacc.data(), span);
  } else
#endif
  {
    for (int64_t n = 0; n < a.N; ++n)
      axpy_row_scalar<B>(a.w + n * rb, a.s + n * ng, a.b + n * ng, L, g0, g1, static_cast<int>(a.M), a.g + n, a.N,
                         acc.data(), width, bacc.data(), span);
  }
  for (int64_t m = 0; m < a.M; ++m) {
    const float* src = acc.data() + m * width;
    float* dst = a.out + m * K + g0 * L.group;
    for (int64_t j = 0; j < span; ++j) {
      const float bj = bacc[m * span + j];
      const float* sg = src + j * L.group;
      float* dg = dst + j * L.group;
      if (block == 0) {
        for (int i = 0; i < L.group; ++i) dg[i] = sg[i] + bj;
      } else {
        for (int c = 0; c < L.group; c += block)
          for (int i = 0; i < block; ++i) dg[c + perm_source(i, B)] = sg[c + i] + bj;
      }
    }
  }
}

// out[r] = dequantized W[r] (natural order) for the rows [r0, r1).
template <int B>
void dequantize_rows(const Layout& L, const uint8_t* w, const float* s, const float* b, float* out, int64_t r0,
                     int64_t r1, bool avx2) {
#if METALNN_QMM_X86
  if (avx2) return dequantize_rows_avx2<B>(L, w, s, b, out, r0, r1);
#endif
  (void)avx2;
  const int64_t rb = L.row_bytes(), ng = L.groups(), K = L.K;
  for (int64_t r = r0; r < r1; ++r) dequantize_row_scalar<B>(w + r * rb, s + r * ng, b + r * ng, L, out + r * K);
}

// Copies input row x (natural order, K values) to dst in kernel order and
// writes its group sums.
inline void prepare_row(const float* x, float* dst, float* xsum, const Layout& L, int block) {
  const int64_t ng = L.groups();
  for (int64_t g = 0; g < ng; ++g) {
    const float* xg = x + g * L.group;
    float t = 0.0f;
    for (int i = 0; i < L.group; ++i) t += xg[i];
    xsum[g] = t;
  }
  if (block == 0) {
    std::memcpy(dst, x, static_cast<size_t>(L.K) * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < L.K; c += block)
    for (int i = 0; i < block; ++i) dst[c + i] = x[c + perm_source(i, L.bits)];
}

inline bool supported_bits(int bits) {
  return bits >= 1 && bits <= 8 && bits != 7;
}

// Calls F<bits>::run(args...) for bits in 1..6 and 8.
template <template <int> class F, typename... Args>
void dispatch_bits(int bits, Args&&... args) {
  switch (bits) {
    case 1:
      return F<1>::run(std::forward<Args>(args)...);
    case 2:
      return F<2>::run(std::forward<Args>(args)...);
    case 3:
      return F<3>::run(std::forward<Args>(args)...);
    case 4:
      return F<4>::run(std::forward<Args>(args)...);
    case 5:
      return F<5>::run(std::forward<Args>(args)...);
    case 6:
      return F<6>::run(std::forward<Args>(args)...);
    case 8:
      return F<8>::run(std::forward<Args>(args)...);
  }
  throw std::invalid_argument("quantized kernels: unsupported bit width");
}

template <int B>
struct MatvecRows {
  static void run(const MatvecArgs& a, int64_t r0, int64_t r1, bool avx2) {
    matvec_rows<B>(a, r0, r1, avx2);
  }
};

template <int B>
struct AxpyColumns {
  static void run(const AxpyArgs& a, int64_t g0, int64_t g1, bool avx2) {
    axpy_columns<B>(a, g0, g1, avx2);
  }
};

template <int B>
struct DequantizeRows {
  static void run(const Layout& L, const uint8_t* w, const float* s, const float* b, float* out, int64_t r0,
                  int64_t r1, bool avx2) {
    dequantize_rows<B>(L, w, s, b, out, r0, r1, avx2);
  }
};

}  // namespace metalnn_qmm
