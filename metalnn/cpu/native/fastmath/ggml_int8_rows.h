// Decoding products with int8 inputs, one tight AVX2 loop per common type (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1, Q4_K, Q5_K, Q6_K): out[m, r] = W[r] . x_m for a few input rows m, the inputs quantized as
// quantize_rows_int8 writes them (int8 levels xq [M, K], one scale xd [M, K / 32] per 32 values).
//
// The same arithmetic as IntDotSink (ggml_kernels.h), which serves the other types: each 32
// weights' integer dot with the input levels (_mm256_maddubs_epi16, levels 0..63 as they are,
// signed levels through the sign trick), converted to float and scaled by the weight's scale times
// the input's; the formats with a minimum add min * (the float input's sum over the sub-block). Here
// every accumulator and scale stays in registers (the generic sink's state goes through memory, a
// third of the time of a decoding product), each block's levels are decoded once, by the
// format's own `chunks`, for all input rows, and the K-quants (Q4_K, Q5_K, Q6_K) convert the
// integer sums of four chunks at once (`half_block_sums`).
#pragma once

#include "ggml_kernels.h"

#if METALNN_GGML_X86

namespace metalnn_ggml {
namespace int8_rows {

// Integer dot of 32 unsigned levels u (0..127) with 32 int8 inputs: 8 int32 partial sums (lane i
// sums values 4i .. 4i + 3).
GGML_INLINE __m256i udot_i32(__m256i u, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

// The same for signed levels q (-128..127).
GGML_INLINE __m256i sdot_i32(__m256i q, __m256i x) {
  return udot_i32(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
}

// udot_i32 / sdot_i32 as floats.
GGML_INLINE __m256 udot(__m256i u, __m256i x) {
  return _mm256_cvtepi32_ps(udot_i32(u, x));
}
GGML_INLINE __m256 sdot(__m256i q, __m256i x) {
  return _mm256_cvtepi32_ps(sdot_i32(q, x));
}

// Lane i of v in every lane.
GGML_INLINE __m256 lane(__m256 v, int i) {
  return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i));
}

// Input rows: their levels, scales and (formats with a minimum) sums over 32 values.
struct Inputs {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t ldq, ldd;
  GGML_INLINE __m256i levels(int m, int64_t k) const {
    return load256(reinterpret_cast<const uint8_t*>(q + m * ldq + k));
  }
};

// Receives the chunks of a block (32 levels each) from the format's `chunks` (ggml_kernels.h).
template <int NC>
struct ChunkSink {
  __m256i q[NC];
  GGML_INLINE void operator()(__m256i v, int i) {
    q[i] = v;
  }
  GGML_INLINE void mem(const int8_t* p, int i) {
    q[i] = load256(reinterpret_cast<const uint8_t*>(p));
  }
};

// The integer dots of chunks 4h .. 4h + 3 of a 256-value block (its levels, unsigned or SIGNED) with
// input row m from value k, summed with two rounds of horizontal adds and converted once: lane j
// holds values 0-15 of chunk 4h + j, lane j + 4 its values 16-31.
template <bool SIGNED>
GGML_INLINE __m256 half_block_sums(const ChunkSink<8>& levels, const Inputs& in, int m, int64_t k, int h) {
  __m256i t[4];
  for (int j = 0; j < 4; ++j) {
    const __m256i x = in.levels(m, k + 32 * j);
    t[j] = SIGNED ? sdot_i32(levels.q[4 * h + j], x) : udot_i32(levels.q[4 * h + j], x);
  }
  return _mm256_cvtepi32_ps(_mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3])));
}

// The types, each over its format F of ggml_kernels.h (whose `params` and `chunks` decode a
// block). Each `block<MB>(p, in, b, acc)` adds block b of a weight row to acc[m] (8 lanes summed at
// the end) for the input rows 0 .. MB - 1 of `in`.

// The 32-value formats (FQ8_0, FQ4_0, FQ4_1, FQ5_0, FQ5_1): scale * levels, plus the minimum (bias)
// for Q4_1 and Q5_1.
template <class F>
struct Legacy {
  static constexpr int QK = 32, TS = F::TS;
  template <int MB>
  GGML_INLINE static void block(const uint8_t* p, const Inputs& in, int64_t b, __m256* acc) {
    float d, mn = 0.0f;
    F::params(p, &d, &mn);
    ChunkSink<1> levels;
    F::chunks(p, levels);
    for (int m = 0; m < MB; ++m) {
      const __m256 dx = _mm256_set1_ps(d * in.d[m * in.ldd + b]);
      if constexpr (F::MIN) {
        // levels 0..31; the minimum's term mn * sum(x) rides in lane 0 of the scaled dot
        const __m256 t = _mm256_fmadd_ps(dx, udot(levels.q[0], in.levels(m, 32 * b)),
                                         _mm256_setr_ps(mn * in.s[m * in.ldd + b], 0, 0, 0, 0, 0, 0, 0));
        acc[m] = _mm256_add_ps(acc[m], t);
      } else {
        acc[m] = _mm256_fmadd_ps(dx, sdot(levels.q[0], in.levels(m, 32 * b)), acc[m]);
      }
    }
  }
};

// Q4_K and Q5_K (FQ4_K, FQ5_K): 8 sub-blocks of 32 (one a chunk), levels 0..31, scales and
// minimums (bias: - dmin * min). Four sub-blocks' integer dots are summed together before their one
// conversion to float: lane j of the reduced vector holds half of sub-block j's sum (lanes j and
// j + 4 together the whole), scaled by [c0 c1 c2 c3 c0 c1 c2 c3] (the coefficients of those four
// sub-blocks): three horizontal adds a four sub-blocks instead of a conversion, a lane broadcast and
// a multiply-add each.
template <class F>
struct K4 {
  static constexpr int QK = 256, TS = F::TS;
  template <int MB>
  GGML_INLINE static void block(const uint8_t* p, const Inputs& in, int64_t b, __m256* acc) {
    alignas(32) float scales[8], bias[8];
    F::params(p, scales, bias);
    const __m256 sc = _mm256_load_ps(scales), neg_mn = _mm256_load_ps(bias);
    __m256 coef[MB];
    for (int m = 0; m < MB; ++m) {
      coef[m] = _mm256_mul_ps(sc, _mm256_loadu_ps(in.d + m * in.ldd + 8 * b));
      // - min * sum(x) for the 8 sub-blocks, lane by lane
      acc[m] = _mm256_fmadd_ps(neg_mn, _mm256_loadu_ps(in.s + m * in.ldd + 8 * b), acc[m]);
    }
    ChunkSink<8> levels;
    F::chunks(p, levels);
    for (int h = 0; h < 2; ++h) {
      for (int m = 0; m < MB; ++m) {
        const __m256 sums = half_block_sums<false>(levels, in, m, 256 * b + 128 * h, h);
        const __m256 c = h == 0 ? _mm256_permute2f128_ps(coef[m], coef[m], 0x00)
                                : _mm256_permute2f128_ps(coef[m], coef[m], 0x11);
        acc[m] = _mm256_fmadd_ps(c, sums, acc[m]);
      }
    }
  }
};

// Q6_K (FQ6_K): 16 sub-blocks of 16 (two a chunk), signed 8-bit scales, levels 0..63 - 32. As in
// K4, four chunks' integer dots are summed before one conversion: after the two rounds of
// horizontal adds, lane j holds chunk j's first sub-block and lane j + 4 its second, scaled by
// [s0 s2 s4 s6 s1 s3 s5 s7] (the four chunks' sub-block scales) times [d0 d1 d2 d3 d0 d1 d2 d3] (their
// input scales).
struct Q6_K {
  static constexpr int QK = 256, TS = FQ6_K::TS;
  template <int MB>
  GGML_INLINE static void block(const uint8_t* p, const Inputs& in, int64_t b, __m256* acc) {
    alignas(32) float sc[16];
    FQ6_K::params(p, sc, nullptr);
    ChunkSink<8> levels;
    FQ6_K::chunks(p, levels);
    const __m256i even_odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_permutevar8x32_ps(_mm256_load_ps(sc + 8 * h), even_odd);
      for (int m = 0; m < MB; ++m) {
        const __m256 sums = half_block_sums<true>(levels, in, m, 256 * b + 128 * h, h);
        const __m256 dx = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(in.d + m * in.ldd + 8 * b + 4 * h));
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(scale, dx), sums, acc[m]);
      }
    }
  }
};

// The 32-value types read the row 1 KiB ahead (measured: Q8_0 1.2-1.4x single-threaded on this
// machine's memory; the K-quants ran slower with it).
constexpr int64_t PREFETCH_BYTES = 1024;

// out[m, r] for weight row r and the input rows m0 .. m0 + MB - 1.
template <class T, int MB>
GGML_TARGET void row_dot(const uint8_t* row, int64_t nblocks, const Inputs& in, float* out, int64_t ldo) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    if constexpr (T::QK == 32) _mm_prefetch(reinterpret_cast<const char*>(row + b * T::TS + PREFETCH_BYTES), _MM_HINT_T0);
    T::template block<MB>(row + b * T::TS, in, b, acc);
  }
  for (int m = 0; m < MB; ++m) out[m * ldo] = hsum(acc[m]);
}

template <class T>
GGML_TARGET void rows(const MatmulArgs& a, int64_t r0, int64_t r1) {
  const int64_t rb = a.row_bytes(), nblocks = a.K / T::QK;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.w + r * rb;
    for (int64_t m = 0; m < a.M; m += 4) {
      const Inputs in{a.xq + m * a.K, a.xd + m * (a.K / 32), a.xsum ? a.xsum + m * (a.K / 32) : nullptr, a.K,
                      a.K / 32};
      float* out = a.out + m * a.N + r;
      switch (std::min<int64_t>(4, a.M - m)) {
        case 4:
          row_dot<T, 4>(row, nblocks, in, out, a.N);
          break;
        case 3:
          row_dot<T, 3>(row, nblocks, in, out, a.N);
          break;
        case 2:
          row_dot<T, 2>(row, nblocks, in, out, a.N);
          break;
        default:
          row_dot<T, 1>(row, nblocks, in, out, a.N);
      }
    }
  }
}

}  // namespace int8_rows

// Runs the dedicated int8 loop of a type; false for the types without one.
inline bool int8_rows_product(const MatmulArgs& a, int64_t r0, int64_t r1) {
  switch (a.type->id) {
    case kQ8_0:
      int8_rows::rows<int8_rows::Legacy<FQ8_0>>(a, r0, r1);
      return true;
    case kQ4_0:
      int8_rows::rows<int8_rows::Legacy<FQ4_0>>(a, r0, r1);
      return true;
    case kQ4_1:
      int8_rows::rows<int8_rows::Legacy<FQ4_1>>(a, r0, r1);
      return true;
    case kQ5_0:
      int8_rows::rows<int8_rows::Legacy<FQ5_0>>(a, r0, r1);
      return true;
    case kQ5_1:
      int8_rows::rows<int8_rows::Legacy<FQ5_1>>(a, r0, r1);
      return true;
    case kQ4_K:
      int8_rows::rows<int8_rows::K4<FQ4_K>>(a, r0, r1);
      return true;
    case kQ5_K:
      int8_rows::rows<int8_rows::K4<FQ5_K>>(a, r0, r1);
      return true;
    case kQ6_K:
      int8_rows::rows<int8_rows::Q6_K>(a, r0, r1);
      return true;
  }
  return false;
}

}  // namespace metalnn_ggml

#endif  // METALNN_GGML_X86
