// Attention of one query head at one new position over its key/value cache, for the decoding step
// (decode_step.cpp), float32:
//
//   s_j = scale * q . key_j   (j < len: the cached columns, then the new position's key)
//   o   = sum_j softmax(s)_j value_j
//
// key_j = kb + j * hd for j < cached (len - 1 by default) and knew + (j - cached) * new_stride after
// (values alike): the new positions' keys and values are not in the cache buffers yet (the caller
// writes them after the step).
//
// The AVX2 kernel keeps q and the output in registers (hd a multiple of 8, at most 256) and
// reads each key and value row once; the softmax is metalnn_fastmath's vectorised one. The
// portable kernel is the plain loop (other CPUs, head sizes that are not a multiple of 8).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace metalnn_decode {

struct HeadAttention {
  const float* q;     // [hd]
  const float* kb;    // [cached, hd] cached keys (row stride hd)
  const float* vb;    // [cached, hd] cached values
  const float* knew;  // [len - cached, hd] the new positions' keys (row stride new_stride)
  const float* vnew;  // their values
  int64_t len;        // columns attended to, >= 1
  int hd;
  float scale;
  int64_t cached = -1;     // columns read from kb / vb (-1: len - 1, one new position)
  int64_t new_stride = 0;  // between the new positions' keys (and values)

  int64_t from_cache() const {
    return cached < 0 ? len - 1 : cached;
  }
  const float* key(int64_t j) const {
    const int64_t c = from_cache();
    return j < c ? kb + j * hd : knew + (j - c) * new_stride;
  }
  const float* value(int64_t j) const {
    const int64_t c = from_cache();
    return j < c ? vb + j * hd : vnew + (j - c) * new_stride;
  }
};

// o[hd] for one head; s: scratch of len floats.
inline void attend_head_portable(const HeadAttention& a, float* s, float* o) {
  float mx_s = -INFINITY;
  for (int64_t j = 0; j < a.len; ++j) {
    const float* kj = a.key(j);
    float d = 0.0f;
    for (int i = 0; i < a.hd; ++i) d += a.q[i] * kj[i];
    s[j] = d * a.scale;
    mx_s = std::max(mx_s, s[j]);
  }
  float total = 0.0f;
  for (int64_t j = 0; j < a.len; ++j) {
    s[j] = std::exp(s[j] - mx_s);
    total += s[j];
  }
  std::fill_n(o, a.hd, 0.0f);
  for (int64_t j = 0; j < a.len; ++j) {
    const float p = s[j] / total;
    const float* vj = a.value(j);
    for (int i = 0; i < a.hd; ++i) o[i] += p * vj[i];
  }
}

#if METALNN_FM_X86
constexpr int kMaxVectors = 32;  // hd <= 256

#define DA_TARGET __attribute__((target("avx2,fma")))

// NV: hd / 8 when known at compile time (the common head sizes), 0 for any multiple of 8.
template <int NV>
DA_TARGET void attend_head_avx2_n(const HeadAttention& a, float* s, float* o) {
  const int nv = NV > 0 ? NV : a.hd / 8;
  __m256 qv[NV > 0 ? NV : kMaxVectors];
  for (int c = 0; c < nv; ++c) qv[c] = _mm256_loadu_ps(a.q + 8 * c);
  for (int64_t j = 0; j < a.len; ++j) {
    const float* kj = a.key(j);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int c = 0;
    for (; c + 2 <= nv; c += 2) {
      s0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kj + 8 * c), s0);
      s1 = _mm256_fmadd_ps(qv[c + 1], _mm256_loadu_ps(kj + 8 * c + 8), s1);
    }
    if (c < nv) s0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kj + 8 * c), s0);
    s[j] = metalnn_fastmath::hsum8(_mm256_add_ps(s0, s1)) * a.scale;
  }
  metalnn_fastmath::softmax_row(s, s, static_cast<size_t>(a.len));
  __m256 ov[NV > 0 ? NV : kMaxVectors];
  for (int c = 0; c < nv; ++c) ov[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < a.len; ++j) {
    const float* vj = a.value(j);
    const __m256 p = _mm256_set1_ps(s[j]);
    for (int c = 0; c < nv; ++c) ov[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * c), ov[c]);
  }
  for (int c = 0; c < nv; ++c) _mm256_storeu_ps(o + 8 * c, ov[c]);
}

#undef DA_TARGET
#endif

// o[hd] for one head (see the file comment); s: scratch of a.len floats.
inline void attend_head(const HeadAttention& a, float* s, float* o) {
#if METALNN_FM_X86
  if (a.hd % 8 == 0 && a.hd <= 8 * kMaxVectors && metalnn_fastmath::use_avx2()) {
    switch (a.hd) {
      case 64:
        return attend_head_avx2_n<8>(a, s, o);
      case 128:
        return attend_head_avx2_n<16>(a, s, o);
      default:
        return attend_head_avx2_n<0>(a, s, o);
    }
  }
#endif
  attend_head_portable(a, s, o);
}

}  // namespace metalnn_decode
