// Fused, multi-threaded float32 CPU primitives for the training step (see
// train_kernels.h for the formulas): rms_norm, rope, gated activations
// (act(a) * b), cross entropy and the scaled (optionally causal) softmax of
// attention. Each forward primitive has a fused backward primitive as its VJP.
//
// Every primitive also carries its definition in plain MLX ops (the
// "fallback"): JVPs, vmap and the derivatives of the backward primitives
// (higher-order autodiff) go through it, so these ops support every MLX
// transform; only the first-order forward and backward passes run natively.

#include "train_ops.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "primitive.h"
#include "threadpool.h"
#include "train_kernels.h"

#ifndef FM_TARGET
#define FM_TARGET  // off x86 the "<true>" (AVX2) instances below are the portable code again
#endif

namespace mx = mlx::core;
namespace nb = nanobind;
using metalnn_fastmath::Kind;

namespace {

using Arrays = std::vector<mx::array>;
using Fallback = std::function<Arrays(const Arrays&)>;

// Rows per parallel chunk so that a chunk holds about 16K elements.
size_t grain_rows(int64_t row_len) {
  return static_cast<size_t>(std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)));
}

void alloc(mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
}

// Whether `strides` lay `shape` out densely: a permutation of a row-major layout (no gaps, no
// broadcast axes), e.g. the transposed view of split attention heads.
bool dense_permutation(const mx::Shape& shape, const mx::Strides& strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] > 1) dims.emplace_back(strides[i], shape[i]);
  std::sort(dims.begin(), dims.end());
  int64_t expect = 1;
  for (auto [st, n] : dims) {
    if (st != expect) return false;
    expect *= n;
  }
  return true;
}

// Allocates `out` in the memory order of `like` when that is dense and of the same shape (so a
// transpose the caller applies next is row-contiguous, with no copy), else row-major.
void alloc_like(mx::array& out, const mx::array& like) {
  if (like.shape() == out.shape() && like.itemsize() == out.itemsize() && like.data_size() == like.size() &&
      dense_permutation(like.shape(), like.strides())) {
    out.set_data(mx::allocator::malloc(out.nbytes()), out.size(), like.strides(), like.flags());
  } else {
    alloc(out);
  }
}

// Element offsets of row r (all axes but the last, row-major order) under `strides`.
inline int64_t row_offset(size_t r, const mx::Shape& shape, const mx::Strides& strides) {
  int64_t off = 0, rem = static_cast<int64_t>(r);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) {
    off += (rem % shape[d]) * strides[d];
    rem /= shape[d];
  }
  return off;
}

// ---------------------------------------------------------------------------
// A primitive defined by a plain-MLX-ops fallback: native eval (subclasses),
// JVP / VJP / vmap through the fallback unless a subclass overrides them.
// ---------------------------------------------------------------------------
class NativeOp : public mx::Primitive {
 public:
  NativeOp(mx::Stream s, Fallback fb, int n_out) : mx::Primitive(s), fallback_(std::move(fb)), n_out_(n_out) {}

  void eval_gpu(const Arrays&, Arrays&) override {
    throw std::runtime_error(std::string("[") + name() + "] has no GPU implementation");
  }

  // The fallback as a function of the inputs listed in argnums (others fixed).
  Fallback partial(const Arrays& primals, const std::vector<int>& argnums) const {
    auto fb = fallback_;
    return [fb, primals, argnums](const Arrays& sub) {
      Arrays all = primals;
      for (size_t j = 0; j < argnums.size(); ++j) all[argnums[j]] = sub[j];
      return fb(all);
    };
  }

  Arrays jvp(const Arrays& primals, const Arrays& tangents, const std::vector<int>& argnums) override {
    Arrays sub;
    for (int i : argnums) sub.push_back(primals[i]);
    return mx::jvp(partial(primals, argnums), sub, tangents).second;
  }

  Arrays vjp(const Arrays& primals, const Arrays& cotangents, const std::vector<int>& argnums,
             const Arrays&) override {
    Arrays sub;
    for (int i : argnums) sub.push_back(primals[i]);
    return mx::vjp(partial(primals, argnums), sub, cotangents).second;
  }

  std::pair<Arrays, std::vector<int>> vmap(const Arrays& inputs, const std::vector<int>& axes) override {
    std::vector<int> out_axes(n_out_, 0);
    return {mx::vmap(fallback_, axes, out_axes)(inputs), out_axes};
  }

 protected:
  Fallback fallback_;
  int n_out_;
};

mx::Stream cpu_stream(mx::StreamOrDevice sd) {
  return mx::to_stream(sd);
}

bool native_stream(const mx::Stream& s) {
  return s.device == mx::Device::cpu;
}

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

mx::array f32(const mx::array& a, mx::Stream s) {
  return a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, s);
}

mx::array rowc(const mx::array& a, mx::Stream s) {
  return mx::contiguous(a, false, s);
}

// ===========================================================================
// RMSNorm
// ===========================================================================

mx::array rms_norm_mlx(const mx::array& x, const std::optional<mx::array>& w, float eps, mx::Stream s) {
  using namespace mlx::core;
  auto r = rsqrt(add(mean(square(x, s), -1, true, s), array(eps, x.dtype()), s), s);
  auto y = multiply(x, r, s);
  return w ? multiply(y, *w, s) : y;
}

template <bool AVX>
void rms_fwd_rows(const float* x, const float* w, float* y, size_t r0, size_t r1, int64_t n, float eps);

template <>
void rms_fwd_rows<false>(const float* x, const float* w, float* y, size_t r0, size_t r1, int64_t n, float eps) {
  for (size_t r = r0; r < r1; ++r) metalnn_train::rms_row_body(x + r * n, w, y + r * n, n, eps);
}

template <>
FM_TARGET void rms_fwd_rows<true>(const float* x, const float* w, float* y, size_t r0, size_t r1, int64_t n,
                                  float eps) {
  for (size_t r = r0; r < r1; ++r) metalnn_train::rms_row_body(x + r * n, w, y + r * n, n, eps);
}

template <bool AVX>
void rms_bwd_rows(const float* x, const float* w, const float* g, float* dx, float* dw, float* gw, size_t r0,
                  size_t r1, int64_t n, float eps);

template <>
void rms_bwd_rows<false>(const float* x, const float* w, const float* g, float* dx, float* dw, float* gw,
                         size_t r0, size_t r1, int64_t n, float eps) {
  for (size_t r = r0; r < r1; ++r)
    metalnn_train::rms_grad_row_body(x + r * n, w, g + r * n, dx + r * n, dw, gw, n, eps);
}

template <>
FM_TARGET void rms_bwd_rows<true>(const float* x, const float* w, const float* g, float* dx, float* dw, float* gw,
                                  size_t r0, size_t r1, int64_t n, float eps) {
  for (size_t r = r0; r < r1; ++r)
    metalnn_train::rms_grad_row_body(x + r * n, w, g + r * n, dx + r * n, dw, gw, n, eps);
}

bool avx2() {
#if METALNN_FM_X86
  return metalnn_fastmath::use_avx2();
#else
  return false;
#endif
}

mx::array rms_norm_op(const mx::array& x, const std::optional<mx::array>& w, float eps, mx::Stream s);
Arrays rms_norm_vjp_op(const mx::array& x, const std::optional<mx::array>& w, const mx::array& g, float eps,
                       mx::Stream s);

class RmsNorm : public NativeOp {
 public:
  RmsNorm(mx::Stream s, float eps, bool has_w)
      : NativeOp(
            s,
            [eps, has_w, s](const Arrays& in) {
              return Arrays{rms_norm_mlx(in[0], has_w ? std::optional<mx::array>(in[1]) : std::nullopt, eps, s)};
            },
            1),
        eps_(eps),
        has_w_(has_w) {}

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& out = outputs[0];
    alloc(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    const bool has_w = has_w_;
    enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                  w = has_w ? mx::array::unsafe_weak_copy(inputs[1]) : mx::array(0.0f),
                  out = mx::array::unsafe_weak_copy(out), eps = eps_, has_w]() mutable {
      const int64_t n = x.shape(-1);
      if (x.size() == 0 || n == 0) return;
      const size_t rows = x.size() / n;
      const float* px = x.data<float>();
      const float* pw = has_w ? w.data<float>() : nullptr;
      float* py = out.data<float>();
      const bool v = avx2();
      metalnn_native::parallel_for(rows, grain_rows(n), [&](size_t r0, size_t r1) {
        v ? rms_fwd_rows<true>(px, pw, py, r0, r1, n, eps) : rms_fwd_rows<false>(px, pw, py, r0, r1, n, eps);
      });
    });
  }

  Arrays vjp(const Arrays& primals, const Arrays& cotangents, const std::vector<int>& argnums,
             const Arrays&) override {
    auto w = has_w_ ? std::optional<mx::array>(primals[1]) : std::nullopt;
    auto grads = rms_norm_vjp_op(primals[0], w, cotangents[0], eps_, stream());
    Arrays res;
    for (int i : argnums) res.push_back(grads[i]);
    return res;
  }

  METALNN_PRIMITIVE("MetalnnRMSNorm", eps_, has_w_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)

 private:
  float eps_;
  bool has_w_;
};

class RmsNormVJP : public NativeOp {
 public:
  RmsNormVJP(mx::Stream s, float eps, bool has_w)
      : NativeOp(
            s,
            [eps, has_w, s](const Arrays& in) {
              // in: x, [w,] g
              Arrays primals = has_w ? Arrays{in[0], in[1]} : Arrays{in[0]};
              auto fn = [eps, has_w, s](const Arrays& p) {
                return Arrays{rms_norm_mlx(p[0], has_w ? std::optional<mx::array>(p[1]) : std::nullopt, eps, s)};
              };
              return mx::vjp(fn, primals, {in.back()}).second;
            },
            has_w ? 2 : 1),
        eps_(eps),
        has_w_(has_w) {}

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    for (auto& o : outputs) {
      alloc(o);
      enc.set_output_array(o);
    }
    const bool has_w = has_w_;
    enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                  w = has_w ? mx::array::unsafe_weak_copy(inputs[1]) : mx::array(0.0f),
                  g = mx::array::unsafe_weak_copy(inputs.back()), dx = mx::array::unsafe_weak_copy(outputs[0]),
                  dw = has_w ? mx::array::unsafe_weak_copy(outputs[1]) : mx::array(0.0f), eps = eps_,
                  has_w]() mutable {
      const int64_t n = x.shape(-1);
      float* pdw = has_w ? dw.data<float>() : nullptr;
      if (pdw) std::fill(pdw, pdw + n, 0.0f);
      if (x.size() == 0 || n == 0) return;
      const size_t rows = x.size() / n;
      const float* px = x.data<float>();
      const float* pw = has_w ? w.data<float>() : nullptr;
      const float* pg = g.data<float>();
      float* pdx = dx.data<float>();
      // Blocks of rows, each with its own dw partial sum (then added in order).
      const size_t grain = grain_rows(n);
      const size_t blocks = std::min<size_t>(std::max<size_t>(1, rows / grain), 64);
      std::vector<float> scratch(blocks * 2 * n, 0.0f);
      const bool v = avx2();
      metalnn_native::parallel_for(blocks, 1, [&](size_t b0, size_t b1) {
        for (size_t b = b0; b < b1; ++b) {
          const size_t r0 = rows * b / blocks, r1 = rows * (b + 1) / blocks;
          float* acc = has_w ? scratch.data() + b * 2 * n : nullptr;
          float* gw = scratch.data() + b * 2 * n + n;
          v ? rms_bwd_rows<true>(px, pw, pg, pdx, acc, gw, r0, r1, n, eps)
            : rms_bwd_rows<false>(px, pw, pg, pdx, acc, gw, r0, r1, n, eps);
        }
      });
      if (pdw) {
        for (size_t b = 0; b < blocks; ++b) {
          const float* acc = scratch.data() + b * 2 * n;
          for (int64_t i = 0; i < n; ++i) pdw[i] += acc[i];
        }
      }
    });
  }

  METALNN_PRIMITIVE("MetalnnRMSNormVJP", eps_, has_w_)
  std::vector<mx::Shape> output_shapes(const Arrays& inputs) override {
    if (has_w_) return {inputs[0].shape(), inputs[1].shape()};
    return {inputs[0].shape()};
  }

 private:
  float eps_;
  bool has_w_;
};

mx::array rms_norm_op(const mx::array& x, const std::optional<mx::array>& w, float eps, mx::Stream s) {
  require(x.ndim() >= 1, "[rms_norm] x must have at least one axis");
  if (w) {
    std::ostringstream msg;
    msg << "[rms_norm] weight must have shape (" << x.shape(-1) << ",), got " << w->shape();
    require(w->ndim() == 1 && w->shape(0) == x.shape(-1), msg.str());
  }
  if (!native_stream(s) || x.dtype() != mx::float32 || (w && w->dtype() != mx::float32))
    return rms_norm_mlx(x, w, eps, s);
  Arrays in = {rowc(x, s)};
  if (w) in.push_back(rowc(*w, s));
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps, bool(w)), in);
}

Arrays rms_norm_vjp_op(const mx::array& x, const std::optional<mx::array>& w, const mx::array& g, float eps,
                       mx::Stream s) {
  Arrays in = {rowc(x, s)};
  std::vector<mx::Shape> shapes = {x.shape()};
  if (w) {
    in.push_back(rowc(*w, s));
    shapes.push_back(w->shape());
  }
  in.push_back(rowc(f32(g, s), s));
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  auto outs = mx::array::make_arrays(shapes, dtypes, std::make_shared<RmsNormVJP>(s, eps, bool(w)), in);
  if (!w) outs.push_back(mx::zeros({x.shape(-1)}, mx::float32, s));  // unused slot
  return outs;
}

// ===========================================================================
// RoPE
// ===========================================================================

// inv_freq: base ** (-2i / dims) for i < dims / 2, unless has_freqs: then the op's second input
// holds the periods (inv_freq = 1 / freqs, read at evaluation, so the periods may be a traced
// array under mx.compile).
struct RopeSpec {
  int dims;
  bool traditional;
  std::vector<float> inv_freq;
  bool has_freqs;
  float scale;
  int offset;
  bool inverse;

  bool operator==(const RopeSpec& o) const {
    return dims == o.dims && traditional == o.traditional && inv_freq == o.inv_freq && has_freqs == o.has_freqs &&
           scale == o.scale && offset == o.offset && inverse == o.inverse;
  }
};

mx::array rope_mlx(const mx::array& x, const RopeSpec& sp, const std::optional<mx::array>& freqs, mx::Stream s) {
  using namespace mlx::core;
  const int T = x.shape(-2), D = x.shape(-1), half = sp.dims / 2;
  auto inv = sp.has_freqs ? divide(array(1.0f), astype(*freqs, float32, s), s)
                          : array(sp.inv_freq.data(), {half}, float32);
  auto pos = multiply(add(arange(0, T, float32, s), array(static_cast<float>(sp.offset)), s), array(sp.scale), s);
  auto theta = multiply(reshape(pos, {T, 1}, s), reshape(inv, {1, half}, s), s);
  auto c = cos(theta, s), sn = sin(theta, s);
  if (sp.inverse) sn = negative(sn, s);
  auto rot = slice(x, Shape(x.ndim(), 0), [&] {
    auto e = x.shape();
    e.back() = sp.dims;
    return e;
  }(), s);
  array out = rot;
  if (sp.traditional) {
    auto shp = rot.shape();
    shp.back() = half;
    shp.push_back(2);
    auto pairs = reshape(rot, shp, s);
    auto x1 = take(pairs, array(0), -1, s), x2 = take(pairs, array(1), -1, s);
    auto r1 = subtract(multiply(x1, c, s), multiply(x2, sn, s), s);
    auto r2 = add(multiply(x1, sn, s), multiply(x2, c, s), s);
    out = reshape(stack({r1, r2}, -1, s), rot.shape(), s);
  } else {
    auto x1 = slice(rot, Shape(x.ndim(), 0), [&] {
      auto e = rot.shape();
      e.back() = half;
      return e;
    }(), s);
    auto x2 = slice(rot, [&] {
      Shape b(x.ndim(), 0);
      b.back() = half;
      return b;
    }(), rot.shape(), s);
    out = concatenate({subtract(multiply(x1, c, s), multiply(x2, sn, s), s),
                       add(multiply(x1, sn, s), multiply(x2, c, s), s)},
                      -1, s);
  }
  if (sp.dims < D) {
    Shape b(x.ndim(), 0);
    b.back() = sp.dims;
    out = concatenate({out, slice(x, b, x.shape(), s)}, -1, s);
  }
  return out;
}

mx::array rope_op(const mx::array& x, const RopeSpec& sp, const std::optional<mx::array>& freqs, mx::Stream s,
                  const std::optional<mx::array>& layout = std::nullopt);

template <bool AVX>
void rope_rows(const mx::array& x, mx::array& out, const float* cs, const float* sn, int64_t T, int64_t half,
               size_t r0, size_t r1, bool trad, float* buf);

#define METALNN_ROPE_ROWS_BODY                                                                    \
  const mx::Shape& shape = x.shape();                                                             \
  const int64_t D = shape.back();                                                                 \
  const int64_t sx = x.strides().back();                                                          \
  const float* src = x.data<float>();                                                             \
  float* dst = out.data<float>();                                                                 \
  for (size_t r = r0; r < r1; ++r) {                                                              \
    const int64_t t = static_cast<int64_t>(r) % T;                                                \
    const float* row = src + row_offset(r, shape, x.strides());                                   \
    if (sx != 1) {                                                                                \
      for (int64_t i = 0; i < D; ++i) buf[i] = row[i * sx];                                       \
      row = buf;                                                                                  \
    }                                                                                             \
    float* orow = dst + row_offset(r, shape, out.strides());                                      \
    metalnn_train::rope_row_body(row, orow, cs + t * half, sn + t * half, half, D, trad);         \
  }

template <>
void rope_rows<false>(const mx::array& x, mx::array& out, const float* cs, const float* sn, int64_t T,
                      int64_t half, size_t r0, size_t r1, bool trad, float* buf) {
  METALNN_ROPE_ROWS_BODY
}

template <>
FM_TARGET void rope_rows<true>(const mx::array& x, mx::array& out, const float* cs, const float* sn, int64_t T,
                               int64_t half, size_t r0, size_t r1, bool trad, float* buf) {
  METALNN_ROPE_ROWS_BODY
}
#undef METALNN_ROPE_ROWS_BODY

class Rope : public NativeOp {
 public:
  Rope(mx::Stream s, RopeSpec sp)
      : NativeOp(
            s,
            [sp, s](const Arrays& in) {
              return Arrays{rope_mlx(in[0], sp, sp.has_freqs ? std::optional<mx::array>(in[1]) : std::nullopt, s)};
            },
            1),
        sp_(std::move(sp)) {}

  std::optional<mx::array> freqs_of(const Arrays& inputs) const {
    return sp_.has_freqs ? std::optional<mx::array>(inputs[1]) : std::nullopt;
  }

  // inputs: x, the periods when has_freqs, and optionally an array whose (dense) memory order
  // the output takes: the backward pass writes the gradient in the layout of the forward input,
  // so that the caller's split-heads transpose of it is row-contiguous again.
  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& out = outputs[0];
    const size_t n_in = sp_.has_freqs ? 2 : 1;
    if (inputs.size() > n_in && inputs[n_in].strides().back() == 1)
      alloc_like(out, inputs[n_in]);
    else
      alloc(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), out = mx::array::unsafe_weak_copy(out),
                  f = sp_.has_freqs ? mx::array::unsafe_weak_copy(inputs[1]) : mx::array(0.0f),
                  sp = sp_]() mutable {
      if (x.size() == 0) return;
      const int64_t T = x.shape(-2), D = x.shape(-1), half = sp.dims / 2;
      if (sp.has_freqs) {
        sp.inv_freq.resize(half);
        for (int64_t i = 0; i < half; ++i) sp.inv_freq[i] = 1.0f / f.data<float>()[i];
      }
      // cos / sin table [T, half]: theta = (offset + t) * scale * inv_freq, in float32 as MLX
      std::vector<float> cs(T * half), sn(T * half);
      for (int64_t t = 0; t < T; ++t) {
        const float pos = (static_cast<float>(t) + static_cast<float>(sp.offset)) * sp.scale;
        for (int64_t i = 0; i < half; ++i) {
          const float th = pos * sp.inv_freq[i];
          cs[t * half + i] = std::cos(th);
          sn[t * half + i] = sp.inverse ? -std::sin(th) : std::sin(th);
        }
      }
      const size_t rows = x.size() / D;
      const bool v = avx2();
      metalnn_native::parallel_for(rows, grain_rows(D), [&](size_t r0, size_t r1) {
        std::vector<float> buf(D);
        v ? rope_rows<true>(x, out, cs.data(), sn.data(), T, half, r0, r1, sp.traditional, buf.data())
          : rope_rows<false>(x, out, cs.data(), sn.data(), T, half, r0, r1, sp.traditional, buf.data());
      });
    });
  }

  // Only x is differentiated: the periods are constants (as for mx.fast.rope) and the optional
  // layout input only decides where values are stored.
  Arrays vjp(const Arrays& primals, const Arrays& cotangents, const std::vector<int>& argnums,
             const Arrays&) override {
    RopeSpec inv = sp_;
    inv.inverse = !inv.inverse;
    Arrays res;
    for (int i : argnums)
      res.push_back(i == 0 ? rope_op(cotangents[0], inv, freqs_of(primals), stream(), primals[0])
                           : mx::zeros_like(primals[i], stream()));
    return res;
  }

  Arrays jvp(const Arrays& primals, const Arrays& tangents, const std::vector<int>& argnums) override {
    for (size_t j = 0; j < argnums.size(); ++j)
      if (argnums[j] == 0) return {rope_op(tangents[j], sp_, freqs_of(primals), stream())};
    return {mx::zeros(primals[0].shape(), mx::float32, stream())};
  }

  METALNN_PRIMITIVE("MetalnnRoPE", sp_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)

 private:
  RopeSpec sp_;
};

mx::array rope_op(const mx::array& x, const RopeSpec& sp, const std::optional<mx::array>& freqs, mx::Stream s,
                  const std::optional<mx::array>& layout) {
  require(x.ndim() >= 2, "[rope] x must be [..., T, D]");
  require(sp.dims > 0 && sp.dims % 2 == 0 && sp.dims <= x.shape(-1), "[rope] dims must be even and <= D");
  if (sp.has_freqs) {
    std::ostringstream msg;
    msg << "[rope] freqs must hold dims / 2 = " << sp.dims / 2 << " periods, got shape " << freqs->shape();
    require(freqs && freqs->size() == static_cast<size_t>(sp.dims / 2), msg.str());
  }
  if (!native_stream(s) || x.dtype() != mx::float32) return rope_mlx(x, sp, freqs, s);
  // The kernel reads any strided layout (e.g. the transposed view of split heads).
  Arrays in = {x};
  if (sp.has_freqs) in.push_back(rowc(mx::astype(mx::reshape(*freqs, {-1}, s), mx::float32, s), s));
  if (layout && layout->shape() == x.shape()) in.push_back(*layout);
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(s, sp), in);
}

// ===========================================================================
// Gated activations: act(a) * b
// ===========================================================================

mx::array act_mlx(Kind k, const mx::array& a, mx::Stream s) {
  using namespace mlx::core;
  switch (k) {
    case Kind::Sigmoid:
      return sigmoid(a, s);
    case Kind::Silu:
      return multiply(a, sigmoid(a, s), s);
    case Kind::Tanh:
      return tanh(a, s);
    case Kind::GeluTanh: {
      auto inner = multiply(array(0.7978845608028654f),
                            add(a, multiply(array(0.044715f), multiply(a, multiply(a, a, s), s), s), s), s);
      return multiply(multiply(array(0.5f), a, s), add(array(1.0f), tanh(inner, s), s), s);
    }
    case Kind::Exp:
      return exp(a, s);
  }
  throw std::logic_error("bad kind");
}

template <bool AVX>
void gated_fwd(Kind k, const float* a, const float* b, float* y, size_t i0, size_t i1);
template <bool AVX>
void gated_bwd(Kind k, const float* a, const float* b, const float* g, float* da, float* db, size_t i0, size_t i1);

template <>
void gated_fwd<false>(Kind k, const float* a, const float* b, float* y, size_t i0, size_t i1) {
  for (size_t i = i0; i < i1; ++i) y[i] = metalnn_fastmath::unary_s(k, a[i]) * b[i];
}

template <>
void gated_bwd<false>(Kind k, const float* a, const float* b, const float* g, float* da, float* db, size_t i0,
                      size_t i1) {
  const bool use_out = k == Kind::Sigmoid || k == Kind::Tanh || k == Kind::Exp;
  for (size_t i = i0; i < i1; ++i) {
    const float act = metalnn_fastmath::unary_s(k, a[i]);
    const float gb = g[i] * b[i];
    const float gact = g[i] * act;
    da[i] = metalnn_fastmath::unary_grad_s(k, use_out ? act : a[i], gb);
    db[i] = gact;
  }
}

#if METALNN_FM_X86
template <Kind K>
FM_TARGET void gated_fwd_k(const float* a, const float* b, float* y, size_t i0, size_t i1) {
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    __m256 va = _mm256_loadu_ps(a + i), vb = _mm256_loadu_ps(b + i);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(metalnn_fastmath::unary8<K>(va), vb));
  }
  if (i < i1) {
    const __m256i m = metalnn_fastmath::tail_mask(i1 - i);
    __m256 va = _mm256_maskload_ps(a + i, m), vb = _mm256_maskload_ps(b + i, m);
    _mm256_maskstore_ps(y + i, m, _mm256_mul_ps(metalnn_fastmath::unary8<K>(va), vb));
  }
}

template <Kind K>
FM_INLINE void gated_bwd8(__m256 va, __m256 vb, __m256 vg, __m256& oa, __m256& ob) {
  constexpr bool use_out = K == Kind::Sigmoid || K == Kind::Tanh || K == Kind::Exp;
  __m256 act = metalnn_fastmath::unary8<K>(va);
  oa = metalnn_fastmath::unary_grad8<K>(use_out ? act : va, _mm256_mul_ps(vg, vb));
  ob = _mm256_mul_ps(vg, act);
}

template <Kind K>
FM_TARGET void gated_bwd_k(const float* a, const float* b, const float* g, float* da, float* db, size_t i0,
                           size_t i1) {
  auto step = gated_bwd8<K>;
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    __m256 oa, ob;
    step(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), _mm256_loadu_ps(g + i), oa, ob);
    _mm256_storeu_ps(da + i, oa);
    _mm256_storeu_ps(db + i, ob);
  }
  if (i < i1) {
    const __m256i m = metalnn_fastmath::tail_mask(i1 - i);
    __m256 oa, ob;
    step(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m), _mm256_maskload_ps(g + i, m), oa, ob);
    _mm256_maskstore_ps(da + i, m, oa);
    _mm256_maskstore_ps(db + i, m, ob);
  }
}

template <>
void gated_fwd<true>(Kind k, const float* a, const float* b, float* y, size_t i0, size_t i1) {
  switch (k) {
    case Kind::Silu:
      return gated_fwd_k<Kind::Silu>(a, b, y, i0, i1);
    case Kind::GeluTanh:
      return gated_fwd_k<Kind::GeluTanh>(a, b, y, i0, i1);
    case Kind::Sigmoid:
      return gated_fwd_k<Kind::Sigmoid>(a, b, y, i0, i1);
    case Kind::Tanh:
      return gated_fwd_k<Kind::Tanh>(a, b, y, i0, i1);
    case Kind::Exp:
      return gated_fwd_k<Kind::Exp>(a, b, y, i0, i1);
  }
}

template <>
void gated_bwd<true>(Kind k, const float* a, const float* b, const float* g, float* da, float* db, size_t i0,
                     size_t i1) {
  switch (k) {
    case Kind::Silu:
      return gated_bwd_k<Kind::Silu>(a, b, g, da, db, i0, i1);
    case Kind::GeluTanh:
      return gated_bwd_k<Kind::GeluTanh>(a, b, g, da, db, i0, i1);
    case Kind::Sigmoid:
      return gated_bwd_k<Kind::Sigmoid>(a, b, g, da, db, i0, i1);
    case Kind::Tanh:
      return gated_bwd_k<Kind::Tanh>(a, b, g, da, db, i0, i1);
    case Kind::Exp:
      return gated_bwd_k<Kind::Exp>(a, b, g, da, db, i0, i1);
  }
}
#endif

Arrays gated_vjp_op(Kind k, const mx::array& a, const mx::array& b, const mx::array& g, mx::Stream s);

class Gated : public NativeOp {
 public:
  Gated(mx::Stream s, Kind k)
      : NativeOp(s, [k, s](const Arrays& in) { return Arrays{mx::multiply(act_mlx(k, in[0], s), in[1], s)}; }, 1),
        k_(k) {}

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& out = outputs[0];
    alloc(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([a = mx::array::unsafe_weak_copy(inputs[0]), b = mx::array::unsafe_weak_copy(inputs[1]),
                  out = mx::array::unsafe_weak_copy(out), k = k_]() mutable {
      const float *pa = a.data<float>(), *pb = b.data<float>();
      float* py = out.data<float>();
      const bool v = avx2();
      metalnn_native::parallel_for(out.size(), 16384, [&](size_t i0, size_t i1) {
#if METALNN_FM_X86
        if (v) return gated_fwd<true>(k, pa, pb, py, i0, i1);
#endif
        gated_fwd<false>(k, pa, pb, py, i0, i1);
      });
      (void)v;
    });
  }

  Arrays vjp(const Arrays& primals, const Arrays& cotangents, const std::vector<int>& argnums,
             const Arrays&) override {
    auto grads = gated_vjp_op(k_, primals[0], primals[1], cotangents[0], stream());
    Arrays res;
    for (int i : argnums) res.push_back(grads[i]);
    return res;
  }

  METALNN_PRIMITIVE("MetalnnGated", k_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)

 private:
  Kind k_;
};

class GatedVJP : public NativeOp {
 public:
  GatedVJP(mx::Stream s, Kind k)
      : NativeOp(
            s,
            [k, s](const Arrays& in) {
              auto fn = [k, s](const Arrays& p) { return Arrays{mx::multiply(act_mlx(k, p[0], s), p[1], s)}; };
              return mx::vjp(fn, {in[0], in[1]}, {in[2]}).second;
            },
            2),
        k_(k) {}

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    for (auto& o : outputs) {
      alloc(o);
      enc.set_output_array(o);
    }
    enc.dispatch([a = mx::array::unsafe_weak_copy(inputs[0]), b = mx::array::unsafe_weak_copy(inputs[1]),
                  g = mx::array::unsafe_weak_copy(inputs[2]), da = mx::array::unsafe_weak_copy(outputs[0]),
                  db = mx::array::unsafe_weak_copy(outputs[1]), k = k_]() mutable {
      const float *pa = a.data<float>(), *pb = b.data<float>(), *pg = g.data<float>();
      float *pda = da.data<float>(), *pdb = db.data<float>();
      const bool v = avx2();
      metalnn_native::parallel_for(a.size(), 16384, [&](size_t i0, size_t i1) {
#if METALNN_FM_X86
        if (v) return gated_bwd<true>(k, pa, pb, pg, pda, pdb, i0, i1);
#endif
        gated_bwd<false>(k, pa, pb, pg, pda, pdb, i0, i1);
      });
      (void)v;
    });
  }

  METALNN_PRIMITIVE("MetalnnGatedVJP", k_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 2)

 private:
  Kind k_;
};

mx::array gated_op(Kind k, const mx::array& a, const mx::array& b, mx::Stream s) {
  {
    std::ostringstream msg;
    msg << "[gated] a and b must have the same shape, got " << a.shape() << " and " << b.shape();
    require(a.shape() == b.shape(), msg.str());
  }
  if (!native_stream(s) || a.dtype() != mx::float32 || b.dtype() != mx::float32)
    return mx::multiply(act_mlx(k, a, s), b, s);
  return mx::array(a.shape(), mx::float32, std::make_shared<Gated>(s, k), {rowc(a, s), rowc(b, s)});
}

Arrays gated_vjp_op(Kind k, const mx::array& a, const mx::array& b, const mx::array& g, mx::Stream s) {
  return mx::array::make_arrays({a.shape(), a.shape()}, {mx::float32, mx::float32},
                                std::make_shared<GatedVJP>(s, k), {rowc(a, s), rowc(b, s), rowc(f32(g, s), s)});
}

// ===========================================================================
// Cross entropy: per-row loss (and logsumexp, kept for the backward)
// ===========================================================================

Arrays cross_entropy_mlx(const mx::array& x, const mx::array& t, float ls, mx::Stream s) {
  using namespace mlx::core;
  // differences with the row's max first (see CrossEntropy::eval_cpu)
  auto m = stop_gradient(max(x, -1, true, s), s);
  m = where(isinf(m, s), array(0.0f), m, s);
  auto xs = subtract(x, m, s);
  auto lse_s = logsumexp(xs, -1, false, s);
  auto picked = squeeze(take_along_axis(xs, expand_dims(astype(t, int32, s), -1, s), -1, s), -1, s);
  auto loss = subtract(lse_s, multiply(array(1.0f - ls), picked, s), s);
  if (ls != 0.0f) loss = subtract(loss, multiply(array(ls), mean(xs, -1, false, s), s), s);
  return {loss, add(lse_s, squeeze(m, -1, s), s)};
}

Arrays cross_entropy_vjp_op(const mx::array& x, const mx::array& t, const mx::array& lse, const mx::array& g,
                            float ls, mx::Stream s);

class CrossEntropy : public NativeOp {
 public:
  CrossEntropy(mx::Stream s, float ls)
      : NativeOp(s, [ls, s](const Arrays& in) { return cross_entropy_mlx(in[0], in[1], ls, s); }, 2), ls_(ls) {}

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    for (auto& o : outputs) {
      alloc(o);
      enc.set_output_array(o);
    }
    enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), t = mx::array::unsafe_weak_copy(inputs[1]),
                  loss = mx::array::unsafe_weak_copy(outputs[0]), lse = mx::array::unsafe_weak_copy(outputs[1]),
                  ls = ls_]() mutable {
      const int64_t n = x.shape(-1);
      const size_t rows = loss.size();
      if (rows == 0) return;
      const float* px = x.data<float>();
      const int32_t* pt = t.data<int32_t>();
      float *pl = loss.data<float>(), *pe = lse.data<float>();
      const bool v = avx2();
      metalnn_native::parallel_for(rows, grain_rows(n), [&](size_t r0, size_t r1) {
        for (size_t r = r0; r < r1; ++r) {
          const float* row = px + r * n;
          float m;
#if METALNN_FM_X86
          const float log_s = v ? metalnn_train::lse_row_avx2(row, n, &m) : metalnn_train::lse_row_scalar(row, n, &m);
#else
          const float log_s = metalnn_train::lse_row_scalar(row, n, &m);
#endif
          const float l = m + log_s;
          const int64_t ti = pt[r];
          const float picked = ti >= 0 && ti < n ? row[ti] : NAN;
          // lse - (1 - ls) x[t] - ls mean(x), formed from differences with the row's max m as
          // torch's log_softmax does: log_s - (1 - ls)(x[t] - m) - ls mean(x - m), exact to float32
          // rounding for large logits (1000 + log 2 - 1000 would lose 4 of float32's 7 digits)
          const bool finite = std::isfinite(m);
          const float shift = finite ? m : 0.0f;
          float out = (finite ? log_s : l) - (1.0f - ls) * (picked - shift);
          if (ls != 0.0f) {
            float sum = 0.0f;
            for (int64_t i = 0; i < n; ++i) sum += row[i] - shift;
            out -= ls * (sum / static_cast<float>(n));
          }
          pe[r] = l;
          pl[r] = out;
        }
      });
      (void)v;
    });
  }

  // The second output (the rows' logsumexp, kept for this backward) never leaves the op
  // (the binding returns the loss only), so its cotangent is always zero and is ignored.
  Arrays vjp(const Arrays& primals, const Arrays& cotangents, const std::vector<int>& argnums,
             const Arrays& outputs) override {
    Arrays res;
    for (int i : argnums) {
      if (i == 0)
        res.push_back(cross_entropy_vjp_op(primals[0], primals[1], outputs[1], cotangents[0], ls_, stream())[0]);
      else
        res.push_back(mx::zeros_like(primals[1], stream()));
    }
    return res;
  }

  METALNN_PRIMITIVE("MetalnnCrossEntropy", ls_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(1, 2)

 private:
  float ls_;
};

class CrossEntropyVJP : public NativeOp {
 public:
  CrossEntropyVJP(mx::Stream s, float ls)
      : NativeOp(
            s,
            [ls, s](const Arrays& in) {
              auto fn = [ls, s, t = in[1]](const Arrays& p) { return Arrays{cross_entropy_mlx(p[0], t, ls, s)[0]}; };
              return mx::vjp(fn, {in[0]}, {in[3]}).second;
            },
            1),
        ls_(ls) {}

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& out = outputs[0];
    alloc(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), t = mx::array::unsafe_weak_copy(inputs[1]),
                  lse = mx::array::unsafe_weak_copy(inputs[2]), g = mx::array::unsafe_weak_copy(inputs[3]),
                  out = mx::array::unsafe_weak_copy(out), ls = ls_]() mutable {
      const int64_t n = x.shape(-1);
      const size_t rows = lse.size();
      if (rows == 0) return;
      const float *px = x.data<float>(), *pe = lse.data<float>(), *pg = g.data<float>();
      const int32_t* pt = t.data<int32_t>();
      float* po = out.data<float>();
      const float hot = 1.0f - ls, cold = ls / static_cast<float>(n);
      const bool v = avx2();
      metalnn_native::parallel_for(rows, grain_rows(n), [&](size_t r0, size_t r1) {
        for (size_t r = r0; r < r1; ++r) {
#if METALNN_FM_X86
          if (v) {
            metalnn_train::ce_grad_row_avx2(px + r * n, pe[r], pt[r], pg[r], hot, cold, po + r * n, n);
            continue;
          }
#endif
          metalnn_train::ce_grad_row_scalar(px + r * n, pe[r], pt[r], pg[r], hot, cold, po + r * n, n);
        }
      });
      (void)v;
    });
  }

  METALNN_PRIMITIVE("MetalnnCrossEntropyVJP", ls_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)

 private:
  float ls_;
};

Arrays cross_entropy_op(const mx::array& x, const mx::array& t, float ls, mx::Stream s) {
  {
    std::ostringstream msg;
    msg << "[cross_entropy] logits [..., C] need targets of shape [...]; got " << x.shape() << " and "
        << t.shape();
    auto lead = x.shape();
    if (!lead.empty()) lead.pop_back();
    require(x.ndim() >= 1 && t.shape() == lead, msg.str());
  }
  require(mx::issubdtype(t.dtype(), mx::integer), "[cross_entropy] targets must be integers");
  if (!native_stream(s) || x.dtype() != mx::float32) return cross_entropy_mlx(x, t, ls, s);
  auto ti = t.dtype() == mx::int32 ? t : mx::astype(t, mx::int32, s);
  return mx::array::make_arrays({t.shape(), t.shape()}, {mx::float32, mx::float32},
                                std::make_shared<CrossEntropy>(s, ls), {rowc(x, s), rowc(ti, s)});
}

Arrays cross_entropy_vjp_op(const mx::array& x, const mx::array& t, const mx::array& lse, const mx::array& g,
                            float ls, mx::Stream s) {
  auto ti = t.dtype() == mx::int32 ? t : mx::astype(t, mx::int32, s);
  return {mx::array(x.shape(), mx::float32, std::make_shared<CrossEntropyVJP>(s, ls),
                    {rowc(x, s), rowc(ti, s), rowc(lse, s), rowc(f32(g, s), s)})};
}

// ===========================================================================
// Scaled, optionally causal softmax over the last axis (attention scores)
// ===========================================================================

struct SoftmaxSpec {
  float scale;
  bool causal;
  int q_len;   // rows cycle through q_len query positions
  int offset;  // query i sees keys j <= i + offset

  bool operator==(const SoftmaxSpec& o) const {
    return scale == o.scale && causal == o.causal && q_len == o.q_len && offset == o.offset;
  }
  int64_t valid(size_t row, int64_t n) const {
    if (!causal) return n;
    const int64_t i = static_cast<int64_t>(row % static_cast<size_t>(q_len));
    return std::clamp<int64_t>(i + offset + 1, 0, n);
  }
};

mx::array causal_bias(const SoftmaxSpec& sp, int64_t n, mx::Stream s) {
  using namespace mlx::core;
  auto q = reshape(add(arange(0, sp.q_len, int32, s), array(sp.offset), s), {sp.q_len, 1}, s);
  auto k = reshape(arange(0, static_cast<int>(n), int32, s), {1, static_cast<int>(n)}, s);
  return where(less_equal(k, q, s), array(0.0f), array(-INFINITY), s);
}

mx::array scaled_softmax_mlx(const mx::array& x, const SoftmaxSpec& sp, mx::Stream s) {
  using namespace mlx::core;
  auto z = multiply(x, array(sp.scale), s);
  if (sp.causal) {
    const int n = x.shape(-1);
    auto shp = x.shape();
    shp.back() = sp.q_len;
    shp.push_back(n);
    shp[shp.size() - 3] = x.shape(-2) / sp.q_len;
    auto zz = reshape(z, shp, s);
    z = reshape(add(zz, causal_bias(sp, n, s), s), x.shape(), s);
  }
  return softmax(z, std::vector<int>{-1}, true, s);
}

mx::array scaled_softmax_vjp_op(const mx::array& y, const mx::array& g, const SoftmaxSpec& sp, mx::Stream s);

class ScaledSoftmax : public NativeOp {
 public:
  ScaledSoftmax(mx::Stream s, SoftmaxSpec sp)
      : NativeOp(s, [sp, s](const Arrays& in) { return Arrays{scaled_softmax_mlx(in[0], sp, s)}; }, 1), sp_(sp) {}

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& out = outputs[0];
    const auto& x = inputs[0];
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    enc.set_output_array(out);
    if (x.is_donatable() && x.itemsize() == out.itemsize())
      out.copy_shared_buffer(x);  // rows are read before they are written
    else
      alloc(out);
    enc.dispatch([x = mx::array::unsafe_weak_copy(x), out = mx::array::unsafe_weak_copy(out), sp = sp_]() mutable {
      const int64_t n = x.shape(-1);
      if (x.size() == 0 || n == 0) return;
      const size_t rows = x.size() / n;
      const float* px = x.data<float>();
      float* py = out.data<float>();
      const bool v = avx2();
      metalnn_native::parallel_for(rows, grain_rows(n), [&](size_t r0, size_t r1) {
        for (size_t r = r0; r < r1; ++r) {
          const int64_t m = sp.valid(r, n);
#if METALNN_FM_X86
          if (v) {
            metalnn_train::scaled_softmax_row_avx2(px + r * n, py + r * n, m, n, sp.scale);
            continue;
          }
#endif
          metalnn_train::scaled_softmax_row_scalar(px + r * n, py + r * n, m, n, sp.scale);
        }
      });
      (void)v;
    });
  }

  Arrays vjp(const Arrays&, const Arrays& cotangents, const std::vector<int>&, const Arrays& outputs) override {
    return {scaled_softmax_vjp_op(outputs[0], cotangents[0], sp_, stream())};
  }

  METALNN_PRIMITIVE("MetalnnScaledSoftmax", sp_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)

 private:
  SoftmaxSpec sp_;
};

// out = scale * y * (g - <g, y>) over the valid prefix of each row (zeros after it).
class ScaledSoftmaxVJP : public NativeOp {
 public:
  ScaledSoftmaxVJP(mx::Stream s, SoftmaxSpec sp)
      : NativeOp(
            s,
            [sp, s](const Arrays& in) {
              using namespace mlx::core;
              auto d = sum(multiply(in[0], in[1], s), -1, true, s);
              return Arrays{multiply(array(sp.scale), multiply(in[0], subtract(in[1], d, s), s), s)};
            },
            1),
        sp_(sp) {}

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& out = outputs[0];
    const auto& y = inputs[0];
    const auto& g = inputs[1];
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(y);
    enc.set_input_array(g);
    enc.set_output_array(out);
    if (g.is_donatable() && g.itemsize() == out.itemsize())
      out.copy_shared_buffer(g);
    else if (y.is_donatable() && y.itemsize() == out.itemsize())
      out.copy_shared_buffer(y);
    else
      alloc(out);
    enc.dispatch([y = mx::array::unsafe_weak_copy(y), g = mx::array::unsafe_weak_copy(g),
                  out = mx::array::unsafe_weak_copy(out), sp = sp_]() mutable {
      const int64_t n = y.shape(-1);
      if (y.size() == 0 || n == 0) return;
      const size_t rows = y.size() / n;
      const float *py = y.data<float>(), *pg = g.data<float>();
      float* po = out.data<float>();
      metalnn_native::parallel_for(rows, grain_rows(n), [&](size_t r0, size_t r1) {
        for (size_t r = r0; r < r1; ++r) {
          const int64_t m = sp.valid(r, n);
          const float* yr = py + r * n;
          const float* gr = pg + r * n;
          float* orow = po + r * n;
          if (m > 0) metalnn_fastmath::softmax_grad_row(yr, gr, orow, static_cast<size_t>(m));
          if (sp.scale != 1.0f)
            for (int64_t i = 0; i < m; ++i) orow[i] *= sp.scale;
          for (int64_t i = m; i < n; ++i) orow[i] = 0.0f;
        }
      });
    });
  }

  METALNN_PRIMITIVE("MetalnnScaledSoftmaxVJP", sp_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)

 private:
  SoftmaxSpec sp_;
};

mx::array scaled_softmax_op(const mx::array& x, const SoftmaxSpec& sp, mx::Stream s) {
  require(x.ndim() >= 2 || !sp.causal, "[scaled_softmax] a causal softmax needs [..., rows, keys]");
  if (sp.causal) {
    std::ostringstream msg;
    msg << "[scaled_softmax] q_len " << sp.q_len << " must divide the rows axis of " << x.shape();
    require(sp.q_len > 0 && x.shape(-2) % sp.q_len == 0, msg.str());
  }
  if (!native_stream(s) || x.dtype() != mx::float32) return scaled_softmax_mlx(x, sp, s);
  return mx::array(x.shape(), mx::float32, std::make_shared<ScaledSoftmax>(s, sp), {rowc(x, s)});
}

mx::array scaled_softmax_vjp_op(const mx::array& y, const mx::array& g, const SoftmaxSpec& sp, mx::Stream s) {
  return mx::array(y.shape(), mx::float32, std::make_shared<ScaledSoftmaxVJP>(s, sp),
                   {rowc(y, s), rowc(f32(g, s), s)});
}

// ===========================================================================
// Layout copy: the values of x in row-major order (or in the dense order of a
// second input), multi-threaded; the VJP stores the cotangent in x's own order.
// ===========================================================================

mx::array layout_copy_op(const mx::array& x, mx::Stream s, const std::optional<mx::array>& like = std::nullopt);

class LayoutCopy : public NativeOp {
 public:
  explicit LayoutCopy(mx::Stream s)
      : NativeOp(s, [s](const Arrays& in) { return Arrays{mx::copy(in[0], s)}; }, 1) {}

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& out = outputs[0];
    if (inputs.size() > 1)
      alloc_like(out, inputs[1]);
    else
      alloc(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), out = mx::array::unsafe_weak_copy(out)]() mutable {
      if (x.size() == 0) return;
      const mx::Shape& shape = x.shape();
      const int64_t n = x.ndim() ? shape.back() : 1;
      const int64_t sx = x.ndim() ? x.strides().back() : 1, so = out.ndim() ? out.strides().back() : 1;
      const size_t rows = x.size() / n, item = x.itemsize();
      const char* src = static_cast<const char*>(x.data<void>());
      char* dst = static_cast<char*>(out.data<void>());
      metalnn_native::parallel_for(rows, grain_rows(n), [&](size_t r0, size_t r1) {
        for (size_t r = r0; r < r1; ++r) {
          const char* a = src + (x.ndim() > 1 ? row_offset(r, shape, x.strides()) : 0) * item;
          char* b = dst + (out.ndim() > 1 ? row_offset(r, shape, out.strides()) : 0) * item;
          if (sx == 1 && so == 1) {
            std::memcpy(b, a, n * item);
          } else {
            for (int64_t i = 0; i < n; ++i) std::memcpy(b + i * so * item, a + i * sx * item, item);
          }
        }
      });
    });
  }

  // The optional layout input only decides where values are stored: its gradient is zero.
  Arrays vjp(const Arrays& primals, const Arrays& cotangents, const std::vector<int>& argnums,
             const Arrays&) override {
    Arrays res;
    for (int i : argnums)
      res.push_back(i == 0 ? layout_copy_op(cotangents[0], stream(), primals[0]) : mx::zeros_like(primals[i], stream()));
    return res;
  }

  Arrays jvp(const Arrays& primals, const Arrays& tangents, const std::vector<int>& argnums) override {
    for (size_t j = 0; j < argnums.size(); ++j)
      if (argnums[j] == 0) return {tangents[j]};
    return {mx::zeros_like(primals[0], stream())};
  }

  METALNN_PRIMITIVE("MetalnnLayoutCopy")
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)
};

mx::array layout_copy_op(const mx::array& x, mx::Stream s, const std::optional<mx::array>& like) {
  if (!native_stream(s)) return mx::copy(x, s);
  Arrays in = {x};
  if (like && like->shape() == x.shape() && like->dtype() == x.dtype()) in.push_back(*like);
  return mx::array(x.shape(), x.dtype(), std::make_shared<LayoutCopy>(s), in);
}

// ===========================================================================
// AdamW update (mlx.optimizers.AdamW's formula), one fused multi-threaded pass:
//   p1 = p (1 - lr wd);  m' = b1 m + (1 - b1) g;  v' = b2 v + (1 - b2) g^2
//   p' = p1 - lr m' / (sqrt(v') + eps)                       (no bias correction)
//   p' = p1 - c1 m' / (sqrt(v') c2 + eps), c1 = lr / (1 - b1^t), c2 = rsqrt(1 - b2^t)
// Inputs p, g, m, v (one shape), lr and the step t (0-d arrays); outputs p', m', v'.
// ===========================================================================

// nb1 = 1 - b1 and nb2 = 1 - b2 are rounded to float32 from double, as Python computes them
// for mlx's optimizer (1 - float32(0.999) would differ from float32(1 - 0.999) by 5e-5 relative).
struct AdamSpec {
  float b1, b2, nb1, nb2, eps, wd;
  bool bias_correction;
  bool operator==(const AdamSpec& o) const {
    return b1 == o.b1 && b2 == o.b2 && nb1 == o.nb1 && nb2 == o.nb2 && eps == o.eps && wd == o.wd &&
           bias_correction == o.bias_correction;
  }
};

Arrays adamw_mlx(const Arrays& in, const AdamSpec& sp, mx::Stream s) {
  using namespace mlx::core;
  const auto &p = in[0], &g = in[1], &m = in[2], &v = in[3];
  auto lr = astype(in[4], float32, s);
  auto p1 = multiply(p, subtract(array(1.0f), multiply(lr, array(sp.wd), s), s), s);
  auto m2 = add(multiply(array(sp.b1), m, s), multiply(array(sp.nb1), g, s), s);
  auto v2 = add(multiply(array(sp.b2), v, s), multiply(array(sp.nb2), square(g, s), s), s);
  array out = p1;
  if (sp.bias_correction) {
    auto t = astype(in[5], float32, s);
    auto c1 = divide(lr, subtract(array(1.0f), power(array(sp.b1), t, s), s), s);
    auto c2 = rsqrt(subtract(array(1.0f), power(array(sp.b2), t, s), s), s);
    out = subtract(p1, divide(multiply(c1, m2, s), add(multiply(sqrt(v2, s), c2, s), array(sp.eps), s), s), s);
  } else {
    out = subtract(p1, divide(multiply(lr, m2, s), add(sqrt(v2, s), array(sp.eps), s), s), s);
  }
  return {out, m2, v2};
}

struct AdamCoef {
  float decay, b1, nb1, b2, nb2, eps, step_size, denom_scale;
};

TK_BODY void adam_body(const float* p, const float* g, const float* m, const float* v, float* po, float* mo,
                       float* vo, const AdamCoef& c, size_t i0, size_t i1) {
#pragma omp simd
  for (size_t i = i0; i < i1; ++i) {
    const float gi = g[i];
    const float m2 = c.b1 * m[i] + c.nb1 * gi;
    const float v2 = c.b2 * v[i] + c.nb2 * (gi * gi);
    po[i] = p[i] * c.decay - (c.step_size * m2) / (std::sqrt(v2) * c.denom_scale + c.eps);
    mo[i] = m2;
    vo[i] = v2;
  }
}

template <bool AVX>
void adam_range(const float* p, const float* g, const float* m, const float* v, float* po, float* mo, float* vo,
                const AdamCoef& c, size_t i0, size_t i1);

template <>
void adam_range<false>(const float* p, const float* g, const float* m, const float* v, float* po, float* mo,
                       float* vo, const AdamCoef& c, size_t i0, size_t i1) {
  adam_body(p, g, m, v, po, mo, vo, c, i0, i1);
}

template <>
FM_TARGET void adam_range<true>(const float* p, const float* g, const float* m, const float* v, float* po,
                                float* mo, float* vo, const AdamCoef& c, size_t i0, size_t i1) {
  adam_body(p, g, m, v, po, mo, vo, c, i0, i1);
}


class AdamWUpdate : public NativeOp {
 public:
  AdamWUpdate(mx::Stream s, AdamSpec sp)
      : NativeOp(s, [sp, s](const Arrays& in) { return adamw_mlx(in, sp, s); }, 3), sp_(sp) {}

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    // p', m', v' may take over the buffers of p, m, v when MLX can donate them.
    for (int i = 0; i < 3; ++i) {
      const auto& src = inputs[i == 0 ? 0 : i + 1];
      if (src.is_donatable() && src.flags().row_contiguous && src.itemsize() == 4)
        outputs[i].copy_shared_buffer(src);
      else
        alloc(outputs[i]);
      enc.set_output_array(outputs[i]);
    }
    enc.dispatch([p = mx::array::unsafe_weak_copy(inputs[0]), g = mx::array::unsafe_weak_copy(inputs[1]),
                  m = mx::array::unsafe_weak_copy(inputs[2]), v = mx::array::unsafe_weak_copy(inputs[3]),
                  lr = mx::array::unsafe_weak_copy(inputs[4]), t = mx::array::unsafe_weak_copy(inputs[5]),
                  po = mx::array::unsafe_weak_copy(outputs[0]), mo = mx::array::unsafe_weak_copy(outputs[1]),
                  vo = mx::array::unsafe_weak_copy(outputs[2]), sp = sp_]() mutable {
      const float lrv = lr.data<float>()[0];
      const float step = t.data<float>()[0];
      AdamCoef c;
      c.decay = 1.0f - lrv * sp.wd;
      c.b1 = sp.b1;
      c.nb1 = sp.nb1;
      c.b2 = sp.b2;
      c.nb2 = sp.nb2;
      c.eps = sp.eps;
      if (sp.bias_correction) {
        c.step_size = lrv / (1.0f - std::pow(sp.b1, step));
        c.denom_scale = 1.0f / std::sqrt(1.0f - std::pow(sp.b2, step));
      } else {
        c.step_size = lrv;
        c.denom_scale = 1.0f;
      }
      const float *pp = p.data<float>(), *pg = g.data<float>(), *pm = m.data<float>(), *pv = v.data<float>();
      float *qp = po.data<float>(), *qm = mo.data<float>(), *qv = vo.data<float>();
      const bool vec = avx2();
      metalnn_native::parallel_for(p.size(), 16384, [&](size_t i0, size_t i1) {
        vec ? adam_range<true>(pp, pg, pm, pv, qp, qm, qv, c, i0, i1)
            : adam_range<false>(pp, pg, pm, pv, qp, qm, qv, c, i0, i1);
      });
    });
  }

  METALNN_PRIMITIVE("MetalnnAdamW", sp_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 3)

 private:
  AdamSpec sp_;
};

Arrays adamw_op(const Arrays& in, const AdamSpec& sp, mx::Stream s) {
  const auto& p = in[0];
  for (int i = 1; i < 4; ++i) {
    std::ostringstream msg;
    msg << "[adamw_update] param, grad, m and v must have one shape; got " << p.shape() << " and "
        << in[i].shape();
    require(in[i].shape() == p.shape(), msg.str());
  }
  bool native = native_stream(s);
  for (int i = 0; i < 4; ++i) native = native && in[i].dtype() == mx::float32;
  if (!native) return adamw_mlx(in, sp, s);
  Arrays args = {rowc(in[0], s), rowc(in[1], s), rowc(in[2], s), rowc(in[3], s),
                 mx::astype(in[4], mx::float32, s), mx::astype(in[5], mx::float32, s)};
  return mx::array::make_arrays({p.shape(), p.shape(), p.shape()}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<AdamWUpdate>(s, sp), args);
}

// base ** (-2i / dims) for i < dims / 2, as MLX computes it in float32: exp(-(2i/dims) * log(base))
std::vector<float> inv_freqs(int dims, std::optional<float> base) {
  const int half = dims / 2;
  std::vector<float> inv(half);
  const float lb = std::log(base.value_or(10000.0f));
  for (int i = 0; i < half; ++i) inv[i] = std::exp(-(static_cast<float>(2 * i) / static_cast<float>(dims)) * lb);
  return inv;
}

Kind kind_of(const std::string& name) {
  if (name == "silu") return Kind::Silu;
  if (name == "gelu_tanh") return Kind::GeluTanh;
  if (name == "sigmoid") return Kind::Sigmoid;
  if (name == "tanh") return Kind::Tanh;
  throw std::invalid_argument("[gated] activation must be silu, gelu_tanh, sigmoid or tanh, got " + name);
}

}  // namespace

void metalnn_train_ops::rms_norm_rows(const float* x, const float* w, float* y, size_t rows, int64_t n, float eps) {
  avx2() ? rms_fwd_rows<true>(x, w, y, 0, rows, n, eps) : rms_fwd_rows<false>(x, w, y, 0, rows, n, eps);
}

void register_train_ops(nb::module_& m) {
  m.def(
      "rms_norm",
      [](const mx::array& x, const std::optional<mx::array>& w, float eps, mx::StreamOrDevice s) {
        return rms_norm_op(x, w, eps, cpu_stream(s));
      },
      nb::arg("x"), nb::arg("weight").none(), nb::arg("eps"), nb::kw_only(), nb::arg("stream") = nb::none(),
      "x * rsqrt(mean(x^2, -1) + eps) * weight over the last axis (float32).");
  m.def(
      "rope",
      [](const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale, int offset,
         const std::optional<mx::array>& freqs, mx::StreamOrDevice s) {
        RopeSpec sp{dims, traditional, freqs ? std::vector<float>{} : inv_freqs(dims, base), bool(freqs), scale,
                    offset, false};
        return rope_op(x, sp, freqs, cpu_stream(s));
      },
      nb::arg("x"), nb::arg("dims"), nb::kw_only(), nb::arg("traditional"), nb::arg("base").none(),
      nb::arg("scale"), nb::arg("offset"), nb::arg("freqs").none() = nb::none(), nb::arg("stream") = nb::none(),
      "Rotary position embedding of x [..., T, D] (as mx.fast.rope with an int offset); the result is "
      "row-contiguous whatever the input layout.");
  m.def(
      "gated",
      [](const mx::array& a, const mx::array& b, const std::string& act, mx::StreamOrDevice s) {
        return gated_op(kind_of(act), a, b, cpu_stream(s));
      },
      nb::arg("a"), nb::arg("b"), nb::arg("activation"), nb::kw_only(), nb::arg("stream") = nb::none(),
      "act(a) * b for act in silu, gelu_tanh, sigmoid, tanh (a, b of one shape).");
  m.def(
      "cross_entropy",
      [](const mx::array& x, const mx::array& t, float ls, mx::StreamOrDevice s) {
        return cross_entropy_op(x, t, ls, cpu_stream(s))[0];
      },
      nb::arg("logits"), nb::arg("targets"), nb::arg("label_smoothing") = 0.0f, nb::kw_only(),
      nb::arg("stream") = nb::none(),
      "Per-row softmax cross entropy logsumexp(x) - (1 - ls) x[t] - ls mean(x).");
  m.def(
      "adamw_update",
      [](const mx::array& p, const mx::array& g, const mx::array& m, const mx::array& v, const mx::array& lr,
         const mx::array& step, double b1, double b2, float eps, float wd, bool bias_correction,
         mx::StreamOrDevice s) {
        AdamSpec sp{static_cast<float>(b1), static_cast<float>(b2), static_cast<float>(1.0 - b1),
                    static_cast<float>(1.0 - b2), eps, wd, bias_correction};
        auto out = adamw_op({p, g, m, v, lr, step}, sp, cpu_stream(s));
        return nb::make_tuple(out[0], out[1], out[2]);
      },
      nb::arg("param"), nb::arg("grad"), nb::arg("m"), nb::arg("v"), nb::arg("lr"), nb::arg("step"),
      nb::kw_only(), nb::arg("b1"), nb::arg("b2"), nb::arg("eps"), nb::arg("weight_decay"),
      nb::arg("bias_correction"), nb::arg("stream") = nb::none(),
      "One AdamW step (mlx.optimizers.AdamW's formula): returns (param, m, v).");
  m.def(
      "contiguous",
      [](const mx::array& x, mx::StreamOrDevice s) { return layout_copy_op(x, cpu_stream(s)); },
      nb::arg("x"), nb::kw_only(), nb::arg("stream") = nb::none(),
      "A row-contiguous copy of x (any dtype), multi-threaded; its gradient is stored in x's own "
      "memory order when that is dense (so a transposed view's gradient needs no further copy).");
  m.def(
      "scaled_softmax",
      [](const mx::array& x, float scale, bool causal, int q_len, int offset, mx::StreamOrDevice s) {
        return scaled_softmax_op(x, SoftmaxSpec{scale, causal, q_len, offset}, cpu_stream(s));
      },
      nb::arg("x"), nb::arg("scale"), nb::kw_only(), nb::arg("causal") = false, nb::arg("q_len") = 1,
      nb::arg("offset") = 0, nb::arg("stream") = nb::none(),
      "softmax(x * scale) over the last axis; causal: row r (query i = r % q_len) keeps keys j <= i + offset.");
}
