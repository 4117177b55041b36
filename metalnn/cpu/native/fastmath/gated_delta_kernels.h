// Per-head kernels of the gated delta rule (gated_delta.cpp), float32.
//
// One head's recurrence, S a K x V state (row i of S is key entry i):
//
//   P = exp(g_t) S;   r = v_t - P^T k_t;   d = beta_t r;   S = P + k_t d^T;   o_t = S^T q_t
//
// forward_head runs it over T tokens and stores S before every block of L tokens (the
// checkpoints). backward_head walks the blocks last to first: it recomputes the block's states
// from its checkpoint, then goes back through the tokens with dS, the gradient of the state:
//
//   dS += q do^T;  dq = a S_prev do + k (d . do)
//   dd = dS^T k;   dk = dS d;   dv = beta dd;   dbeta = r . dd;   dkv = -beta dd
//   dP = dS + k dkv^T;   dk += P dkv;   dg = sum(dP o P);   dS = a dP      (a = exp(g_t), P = a S_prev)
//
// Each kernel comes twice (AVX2+FMA by target attribute, and portable); the loops over V are
// written once as always_inline bodies and vectorised by the compiler (`omp simd`).
// Token t of a head reads q[t * sq], k[t * sk], v[t * sv], g[t * sg], beta[t * sg] (strides in
// floats between tokens; the entries of one token's vector are contiguous).

#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace metalnn_gd {

#define GD_BODY static inline __attribute__((always_inline))

// Strided views of one head's inputs.
struct HeadIn {
  const float *q, *k, *v, *g, *beta;
  int64_t sq, sk, sv, sg;  // floats between consecutive tokens
};

// Forward through one token: S (K x V) updated in place, o (V) written, r (V) = v - P^T k saved.
GD_BODY void token_fwd_body(float* S, const float* q, const float* k, const float* v, float g, float beta,
                            float* o, float* r, int64_t K, int64_t V) {
  const float a = std::exp(g);
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) r[j] = 0.0f;
  for (int64_t i = 0; i < K; ++i) {
    const float ki = k[i];
    const float* s = S + i * V;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) r[j] += ki * s[j];
  }
  float d[1024];
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) {
    r[j] = v[j] - a * r[j];
    d[j] = beta * r[j];
    o[j] = 0.0f;
  }
  for (int64_t i = 0; i < K; ++i) {
    const float ki = k[i], qi = q[i];
    float* s = S + i * V;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      const float x = a * s[j] + ki * d[j];
      s[j] = x;
      o[j] += qi * x;
    }
  }
}

GD_BODY void forward_head_body(const HeadIn& in, float* S, float* o, int64_t so, int64_t T, int64_t K, int64_t V,
                               int64_t L, float* ckpt) {
  float r[1024];
  for (int64_t t = 0; t < T; ++t) {
    if (t % L == 0) std::memcpy(ckpt + (t / L) * K * V, S, sizeof(float) * K * V);
    token_fwd_body(S, in.q + t * in.sq, in.k + t * in.sk, in.v + t * in.sv, in.g[t * in.sg], in.beta[t * in.sg],
                   o + t * so, r, K, V);
  }
}

// Gradients of one head. dS: K x V, holds the gradient of the final state on entry and that of
// the initial state on exit. Outputs dq/dk (stride sq/sk like q/k), dv (stride sv), dg/dbeta
// (stride sg), all written (not accumulated). work: (L + 1) * K * V + L * V floats.
GD_BODY void backward_head_body(const HeadIn& in, const float* ckpt, const float* dout, int64_t so, float* dS,
                                float* dq, float* dk, float* dv, float* dg, float* dbeta, int64_t T, int64_t K,
                                int64_t V, int64_t L, float* work) {
  float* states = work;                    // S before each token of the block: L x K x V
  float* rs = work + L * K * V;            // r of each token of the block: L x V
  float* scratch = rs + L * V;             // K x V (the running state / unused o)
  float o_unused[1024], dd[1024], dkv[1024];
  const int64_t nblocks = (T + L - 1) / L;
  for (int64_t b = nblocks - 1; b >= 0; --b) {
    const int64_t t0 = b * L, t1 = std::min(T, t0 + L);
    std::memcpy(scratch, ckpt + b * K * V, sizeof(float) * K * V);
    for (int64_t t = t0; t < t1; ++t) {
      std::memcpy(states + (t - t0) * K * V, scratch, sizeof(float) * K * V);
      token_fwd_body(scratch, in.q + t * in.sq, in.k + t * in.sk, in.v + t * in.sv, in.g[t * in.sg],
                     in.beta[t * in.sg], o_unused, rs + (t - t0) * V, K, V);
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const float* Sp = states + (t - t0) * K * V;
      const float* r = rs + (t - t0) * V;
      const float *q = in.q + t * in.sq, *k = in.k + t * in.sk, *dO = dout + t * so;
      const float a = std::exp(in.g[t * in.sg]), beta = in.beta[t * in.sg];
      float* dqt = dq + t * in.sq;
      float* dkt = dk + t * in.sk;
      float d_dot_do = 0.0f;
#pragma omp simd reduction(+ : d_dot_do)
      for (int64_t j = 0; j < V; ++j) {
        d_dot_do += beta * r[j] * dO[j];
        dd[j] = 0.0f;
      }
      // pass 1: dS += q do^T; dq; dd = dS^T k; dk = dS d
      for (int64_t i = 0; i < K; ++i) {
        const float qi = q[i], ki = k[i];
        const float* sp = Sp + i * V;
        float* ds = dS + i * V;
        float spdo = 0.0f, dsd = 0.0f;
#pragma omp simd reduction(+ : spdo, dsd)
        for (int64_t j = 0; j < V; ++j) {
          const float x = ds[j] + qi * dO[j];
          ds[j] = x;
          dd[j] += ki * x;
          spdo += sp[j] * dO[j];
          dsd += x * (beta * r[j]);
        }
        dqt[i] = a * spdo + ki * d_dot_do;
        dkt[i] = dsd;
      }
      float db = 0.0f;
#pragma omp simd reduction(+ : db)
      for (int64_t j = 0; j < V; ++j) {
        db += r[j] * dd[j];
        dkv[j] = -beta * dd[j];
      }
      float* dvt = dv + t * in.sv;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) dvt[j] = beta * dd[j];
      dbeta[t * in.sg] = db;
      // pass 2: dP = dS + k dkv^T; dk += P dkv; dg = sum(dP o P); dS = a dP
      float gsum = 0.0f;
      for (int64_t i = 0; i < K; ++i) {
        const float ki = k[i];
        const float* sp = Sp + i * V;
        float* ds = dS + i * V;
        float pdkv = 0.0f, gi = 0.0f;
#pragma omp simd reduction(+ : pdkv, gi)
        for (int64_t j = 0; j < V; ++j) {
          const float x = ds[j] + ki * dkv[j];
          pdkv += sp[j] * dkv[j];
          gi += x * sp[j];
          ds[j] = a * x;
        }
        dkt[i] += a * pdkv;
        gsum += gi;
      }
      dg[t * in.sg] = a * gsum;
    }
  }
}

inline void forward_head_generic(const HeadIn& in, float* S, float* o, int64_t so, int64_t T, int64_t K, int64_t V,
                                 int64_t L, float* ckpt) {
  forward_head_body(in, S, o, so, T, K, V, L, ckpt);
}

inline void backward_head_generic(const HeadIn& in, const float* ckpt, const float* dout, int64_t so, float* dS,
                                  float* dq, float* dk, float* dv, float* dg, float* dbeta, int64_t T, int64_t K,
                                  int64_t V, int64_t L, float* work) {
  backward_head_body(in, ckpt, dout, so, dS, dq, dk, dv, dg, dbeta, T, K, V, L, work);
}

#if METALNN_FM_X86
__attribute__((target("avx2,fma"))) inline void forward_head_avx2(const HeadIn& in, float* S, float* o, int64_t so,
                                                                   int64_t T, int64_t K, int64_t V, int64_t L,
                                                                   float* ckpt) {
  forward_head_body(in, S, o, so, T, K, V, L, ckpt);
}

__attribute__((target("avx2,fma"))) inline void backward_head_avx2(const HeadIn& in, const float* ckpt,
                                                                    const float* dout, int64_t so, float* dS,
                                                                    float* dq, float* dk, float* dv, float* dg,
                                                                    float* dbeta, int64_t T, int64_t K, int64_t V,
                                                                    int64_t L, float* work) {
  backward_head_body(in, ckpt, dout, so, dS, dq, dk, dv, dg, dbeta, T, K, V, L, work);
}
#endif

// Largest value head dimension the kernels take (their per-token vectors live on the stack).
constexpr int64_t kMaxV = 1024;

#undef GD_BODY

}  // namespace metalnn_gd
