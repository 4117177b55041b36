// Reading MLX arrays of any strides as row-major buffers (inside a primitive's evaluation, where
// MLX's own copy routines are not exported to extensions).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace metalnn_native {

namespace mx = mlx::core;

// Copies `a` (any strides) in row-major order into dst.
template <typename T>
inline void gather(const mx::array& a, T* dst) {
  const T* src = a.data<T>();
  const size_t n = a.size();
  if (n == 0) return;
  const int nd = static_cast<int>(a.ndim());
  const int64_t inner = a.shape(nd - 1), st = a.strides()[nd - 1];
  std::vector<int> idx(static_cast<size_t>(std::max(nd - 1, 0)), 0);
  int64_t off = 0;
  for (size_t row = 0, rows = n / static_cast<size_t>(inner); row < rows; ++row) {
    for (int64_t i = 0; i < inner; ++i) *dst++ = src[off + i * st];
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) {
        off += a.strides()[d];
        break;
      }
      off -= a.strides()[d] * (a.shape(d) - 1);
      idx[d] = 0;
    }
  }
}

// The data of `a` as a row-major buffer: its own when row-contiguous, else a copy kept in `keep`.
template <typename T>
inline const T* contiguous_data(const mx::array& a, std::vector<T>& keep) {
  if (a.flags().row_contiguous) return a.data<T>();
  keep.resize(a.size());
  gather<T>(a, keep.data());
  return keep.data();
}

}  // namespace metalnn_native
