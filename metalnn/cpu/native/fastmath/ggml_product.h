// One product out [M, N] = x [M, K] @ W.T with W packed in a GGML type, prepared once and then
// run over ranges of W's rows (by several threads, or as part of a larger fused op): the input is
// put in the form the chosen kernel reads (kernel order, sub-block sums; see ggml_kernels.h).
#pragma once

#include <cstdint>
#include <vector>

#include "ggml_int8_rows.h"
#include "ggml_kernels.h"

namespace metalnn_ggml {

class PreparedProduct {
 public:
  // x [M, K] and out [M, N] row-contiguous float32; w [N, row_bytes]. x must stay alive (and
  // unchanged) until the rows are run; the prepared copies are owned here.
  void prepare(const TypeInfo& t, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* out) {
    avx2_ = use_avx2();
    a_ = MatmulArgs{};
    a_.type = &t;
    a_.w = w;
    a_.N = N;
    a_.K = K;
    a_.M = M;
    a_.x = x;
    a_.out = out;
    const bool int8 = uses_int8(t.id, M, avx2_) && K % 32 == 0;
    const bool split = !int8 && uses_split(t.id, M, avx2_) && K % 32 == 0;  // (K-quants: whole blocks of 256)
    if (int8 || uses_registers(t.id, M, avx2_)) {
      if (int8 || split) {
        a_.xrun = int8_input_run(t.id);
        xq_.resize(static_cast<size_t>(M * K));
        xd_.resize(static_cast<size_t>(M * K / a_.xrun));
        if (split) {
          xq2_.resize(static_cast<size_t>(M * K));
          a_.xq2 = xq2_.data();
        }
        quantize_rows_int8(x, M, K, a_.xrun, xq_.data(), xd_.data(), split ? xq2_.data() : nullptr);
        a_.xq = xq_.data();
        a_.xd = xd_.data();
        if (t.id == kQ6_K) {
          xsum16_.resize(static_cast<size_t>(M * K / 16));
          level_sums16(xq_.data(), M, K, xsum16_.data());
          a_.xsum16 = xsum16_.data();
          if (split) {
            xsum16_2_.resize(static_cast<size_t>(M * K / 16));
            level_sums16(xq2_.data(), M, K, xsum16_2_.data());
            a_.xsum16_2 = xsum16_2_.data();
          }
        }
      }
      if (bias_sub(t.id)) {
        a_.sub = bias_sub(t.id);
        xsum_.resize(static_cast<size_t>(M * (K / a_.sub)));
        sub_block_sums(a_.x, M, K, a_.sub, xsum_.data());
        a_.xsum = xsum_.data();
      }
      if (register_kernel_order(t.id) && a_.xq == nullptr) {
        xperm_.resize(static_cast<size_t>(M * K));
        for (int64_t m = 0; m < M; ++m) permute_chunks(a_.x + m * K, xperm_.data() + m * K, K);
        a_.x = xperm_.data();
      }
    }
  }

  // out[m, r] for W's rows [r0, r1).
  void run_rows(int64_t r0, int64_t r1) const {
#if METALNN_GGML_X86
    if (a_.xq != nullptr && int8_rows_product(a_, r0, r1)) return;
#endif
    matmul_rows(a_, r0, r1, avx2_);
  }

  int64_t rows() const {
    return a_.N;
  }

  int64_t width() const {
    return a_.K;
  }

 private:
  MatmulArgs a_{};
  bool avx2_ = false;
  std::vector<float> xsum_, xperm_, xd_;
  std::vector<int8_t> xq_, xq2_;
  std::vector<int16_t> xsum16_, xsum16_2_;
};

}  // namespace metalnn_ggml
