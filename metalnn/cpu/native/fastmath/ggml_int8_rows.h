// Decoding products with int8 inputs, one tight AVX2 loop per common type (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1, Q4_K, Q5_K, Q6_K): out[m, r] = W[r] . x_m for a few input rows m, the inputs quantized as
// quantize_rows_int8 writes them (int8 levels xq [M, K], one scale per int8_input_run values: 32, or
// 256 for the K-quants, as llama.cpp's Q8_0 / Q8_K inputs).
//
// The same arithmetic as IntDotSink (ggml_kernels.h), which serves the other types: each 32
// weights' integer dot with the input levels (_mm256_maddubs_epi16, levels 0..63 as they are,
// signed levels through the sign trick), converted to float and scaled by the weight's scale times
// the input's; the formats with a minimum add min * (the float input's sum over the sub-block). Here
// every accumulator and scale stays in registers (the generic sink's state goes through memory, a
// third of the time of a decoding product), each block's levels are decoded once, by the
// format's own `chunks`, for all input rows, and the K-quants (Q4_K, Q5_K, Q6_K), whose input has
// one scale a block, multiply their sub-block scales in integers and convert once a block.
//
// The same loops take split inputs (quantize_rows_int8 with q2, `SPLIT` below: the default for one or two
// float input rows): a second int8 level xq2 beside xq, the input d / 254 * (254 xq + xq2), each
// chunk's integer dot taken with both and combined in int32 before the one conversion.
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

// Input rows: their levels, their scales (one every `ldq / ldd` values: 32, or 256 for the
// K-quants) and (formats with a minimum) the float input's sums over 32 values.
struct Inputs {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t ldq, ldd, lds;
  const int16_t* s16 = nullptr;  // the levels' sums over each 16 values (Q6_K), K / 16 a row
  int64_t lds16 = 0;
  // split inputs (MatmulArgs::xq2): the second level and (Q6_K) its sums, as q and s16; the input
  // is d * (q + q2 / 254)
  const int8_t* q2 = nullptr;
  const int16_t* s16_2 = nullptr;
  GGML_INLINE __m256i levels(int m, int64_t k) const {
    return load256(reinterpret_cast<const uint8_t*>(q + m * ldq + k));
  }
  GGML_INLINE __m256i levels2(int m, int64_t k) const {
    return load256(reinterpret_cast<const uint8_t*>(q2 + m * ldq + k));
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

// Shuffle masks picking 16-bit scales for the 8 chunks of a block from a vector holding 8 of them in
// each 128-bit half: chunk j's lanes 0-7 (its values 0-15) get scale (step j) % 8, lanes 8-15 (values
// 16-31) scale (step j + step - 1) % 8. Step 1: one scale a chunk (Q4_K, Q5_K); step 2: two
// (Q6_K, scales 8-15 in a second vector for chunks 4-7).
struct ScalePicks {
  alignas(32) int8_t mask[8][32] = {};
  constexpr explicit ScalePicks(int step) {
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 32; ++i) {
        const int scale = i < 16 ? (step * j) % 8 : (step * j + step - 1) % 8;
        mask[j][i] = static_cast<int8_t>(2 * scale + (i & 1));
      }
  }
};
inline constexpr ScalePicks kOneScale{1}, kTwoScales{2};

GGML_INLINE __m256i pick_scales(__m256i s16, const ScalePicks& picks, int j) {
  return _mm256_shuffle_epi8(s16, load256(reinterpret_cast<const uint8_t*>(picks.mask[j])));
}

// The types, each over its format F of ggml_kernels.h (whose `params` and `chunks` decode a
// block). Each `block<MB>(p, in, b, acc)` adds block b of a weight row to acc[m] (8 lanes summed at
// the end) for the input rows 0 .. MB - 1 of `in`.

// udot / sdot of 32 levels with split inputs a, b (SPLIT: x ~ dx * (a + b / 254)): the dot with
// 254 a + b, from the pair sums (_mm256_maddubs_epi16) of each level, the first's times 254
// (_mm256_madd_epi16), as floats (at most 4 * 128 * 127 * 255 < 2^24 per lane: exact).
GGML_INLINE __m256 udot_split(__m256i u, __m256i a, __m256i b) {
  const __m256i pairs_a = _mm256_maddubs_epi16(u, a), pairs_b = _mm256_maddubs_epi16(u, b);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(pairs_a, _mm256_set1_epi16(254)),
                                             _mm256_madd_epi16(pairs_b, _mm256_set1_epi16(1))));
}

GGML_INLINE __m256 sdot_split(__m256i q, __m256i a, __m256i b) {
  return udot_split(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q), _mm256_sign_epi8(b, q));
}

// The 32-value formats (FQ8_0, FQ4_0, FQ4_1, FQ5_0, FQ5_1): scale * levels, plus the minimum (bias)
// for Q4_1 and Q5_1. SPLIT: split inputs (udot_split / sdot_split, scaled by dx / 254).
template <class F, bool SPLIT = false>
struct Legacy {
  static constexpr int QK = 32, TS = F::TS, ROWS = SPLIT ? 2 : 8;
  template <int MB>
  GGML_INLINE static void block(const uint8_t* p, const Inputs& in, int64_t b, __m256* acc) {
    float d, mn = 0.0f;
    F::params(p, &d, &mn);
    ChunkSink<1> levels;
    F::chunks(p, levels);
    for (int m = 0; m < MB; ++m) {
      if constexpr (SPLIT) {
        const __m256 dx = _mm256_set1_ps(d * in.d[m * in.ldd + b] * (1.0f / 254.0f));
        const __m256i xa = in.levels(m, 32 * b), xb = in.levels2(m, 32 * b);
        if constexpr (F::MIN) {
          const __m256 t = _mm256_fmadd_ps(dx, udot_split(levels.q[0], xa, xb),
                                           _mm256_setr_ps(mn * in.s[m * in.lds + b], 0, 0, 0, 0, 0, 0, 0));
          acc[m] = _mm256_add_ps(acc[m], t);
        } else {
          acc[m] = _mm256_fmadd_ps(dx, sdot_split(levels.q[0], xa, xb), acc[m]);
        }
        continue;
      }
      const __m256 dx = _mm256_set1_ps(d * in.d[m * in.ldd + b]);
      if constexpr (F::MIN) {
        // levels 0..31; the minimum's term mn * sum(x) rides in lane 0 of the scaled dot
        const __m256 t = _mm256_fmadd_ps(dx, udot(levels.q[0], in.levels(m, 32 * b)),
                                         _mm256_setr_ps(mn * in.s[m * in.lds + b], 0, 0, 0, 0, 0, 0, 0));
        acc[m] = _mm256_add_ps(acc[m], t);
      } else {
        acc[m] = _mm256_fmadd_ps(dx, sdot(levels.q[0], in.levels(m, 32 * b)), acc[m]);
      }
    }
  }
};

// Q4_K and Q5_K (FQ4_K, FQ5_K): 8 sub-blocks of 32 (one a chunk), levels 0..31, 6-bit scales and
// minimums (bias: - dmin * min). The input has one scale for the block (run 256, as llama.cpp's Q8_K),
// so the sub-block scales multiply in integers: chunk j's 16-bit pair sums (_mm256_maddubs_epi16) times
// its scale (_mm256_madd_epi16) add up in int32 over the block (at most 2 * 31 * 127 * 63 * 8 per
// lane), converted once and scaled by d * dx; the minimums' term takes the float input's sums.
// SPLIT: split inputs (x ~ dx * (a + b / 254)): the sums with a and with b apart, combined as
// 254 sums_a + sums_b once a block (at most 255 * 8 * 2 * 7874 * 63 per lane < 2^31), scaled by
// d * dx / 254.
template <class F, bool SPLIT = false>
struct K4 {
  static constexpr int QK = 256, TS = F::TS, ROWS = SPLIT ? 2 : 4;
  template <int MB>
  GGML_INLINE static void block(const uint8_t* p, const Inputs& in, int64_t b, __m256* acc) {
    const __m128i raw = k4_scale_bytes(p);  // scales[8], mins[8]
    const __m128i s8 = _mm_cvtepu8_epi16(raw);
    const __m256i s16 = _mm256_set_m128i(s8, s8);
    const __m256 d = _mm256_set1_ps(h2f(p));
    const __m256 neg_mn = _mm256_mul_ps(_mm256_set1_ps(-h2f(p + 2)),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))));
    ChunkSink<8> levels;
    F::chunks(p, levels);
    __m256i sums[MB], sums2[SPLIT ? MB : 1];
    for (int m = 0; m < MB; ++m) sums[m] = _mm256_setzero_si256();
    if constexpr (SPLIT)
      for (int m = 0; m < MB; ++m) sums2[m] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i sc = pick_scales(s16, kOneScale, j);
      for (int m = 0; m < MB; ++m) {
        const __m256i pairs = _mm256_maddubs_epi16(levels.q[j], in.levels(m, 256 * b + 32 * j));
        sums[m] = _mm256_add_epi32(sums[m], _mm256_madd_epi16(pairs, sc));
        if constexpr (SPLIT) {
          const __m256i pairs2 = _mm256_maddubs_epi16(levels.q[j], in.levels2(m, 256 * b + 32 * j));
          sums2[m] = _mm256_add_epi32(sums2[m], _mm256_madd_epi16(pairs2, sc));
        }
      }
    }
    if constexpr (SPLIT)  // 254 a + b: once a block
      for (int m = 0; m < MB; ++m)
        sums[m] = _mm256_add_epi32(_mm256_mullo_epi32(sums[m], _mm256_set1_epi32(254)), sums2[m]);
    const __m256 dscale = SPLIT ? _mm256_mul_ps(d, _mm256_set1_ps(1.0f / 254.0f)) : d;
    for (int m = 0; m < MB; ++m) {
      const __m256 dx = _mm256_mul_ps(dscale, _mm256_broadcast_ss(in.d + m * in.ldd + b));
      acc[m] = _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(sums[m]), acc[m]);
      // - min * sum(x) for the 8 sub-blocks, lane by lane
      acc[m] = _mm256_fmadd_ps(neg_mn, _mm256_loadu_ps(in.s + m * in.lds + 8 * b), acc[m]);
    }
  }
};

// Q6_K (FQ6_K): 16 sub-blocks of 16 (two a chunk), signed 8-bit scales, levels 0..63 - 32. As in K4
// the input has one scale for the block and the sub-block scales multiply in integers: chunk j's
// pair sums of the stored levels 0..63 (_mm256_maddubs_epi16, at most 2 * 63 * 127) for its values
// 0-15 (lanes 0-7) times scale 2j, for 16-31 (lanes 8-15) times scale 2j + 1; the offset 32 comes off
// once a block as 32 * (scales . the input levels' sums over each 16), as llama.cpp does with its
// Q8_K sums (at most 8 * 2 * 16002 * 128 + 32 * 16 * 2032 * 128 per lane). SPLIT: split inputs, the
// second level's sums apart (254 times the first's would overflow int32), with its own offset, and
// scaled by d * dx / 254.
template <bool SPLIT = false>
struct Q6_K {
  static constexpr int QK = 256, TS = FQ6_K::TS, ROWS = SPLIT ? 2 : 4;
  template <int MB>
  GGML_INLINE static void block(const uint8_t* p, const Inputs& in, int64_t b, __m256* acc) {
    const __m256i s16 = _mm256_cvtepi8_epi16(load128(p + 192));  // the 16 scales
    const __m256i first = _mm256_permute2x128_si256(s16, s16, 0x00);  // scales 0-7 in both halves
    const __m256i second = _mm256_permute2x128_si256(s16, s16, 0x11);  // 8-15
    const __m256 d = _mm256_set1_ps(h2f(p + 208));
    ChunkSink<8> levels;
    FQ6_K::unsigned_chunks(p, levels);
    __m256i sums[MB], sums2[SPLIT ? MB : 1];
    for (int m = 0; m < MB; ++m) {
      const auto* level_sums = reinterpret_cast<const uint8_t*>(in.s16 + m * in.lds16 + 16 * b);
      const __m256i offset = _mm256_madd_epi16(load256(level_sums), s16);
      sums[m] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
      if constexpr (SPLIT) {
        const auto* level_sums2 = reinterpret_cast<const uint8_t*>(in.s16_2 + m * in.lds16 + 16 * b);
        const __m256i offset2 = _mm256_madd_epi16(load256(level_sums2), s16);
        sums2[m] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset2, 5));
      }
    }
    for (int j = 0; j < 8; ++j) {
      const __m256i sc = pick_scales(j < 4 ? first : second, kTwoScales, j);
      for (int m = 0; m < MB; ++m) {
        const __m256i pairs = _mm256_maddubs_epi16(levels.q[j], in.levels(m, 256 * b + 32 * j));
        sums[m] = _mm256_add_epi32(sums[m], _mm256_madd_epi16(pairs, sc));
        if constexpr (SPLIT) {
          const __m256i pairs2 = _mm256_maddubs_epi16(levels.q[j], in.levels2(m, 256 * b + 32 * j));
          sums2[m] = _mm256_add_epi32(sums2[m], _mm256_madd_epi16(pairs2, sc));
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 dx = _mm256_mul_ps(d, _mm256_broadcast_ss(in.d + m * in.ldd + b));
      acc[m] = _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(sums[m]), acc[m]);
      if constexpr (SPLIT) {
        const __m256 dx2 = _mm256_mul_ps(dx, _mm256_set1_ps(1.0f / 254.0f));
        acc[m] = _mm256_fmadd_ps(dx2, _mm256_cvtepi32_ps(sums2[m]), acc[m]);
      }
    }
  }
};

// out[m, r] for weight row r and the input rows m0 .. m0 + MB - 1.
template <class T, int MB>
GGML_TARGET void row_dot(const uint8_t* row, int64_t nblocks, const Inputs& in, float* out, int64_t ldo) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    prefetch_block_ahead<T::TS>(row + b * T::TS);  // every line of the block (ggml_kernels.h)
    T::template block<MB>(row + b * T::TS, in, b, acc);
  }
  for (int m = 0; m < MB; ++m) out[m * ldo] = hsum(acc[m]);
}

// row_dot for n (1 .. MB) input rows.
template <class T, int MB>
GGML_TARGET void row_dot_n(int n, const uint8_t* row, int64_t nblocks, const Inputs& in, float* out, int64_t ldo) {
  if constexpr (MB > 1) {
    if (n < MB) return row_dot_n<T, MB - 1>(n, row, nblocks, in, out, ldo);
  }
  row_dot<T, MB>(row, nblocks, in, out, ldo);
}

// The input rows a pass over a weight row takes at most (T::ROWS): 8 for the 32-value types
// (accumulators and one chunk in registers), 4 for the K-quants (their 8 chunks of a block stay in
// registers beside them), 2 with split inputs (two integer sums a row).
template <class T>
GGML_TARGET void rows(const MatmulArgs& a, int64_t r0, int64_t r1) {
  constexpr int MB = T::ROWS;
  const int64_t rb = a.row_bytes(), nblocks = a.K / T::QK, ldd = a.K / a.xrun;
  // M rows in passes of even size (5 with MB = 4: 3 + 2, not 4 + 1: a pass decodes the row's blocks
  // again, which a single row does not amortize)
  const int64_t passes = (a.M + MB - 1) / MB;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.w + r * rb;
    for (int64_t m = 0, p = 0; m < a.M; ++p) {
      const int n = static_cast<int>((a.M - m + (passes - p) - 1) / (passes - p));
      const Inputs in{a.xq + m * a.K,
                      a.xd + m * ldd,
                      a.xsum ? a.xsum + m * (a.K / 32) : nullptr,
                      a.K,
                      ldd,
                      a.K / 32,
                      a.xsum16 ? a.xsum16 + m * (a.K / 16) : nullptr,
                      a.K / 16,
                      a.xq2 ? a.xq2 + m * a.K : nullptr,
                      a.xsum16_2 ? a.xsum16_2 + m * (a.K / 16) : nullptr};
      row_dot_n<T, MB>(n, row, nblocks, in, a.out + m * a.N + r, a.N);
      m += n;
    }
  }
}

}  // namespace int8_rows

// The int8 loop of type T, with split inputs where a.xq2 is set.
template <template <class, bool> class T, class F>
GGML_TARGET void rows_of(const MatmulArgs& a, int64_t r0, int64_t r1) {
  if (a.xq2 != nullptr) int8_rows::rows<T<F, true>>(a, r0, r1);
  else int8_rows::rows<T<F, false>>(a, r0, r1);
}

// Runs the dedicated int8 loop of a type; false for the types without one.
inline bool int8_rows_product(const MatmulArgs& a, int64_t r0, int64_t r1) {
  switch (a.type->id) {
    case kQ8_0:
      rows_of<int8_rows::Legacy, FQ8_0>(a, r0, r1);
      return true;
    case kQ4_0:
      rows_of<int8_rows::Legacy, FQ4_0>(a, r0, r1);
      return true;
    case kQ4_1:
      rows_of<int8_rows::Legacy, FQ4_1>(a, r0, r1);
      return true;
    case kQ5_0:
      rows_of<int8_rows::Legacy, FQ5_0>(a, r0, r1);
      return true;
    case kQ5_1:
      rows_of<int8_rows::Legacy, FQ5_1>(a, r0, r1);
      return true;
    case kQ4_K:
      rows_of<int8_rows::K4, FQ4_K>(a, r0, r1);
      return true;
    case kQ5_K:
      rows_of<int8_rows::K4, FQ5_K>(a, r0, r1);
      return true;
    case kQ6_K:
      if (a.xq2 != nullptr) int8_rows::rows<int8_rows::Q6_K<true>>(a, r0, r1);
      else int8_rows::rows<int8_rows::Q6_K<>>(a, r0, r1);
      return true;
  }
  return false;
}

}  // namespace metalnn_ggml

#endif  // METALNN_GGML_X86
