// GGML's block formats (``ggml-common.h``) for the native products: the table of types and a portable
// decoder of one block per type that gives the same floats as the type's MLX decoder in
// metalnn/ggml/ (bit for bit: every product and sum is written in the order the MLX decoder
// computes it, one rounding per operation, no fused multiply-add).
//
// Layouts, byte offsets in a block (d, dmin: float16; multi-byte fields little-endian):
//   Q4_0    (32, 18)   d@0 qs[16]@2                      d * (q - 8)
//   Q4_1    (32, 20)   d@0 m@2 qs[16]@4                  d * q + m
//   Q5_0    (32, 22)   d@0 qh u32@2 qs[16]@6             d * (q - 16)
//   Q5_1    (32, 24)   d@0 m@2 qh u32@4 qs[16]@8         d * q + m
//   Q8_0    (32, 34)   d@0 qs[32] int8@2                 q * d
//   Q2_K    (256, 84)  scales[16]@0 qs[64]@16 d@80 dmin@82
//   Q3_K    (256, 110) hmask[32]@0 qs[64]@32 scales[12]@96 d@108
//   Q4_K    (256, 144) d@0 dmin@2 scales[12]@4 qs[128]@16
//   Q5_K    (256, 176) d@0 dmin@2 scales[12]@4 qh[32]@16 qs[128]@48
//   Q6_K    (256, 210) ql[128]@0 qh[64]@128 scales[16] int8@192 d@208
//   IQ4_NL  (32, 18)   d@0 qs[16]@2                      d * kvalues[q]
//   IQ4_XS  (256, 136) d@0 scales_h u16@2 scales_l[4]@4 qs[128]@8
//   MXFP4   (32, 17)   e@0 qs[16]@1                      half(e) * kvalues_mxfp4[q]
//   TQ1_0   (256, 54)  qs[48]@0 qh[4]@48 d@52            d * (trit - 1)
//   TQ2_0   (256, 66)  qs[64]@0 d@64                     d * (q - 1)
//   IQ2_XXS (256, 66), IQ2_XS (256, 74), IQ2_S (256, 82), IQ3_XXS (256, 98), IQ3_S (256, 110),
//   IQ1_S (256, 50), IQ1_M (256, 56): grid codebooks (ggml_grids.h); see metalnn/ggml/iquants.py.
// metalnn/ggml/*.py documents each layout in full.
#pragma once

#include <cstdint>
#include <cstring>

#include "ggml_grids.h"

#if defined(__clang__)
// The decoders must round every product on its own, as the MLX decoder does.
#pragma clang fp contract(off)
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGML kernels assume a little-endian host"
#endif

namespace metalnn_ggml {

enum TypeId : int {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kIQ1_M = 29,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
};

struct TypeInfo {
  int id;
  const char* name;
  int block;  // values a block
  int size;  // bytes a block
};

inline constexpr TypeInfo kTypes[] = {
    {kQ4_0, "Q4_0", 32, 18},       {kQ4_1, "Q4_1", 32, 20},       {kQ5_0, "Q5_0", 32, 22},
    {kQ5_1, "Q5_1", 32, 24},       {kQ8_0, "Q8_0", 32, 34},       {kQ2_K, "Q2_K", 256, 84},
    {kQ3_K, "Q3_K", 256, 110},     {kQ4_K, "Q4_K", 256, 144},     {kQ5_K, "Q5_K", 256, 176},
    {kQ6_K, "Q6_K", 256, 210},     {kIQ2_XXS, "IQ2_XXS", 256, 66}, {kIQ2_XS, "IQ2_XS", 256, 74},
    {kIQ3_XXS, "IQ3_XXS", 256, 98}, {kIQ1_S, "IQ1_S", 256, 50},    {kIQ4_NL, "IQ4_NL", 32, 18},
    {kIQ3_S, "IQ3_S", 256, 110},   {kIQ2_S, "IQ2_S", 256, 82},    {kIQ4_XS, "IQ4_XS", 256, 136},
    {kIQ1_M, "IQ1_M", 256, 56},    {kTQ1_0, "TQ1_0", 256, 54},    {kTQ2_0, "TQ2_0", 256, 66},
    {kMXFP4, "MXFP4", 32, 17},
};

inline const TypeInfo* find_type(int id) {
  for (const auto& t : kTypes)
    if (t.id == id) return &t;
  return nullptr;
}

inline constexpr int8_t kValuesIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1,    13,   25,  38,  53,  69,  89,  113};
inline constexpr int8_t kValuesMXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline constexpr float kIQ1Delta = 0.125f;

// ---------------------------------------------------------------------------
// Field readers
// ---------------------------------------------------------------------------

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// IEEE half -> float, exact for every value (subnormals, infinities, NaN payloads).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0) {
    // mant * 2^-24: exact in float32
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_to_float(sign | 0x7F800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline float f16_at(const uint8_t* p) {
  return half_to_float(rd16(p));
}

// MXFP4's shared exponent read as half its power of two (ggml_e8m0_to_fp32_half).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
  return bits_to_float(bits);
}

// ---------------------------------------------------------------------------
// Per-sub-block scales and offsets, as the MLX decoders compute them: a block's value is
// scale[s] * q + bias[s] over sub-block s (bias only for the types with a minimum; the
// K-quants subtract dmin * m, i.e. add its negation, which is exact).
// ---------------------------------------------------------------------------

// Q4_K / Q5_K: the eight 6-bit scales and minimums from the 12 bytes at s.
inline void scale_min_k4(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int i = 0; i < 4; ++i) {
    sc[i] = s[i] & 63;
    mn[i] = s[i + 4] & 63;
    sc[i + 4] = (s[i + 8] & 0xF) | ((s[i] >> 6) << 4);
    mn[i + 4] = (s[i + 8] >> 4) | ((s[i + 4] >> 6) << 4);
  }
}

inline void params_q4k(const uint8_t* b, float* sc, float* bias) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  uint8_t s[8], m[8];
  scale_min_k4(b + 4, s, m);
  for (int i = 0; i < 8; ++i) {
    sc[i] = d * static_cast<float>(s[i]);
    bias[i] = -(dmin * static_cast<float>(m[i]));
  }
}

inline void params_q2k(const uint8_t* b, float* sc, float* bias) {
  const float d = f16_at(b + 80), dmin = f16_at(b + 82);
  for (int i = 0; i < 16; ++i) {
    sc[i] = d * static_cast<float>(b[i] & 0xF);
    bias[i] = -(dmin * static_cast<float>(b[i] >> 4));
  }
}

inline void params_q3k(const uint8_t* b, float* sc) {
  const float d = f16_at(b + 108);
  const uint8_t* s = b + 96;
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? (s[i] & 0xF) : (s[i - 8] >> 4);
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    sc[i] = d * (static_cast<float>(low | (high << 4)) - 32.0f);
  }
}

inline void params_q6k(const uint8_t* b, float* sc) {
  const float d = f16_at(b + 208);
  for (int i = 0; i < 16; ++i) sc[i] = d * static_cast<float>(static_cast<int8_t>(b[192 + i]));
}

inline void params_iq4xs(const uint8_t* b, float* sc) {
  const float d = f16_at(b);
  const uint32_t h = rd16(b + 2);
  for (int i = 0; i < 8; ++i) {
    const uint32_t ls = ((b[4 + i / 2] >> (4 * (i % 2))) & 0xF) | (((h >> (2 * i)) & 3) << 4);
    sc[i] = d * (static_cast<float>(ls) - 32.0f);
  }
}

// ---------------------------------------------------------------------------
// Portable decoders: one block -> its block_size floats
// ---------------------------------------------------------------------------

// 4-bit values of the legacy layout: value j in the low nibble of byte j, j + 16 in its high one.
inline void nibbles32(const uint8_t* qs, int* q) {
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 0xF;
    q[j + 16] = qs[j] >> 4;
  }
}

inline void decode_q4_0(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  int q[32];
  nibbles32(b + 2, q);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q[j] - 8);
}

inline void decode_q4_1(const uint8_t* b, float* y) {
  const float d = f16_at(b), m = f16_at(b + 2);
  int q[32];
  nibbles32(b + 4, q);
  for (int j = 0; j < 32; ++j) {
    const float t = d * static_cast<float>(q[j]);
    y[j] = t + m;
  }
}

// The fifth bits of Q5_0 / Q5_1: bit j of the u32 qh, as 0 or 16, for the 32 values.
inline void fifth_bits(uint32_t qh, int* hb) {
  for (int j = 0; j < 32; ++j) hb[j] = static_cast<int>((qh >> j) & 1) << 4;
}

inline void decode_q5_0(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  int hb[32];
  fifth_bits(rd32(b + 2), hb);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(((qs[j] & 0xF) | hb[j]) - 16);
    y[j + 16] = d * static_cast<float>(((qs[j] >> 4) | hb[j + 16]) - 16);
  }
}

inline void decode_q5_1(const uint8_t* b, float* y) {
  const float d = f16_at(b), m = f16_at(b + 2);
  int hb[32];
  fifth_bits(rd32(b + 4), hb);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const float tl = d * static_cast<float>((qs[j] & 0xF) | hb[j]);
    const float th = d * static_cast<float>((qs[j] >> 4) | hb[j + 16]);
    y[j] = tl + m;
    y[j + 16] = th + m;
  }
}

inline void decode_q8_0(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
}

// 2-bit planes (Q2_K, Q3_K, TQ2_0): value 128 h + 32 s + j is bits 2s, 2s + 1 of byte 32 h + j.
// Nibble planes (Q4_K, Q5_K): value 64 c + 32 s + j is nibble s of byte 32 c + j.

inline void decode_q2_k(const uint8_t* b, float* y) {
  float sc[16], bias[16];
  params_q2k(b, sc, bias);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* q = b + 16 + 32 * h;
    for (int s = 0; s < 4; ++s) {
      float* o = y + 128 * h + 32 * s;
      const int i = 8 * h + 2 * s;  // sub-block of the first 16 values
      for (int j = 0; j < 32; ++j) {
        const float t = sc[i + j / 16] * static_cast<float>((q[j] >> (2 * s)) & 3);
        o[j] = t + bias[i + j / 16];
      }
    }
  }
}

inline void decode_q3_k(const uint8_t* b, float* y) {
  float sc[16];
  params_q3k(b, sc);
  const uint8_t* hm = b;
  for (int h = 0; h < 2; ++h) {
    const uint8_t* q = b + 32 + 32 * h;
    for (int s = 0; s < 4; ++s) {
      float* o = y + 128 * h + 32 * s;
      const int i = 8 * h + 2 * s, bit = 4 * h + s;
      for (int j = 0; j < 32; ++j) {
        const int v = ((q[j] >> (2 * s)) & 3) - (((hm[j] >> bit) & 1) ? 0 : 4);
        o[j] = sc[i + j / 16] * static_cast<float>(v);
      }
    }
  }
}

inline void decode_q4_k(const uint8_t* b, float* y) {
  float sc[8], bias[8];
  params_q4k(b, sc, bias);
  const uint8_t* q = b + 16;
  for (int c = 0; c < 4; ++c) {
    for (int j = 0; j < 32; ++j) {
      const float lo = sc[2 * c] * static_cast<float>(q[32 * c + j] & 0xF);
      const float hi = sc[2 * c + 1] * static_cast<float>(q[32 * c + j] >> 4);
      y[64 * c + j] = lo + bias[2 * c];
      y[64 * c + 32 + j] = hi + bias[2 * c + 1];
    }
  }
}

inline void decode_q5_k(const uint8_t* b, float* y) {
  float sc[8], bias[8];
  params_q4k(b, sc, bias);
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + 48;
  for (int c = 0; c < 4; ++c) {
    for (int j = 0; j < 32; ++j) {
      const int l = (q[32 * c + j] & 0xF) | (((qh[j] >> (2 * c)) & 1) << 4);
      const int h = (q[32 * c + j] >> 4) | (((qh[j] >> (2 * c + 1)) & 1) << 4);
      const float lo = sc[2 * c] * static_cast<float>(l);
      const float hi = sc[2 * c + 1] * static_cast<float>(h);
      y[64 * c + j] = lo + bias[2 * c];
      y[64 * c + 32 + j] = hi + bias[2 * c + 1];
    }
  }
}

inline void decode_q6_k(const uint8_t* b, float* y) {
  float sc[16];
  params_q6k(b, sc);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    float* o = y + 128 * h;
    const float* s = sc + 8 * h;
    for (int j = 0; j < 32; ++j) {
      const int q1 = ((ql[j] & 0xF) | (((qh[j] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[j + 32] & 0xF) | (((qh[j] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[j] >> 4) | (((qh[j] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[j + 32] >> 4) | (((qh[j] >> 6) & 3) << 4)) - 32;
      o[j] = s[j / 16] * static_cast<float>(q1);
      o[j + 32] = s[2 + j / 16] * static_cast<float>(q2);
      o[j + 64] = s[4 + j / 16] * static_cast<float>(q3);
      o[j + 96] = s[6 + j / 16] * static_cast<float>(q4);
    }
  }
}

inline void decode_iq4_nl(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  int q[32];
  nibbles32(b + 2, q);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(kValuesIQ4NL[q[j]]);
}

inline void decode_iq4_xs(const uint8_t* b, float* y) {
  float sc[8];
  params_iq4xs(b, sc);
  for (int i = 0; i < 8; ++i) {
    int q[32];
    nibbles32(b + 8 + 16 * i, q);
    for (int j = 0; j < 32; ++j) y[32 * i + j] = sc[i] * static_cast<float>(kValuesIQ4NL[q[j]]);
  }
}

inline void decode_mxfp4(const uint8_t* b, float* y) {
  const float h = e8m0_half(b[0]);
  int q[32];
  nibbles32(b + 1, q);
  for (int j = 0; j < 32; ++j) y[j] = h * static_cast<float>(kValuesMXFP4[q[j]]);
}

// Base-3 digit p of byte b: ((b * 3^p mod 256) * 3) >> 8.
inline int trit(uint32_t byte, int p) {
  static constexpr uint32_t pow3[5] = {1, 3, 9, 27, 81};
  return static_cast<int>((((byte * pow3[p]) & 0xFF) * 3) >> 8);
}

inline void decode_tq1_0(const uint8_t* b, float* y) {
  const float d = f16_at(b + 52);
  for (int p = 0; p < 5; ++p) {
    for (int j = 0; j < 32; ++j) y[32 * p + j] = d * static_cast<float>(trit(b[j], p) - 1);
    for (int j = 0; j < 16; ++j) y[160 + 16 * p + j] = d * static_cast<float>(trit(b[32 + j], p) - 1);
  }
  for (int p = 0; p < 4; ++p)
    for (int j = 0; j < 4; ++j) y[240 + 4 * p + j] = d * static_cast<float>(trit(b[48 + j], p) - 1);
}

inline void decode_tq2_0(const uint8_t* b, float* y) {
  const float d = f16_at(b + 64);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int j = 0; j < 32; ++j)
        y[128 * h + 32 * s + j] = d * static_cast<float>(((b[32 * h + j] >> (2 * s)) & 3) - 1);
}

// Coordinate j of an 8-byte grid point.
inline int grid8(uint64_t point, int j) {
  return static_cast<int>((point >> (8 * j)) & 0xFF);
}

// The sign of value j under sign byte s: -1 where bit j is set (a table, not a branch: the signs
// are unpredictable).
inline constexpr float kSignFactor[2] = {1.0f, -1.0f};

inline float sign_of(uint32_t s, int j) {
  return kSignFactor[(s >> j) & 1];
}

inline void decode_iq2_xxs(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  for (int ib = 0; ib < 8; ++ib) {
    const uint8_t* g = b + 2 + 8 * ib;
    const uint32_t aux = rd32(g + 4);
    const float db = (d * (0.5f + static_cast<float>(aux >> 28))) * 0.25f;
    for (int l = 0; l < 4; ++l) {
      const uint64_t point = kIQ2XXSGrid[g[l]];
      const uint32_t signs = kKSignsIQ2XS[(aux >> (7 * l)) & 127];
      for (int j = 0; j < 8; ++j)
        y[32 * ib + 8 * l + j] = (db * static_cast<float>(grid8(point, j))) * sign_of(signs, j);
    }
  }
}

inline void decode_iq2_xs(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  for (int k = 0; k < 16; ++k) {  // 16 values with one scale
    const uint32_t s = (b[66 + k / 2] >> (4 * (k % 2))) & 0xF;
    const float db = (d * (0.5f + static_cast<float>(s))) * 0.25f;
    for (int l = 0; l < 2; ++l) {
      const uint32_t q = rd16(b + 2 + 2 * (2 * k + l));
      const uint64_t point = kIQ2XSGrid[q & 511];
      const uint32_t signs = kKSignsIQ2XS[q >> 9];
      for (int j = 0; j < 8; ++j)
        y[16 * k + 8 * l + j] = (db * static_cast<float>(grid8(point, j))) * sign_of(signs, j);
    }
  }
}

inline void decode_iq2_s(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  for (int k = 0; k < 16; ++k) {
    const uint32_t s = (b[74 + k / 2] >> (4 * (k % 2))) & 0xF;
    const float db = (d * (0.5f + static_cast<float>(s))) * 0.25f;
    for (int l = 0; l < 2; ++l) {
      const int g = 2 * k + l;
      const uint32_t index = b[2 + g] | (((b[66 + g / 4] >> (2 * (g % 4))) & 3u) << 8);
      const uint64_t point = kIQ2SGrid[index];
      const uint32_t signs = b[34 + g];
      for (int j = 0; j < 8; ++j)
        y[8 * g + j] = (db * static_cast<float>(grid8(point, j))) * sign_of(signs, j);
    }
  }
}

inline void decode_iq3_xxs(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  for (int ib = 0; ib < 8; ++ib) {
    const uint32_t aux = rd32(b + 66 + 4 * ib);
    const float db = (d * (0.5f + static_cast<float>(aux >> 28))) * 0.5f;
    for (int l = 0; l < 4; ++l) {
      const uint32_t signs = kKSignsIQ2XS[(aux >> (7 * l)) & 127];
      for (int h = 0; h < 2; ++h) {
        const uint32_t point = kIQ3XXSGrid[b[2 + 8 * ib + 2 * l + h]];
        for (int j = 0; j < 4; ++j)
          y[32 * ib + 8 * l + 4 * h + j] =
              (db * static_cast<float>((point >> (8 * j)) & 0xFF)) * sign_of(signs, 4 * h + j);
      }
    }
  }
}

inline void decode_iq3_s(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  for (int i = 0; i < 8; ++i) {  // 32 values with one scale
    const uint32_t s = (b[106 + i / 2] >> (4 * (i % 2))) & 0xF;
    const float db = d * static_cast<float>(1 + 2 * s);
    for (int k = 8 * i; k < 8 * i + 8; ++k) {  // grid points of 4 values
      const uint32_t index = b[2 + k] | (((b[66 + k / 8] >> (k % 8)) & 1u) << 8);
      const uint32_t point = kIQ3SGrid[index];
      for (int j = 0; j < 4; ++j) {
        const int v = 4 * k + j;
        y[v] = (db * static_cast<float>((point >> (8 * j)) & 0xFF)) * sign_of(b[74 + v / 8], v % 8);
      }
    }
  }
}

inline void decode_iq1_s(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  for (int ib = 0; ib < 8; ++ib) {
    const uint32_t qh = rd16(b + 34 + 2 * ib);
    const float dl = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1);
    const float delta = kIQ1Delta * kSignFactor[qh >> 15];
    for (int l = 0; l < 4; ++l) {
      const uint32_t index = b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8);
      const uint64_t point = kIQ1SGrid[index];
      for (int j = 0; j < 8; ++j) {
        const float g = static_cast<float>(static_cast<int8_t>(grid8(point, j)));
        y[32 * ib + 8 * l + j] = dl * (g + delta);
      }
    }
  }
}

inline void decode_iq1_m(const uint8_t* b, float* y) {
  uint32_t sc[4];
  for (int m = 0; m < 4; ++m) sc[m] = rd16(b + 48 + 2 * m);
  const uint32_t dbits = (sc[0] >> 12) | ((sc[1] >> 12) << 4) | ((sc[2] >> 12) << 8) | ((sc[3] >> 12) << 12);
  const float d = half_to_float(static_cast<uint16_t>(dbits));
  for (int k = 0; k < 16; ++k) {  // 16 values with one scale
    const uint32_t s = (sc[k / 4] >> (3 * (k % 4))) & 7;
    const float dl = d * static_cast<float>(2 * s + 1);
    for (int l = 0; l < 2; ++l) {
      const int g = 2 * k + l;
      const uint32_t h = (b[32 + g / 2] >> (4 * (g % 2))) & 0xF;
      const uint32_t index = b[g] | ((h & 7) << 8);
      const float delta = kIQ1Delta * kSignFactor[h >> 3];
      const uint64_t point = kIQ1SGrid[index];
      for (int j = 0; j < 8; ++j) {
        const float gv = static_cast<float>(static_cast<int8_t>(grid8(point, j)));
        y[8 * g + j] = dl * (gv + delta);
      }
    }
  }
}

using BlockDecoder = void (*)(const uint8_t*, float*);

inline BlockDecoder portable_decoder(int id) {
  switch (id) {
    case kQ4_0:
      return decode_q4_0;
    case kQ4_1:
      return decode_q4_1;
    case kQ5_0:
      return decode_q5_0;
    case kQ5_1:
      return decode_q5_1;
    case kQ8_0:
      return decode_q8_0;
    case kQ2_K:
      return decode_q2_k;
    case kQ3_K:
      return decode_q3_k;
    case kQ4_K:
      return decode_q4_k;
    case kQ5_K:
      return decode_q5_k;
    case kQ6_K:
      return decode_q6_k;
    case kIQ2_XXS:
      return decode_iq2_xxs;
    case kIQ2_XS:
      return decode_iq2_xs;
    case kIQ2_S:
      return decode_iq2_s;
    case kIQ3_XXS:
      return decode_iq3_xxs;
    case kIQ3_S:
      return decode_iq3_s;
    case kIQ1_S:
      return decode_iq1_s;
    case kIQ1_M:
      return decode_iq1_m;
    case kIQ4_NL:
      return decode_iq4_nl;
    case kIQ4_XS:
      return decode_iq4_xs;
    case kTQ1_0:
      return decode_tq1_0;
    case kTQ2_0:
      return decode_tq2_0;
    case kMXFP4:
      return decode_mxfp4;
  }
  return nullptr;
}

}  // namespace metalnn_ggml
