// Registers metalnn's fused training primitives (train_ops.cpp) in the module.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>

void register_train_ops(nanobind::module_& m);

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w (w may be null) for `rows` rows of width n, on the
// calling thread: the numbers of MetalnnRMSNorm's forward (the fused decoding step's final norm
// uses it so that its logits equal those of the model's own norm and head).
namespace metalnn_train_ops {
void rms_norm_rows(const float* x, const float* w, float* y, size_t rows, int64_t n, float eps);
}
