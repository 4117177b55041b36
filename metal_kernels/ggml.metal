// Products with weights packed in a GGML tensor type (metalnn.ggml): dequantize, a matrix-vector
// product for decoding and a tiled matrix-matrix product for prompts, for every type.
//
// Layout: the weight w is uint8 [rows, row_bytes], row-contiguous; a row of `cols` values is
// cols / QK blocks of QB bytes each (QK, QB: the type's block_size and type_size, ggml_block(Q)
// and ggml_bytes(Q) below). Q, a template constant, is the type's GGUF type id; the decode of each
// type is one function (ggml_dq_<type>) that writes one *unit* of values: 16 consecutive values of
// a block (chunk c of a 32- or 256-value block), or a single value for the float types (F32, F16,
// BF16, whose rows may hold any number of values). Unit u of a row covers values
// [u * U, u * U + U) with U = ggml_unit(Q). The decoders follow the MLX decoders of metalnn.ggml
// operation for operation (same products, same order, float32), so `dequantize` is bit-exact with
// them where the compiler keeps every rounding (no contraction of a * b + c into an fma).
// Codebook types (IQ2_XXS ... IQ1_M) read their grid from `tab` (float32 [points, coords], the
// tables of metalnn.ggml.grids); the other types get an unused `tab`. The sign bytes of
// ksigns_iq2xs are computed (k with bit 7 making the count of set bits even).
//
// Kernels:
//   dequantize: out[r, :] = decode(w[r, :]) (float32); one thread per unit.
//   matvec:     y[m, n] = sum_k x[m, k] * W[n, k] for few rows of x (decoding). A SIMD group owns
//               GGML_MV_ROWS rows of W; its lanes stride the units of a row, decode each unit once
//               and multiply it with up to GGML_MV_X rows of x held in registers' partial sums,
//               reduced with simd_sum (rows of x in batches of GGML_MV_X, so any count works).
//               Threadgroup of 32 * GGML_MV_SIMDGROUPS threads; grid = ceil(N / rows per
//               threadgroup) threadgroups.
//   matmul:     the same product tiled for many rows of x (prompts). A threadgroup of 128 threads
//               (4 SIMD groups) computes a 32 (rows of W) x 32 (rows of x) tile of y^T = W @ x^T:
//               the reduction is walked in GGML_MM_BK = 64 chunks; all threads decode the W chunk
//               [32 x 64] unit by unit into threadgroup memory and stage the x chunk transposed
//               [64 x 32] (as float), a barrier, then each SIMD group multiplies its 16 x 16
//               quarter with 2 x 2 simdgroup_float8x8 accumulators, a barrier. Rows past the edges
//               and values past `cols` stage as 0 (a unit lies wholly inside or outside a row,
//               since cols and 64 are multiples of U). Grid (ceil(N / 32) * 128, ceil(M / 32)).
// Accumulation is in float whatever T (the dtype of x and y) is. Loops containing a barrier have
// bounds uniform over the threadgroup (no early return in matmul); SIMD operations in matvec sit
// under conditions uniform over the SIMD group. Inputs are read through template pointer types:
// MLX passes an input of fewer than 8 elements as `const constant T*` (a 1 x 1 F16 weight holds
// 2 bytes), others as `const device T*`.

// @header
#define GGML_MV_SIMDGROUPS 2
#define GGML_MV_ROWS 2
#define GGML_MV_X 8
#define GGML_MM_BN 32
#define GGML_MM_BM 32
#define GGML_MM_BK 64
#define GGML_MM_THREADS 128
// Row stride of the staged x chunk [GGML_MM_BK][GGML_MM_LDX]: one column of padding.
#define GGML_MM_LDX (GGML_MM_BM + 1)

// Values a block (QK), bytes a block (QB) and values a unit (U) of type Q (GGUF type ids).
constexpr uint ggml_block(int q) {
  return (q == 0 || q == 1 || q == 30) ? 1u
       : (q == 2 || q == 3 || q == 6 || q == 7 || q == 8 || q == 20 || q == 39) ? 32u : 256u;
}

constexpr uint ggml_bytes(int q) {
  switch (q) {
    case 0: return 4u;     // F32
    case 1: return 2u;     // F16
    case 30: return 2u;    // BF16
    case 2: return 18u;    // Q4_0
    case 3: return 20u;    // Q4_1
    case 6: return 22u;    // Q5_0
    case 7: return 24u;    // Q5_1
    case 8: return 34u;    // Q8_0
    case 10: return 84u;   // Q2_K
    case 11: return 110u;  // Q3_K
    case 12: return 144u;  // Q4_K
    case 13: return 176u;  // Q5_K
    case 14: return 210u;  // Q6_K
    case 16: return 66u;   // IQ2_XXS
    case 17: return 74u;   // IQ2_XS
    case 18: return 98u;   // IQ3_XXS
    case 19: return 50u;   // IQ1_S
    case 20: return 18u;   // IQ4_NL
    case 21: return 110u;  // IQ3_S
    case 22: return 82u;   // IQ2_S
    case 23: return 136u;  // IQ4_XS
    case 29: return 56u;   // IQ1_M
    case 34: return 54u;   // TQ1_0
    case 35: return 66u;   // TQ2_0
    case 39: return 17u;   // MXFP4
    default: return 0u;
  }
}

constexpr uint ggml_unit(int q) {
  return ggml_block(q) == 1u ? 1u : 16u;
}

constant float GGML_KVALUES_IQ4NL[16] = {-127.0f, -104.0f, -83.0f, -65.0f, -49.0f, -35.0f, -22.0f, -10.0f,
                                         1.0f, 13.0f, 25.0f, 38.0f, 53.0f, 69.0f, 89.0f, 113.0f};
constant float GGML_KVALUES_MXFP4[16] = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f, 12.0f,
                                         0.0f, -1.0f, -2.0f, -3.0f, -4.0f, -6.0f, -8.0f, -12.0f};
constant uint GGML_POW3[5] = {1u, 3u, 9u, 27u, 81u};

// -- byte readers: `w` is the packed input (device or constant pointer), `o` a byte offset ------

template <typename P>
inline uint ggml_u8(P w, size_t o) {
  return uint(w[o]);
}

template <typename P>
inline uint ggml_u16(P w, size_t o) {
  return uint(w[o]) | (uint(w[o + 1]) << 8);
}

template <typename P>
inline uint ggml_u32(P w, size_t o) {
  return ggml_u16(w, o) | (ggml_u16(w, o + 2) << 16);
}

inline float ggml_half_bits(uint bits) {
  const ushort h = ushort(bits);
  return float(as_type<half>(h));
}

template <typename P>
inline float ggml_f16(P w, size_t o) {
  return ggml_half_bits(ggml_u16(w, o));
}

// -1 where bit j of the sign byte is set, else 1.
inline float ggml_sign(uint bits, uint j) {
  return ((bits >> j) & 1u) != 0u ? -1.0f : 1.0f;
}

// ksigns_iq2xs[k]: the 7 stored sign bits with an 8th making the count of set bits even.
inline uint ggml_ksigns(uint k) {
  return k | ((popcount(k) & 1u) << 7);
}

// d * (0.5 + s) * 0.25 (IQ2 types), rounded as the MLX decoder rounds it.
inline float ggml_quarter_scale(float d, uint s) {
  return d * (0.5f + float(s)) * 0.25f;
}

// The 6-bit scale and minimum of sub-block i (of 8) of Q4_K / Q5_K from the 12 bytes at `o`.
template <typename P>
inline void ggml_scale_min_k4(P w, size_t o, uint i, thread uint& sc, thread uint& mn) {
  if (i < 4u) {
    sc = ggml_u8(w, o + i) & 63u;
    mn = ggml_u8(w, o + i + 4u) & 63u;
  } else {
    sc = (ggml_u8(w, o + i + 4u) & 15u) | ((ggml_u8(w, o + i - 4u) >> 6) << 4);
    mn = (ggml_u8(w, o + i + 4u) >> 4) | ((ggml_u8(w, o + i) >> 6) << 4);
  }
}

// -- one decoder per type: block at byte `b`, chunk `c` (16 values), into v[0..16) --------------
// (the float types: the value at byte `b` into v[0])

template <typename P>
inline void ggml_dq_f32(P w, size_t b, thread float* v) {
  const uint bits = ggml_u32(w, b);
  v[0] = as_type<float>(bits);
}

template <typename P>
inline void ggml_dq_f16(P w, size_t b, thread float* v) {
  v[0] = ggml_f16(w, b);
}

template <typename P>
inline void ggml_dq_bf16(P w, size_t b, thread float* v) {
  const uint bits = ggml_u16(w, b) << 16;
  v[0] = as_type<float>(bits);
}

// Q4_0: d f16, qs[16]; value j in the low nibble of qs[j], j + 16 in its high one; x = d * (q - 8).
template <typename P>
inline void ggml_dq_q4_0(P w, size_t b, uint c, thread float* v) {
  const float d = ggml_f16(w, b);
  for (uint t = 0; t < 16u; ++t) {
    v[t] = d * (float((ggml_u8(w, b + 2u + t) >> (4u * c)) & 15u) - 8.0f);
  }
}

// Q4_1: d, m f16, qs[16]; x = d * q + m.
template <typename P>
inline void ggml_dq_q4_1(P w, size_t b, uint c, thread float* v) {
  const float d = ggml_f16(w, b);
  const float m = ggml_f16(w, b + 2u);
  for (uint t = 0; t < 16u; ++t) {
    v[t] = d * float((ggml_u8(w, b + 4u + t) >> (4u * c)) & 15u) + m;
  }
}

// Q5_0: d f16, qh u32 (bit j: fifth bit of value j), qs[16]; x = d * (q - 16).
template <typename P>
inline void ggml_dq_q5_0(P w, size_t b, uint c, thread float* v) {
  const float d = ggml_f16(w, b);
  const uint qh = ggml_u32(w, b + 2u);
  for (uint t = 0; t < 16u; ++t) {
    const uint q = ((ggml_u8(w, b + 6u + t) >> (4u * c)) & 15u) | (((qh >> (16u * c + t)) & 1u) << 4);
    v[t] = d * (float(q) - 16.0f);
  }
}

// Q5_1: d, m f16, qh u32, qs[16]; x = d * q + m.
template <typename P>
inline void ggml_dq_q5_1(P w, size_t b, uint c, thread float* v) {
  const float d = ggml_f16(w, b);
  const float m = ggml_f16(w, b + 2u);
  const uint qh = ggml_u32(w, b + 4u);
  for (uint t = 0; t < 16u; ++t) {
    const uint q = ((ggml_u8(w, b + 8u + t) >> (4u * c)) & 15u) | (((qh >> (16u * c + t)) & 1u) << 4);
    v[t] = d * float(q) + m;
  }
}

// Q8_0: d f16, qs[32] int8; x = q * d.
template <typename P>
inline void ggml_dq_q8_0(P w, size_t b, uint c, thread float* v) {
  const float d = ggml_f16(w, b);
  for (uint t = 0; t < 16u; ++t) {
    const int q = int(ggml_u8(w, b + 2u + 16u * c + t));
    v[t] = float(q - ((q & 128) << 1)) * d;
  }
}

// Q2_K: scales[16], qs[64] (2-bit planes), d, dmin f16; chunk c is sub-block c;
// x = (d * (sc & 15)) * q - dmin * (sc >> 4).
template <typename P>
inline void ggml_dq_q2_k(P w, size_t b, uint c, thread float* v) {
  const uint sc = ggml_u8(w, b + c);
  const float dl = ggml_f16(w, b + 80u) * float(sc & 15u);
  const float ml = ggml_f16(w, b + 82u) * float(sc >> 4);
  const size_t q0 = b + 16u + 32u * (c / 8u) + 16u * (c % 2u);
  const uint shift = 2u * ((c % 8u) / 2u);
  for (uint t = 0; t < 16u; ++t) {
    v[t] = dl * float((ggml_u8(w, q0 + t) >> shift) & 3u) - ml;
  }
}

// Q3_K: hmask[32], qs[64] (2-bit planes), scales[12] (sixteen 6-bit), d f16;
// x = (d * (scale - 32)) * (low2 - (high bit ? 0 : 4)).
template <typename P>
inline void ggml_dq_q3_k(P w, size_t b, uint c, thread float* v) {
  const uint low = c < 8u ? (ggml_u8(w, b + 96u + c) & 15u) : (ggml_u8(w, b + 88u + c) >> 4);
  const uint high = (ggml_u8(w, b + 104u + c % 4u) >> (2u * (c / 4u))) & 3u;
  const float dl = ggml_f16(w, b + 108u) * (float(low | (high << 4)) - 32.0f);
  const uint j0 = 16u * (c % 2u);
  const size_t q0 = b + 32u + 32u * (c / 8u) + j0;
  const uint shift = 2u * ((c % 8u) / 2u);
  const uint hshift = c / 2u;
  for (uint t = 0; t < 16u; ++t) {
    const int low2 = int((ggml_u8(w, q0 + t) >> shift) & 3u);
    const int missing = ((ggml_u8(w, b + j0 + t) >> hshift) & 1u) != 0u ? 0 : 4;
    v[t] = dl * float(low2 - missing);
  }
}

// Q4_K: d, dmin f16, scales[12], qs[128] (nibble planes); x = (d * sc) * q - dmin * m.
template <typename P>
inline void ggml_dq_q4_k(P w, size_t b, uint c, thread float* v) {
  uint sc, mn;
  ggml_scale_min_k4(w, b + 4u, c / 2u, sc, mn);
  const float d1 = ggml_f16(w, b) * float(sc);
  const float m1 = ggml_f16(w, b + 2u) * float(mn);
  const size_t q0 = b + 16u + 32u * (c / 4u) + 16u * (c % 2u);
  const uint shift = 4u * ((c / 2u) % 2u);
  for (uint t = 0; t < 16u; ++t) {
    v[t] = d1 * float((ggml_u8(w, q0 + t) >> shift) & 15u) - m1;
  }
}

// Q5_K: d, dmin f16, scales[12], qh[32] (high-bit mask), qs[128]; x = (d * sc) * q - dmin * m.
template <typename P>
inline void ggml_dq_q5_k(P w, size_t b, uint c, thread float* v) {
  uint sc, mn;
  ggml_scale_min_k4(w, b + 4u, c / 2u, sc, mn);
  const float d1 = ggml_f16(w, b) * float(sc);
  const float m1 = ggml_f16(w, b + 2u) * float(mn);
  const uint j0 = 16u * (c % 2u);
  const size_t q0 = b + 48u + 32u * (c / 4u) + j0;
  const uint shift = 4u * ((c / 2u) % 2u);
  const uint hshift = c / 2u;
  for (uint t = 0; t < 16u; ++t) {
    const uint q = ((ggml_u8(w, q0 + t) >> shift) & 15u) | (((ggml_u8(w, b + 16u + j0 + t) >> hshift) & 1u) << 4);
    v[t] = d1 * float(q) - m1;
  }
}

// Q6_K: ql[128], qh[64], scales[16] int8, d f16; x = (d * scale) * (q - 32).
template <typename P>
inline void ggml_dq_q6_k(P w, size_t b, uint c, thread float* v) {
  const int s = int(ggml_u8(w, b + 192u + c));
  const float dl = ggml_f16(w, b + 208u) * float(s - ((s & 128) << 1));
  const uint h = c / 8u;
  const size_t lo0 = b + 64u * h + 16u * (c % 4u);
  const uint lo_shift = 4u * ((c % 8u) / 4u);
  const size_t hi0 = b + 128u + 32u * h + 16u * (c % 2u);
  const uint hi_shift = 2u * ((c % 8u) / 2u);
  for (uint t = 0; t < 16u; ++t) {
    const uint q = ((ggml_u8(w, lo0 + t) >> lo_shift) & 15u) | (((ggml_u8(w, hi0 + t) >> hi_shift) & 3u) << 4);
    v[t] = dl * (float(q) - 32.0f);
  }
}

// IQ4_NL: d f16, qs[16] (nibbles as Q4_0); x = d * kvalues_iq4nl[q].
template <typename P>
inline void ggml_dq_iq4_nl(P w, size_t b, uint c, thread float* v) {
  const float d = ggml_f16(w, b);
  for (uint t = 0; t < 16u; ++t) {
    v[t] = d * GGML_KVALUES_IQ4NL[(ggml_u8(w, b + 2u + t) >> (4u * c)) & 15u];
  }
}

// IQ4_XS: d f16, scales_h u16, scales_l[4], qs[128]; eight sub-blocks of 32 with 6-bit scales;
// x = (d * (ls - 32)) * kvalues_iq4nl[q].
template <typename P>
inline void ggml_dq_iq4_xs(P w, size_t b, uint c, thread float* v) {
  const uint i = c / 2u;
  const uint low = (ggml_u8(w, b + 4u + i / 2u) >> (4u * (i % 2u))) & 15u;
  const uint ls = low | (((ggml_u16(w, b + 2u) >> (2u * i)) & 3u) << 4);
  const float dl = ggml_f16(w, b) * (float(ls) - 32.0f);
  const size_t q0 = b + 8u + 16u * i;
  const uint shift = 4u * (c % 2u);
  for (uint t = 0; t < 16u; ++t) {
    v[t] = dl * GGML_KVALUES_IQ4NL[(ggml_u8(w, q0 + t) >> shift) & 15u];
  }
}

// MXFP4: e u8 (E8M0, read as half its power of two, as ggml does), qs[16] (FP4 E2M1 codes, nibbles
// as Q4_0); x = half(e) * kvalues_mxfp4[q].
template <typename P>
inline void ggml_dq_mxfp4(P w, size_t b, uint c, thread float* v) {
  const uint e = ggml_u8(w, b);
  const uint bits = e < 2u ? (0x00200000u << e) : ((e - 1u) << 23);
  const float half_scale = as_type<float>(bits);
  for (uint t = 0; t < 16u; ++t) {
    v[t] = half_scale * GGML_KVALUES_MXFP4[(ggml_u8(w, b + 1u + t) >> (4u * c)) & 15u];
  }
}

// TQ1_0: qs[48], qh[4] (base-3 digits as fixed-point fractions), d f16; x = d * (digit - 1).
template <typename P>
inline void ggml_dq_tq1_0(P w, size_t b, uint c, thread float* v) {
  const float d = ggml_f16(w, b + 52u);
  for (uint t = 0; t < 16u; ++t) {
    const uint idx = 16u * c + t;
    uint p, o;
    if (idx < 160u) {
      p = idx / 32u;
      o = idx % 32u;
    } else if (idx < 240u) {
      p = (idx - 160u) / 16u;
      o = 32u + (idx - 160u) % 16u;
    } else {
      p = (idx - 240u) / 4u;
      o = 48u + (idx - 240u) % 4u;
    }
    const uint digit = (((ggml_u8(w, b + o) * GGML_POW3[p]) & 255u) * 3u) >> 8;
    v[t] = d * (float(digit) - 1.0f);
  }
}

// TQ2_0: qs[64] (2-bit planes), d f16; x = d * (q - 1).
template <typename P>
inline void ggml_dq_tq2_0(P w, size_t b, uint c, thread float* v) {
  const float d = ggml_f16(w, b + 64u);
  const size_t q0 = b + 32u * (c / 8u) + 16u * (c % 2u);
  const uint shift = 2u * ((c % 8u) / 2u);
  for (uint t = 0; t < 16u; ++t) {
    v[t] = d * (float((ggml_u8(w, q0 + t) >> shift) & 3u) - 1.0f);
  }
}

// IQ2_XXS: d f16, then per 32 values 4 grid indices (8 values each) and a u32 of four 7-bit sign
// indices and the 4-bit scale s (bits 28-31); x = (d * (0.5 + s) * 0.25) * grid * sign.
template <typename P, typename TP>
inline void ggml_dq_iq2_xxs(P w, size_t b, uint c, TP tab, thread float* v) {
  const size_t g = b + 2u + 8u * (c / 2u);
  const uint aux = ggml_u32(w, g + 4u);
  const float db = ggml_quarter_scale(ggml_f16(w, b), aux >> 28);
  for (uint t = 0; t < 16u; ++t) {
    const uint l = 2u * (c % 2u) + t / 8u;
    const uint j = t % 8u;
    const float grid = tab[ggml_u8(w, g + l) * 8u + j];
    v[t] = db * grid * ggml_sign(ggml_ksigns((aux >> (7u * l)) & 127u), j);
  }
}

// IQ2_XS: d f16, qs[32] u16 (9-bit grid index, 7-bit sign index), scales[8] (a nibble per 16 values).
template <typename P, typename TP>
inline void ggml_dq_iq2_xs(P w, size_t b, uint c, TP tab, thread float* v) {
  const uint s = (ggml_u8(w, b + 66u + c / 2u) >> (4u * (c % 2u))) & 15u;
  const float db = ggml_quarter_scale(ggml_f16(w, b), s);
  for (uint t = 0; t < 16u; ++t) {
    const uint q = ggml_u16(w, b + 2u + 2u * (2u * c + t / 8u));
    const uint j = t % 8u;
    const float grid = tab[(q & 511u) * 8u + j];
    v[t] = db * grid * ggml_sign(ggml_ksigns(q >> 9), j);
  }
}

// IQ2_S: d f16, qs[32] (low 8 index bits), signs[32], qh[8] (2 high index bits a group), scales[8].
template <typename P, typename TP>
inline void ggml_dq_iq2_s(P w, size_t b, uint c, TP tab, thread float* v) {
  const uint s = (ggml_u8(w, b + 74u + c / 2u) >> (4u * (c % 2u))) & 15u;
  const float db = ggml_quarter_scale(ggml_f16(w, b), s);
  for (uint t = 0; t < 16u; ++t) {
    const uint l = 2u * c + t / 8u;
    const uint j = t % 8u;
    const uint index = ggml_u8(w, b + 2u + l) | (((ggml_u8(w, b + 66u + l / 4u) >> (2u * (l % 4u))) & 3u) << 8);
    const float grid = tab[index * 8u + j];
    v[t] = db * grid * ggml_sign(ggml_u8(w, b + 34u + l), j);
  }
}

// IQ3_XXS: d f16, qs[64] (indices into a 4-value grid), 8 u32 (sign indices and s per 32 values);
// x = (d * (0.5 + s) * 0.5) * grid * sign.
template <typename P, typename TP>
inline void ggml_dq_iq3_xxs(P w, size_t b, uint c, TP tab, thread float* v) {
  const uint aux = ggml_u32(w, b + 66u + 4u * (c / 2u));
  const float db = ggml_f16(w, b) * (0.5f + float(aux >> 28)) * 0.5f;
  for (uint t = 0; t < 16u; ++t) {
    const uint idx = 16u * c + t;
    const uint l = (idx % 32u) / 8u;
    const float grid = tab[ggml_u8(w, b + 2u + idx / 4u) * 4u + idx % 4u];
    v[t] = db * grid * ggml_sign(ggml_ksigns((aux >> (7u * l)) & 127u), idx % 8u);
  }
}

// IQ3_S: d f16, qs[64] (low 8 index bits), qh[8] (bit 8 of each index), signs[32], scales[4]
// (a nibble per 32 values); x = (d * (1 + 2 s)) * grid * sign.
template <typename P, typename TP>
inline void ggml_dq_iq3_s(P w, size_t b, uint c, TP tab, thread float* v) {
  const uint k = c / 2u;
  const uint s = (ggml_u8(w, b + 106u + k / 2u) >> (4u * (k % 2u))) & 15u;
  const float db = ggml_f16(w, b) * float(1u + 2u * s);
  for (uint t = 0; t < 16u; ++t) {
    const uint idx = 16u * c + t;
    const uint m = idx / 4u;
    const uint index = ggml_u8(w, b + 2u + m) | (((ggml_u8(w, b + 66u + m / 8u) >> (m % 8u)) & 1u) << 8);
    const float grid = tab[index * 4u + idx % 4u];
    v[t] = db * grid * ggml_sign(ggml_u8(w, b + 74u + idx / 8u), idx % 8u);
  }
}

// IQ1_S: d f16, qs[32] (low 8 index bits), qh[8] u16 per 32 values (3 high index bits a group,
// s in bits 12-14, the sign of delta in bit 15); x = (d * (2 s + 1)) * (grid + delta).
template <typename P, typename TP>
inline void ggml_dq_iq1_s(P w, size_t b, uint c, TP tab, thread float* v) {
  const uint qh = ggml_u16(w, b + 34u + 2u * (c / 2u));
  const float dl = ggml_f16(w, b) * float(2u * ((qh >> 12) & 7u) + 1u);
  const float delta = (qh & 0x8000u) != 0u ? -0.125f : 0.125f;
  for (uint t = 0; t < 16u; ++t) {
    const uint l = 2u * c + t / 8u;
    const uint index = ggml_u8(w, b + 2u + l) | (((qh >> (3u * (l % 4u))) & 7u) << 8);
    v[t] = dl * (tab[index * 8u + t % 8u] + delta);
  }
}

// IQ1_M: qs[32], qh[16] (a nibble a group: 3 high index bits, the sign of delta), scales[4] u16
// (3-bit s per 16 values; bits 12-15 of the four are the nibbles of the float16 d);
// x = (d * (2 s + 1)) * (grid + delta).
template <typename P, typename TP>
inline void ggml_dq_iq1_m(P w, size_t b, uint c, TP tab, thread float* v) {
  uint dbits = 0u;
  for (uint m = 0; m < 4u; ++m) {
    dbits |= (ggml_u16(w, b + 48u + 2u * m) >> 12) << (4u * m);
  }
  const uint s = (ggml_u16(w, b + 48u + 2u * (c / 4u)) >> (3u * (c % 4u))) & 7u;
  const float dl = ggml_half_bits(dbits) * float(2u * s + 1u);
  for (uint t = 0; t < 16u; ++t) {
    const uint l = 2u * c + t / 8u;
    const uint h = (ggml_u8(w, b + 32u + l / 2u) >> (4u * (l % 2u))) & 15u;
    const uint index = ggml_u8(w, b + l) | ((h & 7u) << 8);
    const float delta = (h & 8u) != 0u ? -0.125f : 0.125f;
    v[t] = dl * (tab[index * 8u + t % 8u] + delta);
  }
}

// Unit u of the row starting at byte `row` into v[0..ggml_unit(Q)).
template <int Q, typename P, typename TP>
inline void ggml_decode_unit(P w, size_t row, uint u, TP tab, thread float* v) {
  const uint per = ggml_block(Q) / ggml_unit(Q);
  const size_t b = row + size_t(u / per) * ggml_bytes(Q);
  const uint c = u % per;
  if (Q == 0) {
    ggml_dq_f32(w, b, v);
  } else if (Q == 1) {
    ggml_dq_f16(w, b, v);
  } else if (Q == 30) {
    ggml_dq_bf16(w, b, v);
  } else if (Q == 2) {
    ggml_dq_q4_0(w, b, c, v);
  } else if (Q == 3) {
    ggml_dq_q4_1(w, b, c, v);
  } else if (Q == 6) {
    ggml_dq_q5_0(w, b, c, v);
  } else if (Q == 7) {
    ggml_dq_q5_1(w, b, c, v);
  } else if (Q == 8) {
    ggml_dq_q8_0(w, b, c, v);
  } else if (Q == 10) {
    ggml_dq_q2_k(w, b, c, v);
  } else if (Q == 11) {
    ggml_dq_q3_k(w, b, c, v);
  } else if (Q == 12) {
    ggml_dq_q4_k(w, b, c, v);
  } else if (Q == 13) {
    ggml_dq_q5_k(w, b, c, v);
  } else if (Q == 14) {
    ggml_dq_q6_k(w, b, c, v);
  } else if (Q == 20) {
    ggml_dq_iq4_nl(w, b, c, v);
  } else if (Q == 23) {
    ggml_dq_iq4_xs(w, b, c, v);
  } else if (Q == 39) {
    ggml_dq_mxfp4(w, b, c, v);
  } else if (Q == 34) {
    ggml_dq_tq1_0(w, b, c, v);
  } else if (Q == 35) {
    ggml_dq_tq2_0(w, b, c, v);
  } else if (Q == 16) {
    ggml_dq_iq2_xxs(w, b, c, tab, v);
  } else if (Q == 17) {
    ggml_dq_iq2_xs(w, b, c, tab, v);
  } else if (Q == 22) {
    ggml_dq_iq2_s(w, b, c, tab, v);
  } else if (Q == 18) {
    ggml_dq_iq3_xxs(w, b, c, tab, v);
  } else if (Q == 21) {
    ggml_dq_iq3_s(w, b, c, tab, v);
  } else if (Q == 19) {
    ggml_dq_iq1_s(w, b, c, tab, v);
  } else if (Q == 29) {
    ggml_dq_iq1_m(w, b, c, tab, v);
  }
}

// Bytes of a row of `cols` values.
template <int Q>
inline size_t ggml_row_bytes(int cols) {
  return size_t(uint(cols) / ggml_block(Q)) * ggml_bytes(Q);
}

// @kernel dequantize
// @inputs w, tab, rows, cols
// @outputs out
// Template: Q. out is float32 [rows, cols]; grid = rows * cols / ggml_unit(Q) threads.
  constexpr uint U = ggml_unit(Q);
  const uint units = uint(cols) / U;
  const size_t t = size_t(thread_position_in_grid.x);
  if (t >= size_t(rows) * size_t(units)) {
    return;
  }
  const uint r = uint(t / units);
  const uint u = uint(t % units);
  float v[U];
  ggml_decode_unit<Q>(w, size_t(r) * ggml_row_bytes<Q>(cols), u, tab, v);
  const size_t o = size_t(r) * size_t(cols) + size_t(u) * U;
  for (uint i = 0; i < U; ++i) {
    out[o + i] = v[i];
  }

// @kernel matvec
// @inputs w, x, tab, rows, cols, xrows
// @outputs y
// Template: T (dtype of x and y), Q. x [xrows, cols], y [xrows, rows].
  constexpr uint U = ggml_unit(Q);
  const uint lane = thread_index_in_simdgroup;
  const uint group = threadgroup_position_in_grid.x * GGML_MV_SIMDGROUPS + simdgroup_index_in_threadgroup;
  const uint first = group * GGML_MV_ROWS;
  const uint n_rows = uint(rows);
  if (first >= n_rows) {
    return;  // the whole SIMD group: `first` is uniform over it
  }
  const uint K = uint(cols);
  const uint M = uint(xrows);
  const uint units = K / U;
  const size_t row_bytes = ggml_row_bytes<Q>(cols);
  for (uint m0 = 0; m0 < M; m0 += GGML_MV_X) {
    float acc[GGML_MV_ROWS][GGML_MV_X];
    for (uint r = 0; r < GGML_MV_ROWS; ++r) {
      for (uint m = 0; m < GGML_MV_X; ++m) {
        acc[r][m] = 0.0f;
      }
    }
    for (uint u = lane; u < units; u += 32u) {
      for (uint r = 0; r < GGML_MV_ROWS; ++r) {
        if (first + r < n_rows) {
          float v[U];
          ggml_decode_unit<Q>(w, size_t(first + r) * row_bytes, u, tab, v);
          for (uint m = 0; m < GGML_MV_X; ++m) {
            if (m0 + m < M) {
              const size_t xo = size_t(m0 + m) * K + size_t(u) * U;
              float part = 0.0f;
              for (uint i = 0; i < U; ++i) {
                part += float(x[xo + i]) * v[i];
              }
              acc[r][m] += part;
            }
          }
        }
      }
    }
    for (uint r = 0; r < GGML_MV_ROWS; ++r) {
      if (first + r < n_rows) {
        for (uint m = 0; m < GGML_MV_X; ++m) {
          if (m0 + m < M) {
            const float total = simd_sum(acc[r][m]);
            if (lane == 0u) {
              y[size_t(m0 + m) * n_rows + first + r] = static_cast<T>(total);
            }
          }
        }
      }
    }
  }

// @kernel matmul
// @inputs w, x, tab, rows, cols, xrows
// @outputs y
// Template: T (dtype of x and y), Q. x [xrows, cols], y [xrows, rows]. Tile of y^T = W @ x^T.
  threadgroup float Ws[GGML_MM_BN * GGML_MM_BK];
  threadgroup float Xs[GGML_MM_BK * GGML_MM_LDX];
  threadgroup float Cs[GGML_MM_BN * GGML_MM_BM];
  constexpr uint U = ggml_unit(Q);
  constexpr uint UNITS = GGML_MM_BK / U;  // units of a row in one chunk
  const uint tid = thread_index_in_threadgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const uint sn = sg / 2u;  // the SIMD group's 16 rows of W in the tile
  const uint sm = sg % 2u;  // its 16 rows of x
  const uint n0 = threadgroup_position_in_grid.x * GGML_MM_BN;
  const uint m0 = threadgroup_position_in_grid.y * GGML_MM_BM;
  const uint N = uint(rows);
  const uint K = uint(cols);
  const uint M = uint(xrows);
  const size_t row_bytes = ggml_row_bytes<Q>(cols);

  simdgroup_float8x8 acc[4];
  for (uint i = 0; i < 4u; ++i) {
    acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  for (uint k0 = 0; k0 < K; k0 += GGML_MM_BK) {
    for (uint e = tid; e < GGML_MM_BN * UNITS; e += GGML_MM_THREADS) {
      const uint n = e / UNITS;
      const uint ku = e % UNITS;
      const uint k = k0 + ku * U;
      float v[U];
      if (n0 + n < N && k < K) {
        ggml_decode_unit<Q>(w, size_t(n0 + n) * row_bytes, k / U, tab, v);
      } else {
        for (uint i = 0; i < U; ++i) {
          v[i] = 0.0f;
        }
      }
      for (uint i = 0; i < U; ++i) {
        Ws[n * GGML_MM_BK + ku * U + i] = v[i];
      }
    }
    for (uint e = tid; e < GGML_MM_BM * GGML_MM_BK; e += GGML_MM_THREADS) {
      const uint m = e / GGML_MM_BK;
      const uint k = e % GGML_MM_BK;
      float xv = 0.0f;
      if (m0 + m < M && k0 + k < K) {
        xv = float(x[size_t(m0 + m) * K + k0 + k]);
      }
      Xs[k * GGML_MM_LDX + m] = xv;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < GGML_MM_BK; kk += 8u) {
      simdgroup_float8x8 a0;
      simdgroup_float8x8 a1;
      simdgroup_float8x8 b0;
      simdgroup_float8x8 b1;
      simdgroup_load(a0, Ws + (sn * 16u) * GGML_MM_BK + kk, GGML_MM_BK);
      simdgroup_load(a1, Ws + (sn * 16u + 8u) * GGML_MM_BK + kk, GGML_MM_BK);
      simdgroup_load(b0, Xs + kk * GGML_MM_LDX + sm * 16u, GGML_MM_LDX);
      simdgroup_load(b1, Xs + kk * GGML_MM_LDX + sm * 16u + 8u, GGML_MM_LDX);
      simdgroup_multiply_accumulate(acc[0], a0, b0, acc[0]);
      simdgroup_multiply_accumulate(acc[1], a0, b1, acc[1]);
      simdgroup_multiply_accumulate(acc[2], a1, b0, acc[2]);
      simdgroup_multiply_accumulate(acc[3], a1, b1, acc[3]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0; i < 2u; ++i) {
    for (uint j = 0; j < 2u; ++j) {
      simdgroup_store(acc[2u * i + j], Cs + (sn * 16u + 8u * i) * GGML_MM_BM + sm * 16u + 8u * j, GGML_MM_BM);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < GGML_MM_BN * GGML_MM_BM; e += GGML_MM_THREADS) {
    const uint m = e / GGML_MM_BN;
    const uint n = e % GGML_MM_BN;
    if (m0 + m < M && n0 + n < N) {
      y[size_t(m0 + m) * N + n0 + n] = static_cast<T>(Cs[n * GGML_MM_BM + m]);
    }
  }
