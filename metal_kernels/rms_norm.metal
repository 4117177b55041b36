// RMS normalisation over the last axis: y = x * rsqrt(mean(x^2) + eps) * w.
// Layout: x is [rows, axis_size] row-contiguous; one threadgroup per row, its threads stride the
// row, partial sums are reduced with simd_sum and then across SIMD groups in threadgroup memory.
// Accumulation is in float whatever T is. Inputs are indexed from their own pointers (no derived
// `const device T*`): MLX passes inputs of fewer than 8 elements in the `constant` address space.

// @header
// Sum of `value` over the whole threadgroup; every thread gets the total.
// `scratch` must hold 32 floats, `total` one; both threadgroup memory.
inline float threadgroup_sum(float value, threadgroup float* scratch, threadgroup float* total,
                             uint lane, uint simd_group, uint n_threads) {
  value = simd_sum(value);
  if (lane == 0) {
    scratch[simd_group] = value;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd_group == 0) {
    uint n_groups = (n_threads + 31) / 32;
    float v = lane < n_groups ? scratch[lane] : 0.0f;
    v = simd_sum(v);
    if (lane == 0) {
      total[0] = v;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return total[0];
}

// @kernel rms_norm_forward
// @inputs x, w, eps, axis_size
// @outputs y
// Template: T (dtype of x and y), WT (dtype of w).
  threadgroup float scratch[32];
  threadgroup float total[1];
  uint row = threadgroup_position_in_grid.x;
  uint tid = thread_position_in_threadgroup.x;
  uint n_threads = threads_per_threadgroup.x;
  uint n = uint(axis_size);
  size_t base = size_t(row) * n;
  float acc = 0.0f;
  for (uint i = tid; i < n; i += n_threads) {
    float v = float(x[base + i]);
    acc += v * v;
  }
  float sum_sq = threadgroup_sum(acc, scratch, total, thread_index_in_simdgroup,
                                 simdgroup_index_in_threadgroup, n_threads);
  float r = metal::rsqrt(sum_sq / float(n) + eps);
  for (uint i = tid; i < n; i += n_threads) {
    y[base + i] = static_cast<T>(w[i]) * static_cast<T>(float(x[base + i]) * r);
  }

// @kernel rms_norm_backward_dx
// @inputs x, w, dy, eps, axis_size
// @outputs dx, rstd
// dn = dy * w;  dx = r * dn - x * r^3 * mean(dn * x);  rstd[row] = r (used by the dw kernel).
  threadgroup float scratch[32];
  threadgroup float total[1];
  uint row = threadgroup_position_in_grid.x;
  uint tid = thread_position_in_threadgroup.x;
  uint n_threads = threads_per_threadgroup.x;
  uint lane = thread_index_in_simdgroup;
  uint simd_group = simdgroup_index_in_threadgroup;
  uint n = uint(axis_size);
  size_t base = size_t(row) * n;
  float acc_sq = 0.0f;
  for (uint i = tid; i < n; i += n_threads) {
    float v = float(x[base + i]);
    acc_sq += v * v;
  }
  float sum_sq = threadgroup_sum(acc_sq, scratch, total, lane, simd_group, n_threads);
  float r = metal::rsqrt(sum_sq / float(n) + eps);
  float acc_dot = 0.0f;
  for (uint i = tid; i < n; i += n_threads) {
    acc_dot += float(dy[base + i]) * float(w[i]) * float(x[base + i]);
  }
  // Reusing scratch/total is safe: the first sum's last barrier orders its reads of scratch
  // before these writes, and `total` is rewritten only after the next sum's first barrier.
  float dot = threadgroup_sum(acc_dot, scratch, total, lane, simd_group, n_threads);
  float coef = r * r * r * dot / float(n);
  for (uint i = tid; i < n; i += n_threads) {
    float dn = float(dy[base + i]) * float(w[i]);
    dx[base + i] = static_cast<T>(r * dn - float(x[base + i]) * coef);
  }
  if (tid == 0) {
    rstd[row] = r;
  }

// @kernel rms_norm_backward_dw
// @inputs x, dy, rstd, rows, axis_size
// @outputs dw
// One thread per feature j: dw[j] = sum over rows of dy * x * rstd (reads are coalesced across j).
  uint j = thread_position_in_grid.x;
  uint n = uint(axis_size);
  if (j >= n) {
    return;
  }
  float acc = 0.0f;
  for (uint row = 0; row < uint(rows); ++row) {
    size_t k = size_t(row) * n + j;
    acc += float(dy[k]) * float(x[k]) * rstd[row];
  }
  dw[j] = static_cast<WT>(acc);
