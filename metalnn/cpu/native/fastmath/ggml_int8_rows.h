// Decoding products with int8 inputs, one tight AVX2 loop per common type (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1, Q4_K, Q5_K, Q6_K): out[m, r] = W[r] . x_m for a few input rows m, the inputs quantized as
// quantize_rows_int8 writes them (int8 levels xq [M, K], one scale xd [M, K / 32] per 32 values).
//
// The same arithmetic as IntDotSink (ggml_kernels.h), which serves the other types: each 32
// weights' integer dot with the input levels (_mm256_maddubs_epi16, levels 0..63 as they are,
// signed levels through the sign trick), converted to float and scaled by the weight's scale times
// the input's; the formats with a minimum add min * (the float input's sum over the sub-block). Here
// every accumulator and scale stays in registers (the generic sink's state goes through memory, a
// third of the time of a decoding product), and each block's weights are decoded once for all input
// rows.
#pragma once

#include "ggml_kernels.h"

#if METALNN_GGML_X86

namespace metalnn_ggml {
namespace int8_rows {

// Integer dot of 32 unsigned levels u (0..127) with 32 int8 inputs: 8 int32 partial sums as floats.
GGML_INLINE __m256 udot(__m256i u, __m256i x) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}

// The same for signed levels q (-128..127).
GGML_INLINE __m256 sdot(__m256i q, __m256i x) {
  return udot(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
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

// The types. Each `block<MB>(p, in, b, acc)` adds block b of a weight row to acc[m] (8 lanes
// summed at the end) for the input rows 0 .. MB - 1 of `in`.
// Receives the one chunk of a 32-value block from the format's `chunks` (ggml_kernels.h).
struct LevelSink {
  __m256i q;
  GGML_INLINE void operator()(__m256i v, int) {
    q = v;
  }
  GGML_INLINE void mem(const int8_t* p, int) {
    q = load256(reinterpret_cast<const uint8_t*>(p));
  }
};

// The 32-value formats (F: FQ8_0, FQ4_0, FQ4_1, FQ5_0, FQ5_1 of ggml_kernels.h, whose `params` and
// `chunks` decode the block): scale * levels, plus the minimum (bias) for Q4_1 and Q5_1.
template <class F>
struct Legacy {
  static constexpr int QK = 32, TS = F::TS;
  template <int MB>
  GGML_INLINE static void block(const uint8_t* p, const Inputs& in, int64_t b, __m256* acc) {
    float d, mn = 0.0f;
    F::params(p, &d, &mn);
    LevelSink levels;
    F::chunks(p, levels);
    for (int m = 0; m < MB; ++m) {
      const __m256 dx = _mm256_set1_ps(d * in.d[m * in.ldd + b]);
      if constexpr (F::MIN) {
        // levels 0..31; the minimum's term mn * sum(x) rides in lane 0 of the scaled dot
        const __m256 t = _mm256_fmadd_ps(dx, udot(levels.q, in.levels(m, 32 * b)),
                                         _mm256_setr_ps(mn * in.s[m * in.ldd + b], 0, 0, 0, 0, 0, 0, 0));
        acc[m] = _mm256_add_ps(acc[m], t);
      } else {
        acc[m] = _mm256_fmadd_ps(dx, sdot(levels.q, in.levels(m, 32 * b)), acc[m]);
      }
    }
  }
};

// Q4_K and Q5_K: 8 sub-blocks of 32, 6-bit scales and minimums (unpacked by params_k4_avx2).
template <bool FIFTH_BIT>
struct K4 {
  static constexpr int QK = 256, TS = FIFTH_BIT ? 176 : 144;
  template <int MB>
  GGML_INLINE static void block(const uint8_t* p, const Inputs& in, int64_t b, __m256* acc) {
    alignas(32) float scales[8], bias[8];  // bias: - dmin * min of each sub-block
    params_k4_avx2(p, scales, bias);
    const __m256 sc = _mm256_load_ps(scales), neg_mn = _mm256_load_ps(bias);
    __m256 coef[MB];
    for (int m = 0; m < MB; ++m) {
      coef[m] = _mm256_mul_ps(sc, _mm256_loadu_ps(in.d + m * in.ldd + 8 * b));
      // - min * sum(x) for the 8 sub-blocks, lane by lane
      acc[m] = _mm256_fmadd_ps(neg_mn, _mm256_loadu_ps(in.s + m * in.ldd + 8 * b), acc[m]);
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const uint8_t* qs = p + (FIFTH_BIT ? 48 : 16);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load256(qs + 32 * c);
      __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if constexpr (FIFTH_BIT) {
        const __m256i qh = load256(p + 16), m16 = _mm256_set1_epi8(0x10);
        lo = _mm256_or_si256(lo, _mm256_and_si256(bit_to_4(qh, 2 * c), m16));
        hi = _mm256_or_si256(hi, _mm256_and_si256(bit_to_4(qh, 2 * c + 1), m16));
      }
      for (int m = 0; m < MB; ++m) {
        const int64_t k = 256 * b + 64 * c;
        acc[m] = _mm256_fmadd_ps(lane(coef[m], 2 * c), udot(lo, in.levels(m, k)), acc[m]);
        acc[m] = _mm256_fmadd_ps(lane(coef[m], 2 * c + 1), udot(hi, in.levels(m, k + 32)), acc[m]);
      }
    }
  }
};

// Q6_K: 16 sub-blocks of 16, signed 8-bit scales; levels 0..63 - 32 (signed chunks).
struct Q6_K {
  static constexpr int QK = 256, TS = 210;
  template <int MB>
  GGML_INLINE static void block(const uint8_t* p, const Inputs& in, int64_t b, __m256* acc) {
    const __m256 d = _mm256_set1_ps(h2f(p + 208));
    const __m128i raw = load128(p + 192);
    const __m256 sc_lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
    const __m256 sc_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))));
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load256(p + 64 * h), l1 = load256(p + 64 * h + 32);
      const __m256i qh = load256(p + 128 + 32 * h);
      // values 128 h + 32 t + j: nibble t / 2 of ql[64 h + 32 (t % 2) + j], bits 2t of qh[32 h + j]
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
      q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
      const __m256 sc = h ? sc_hi : sc_lo;
      for (int t = 0; t < 4; ++t) {
        const __m256i st = _mm256_sub_epi8(q[t], off);
        // int32 lanes 0-3 sum values 0-15 of the chunk (sub-block 2t of this half), lanes 4-7 16-31
        const __m256 scale = _mm256_permutevar8x32_ps(sc, _mm256_setr_epi32(2 * t, 2 * t, 2 * t, 2 * t, 2 * t + 1,
                                                                            2 * t + 1, 2 * t + 1, 2 * t + 1));
        const int i = 4 * h + t;  // chunk of the block
        for (int m = 0; m < MB; ++m) {
          const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(in.d[m * in.ldd + 8 * b + i]));
          acc[m] = _mm256_fmadd_ps(s, sdot(st, in.levels(m, 256 * b + 32 * i)), acc[m]);
        }
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
      int8_rows::rows<int8_rows::K4<false>>(a, r0, r1);
      return true;
    case kQ5_K:
      int8_rows::rows<int8_rows::K4<true>>(a, r0, r1);
      return true;
    case kQ6_K:
      int8_rows::rows<int8_rows::Q6_K>(a, r0, r1);
      return true;
  }
  return false;
}

}  // namespace metalnn_ggml

#endif  // METALNN_GGML_X86
