// Portable kernels of metalnn's im2col / col2im primitives (any CPU).
//
// Layouts (channels-first, as torch.nn.functional.unfold / fold):
//   image   [N, C, D, H, W]                     (1-D and 2-D use D = H = 1)
//   columns [N, C, K, L] with K = kD*kH*kW, L = oD*oH*oW, both row-major,
//   columns[n, c, (kd, kh, kw), (od, oh, ow)] =
//       image[n, c, od*sD - pD + kd*dD, oh*sH - pH + kh*dH, ow*sW - pW + kw*dW]
//   (zero where that position falls into the padding).
// im2col gathers one (plane, kernel offset) row of the columns at a time:
// a contiguous input row with stride 1 is one memcpy; col2im adds columns back
// into a plane with unit-stride loops the compiler vectorises.

#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace metalnn_im2col {

struct Geometry {
  // Always 3-D (D, H, W); lower-rank problems have leading size-1 axes with
  // kernel 1, stride 1, padding 0, dilation 1.
  int64_t in[3] = {1, 1, 1};
  int64_t out[3] = {1, 1, 1};
  int64_t k[3] = {1, 1, 1};
  int64_t s[3] = {1, 1, 1};
  int64_t p[3] = {0, 0, 0};
  int64_t d[3] = {1, 1, 1};

  int64_t K() const {
    return k[0] * k[1] * k[2];
  }
  int64_t L() const {
    return out[0] * out[1] * out[2];
  }
  int64_t S() const {
    return in[0] * in[1] * in[2];
  }
};

// Output length of a convolution window sweep along one axis.
inline int64_t
out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
  return (in + 2 * p - d * (k - 1) - 1) / s + 1;
}

// Range [lo, hi) of output positions o with 0 <= start + o * step < n.
inline void valid_range(
    int64_t start, int64_t step, int64_t n, int64_t count, int64_t& lo, int64_t& hi) {
  lo = start >= 0 ? 0 : (-start + step - 1) / step;
  hi = start <= n - 1 ? std::min(count, (n - 1 - start) / step + 1) : 0;
  lo = std::min(lo, count);
  if (hi < lo) hi = lo;
}

// One row of the columns: kernel offset kidx of the plane at `src` (element
// strides st[3] for D, H, W) -> dst[L]. T is a same-size bit carrier.
template <typename T>
void im2col_row(const T* src, const int64_t st[3], const Geometry& g, int64_t kidx, T* __restrict dst) {
  const int64_t kw = kidx % g.k[2], kh = (kidx / g.k[2]) % g.k[1], kd = kidx / (g.k[2] * g.k[1]);
  const int64_t ow_n = g.out[2];
  const int64_t iw0 = kw * g.d[2] - g.p[2];
  int64_t lo, hi;
  valid_range(iw0, g.s[2], g.in[2], ow_n, lo, hi);
  for (int64_t od = 0; od < g.out[0]; ++od) {
    const int64_t id = od * g.s[0] - g.p[0] + kd * g.d[0];
    for (int64_t oh = 0; oh < g.out[1]; ++oh) {
      const int64_t ih = oh * g.s[1] - g.p[1] + kh * g.d[1];
      T* out = dst + (od * g.out[1] + oh) * ow_n;
      if (id < 0 || id >= g.in[0] || ih < 0 || ih >= g.in[1] || lo == hi) {
        std::memset(out, 0, sizeof(T) * ow_n);
        continue;
      }
      const T* row = src + id * st[0] + ih * st[1];
      if (lo > 0) std::memset(out, 0, sizeof(T) * lo);
      if (hi < ow_n) std::memset(out + hi, 0, sizeof(T) * (ow_n - hi));
      if (g.s[2] == 1 && st[2] == 1) {
        std::memcpy(out + lo, row + iw0 + lo, sizeof(T) * (hi - lo));
      } else {
        const int64_t step = g.s[2] * st[2];
        const T* r = row + (iw0 + lo * g.s[2]) * st[2];
        for (int64_t ow = lo; ow < hi; ++ow, r += step) out[ow] = *r;
      }
    }
  }
}

// Adds the columns of one plane, src[K, L] (contiguous), into dst[D*H*W]
// (contiguous; the caller zeroes it first).
template <typename T>
void col2im_plane(const T* __restrict src, const Geometry& g, T* __restrict dst) {
  const int64_t ow_n = g.out[2];
  const int64_t L = g.L();
  for (int64_t kidx = 0; kidx < g.K(); ++kidx) {
    const int64_t kw = kidx % g.k[2], kh = (kidx / g.k[2]) % g.k[1], kd = kidx / (g.k[2] * g.k[1]);
    const int64_t iw0 = kw * g.d[2] - g.p[2];
    int64_t lo, hi;
    valid_range(iw0, g.s[2], g.in[2], ow_n, lo, hi);
    if (lo == hi) continue;
    const T* krow = src + kidx * L;
    for (int64_t od = 0; od < g.out[0]; ++od) {
      const int64_t id = od * g.s[0] - g.p[0] + kd * g.d[0];
      if (id < 0 || id >= g.in[0]) continue;
      for (int64_t oh = 0; oh < g.out[1]; ++oh) {
        const int64_t ih = oh * g.s[1] - g.p[1] + kh * g.d[1];
        if (ih < 0 || ih >= g.in[1]) continue;
        const T* s = krow + (od * g.out[1] + oh) * ow_n + lo;
        T* r = dst + (id * g.in[1] + ih) * g.in[2] + iw0 + lo * g.s[2];
        const int64_t n = hi - lo;
        if (g.s[2] == 1) {
          for (int64_t i = 0; i < n; ++i) r[i] += s[i];
        } else {
          const int64_t step = g.s[2];
          for (int64_t i = 0; i < n; ++i) r[i * step] += s[i];
        }
      }
    }
  }
}

}  // namespace metalnn_im2col
