// Products with GGML-packed matrices on the CPU (float32 math) and their dequantization.
//
// W [N, K] is stored as rows of blocks (ggml_types.h). Three ways to compute out = x @ W.T:
//
// * Registers (AVX2+FMA, the common types, up to `register_rows_setting` input rows): each
//   block's quantized values are decoded 32 at a time into one register of int8 (the "chunk": the
//   values' integer levels, with any constant offset of the format already subtracted), widened
//   to float with shifts (in a fixed "kernel order", the input rows permuted to match) and
//   multiplied into the input rows; the sub-block scales multiply those partial sums, and the
//   formats with a minimum add bias * (sum of the input over the sub-block), so the inner loop
//   is decode + FMA.
// * Decoded rows (every type, more input rows): a few weight rows are dequantized into a small
//   buffer (exactly as `dequantize` writes them) and multiplied as a float tile, so the decoding
//   is paid once for all the input rows.
// * Portable: the decoded-rows product in plain C++ (no x86, or the AVX2 kernels switched off).
//
// Dequantize writes the same floats as the MLX decoders of metalnn/ggml: scale * q (+ bias) with
// one rounding for the product and one for the sum, in both the AVX2 and the portable path.
//
// Every AVX2 routine has per-function target attributes (the translation unit needs no -march)
// and is chosen at run time (`use_avx2`).
#pragma once

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ggml_types.h"

#if defined(__x86_64__) || defined(_M_X64)
#define METALNN_GGML_X86 1
#include <immintrin.h>
#else
#define METALNN_GGML_X86 0
#endif

namespace metalnn_ggml {

inline bool cpu_has_avx2() {
#if METALNN_GGML_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
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

// Input rows up to which the register kernels run (above: the decoded-rows product, faster from
// 5-8 rows on as measured on SmolLM2's shapes; tests set it to cover both).
inline std::atomic<int>& register_rows_setting() {
  static std::atomic<int> rows{4};
  return rows;
}

// Input rows up to which the register kernels take the input quantized to int8, as llama.cpp's
// products do: each 32 values of an input row (256 for the K-quants with their own loops:
// int8_input_run) become int8 levels and one float scale, max|x| / 127, and a block's products are
// integer dot products scaled once. Faster (1.25-1.5x single-threaded,
// scripts/bench_products_llamacpp.py) but less exact: on the bundled
// SmolLM2-135M Q4_1 the greedy continuation of "The capital of France is" stays " Paris." and then
// goes another way. Default 0 (the input stays float32); METALNN_GGML_INT8_ROWS=<rows> sets it.
inline int default_int8_rows() {
  const char* env = std::getenv("METALNN_GGML_INT8_ROWS");
  return env != nullptr ? std::max(0, std::atoi(env)) : 0;
}

inline std::atomic<int>& int8_rows_setting() {
  static std::atomic<int> rows{default_int8_rows()};
  return rows;
}

// Whether the register kernels of the types with an int8 loop (ggml_int8_rows.h: Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) take float inputs of one or two rows as two int8 levels ("split
// inputs"): each run of int8_input_run values (32; 256 for the K-quants) becomes
// X = round(x * 127 * 254 / max|x|), a 16-bit level (|X| <= 32258), written as X = 254 a + b with
// a = round(X / 254) and b = X - 254 a (both int8, |b| <= 127), so x ~ (d / 254) (254 a + b) with
// d = max|x| / 127 (a: llama.cpp's Q8_0 / Q8_K input) and every value is within d / 508 of x (one int8
// level: d / 2). The products run as integer dot products with both levels, combined in integers
// (ggml_int8_rows.h), 1.2-1.6x the float kernel from memory with one row; a product is within ~3e-6
// of sum |w x| (measured on random rows of 2048; one int8 level: ~4e-3, float32 inputs: ~2e-8).
// Default on; METALNN_GGML_SPLIT_INPUTS=0 (or `metalnn.cpu.ggml.set_split_inputs(False)`) keeps
// every product's input float32.
inline bool default_split_inputs() {
  const char* env = std::getenv("METALNN_GGML_SPLIT_INPUTS");
  return env == nullptr || std::atoi(env) != 0;
}

inline std::atomic<bool>& split_inputs_setting() {
  static std::atomic<bool> on{default_split_inputs()};
  return on;
}

inline bool use_avx2() {
  return cpu_has_avx2() && !force_scalar_flag().load();
}

// One product out [M, N] = x [M, K] @ W.T (x float32 row-contiguous).
struct MatmulArgs {
  const TypeInfo* type;
  const uint8_t* w;  // [N, row_bytes]
  int64_t N, K, M;
  const float* x;  // [M, K] (register kernels: in kernel order where register_kernel_order says so)
  const float* xsum;  // [M, K / sub] sums of x over each sub-block (formats with a minimum)
  int64_t sub;  // values a sub-block (0: no sums)
  float* out;  // [M, N]
  const int8_t* xq = nullptr;  // [M, K] the input quantized to int8 (the int8 register kernels), or null
  const float* xd = nullptr;  // [M, K / xrun] the scale of each xrun values of xq
  int64_t xrun = 32;  // values per scale of xq (int8_input_run)
  const int16_t* xsum16 = nullptr;  // [M, K / 16] sums of xq over each 16 values (Q6_K's int8 loop)
  // split inputs (split_inputs_setting): the second level, x ~ xd * (xq + xq2 / 254), or null
  const int8_t* xq2 = nullptr;  // [M, K]
  const int16_t* xsum16_2 = nullptr;  // [M, K / 16] sums of xq2 over each 16 values (Q6_K)
  int64_t row_bytes() const {
    return K / type->block * type->size;
  }
};

// Values per sub-block sum the register kernel of a type reads (0: none).
inline int64_t bias_sub(int id) {
  switch (id) {
    case kQ4_1:
    case kQ5_1:
    case kQ4_K:
    case kQ5_K:
      return 32;
    case kQ2_K:
      return 16;
  }
  return 0;
}

// dst = x in kernel order: within every 32 values, dst[8 k + l] = x[4 l + k] (K a multiple of 32).
inline void permute_chunks(const float* x, float* dst, int64_t K) {
  for (int64_t c = 0; c < K; c += 32)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 8; ++l) dst[c + 8 * k + l] = x[c + 4 * l + k];
}

inline bool has_register_kernel(int id) {
  switch (id) {
    case kQ4_0:
    case kQ4_1:
    case kQ5_0:
    case kQ5_1:
    case kQ8_0:
    case kQ2_K:
    case kQ3_K:
    case kQ4_K:
    case kQ5_K:
    case kQ6_K:
    case kIQ4_NL:
    case kIQ4_XS:
    case kMXFP4:
    case kTQ2_0:
      return true;
  }
  return false;
}

// ---------------------------------------------------------------------------
// Portable path
// ---------------------------------------------------------------------------

inline void decode_row_portable(const TypeInfo& t, const uint8_t* row, int64_t K, float* y) {
  const BlockDecoder dec = portable_decoder(t.id);
  for (int64_t b = 0, nb = K / t.block; b < nb; ++b) dec(row + b * t.size, y + b * t.block);
}

inline float dot_portable(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void matmul_rows_portable(const MatmulArgs& a, int64_t r0, int64_t r1) {
  std::vector<float> buf(static_cast<size_t>(a.K));
  const int64_t rb = a.row_bytes();
  for (int64_t r = r0; r < r1; ++r) {
    decode_row_portable(*a.type, a.w + r * rb, a.K, buf.data());
    for (int64_t m = 0; m < a.M; ++m) a.out[m * a.N + r] = dot_portable(buf.data(), a.x + m * a.K, a.K);
  }
}

// ---------------------------------------------------------------------------
// AVX2 + FMA path
// ---------------------------------------------------------------------------
#if METALNN_GGML_X86

#define GGML_TARGET __attribute__((target("avx2,fma,f16c")))
#define GGML_INLINE GGML_TARGET inline __attribute__((always_inline))

GGML_INLINE float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

GGML_INLINE float h2f(const uint8_t* p) {
  return _cvtsh_ss(rd16(p));
}

GGML_INLINE __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

GGML_INLINE __m128i load128(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// How far ahead of the block being multiplied a decoding product asks for its weight row's bytes:
// the hardware prefetcher alone left the single-row products waiting on memory (measured on 8192 x
// 2048 weights, two threads, alternated runs: float inputs 1.1-1.3x faster, the K-quants' int8 loops
// 1.1x; README, "Prefetching the weights' rows").
constexpr int64_t PREFETCH_AHEAD = 1536;

// Asks for every cache line of the block of TS bytes at p, PREFETCH_AHEAD bytes on (a prefetch
// past the end of a buffer is harmless: it never faults).
template <int TS>
GGML_INLINE void prefetch_block_ahead(const uint8_t* p) {
  for (int o = 0; o < TS; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_AHEAD + o), _MM_HINT_T0);
}

// 16 bytes of the legacy nibble layout -> 32 values 0..15 (value j: low nibble of byte j; j + 16:
// high nibble).
GGML_INLINE __m256i nibbles_32(const uint8_t* p) {
  const __m256i both = _mm256_broadcastsi128_si256(load128(p));
  return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

// The 32 bits of a u32 as 32 bytes: 0xFF where the bit is set.
GGML_INLINE __m256i bits_to_bytes(uint32_t x) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// A 16-entry int8 table in both lanes (for _mm256_shuffle_epi8).
GGML_INLINE __m256i table16(const int8_t* t) {
  return _mm256_broadcastsi128_si256(load128(reinterpret_cast<const uint8_t*>(t)));
}

// ---------------------------------------------------------------------------
// The formats, as chunks of 32 int8 levels. Each type gives
//   QK, TS           block_size and type_size
//   SUB              values per scale (16, 32, or the whole block)
//   MIN              whether values carry a bias (a minimum) per sub-block
//   params(b, sc, bias)      the sub-block scales and biases (the floats the MLX decoder uses)
//   chunks(b, sink)          sink(q, i) for each 32 values 32 i .. 32 i + 31 (int8 levels in q),
//                            or sink.mem(p, i) with the 32 int8 levels at p
// value = sc[s] * q (+ bias[s]).
//
// The register kernel widens a chunk with shifts only, which yields its values in "kernel
// order" (vector k, lane l: value 4 l + k of the chunk); the input rows are permuted the same
// way once per call (`permute_chunks`). Q8_0 reads its int8 values from memory in natural order
// (NATURAL) and takes the input rows as they are.
// ---------------------------------------------------------------------------

// The 4-bit formats whose levels are plain nibbles (Q4_0, Q4_1, Q4_K) also give
//   float_chunks(b, sink)    sink.nibbles<N, OFFSET>(p, lo, hi, i_lo, i_hi): N bytes at p whose low
//                            nibbles are values lo .. lo + N - 1 of the block (scale of chunk i_lo)
//                            and high nibbles values hi .. hi + N - 1 (chunk i_hi), minus OFFSET
// for the float register kernel, which widens them straight from memory in natural order (a zero-
// extending load of 8 bytes to 8 lanes, a mask and a shift) instead of going through int8 chunks.

struct FQ4_0 {
  static constexpr int QK = 32, TS = 18, SUB = 32;
  static constexpr bool MIN = false;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float*) {
    sc[0] = h2f(b);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    s(_mm256_sub_epi8(nibbles_32(b + 2), _mm256_set1_epi8(8)), 0);
  }
  template <class S>
  GGML_INLINE static void float_chunks(const uint8_t* b, S& s) {
    s.template nibbles<16, 8>(b + 2, 0, 16, 0, 0);
  }
};

struct FQ4_1 {
  static constexpr int QK = 32, TS = 20, SUB = 32;
  static constexpr bool MIN = true;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float* bias) {
    sc[0] = h2f(b);
    bias[0] = h2f(b + 2);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    s(nibbles_32(b + 4), 0);
  }
  template <class S>
  GGML_INLINE static void float_chunks(const uint8_t* b, S& s) {
    s.template nibbles<16, 0>(b + 4, 0, 16, 0, 0);
  }
};

struct FQ5_0 {
  static constexpr int QK = 32, TS = 22, SUB = 32;
  static constexpr bool MIN = false;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float*) {
    sc[0] = h2f(b);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    // q - 16 as int8: the nibble where the fifth bit is set, else the nibble with 0xF0 set
    const __m256i hb = bits_to_bytes(rd32(b + 2));
    s(_mm256_or_si256(nibbles_32(b + 6), _mm256_andnot_si256(hb, _mm256_set1_epi8(static_cast<char>(0xF0)))), 0);
  }
};

struct FQ5_1 {
  static constexpr int QK = 32, TS = 24, SUB = 32;
  static constexpr bool MIN = true;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float* bias) {
    sc[0] = h2f(b);
    bias[0] = h2f(b + 2);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    const __m256i hb = bits_to_bytes(rd32(b + 4));
    s(_mm256_or_si256(nibbles_32(b + 8), _mm256_and_si256(hb, _mm256_set1_epi8(0x10))), 0);
  }
};

struct FQ8_0 {
  static constexpr int QK = 32, TS = 34, SUB = 32;
  static constexpr bool MIN = false, NATURAL = true;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float*) {
    sc[0] = h2f(b);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    s.mem(reinterpret_cast<const int8_t*>(b + 2), 0);
  }
};

struct FIQ4_NL {
  static constexpr int QK = 32, TS = 18, SUB = 32;
  static constexpr bool MIN = false;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float*) {
    sc[0] = h2f(b);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    s(_mm256_shuffle_epi8(table16(kValuesIQ4NL), nibbles_32(b + 2)), 0);
  }
};

struct FMXFP4 {
  static constexpr int QK = 32, TS = 17, SUB = 32;
  static constexpr bool MIN = false;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float*) {
    sc[0] = e8m0_half(b[0]);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    s(_mm256_shuffle_epi8(table16(kValuesMXFP4), nibbles_32(b + 1)), 0);
  }
};

// Bits [2s, 2s + 2) of each byte of v.
GGML_INLINE __m256i crumbs(__m256i v, int s) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
}

struct FQ2_K {
  static constexpr int QK = 256, TS = 84, SUB = 16;
  static constexpr bool MIN = true;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float* bias) {
    const __m128i raw = load128(b);
    const __m256 d = _mm256_set1_ps(h2f(b + 80)), dmin = _mm256_set1_ps(h2f(b + 82));
    const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int h = 0; h < 2; ++h) {
      const __m128i l8 = h ? _mm_srli_si128(lo, 8) : lo, m8 = h ? _mm_srli_si128(hi, 8) : hi;
      _mm256_storeu_ps(sc + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l8))));
      const __m256 ml = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8)));
      _mm256_storeu_ps(bias + 8 * h, _mm256_xor_ps(ml, sign));
    }
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load256(b + 16 + 32 * h);
      for (int k = 0; k < 4; ++k) s(crumbs(v, k), 4 * h + k);
    }
  }
};

// Q3_K's 16 sub-block scales (params_q3k of ggml_types.h) in SSE registers: scale i is
// (low | high << 4) - 32 times d, low the low nibble of s[i] (i < 8) or the high nibble of s[i - 8],
// high bits 2 (i / 4) .. 2 (i / 4) + 1 of s[8 + i % 4] (s: the 12 bytes at b + 96). The same
// values; in-cache products with float inputs ran 1.2-1.4x faster than with the scalar loop.
GGML_INLINE void params_q3k_avx2(const uint8_t* b, float* sc) {
  const __m128i s = _mm_srli_si128(load128(b + 94), 2);  // s[0..11] (+ d): 16 bytes inside the 110
  const __m128i m4 = _mm_set1_epi8(15);
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(s, m4), _mm_and_si128(_mm_srli_epi16(s, 4), m4));
  // s[8..11] in each 32-bit lane k, shifted right by 2k: bits 2k, 2k + 1 of each byte at the bottom
  const __m128i h = _mm_shuffle_epi8(s, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
  const __m128i high = _mm_and_si128(_mm_srlv_epi32(h, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
  const __m128i v = _mm_or_si128(low, _mm_slli_epi16(high, 4));  // 0..63 (no bit crosses a byte)
  const __m256 d = _mm256_set1_ps(h2f(b + 108));
  const __m256i off = _mm256_set1_epi32(32);
  _mm256_storeu_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(v), off))));
  _mm256_storeu_ps(sc + 8, _mm256_mul_ps(
      d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)), off))));
}

struct FQ3_K {
  static constexpr int QK = 256, TS = 110, SUB = 16;
  static constexpr bool MIN = false;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float*) {
    params_q3k_avx2(b, sc);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    const __m256i hm = load256(b);
    const __m256i four = _mm256_set1_epi8(4);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load256(b + 32 + 32 * h);
      for (int k = 0; k < 4; ++k) {
        const int i = 4 * h + k;
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << i));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
        s(_mm256_sub_epi8(crumbs(v, k), _mm256_andnot_si256(set, four)), i);
      }
    }
  }
};

// The 6-bit sub-block scales and minimums of a Q4_K / Q5_K block as bytes: scales[8], mins[8].
// The 12 packed bytes q (at b + 4; ggml's get_scale_min_k4): scale j < 4 is q[j] & 63, minimum
// j < 4 is q[j + 4] & 63; scale j >= 4 is (q[j + 4] & 15) | (q[j - 4] >> 6) << 4, minimum j >= 4 is
// (q[j + 4] >> 4) | (q[j] >> 6) << 4. In SSE registers, all sixteen at once (the scalar form took a
// tenth of a Q4_K decoding product with float inputs; the same bytes).
GGML_INLINE __m128i k4_scale_bytes(const uint8_t* b) {
  const __m128i q = load128(b + 4);  // bytes 0..11 used (a block is 144 or 176 bytes)
  const __m128i low6 = _mm_and_si128(q, _mm_set1_epi8(63));  // scales 0-3, minimums 0-3
  // q[8..11] twice: low nibbles (scales 4-7), then high nibbles (minimums 4-7)
  const __m128i q8 = _mm_shuffle_epi8(q, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m128i nibbles = _mm_and_si128(_mm_blend_epi16(q8, _mm_srli_epi16(q8, 4), 0x0C), _mm_set1_epi8(15));
  // (q[0..7] >> 6) << 4: the top two bits of scales 4-7 (from q[0..3]) and minimums 4-7 (q[4..7])
  const __m128i top = _mm_srli_epi16(_mm_and_si128(q, _mm_set1_epi8(static_cast<char>(0xC0))), 2);
  const __m128i high = _mm_or_si128(nibbles, top);  // scales 4-7, minimums 4-7
  return _mm_unpacklo_epi32(low6, high);  // scales 0-3, 4-7, minimums 0-3, 4-7
}

GGML_INLINE void params_k4_avx2(const uint8_t* b, float* sc, float* bias) {
  const __m128i raw = k4_scale_bytes(b);  // scales[8], mins[8]
  const __m256 d = _mm256_set1_ps(h2f(b)), dmin = _mm256_set1_ps(h2f(b + 2));
  _mm256_storeu_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw))));
  const __m256 ml = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))));
  _mm256_storeu_ps(bias, _mm256_xor_ps(ml, _mm256_set1_ps(-0.0f)));
}

struct FQ4_K {
  static constexpr int QK = 256, TS = 144, SUB = 32;
  static constexpr bool MIN = true;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float* bias) {
    params_k4_avx2(b, sc, bias);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load256(b + 16 + 32 * c);
      s(_mm256_and_si256(v, m4), 2 * c);
      s(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), 2 * c + 1);
    }
  }
  template <class S>
  GGML_INLINE static void float_chunks(const uint8_t* b, S& s) {
    for (int c = 0; c < 4; ++c) s.template nibbles<32, 0>(b + 16 + 32 * c, 64 * c, 64 * c + 32, 2 * c, 2 * c + 1);
  }
};

// Bit i of each byte moved to bit 4 (other bits of the bytes are left over: mask with 0x10). The
// 16-bit shifts by at most 4 bring bit 4 of each byte from the same byte.
GGML_INLINE __m256i bit_to_4(__m256i v, int i) {
  return i <= 4 ? _mm256_sll_epi16(v, _mm_cvtsi32_si128(4 - i)) : _mm256_srl_epi16(v, _mm_cvtsi32_si128(i - 4));
}

struct FQ5_K {
  static constexpr int QK = 256, TS = 176, SUB = 32;
  static constexpr bool MIN = true;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float* bias) {
    params_k4_avx2(b, sc, bias);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m16 = _mm256_set1_epi8(0x10);
    const __m256i qh = load256(b + 16);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load256(b + 48 + 32 * c);
      s(_mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(bit_to_4(qh, 2 * c), m16)), 2 * c);
      s(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(bit_to_4(qh, 2 * c + 1), m16)),
        2 * c + 1);
    }
  }
};

struct FQ6_K {
  static constexpr int QK = 256, TS = 210, SUB = 16;
  static constexpr bool MIN = false;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float*) {
    const __m256 d = _mm256_set1_ps(h2f(b + 208));
    const __m128i raw = load128(b + 192);
    _mm256_storeu_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw))));
    _mm256_storeu_ps(sc + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)))));
  }
  // The levels 0..63 as stored (the int8 loop takes them so and subtracts 32 * sum(x) once a block).
  template <class S>
  GGML_INLINE static void unsigned_chunks(const uint8_t* b, S& s) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load256(b + 64 * h), l1 = load256(b + 64 * h + 32);
      const __m256i qh = load256(b + 128 + 32 * h);
      // values 128 h + 32 t + j: nibble t / 2 of ql[64 h + 32 (t % 2) + j], bits 2t of qh[32 h + j]
      const __m256i hi0 = _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30);
      const __m256i hi1 = _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30);
      const __m256i hi2 = _mm256_and_si256(qh, m30);
      const __m256i hi3 = _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30);
      s(_mm256_or_si256(_mm256_and_si256(l0, m4), hi0), 4 * h);
      s(_mm256_or_si256(_mm256_and_si256(l1, m4), hi1), 4 * h + 1);
      s(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), hi2), 4 * h + 2);
      s(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), hi3), 4 * h + 3);
    }
  }
  template <class S>
  struct Minus32 {  // hands on the levels - 32
    S& s;
    GGML_INLINE void operator()(__m256i v, int i) {
      s(_mm256_sub_epi8(v, _mm256_set1_epi8(32)), i);
    }
  };
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    Minus32<S> minus32{s};
    unsigned_chunks(b, minus32);
  }
};

// IQ4_XS's 8 sub-block scales (params_iq4xs of ggml_types.h) in AVX2 registers: scale i is
// (the i-th nibble of b[4..7] | bits 2i, 2i + 1 of the 16 at b + 2, << 4) - 32, times d. The same values.
GGML_INLINE void params_iq4xs_avx2(const uint8_t* b, float* sc) {
  const __m128i l = _mm_cvtsi32_si128(static_cast<int>(rd32(b + 4)));
  const __m128i m4 = _mm_set1_epi8(15);
  const __m128i low = _mm_unpacklo_epi8(_mm_and_si128(l, m4), _mm_and_si128(_mm_srli_epi16(l, 4), m4));
  const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(rd16(b + 2)),
                                                          _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                        _mm256_set1_epi32(3));
  const __m256i v = _mm256_or_si256(_mm256_cvtepu8_epi32(low), _mm256_slli_epi32(high, 4));
  _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_set1_ps(h2f(b)),
                                     _mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(32)))));
}

struct FIQ4_XS {
  static constexpr int QK = 256, TS = 136, SUB = 32;
  static constexpr bool MIN = false;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float*) {
    params_iq4xs_avx2(b, sc);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    const __m256i t = table16(kValuesIQ4NL);
    for (int i = 0; i < 8; ++i) s(_mm256_shuffle_epi8(t, nibbles_32(b + 8 + 16 * i)), i);
  }
};

struct FTQ2_0 {
  static constexpr int QK = 256, TS = 66, SUB = 256;
  static constexpr bool MIN = false;
  GGML_INLINE static void params(const uint8_t* b, float* sc, float*) {
    sc[0] = h2f(b + 64);
  }
  template <class S>
  GGML_INLINE static void chunks(const uint8_t* b, S& s) {
    const __m256i one = _mm256_set1_epi8(1);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load256(b + 32 * h);
      for (int k = 0; k < 4; ++k) s(_mm256_sub_epi8(crumbs(v, k), one), 4 * h + k);
    }
  }
};

// The int8 levels of a chunk as four vectors of 8 floats.
GGML_INLINE void widen(__m256i q, __m256* f) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
  f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
}

// The int8 levels of a chunk as four vectors of 8 floats in kernel order: f[k] lane l is level
// 4 l + k (byte k of 32-bit lane l, sign-extended by shifts; no cross-lane shuffles).
GGML_INLINE void widen_perm(__m256i q, __m256* f) {
  f[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(q, 24), 24));
  f[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(q, 16), 24));
  f[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(q, 8), 24));
  f[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(q, 24));
}

GGML_INLINE void widen_mem(const int8_t* p, __m256* f) {
  for (int v = 0; v < 4; ++v)
    f[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v))));
}

template <class T>
constexpr bool natural_order() {
  if constexpr (requires { T::NATURAL; }) {
    return T::NATURAL;
  } else {
    return false;
  }
}

// Sink of the register product: acc[m] += sc * (chunk . x_m) for MB input rows (x in kernel
// order unless the type reads its values in natural order).
template <class T, int MB>
struct DotSink {
  const float* x;  // the block's first value in input row 0
  int64_t ldx;
  const float* sc;
  __m256 acc[MB];
  const float* x0;  // input row 0's first value

  // Input rows m .. m + MB - 1 of the product; then block b of them.
  GGML_INLINE void start(const MatmulArgs& a, int64_t m) {
    x0 = a.x + m * a.K;
    ldx = a.K;
  }
  GGML_INLINE void at_block(int64_t b) {
    x = x0 + b * T::QK;
  }

  GGML_INLINE void add(const __m256* f, int i) {
    const float* xc = x + 32 * i;
    __m256 scale;
    if constexpr (T::SUB == 16) {
      // in kernel order lanes 0-3 hold values of the chunk's first 16, lanes 4-7 of its last 16:
      // the scale vector is [sc[2i]] * 4 + [sc[2i + 1]] * 4
      static_assert(!natural_order<T>());
      const __m256i pick =
          _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_set1_epi32(2 * (i % 4)));
      scale = _mm256_permutevar8x32_ps(_mm256_load_ps(sc + 8 * (i / 4)), pick);
    } else {
      scale = _mm256_broadcast_ss(sc + (32 * i) / T::SUB);
    }
    for (int m = 0; m < MB; ++m) {
      const float* xm = xc + m * ldx;
      __m256 s0 = _mm256_mul_ps(f[0], _mm256_loadu_ps(xm));
      __m256 s1 = _mm256_mul_ps(f[1], _mm256_loadu_ps(xm + 8));
      s0 = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xm + 16), s0);
      s1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xm + 24), s1);
      acc[m] = _mm256_fmadd_ps(scale, _mm256_add_ps(s0, s1), acc[m]);
    }
  }
  GGML_INLINE void operator()(__m256i q, int i) {
    __m256 f[4];
    widen_perm(q, f);
    add(f, i);
  }
  GGML_INLINE void mem(const int8_t* p, int i) {
    __m256 f[4];
    widen_mem(p, f);
    add(f, i);
  }
  // See float_chunks (the formats with plain nibbles; x in natural order, SUB 32).
  template <int N, int OFFSET>
  GGML_INLINE void nibbles(const uint8_t* p, int lo, int hi, int i_lo, int i_hi) {
    static_assert(N % 8 == 0 && T::SUB == 32);
    const __m256i m4 = _mm256_set1_epi32(0x0F), off = _mm256_set1_epi32(OFFSET);
    __m256 flo[N / 8], fhi[N / 8];
    for (int t = 0; t < N / 8; ++t) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * t)));
      __m256i l = _mm256_and_si256(b, m4), h = _mm256_srli_epi32(b, 4);
      if constexpr (OFFSET != 0) {
        l = _mm256_sub_epi32(l, off);
        h = _mm256_sub_epi32(h, off);
      }
      flo[t] = _mm256_cvtepi32_ps(l);
      fhi[t] = _mm256_cvtepi32_ps(h);
    }
    const __m256 s_lo = _mm256_broadcast_ss(sc + i_lo), s_hi = _mm256_broadcast_ss(sc + i_hi);
    for (int m = 0; m < MB; ++m) {
      const float* xm = x + m * ldx;
      __m256 a_lo = _mm256_mul_ps(flo[0], _mm256_loadu_ps(xm + lo));
      __m256 a_hi = _mm256_mul_ps(fhi[0], _mm256_loadu_ps(xm + hi));
      for (int t = 1; t < N / 8; ++t) {
        a_lo = _mm256_fmadd_ps(flo[t], _mm256_loadu_ps(xm + lo + 8 * t), a_lo);
        a_hi = _mm256_fmadd_ps(fhi[t], _mm256_loadu_ps(xm + hi + 8 * t), a_hi);
      }
      if (i_lo == i_hi) {
        acc[m] = _mm256_fmadd_ps(s_lo, _mm256_add_ps(a_lo, a_hi), acc[m]);
      } else {
        acc[m] = _mm256_fmadd_ps(s_lo, a_lo, acc[m]);
        acc[m] = _mm256_fmadd_ps(s_hi, a_hi, acc[m]);
      }
    }
  }
};

// Whether the float register kernel of type T reads plain nibbles (float_chunks; x in natural order).
template <class T>
constexpr bool float_nibbles() {
  return requires(const uint8_t* b, DotSink<T, 1>& s) { T::float_chunks(b, s); };
}

// out[m * ldo] = row . x_m for the sink's MB input rows (xs: their sub-block sums, for the formats
// with a bias). The sink (`DotSink`: float32 inputs; `IntDotSink`: int8 levels) multiplies the
// chunks; the bias terms are the same for both.
template <class T, int MB, class Sink>
GGML_TARGET void dot_row(const uint8_t* row, int64_t nblocks, Sink& sink, const float* xs, int64_t ldxs, float* out,
                         int64_t ldo) {
  constexpr int NS = T::QK / T::SUB;
  alignas(32) float sc[NS], bias[NS];
  sink.sc = sc;
  __m256 bacc[MB];
  float bsum[MB];
  for (int m = 0; m < MB; ++m) {
    sink.acc[m] = _mm256_setzero_ps();
    bacc[m] = _mm256_setzero_ps();
    bsum[m] = 0.0f;
  }
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* p = row + b * T::TS;
    prefetch_block_ahead<T::TS>(p);
    T::params(p, sc, bias);
    sink.at_block(b);
    if constexpr (requires { sink.block_params(); }) sink.block_params();
    if constexpr (std::is_same_v<Sink, DotSink<T, MB>> && float_nibbles<T>()) {
      T::float_chunks(p, sink);
    } else {
      T::chunks(p, sink);
    }
    if constexpr (T::MIN) {
      const float* xb = xs + b * NS;
      for (int m = 0; m < MB; ++m) {
        if constexpr (NS % 8 == 0) {
          for (int v = 0; v < NS; v += 8)
            bacc[m] = _mm256_fmadd_ps(_mm256_load_ps(bias + v), _mm256_loadu_ps(xb + m * ldxs + v), bacc[m]);
        } else {
          for (int v = 0; v < NS; ++v) bsum[m] += bias[v] * xb[m * ldxs + v];
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    float r = hsum(sink.acc[m]);
    if constexpr (T::MIN) r += hsum(bacc[m]) + bsum[m];
    out[m * ldo] = r;
  }
}

// dot_row for the input rows m .. m + MB - 1 against weight row r.
template <class T, template <class, int> class Sink, int MB>
GGML_TARGET void dot_rows(const MatmulArgs& a, const uint8_t* row, int64_t m, int64_t r) {
  const int64_t ldxs = a.sub ? a.K / a.sub : 0;
  Sink<T, MB> sink;
  sink.start(a, m);
  dot_row<T, MB>(row, a.K / T::QK, sink, a.xsum + m * ldxs, ldxs, a.out + m * a.N + r, a.N);
}

// out[m, r] for the weight rows [r0, r1), the input rows four at a time.
template <class T, template <class, int> class Sink>
GGML_TARGET void matmul_rows_registers(const MatmulArgs& a, int64_t r0, int64_t r1) {
  const int64_t rb = a.row_bytes();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.w + r * rb;
    int64_t m = 0;
    for (; m + 4 <= a.M; m += 4) dot_rows<T, Sink, 4>(a, row, m, r);
    switch (a.M - m) {
      case 3:
        dot_rows<T, Sink, 3>(a, row, m, r);
        break;
      case 2:
        dot_rows<T, Sink, 2>(a, row, m, r);
        break;
      case 1:
        dot_rows<T, Sink, 1>(a, row, m, r);
        break;
    }
  }
}

// Sink of the int8 register product: acc[m] += (sc * dx_m) * (chunk . xq_m) for MB input rows, the
// dot product of the 32 int8 levels in integers (levels in natural order: byte j is value j). The
// formats with a minimum have levels 0..31, which _mm256_maddubs_epi16 takes as they are (unsigned
// times signed); the others go through the sign trick (|q| times x with q's sign). With one scale
// per 32 values (SUB 32) each chunk's coefficient sc * dx_m is made once a block (`block_params`),
// so a chunk costs the integer dot, a conversion and one FMA per input row.
template <class T, int MB>
struct IntDotSink {
  static constexpr int NC = T::QK / 32;  // chunks a block
  const int8_t* xq;  // the block's first quantized value in input row 0
  int64_t ldq;
  const float* xd;  // the scale of the block's first 32 values in input row 0
  int64_t ldd;
  const float* sc;
  __m256 acc[MB];
  const int8_t* xq0;  // input row 0's first level and scale
  const float* xd0;
  alignas(32) float cf[MB][NC];  // SUB 32: chunk i's coefficient sc[i] * dx_m of the current block

  GGML_INLINE void start(const MatmulArgs& a, int64_t m) {
    ldq = a.K;
    ldd = a.K / 32;
    xq0 = a.xq + m * ldq;
    xd0 = a.xd + m * ldd;
  }
  GGML_INLINE void at_block(int64_t b) {
    xq = xq0 + b * T::QK;
    xd = xd0 + b * NC;
  }
  // After the block's scales are in sc.
  GGML_INLINE void block_params() {
    if constexpr (T::SUB == 32) {
      for (int m = 0; m < MB; ++m) {
        if constexpr (NC == 8) {
          _mm256_store_ps(cf[m], _mm256_mul_ps(_mm256_loadu_ps(sc), _mm256_loadu_ps(xd + m * ldd)));
        } else {
          for (int i = 0; i < NC; ++i) cf[m][i] = sc[i] * xd[m * ldd + i];
        }
      }
    }
  }

  GGML_INLINE void operator()(__m256i q, int i) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i aq = q;
    if constexpr (!T::MIN) aq = _mm256_sign_epi8(q, q);
    for (int m = 0; m < MB; ++m) {
      __m256i qx = load256(reinterpret_cast<const uint8_t*>(xq + m * ldq + 32 * i));
      if constexpr (!T::MIN) qx = _mm256_sign_epi8(qx, q);
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aq, qx), ones));
      if constexpr (T::SUB == 32) {
        acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(&cf[m][i]), dot, acc[m]);
      } else if constexpr (T::SUB == 16) {
        // int32 lanes 0-3 sum bytes 0-15 (sub-block 2i), lanes 4-7 bytes 16-31 (sub-block 2i + 1)
        const __m256 scale =
            _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(sc[2 * i])), _mm_set1_ps(sc[2 * i + 1]), 1);
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_broadcast_ss(xd + m * ldd + i)), dot, acc[m]);
      } else {
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(sc[(32 * i) / T::SUB] * xd[m * ldd + i]), dot, acc[m]);
      }
    }
  }
  GGML_INLINE void mem(const int8_t* p, int i) {
    (*this)(load256(reinterpret_cast<const uint8_t*>(p)), i);
  }
};

// Sink of the exact dequantization: y = sc * q (+ bias), rounded as the MLX decoder rounds.
template <class T>
struct DequantSink {
  float* y;
  const float* sc;
  const float* bias;

  GGML_INLINE void add(const __m256* f, int i) {
    for (int v = 0; v < 4; ++v) {
      const int s = (32 * i + 8 * v) / T::SUB;
      __m256 t = _mm256_mul_ps(_mm256_broadcast_ss(sc + s), f[v]);
      if constexpr (T::MIN) t = _mm256_add_ps(t, _mm256_broadcast_ss(bias + s));
      _mm256_storeu_ps(y + 32 * i + 8 * v, t);
    }
  }
  GGML_INLINE void operator()(__m256i q, int i) {
    __m256 f[4];
    widen(q, f);
    add(f, i);
  }
  GGML_INLINE void mem(const int8_t* p, int i) {
    __m256 f[4];
    widen_mem(p, f);
    add(f, i);
  }
};

template <class T>
GGML_TARGET void decode_row_fast(const uint8_t* row, int64_t K, float* y) {
  constexpr int NS = T::QK / T::SUB;
  alignas(32) float sc[NS], bias[NS];
  DequantSink<T> sink;
  sink.sc = sc;
  sink.bias = bias;
  for (int64_t b = 0, nb = K / T::QK; b < nb; ++b) {
    const uint8_t* p = row + b * T::TS;
    T::params(p, sc, bias);
    sink.y = y + b * T::QK;
    T::chunks(p, sink);
  }
}

// Calls F::template run<Fast type>(args...) for the types with a register kernel; false otherwise.
template <class F, class... Args>
bool dispatch_fast(int id, Args&&... args) {
  switch (id) {
    case kQ4_0:
      F::template run<FQ4_0>(args...);
      return true;
    case kQ4_1:
      F::template run<FQ4_1>(args...);
      return true;
    case kQ5_0:
      F::template run<FQ5_0>(args...);
      return true;
    case kQ5_1:
      F::template run<FQ5_1>(args...);
      return true;
    case kQ8_0:
      F::template run<FQ8_0>(args...);
      return true;
    case kQ2_K:
      F::template run<FQ2_K>(args...);
      return true;
    case kQ3_K:
      F::template run<FQ3_K>(args...);
      return true;
    case kQ4_K:
      F::template run<FQ4_K>(args...);
      return true;
    case kQ5_K:
      F::template run<FQ5_K>(args...);
      return true;
    case kQ6_K:
      F::template run<FQ6_K>(args...);
      return true;
    case kIQ4_NL:
      F::template run<FIQ4_NL>(args...);
      return true;
    case kIQ4_XS:
      F::template run<FIQ4_XS>(args...);
      return true;
    case kMXFP4:
      F::template run<FMXFP4>(args...);
      return true;
    case kTQ2_0:
      F::template run<FTQ2_0>(args...);
      return true;
  }
  return false;
}

struct DecodeRowFast {
  template <class T>
  static void run(const uint8_t* row, int64_t K, float* y) {
    decode_row_fast<T>(row, K, y);
  }
};

struct MatmulRegisters {
  template <class T>
  static void run(const MatmulArgs& a, int64_t r0, int64_t r1) {
    if (a.xq != nullptr) {
      matmul_rows_registers<T, IntDotSink>(a, r0, r1);
    } else {
      matmul_rows_registers<T, DotSink>(a, r0, r1);
    }
  }
};

struct KernelOrder {
  template <class T>
  static void run(bool& out) {
    out = !natural_order<T>() && !float_nibbles<T>();
  }
};

// out[r, m] for NR decoded weight rows (w, K apart) and MB input rows: a float tile.
template <int NR, int MB>
GGML_TARGET void tile_dot(const float* w, const float* x, int64_t K, float* out, int64_t N) {
  __m256 acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm256_loadu_ps(w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < NR; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) out[m * N + r] = hsum(acc[r][m]);
}

template <int NR>
GGML_TARGET void tile_rows(const float* w, const MatmulArgs& a, int64_t r) {
  int64_t m = 0;
  for (; m + 3 <= a.M; m += 3) tile_dot<NR, 3>(w, a.x + m * a.K, a.K, a.out + m * a.N + r, a.N);
  if (a.M - m == 2) tile_dot<NR, 2>(w, a.x + m * a.K, a.K, a.out + m * a.N + r, a.N);
  if (a.M - m == 1) tile_dot<NR, 1>(w, a.x + m * a.K, a.K, a.out + m * a.N + r, a.N);
}

inline void decode_row_avx2(const TypeInfo& t, const uint8_t* row, int64_t K, float* y) {
  if (!dispatch_fast<DecodeRowFast>(t.id, row, K, y)) decode_row_portable(t, row, K, y);
}

// The decoded-rows product for the weight rows [r0, r1).
GGML_TARGET inline void matmul_rows_decoded_avx2(const MatmulArgs& a, int64_t r0, int64_t r1) {
  constexpr int R = 4;
  std::vector<float> buf(static_cast<size_t>(R * a.K));
  const int64_t rb = a.row_bytes();
  for (int64_t r = r0; r < r1; r += R) {
    const int nr = static_cast<int>(std::min<int64_t>(R, r1 - r));
    for (int i = 0; i < nr; ++i) decode_row_avx2(*a.type, a.w + (r + i) * rb, a.K, buf.data() + i * a.K);
    switch (nr) {
      case 4:
        tile_rows<4>(buf.data(), a, r);
        break;
      case 3:
        tile_rows<3>(buf.data(), a, r);
        break;
      case 2:
        tile_rows<2>(buf.data(), a, r);
        break;
      case 1:
        tile_rows<1>(buf.data(), a, r);
        break;
    }
  }
}

#endif  // METALNN_GGML_X86

// ---------------------------------------------------------------------------
// Range drivers (one call per thread chunk)
// ---------------------------------------------------------------------------

// Whether the register kernel runs a product of M input rows of type id.
inline bool uses_registers(int id, int64_t M, bool avx2) {
  return avx2 && has_register_kernel(id) && M <= register_rows_setting().load();
}

// Whether the register kernel of a product of M input rows takes the input as int8 (up to
// `int8_rows_setting` rows, beyond `register_rows_setting`: with int8 inputs the register kernels
// stay faster than the decoded-rows product up to 8 rows at least, as the float ones do not).
inline bool uses_int8(int id, int64_t M, bool avx2) {
  return avx2 && has_register_kernel(id) && M <= int8_rows_setting().load();
}

// The input rows x [M, K] as int8 levels q [M, K] and scales d [M, K / run]: each `run` values
// (32, or 256 for the K-quants' loops) get d = max|x| / 127 and q = round(x / d) (d = 0, q = 0
// for an all-zero run).
#if METALNN_GGML_X86
// max |v| over n values (n a multiple of 8).
GGML_TARGET inline float amax_avx2(const float* v, int64_t n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(v + j), abs_mask));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

// 32 int32 levels (|v| <= 127) as int8, in order.
GGML_TARGET inline void store_levels32(const __m256i* v, int8_t* q) {
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, order));
}

// quantize_rows_int8 for one run of a multiple of 32 values (q2 null: one int8 level),
// rounding half to even as std::nearbyint does.
GGML_TARGET inline void quantize_run_avx2(const float* x, int64_t run, int8_t* q, float* d, int8_t* q2) {
  const float amax = amax_avx2(x, run);
  *d = amax / 127.0f;
  const float base = q2 != nullptr ? 254.0f : 1.0f;
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f * base / amax : 0.0f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t j = 0; j < run; j += 32) {
    __m256i high[4], low[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 level = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * i), inv), kRound);
      if (q2 == nullptr) {
        high[i] = _mm256_cvtps_epi32(level);
        continue;
      }
      const __m256 h = _mm256_round_ps(_mm256_mul_ps(level, _mm256_set1_ps(1.0f / 254.0f)), kRound);
      high[i] = _mm256_cvtps_epi32(h);
      low[i] = _mm256_cvtps_epi32(_mm256_sub_ps(level, _mm256_mul_ps(h, _mm256_set1_ps(254.0f))));
    }
    store_levels32(high, q + j);
    if (q2 != nullptr) store_levels32(low, q2 + j);
  }
}
#endif

// Input rows up to which split inputs run: with more, the doubled integer work makes the kernels
// compute-bound (4 rows: Q4_K 1.0-1.25x the float kernel, Q6_K 0.9-1.0x, two threads, from memory).
inline constexpr int64_t kSplitRows = 2;

// Whether a product of M input rows of type id takes split inputs (split_inputs_setting): the types
// with an int8 loop where their float register kernel would run, up to kSplitRows rows.
inline bool uses_split(int id, int64_t M, bool avx2) {
  switch (id) {
    case kQ4_0:
    case kQ4_1:
    case kQ5_0:
    case kQ5_1:
    case kQ8_0:
    case kQ4_K:
    case kQ5_K:
    case kQ6_K:
      return M <= kSplitRows && uses_registers(id, M, avx2) && split_inputs_setting().load();
  }
  return false;
}

// The input rows x [M, K] as int8: each `run` values get d = max|x| / 127 and levels q = round(x / d)
// (d = 0, q = 0 for an all-zero run); or, with q2 (split inputs, split_inputs_setting), 16-bit levels
// X = round(x * 254 / d) held as X = 254 q + q2, q = round(X / 254).
inline void quantize_rows_int8(const float* x, int64_t M, int64_t K, int64_t run, int8_t* q, float* d,
                               int8_t* q2 = nullptr) {
#if METALNN_GGML_X86
  if (use_avx2() && run % 32 == 0) {
    for (int64_t c = 0, n = M * K / run; c < n; ++c)
      quantize_run_avx2(x + run * c, run, q + run * c, d + c, q2 != nullptr ? q2 + run * c : nullptr);
    return;
  }
#endif
  const float base = q2 != nullptr ? 254.0f : 1.0f;
  for (int64_t c = 0, n = M * K / run; c < n; ++c) {
    const float* xc = x + run * c;
    float amax = 0.0f;
    for (int64_t j = 0; j < run; ++j) amax = std::max(amax, std::fabs(xc[j]));
    d[c] = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f * base / amax : 0.0f;
    for (int64_t j = 0; j < run; ++j) {
      const float level = std::nearbyint(xc[j] * inv);
      if (q2 == nullptr) {
        q[run * c + j] = static_cast<int8_t>(level);
        continue;
      }
      const float high = std::nearbyint(level * (1.0f / 254.0f));
      q[run * c + j] = static_cast<int8_t>(high);
      q2[run * c + j] = static_cast<int8_t>(level - 254.0f * high);
    }
  }
}

// Sums of the int8 input levels over each 16 values: s [M, K / 16].
inline void level_sums16(const int8_t* q, int64_t M, int64_t K, int16_t* s) {
  for (int64_t c = 0, n = M * K / 16; c < n; ++c) {
    int sum = 0;
    for (int j = 0; j < 16; ++j) sum += q[16 * c + j];
    s[c] = static_cast<int16_t>(sum);
  }
}

// Values per input scale of a type's int8 products: 256 for the K-quants whose loop (ggml_int8_rows.h)
// multiplies the sub-block scales in integers, as llama.cpp's Q8_K input does (one scale a block);
// 32 for the others (llama.cpp's Q8_0 / Q8_1).
inline int64_t int8_input_run(int id) {
  return id == kQ4_K || id == kQ5_K || id == kQ6_K ? 256 : 32;
}

// Whether the float register kernel of a type takes the input rows in kernel order
// (permute_chunks): every type but those that read their levels in natural order, from memory
// (Q8_0: NATURAL) or as plain nibbles (float_chunks: Q4_0, Q4_1, Q4_K).
inline bool register_kernel_order(int id) {
#if METALNN_GGML_X86
  bool kernel_order = false;
  dispatch_fast<KernelOrder>(id, kernel_order);
  return kernel_order;
#else
  (void)id;
  return false;  // no register kernels
#endif
}

// out[m, r] = W[r] . x_m for the weight rows [r0, r1).
inline void matmul_rows(const MatmulArgs& a, int64_t r0, int64_t r1, bool avx2) {
#if METALNN_GGML_X86
  if (avx2) {
    if (a.xq != nullptr || uses_registers(a.type->id, a.M, avx2)) {
      dispatch_fast<MatmulRegisters>(a.type->id, a, r0, r1);
      return;
    }
    matmul_rows_decoded_avx2(a, r0, r1);
    return;
  }
#endif
  (void)avx2;
  matmul_rows_portable(a, r0, r1);
}

// out[r] = the decoded row r (K floats) for the rows [r0, r1).
inline void dequantize_rows(const TypeInfo& t, const uint8_t* w, int64_t K, float* out, int64_t r0, int64_t r1,
                            bool avx2) {
  const int64_t rb = K / t.block * t.size;
#if METALNN_GGML_X86
  if (avx2) {
    for (int64_t r = r0; r < r1; ++r) decode_row_avx2(t, w + r * rb, K, out + r * K);
    return;
  }
#endif
  (void)avx2;
  for (int64_t r = r0; r < r1; ++r) decode_row_portable(t, w + r * rb, K, out + r * K);
}

// Sums of each input row over sub-blocks of `sub` values: xs[m, K / sub].
inline void sub_block_sums(const float* x, int64_t M, int64_t K, int64_t sub, float* xs) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t s = 0; s < K / sub; ++s) {
      const float* p = x + m * K + s * sub;
      float t = 0.0f;
      for (int64_t i = 0; i < sub; ++i) t += p[i];
      xs[m * (K / sub) + s] = t;
    }
}

}  // namespace metalnn_ggml
