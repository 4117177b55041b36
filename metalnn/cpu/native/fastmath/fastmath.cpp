// metalnn's native extension: vectorised, differentiable CPU primitives for
// MLX (exp, sigmoid, silu, tanh, gelu_tanh, softmax over the last axis here;
// im2col / col2im in im2col.cpp), bound with nanobind in MLX's nanobind domain
// so mx.array objects pass straight through.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"

#include "decode_step.h"
#include "ggml.h"
#include "im2col.h"
#include "kernels.h"
#include "primitive.h"
#include "qmatmul.h"
#include "causal_attention.h"
#include "gated_delta.h"
#include "train_ops.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using metalnn_fastmath::Kind;

#ifndef METALNN_MLX_VERSION
#define METALNN_MLX_VERSION "unknown"
#endif

// The mlx version this binary was built against, findable in the file itself:
// metalnn/cpu/native_ext.py reads it before importing the module, because importing
// a build for another libmlx may already fail or misbehave.
extern "C" __attribute__((used, visibility("default"))) const char
    metalnn_fastmath_build_tag[] =
        "metalnn_fastmath_mlx_version=" METALNN_MLX_VERSION;

namespace {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Exp:
      return "FastExp";
    case Kind::Sigmoid:
      return "FastSigmoid";
    case Kind::Silu:
      return "FastSilu";
    case Kind::Tanh:
      return "FastTanh";
    case Kind::GeluTanh:
      return "FastGeluTanh";
  }
  return "FastUnary";
}

const char* kind_grad_name(Kind k) {
  switch (k) {
    case Kind::Exp:
      return "FastExpGrad";
    case Kind::Sigmoid:
      return "FastSigmoidGrad";
    case Kind::Silu:
      return "FastSiluGrad";
    case Kind::Tanh:
      return "FastTanhGrad";
    case Kind::GeluTanh:
      return "FastGeluTanhGrad";
  }
  return "FastUnaryGrad";
}

// The gradient primitive takes the output y for these kinds, the input x
// for the others.
bool grad_uses_output(Kind k) {
  return k == Kind::Exp || k == Kind::Sigmoid || k == Kind::Tanh;
}

// ---------------------------------------------------------------------------
// Strided row iteration (for inputs that are not row-contiguous)
// ---------------------------------------------------------------------------

// Calls f(row_index, offset_of_each_input_row) for each row of the last axis.
// offsets are in elements.
template <typename F>
void for_each_row(
    const mx::Shape& shape,
    const std::vector<const mx::Strides*>& strides,
    F&& f) {
  const int ndim = static_cast<int>(shape.size());
  const size_t nin = strides.size();
  size_t rows = 1;
  for (int d = 0; d + 1 < ndim; ++d) rows *= static_cast<size_t>(shape[d]);
  std::vector<int64_t> off(nin, 0);
  std::vector<int64_t> idx(std::max(ndim - 1, 0), 0);
  for (size_t r = 0; r < rows; ++r) {
    f(r, off);
    // increment the multi-index over the leading ndim-1 axes
    for (int d = ndim - 2; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        for (size_t k = 0; k < nin; ++k) off[k] += (*strides[k])[d];
        break;
      }
      for (size_t k = 0; k < nin; ++k)
        off[k] -= (*strides[k])[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
}

// Pointer to a contiguous copy of a row (or the row itself when stride 1).
inline const float*
row_ptr(const float* base, int64_t stride, size_t n, std::vector<float>& buf) {
  if (stride == 1 || n <= 1) return base;
  buf.resize(n);
  for (size_t i = 0; i < n; ++i) buf[i] = base[static_cast<int64_t>(i) * stride];
  return buf.data();
}

inline int64_t last_stride(const mx::array& a) {
  return a.ndim() ? a.strides().back() : 1;
}
inline size_t last_dim(const mx::array& a) {
  return a.ndim() ? static_cast<size_t>(a.shape().back()) : 1;
}

void check_f32(const mx::array& a, const char* who) {
  if (a.dtype() != mx::float32) {
    std::ostringstream msg;
    msg << "[" << who << "] expected float32 input, got " << a.dtype();
    throw std::invalid_argument(msg.str());
  }
}

// Forward declarations of the graph-level ops (used by transforms).
mx::array fast_unary(Kind k, const mx::array& x, mx::StreamOrDevice s);
mx::array fast_unary_grad(
    Kind k,
    const mx::array& a,
    const mx::array& g,
    mx::StreamOrDevice s);
mx::array fast_softmax(const mx::array& x, mx::StreamOrDevice s);
mx::array fast_softmax_grad(
    const mx::array& y,
    const mx::array& g,
    mx::StreamOrDevice s);

// Reference (plain MLX ops) versions of the gradient primitives, used only
// to differentiate the gradient primitives themselves (higher-order AD).
mx::array ref_unary_grad(
    Kind k,
    const mx::array& a,
    const mx::array& g,
    mx::Stream s) {
  using namespace mlx::core;
  switch (k) {
    case Kind::Exp:
      return multiply(g, a, s);
    case Kind::Sigmoid:
      return multiply(multiply(g, a, s), subtract(array(1.0f), a, s), s);
    case Kind::Tanh:
      return multiply(g, subtract(array(1.0f), square(a, s), s), s);
    case Kind::Silu: {
      auto sg = sigmoid(a, s);
      auto t = add(
          array(1.0f), multiply(a, subtract(array(1.0f), sg, s), s), s);
      return multiply(multiply(g, sg, s), t, s);
    }
    case Kind::GeluTanh: {
      auto a2 = square(a, s);
      auto v = multiply(
          array(metalnn_fastmath::kGeluK),
          add(a, multiply(array(metalnn_fastmath::kGeluA), multiply(a2, a, s), s), s),
          s);
      auto sg = sigmoid(v, s);
      auto dv = multiply(
          array(metalnn_fastmath::kGeluK),
          add(array(1.0f),
              multiply(array(3.0f * metalnn_fastmath::kGeluA), a2, s),
              s),
          s);
      auto t = multiply(
          multiply(a, sg, s), multiply(subtract(array(1.0f), sg, s), dv, s), s);
      return multiply(g, add(sg, t, s), s);
    }
  }
  throw std::logic_error("bad kind");
}

mx::array ref_softmax_grad(const mx::array& y, const mx::array& g, mx::Stream s) {
  using namespace mlx::core;
  auto d = sum(multiply(g, y, s), -1, true, s);
  return multiply(y, subtract(g, d, s), s);
}

// Differentiate a two-input function given by plain MLX ops.
std::vector<mx::array> vjp_via_ref(
    const std::function<mx::array(const mx::array&, const mx::array&)>& ref,
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums) {
  auto fn = [&](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{ref(in[0], in[1])};
  };
  auto [outs, grads] = mx::vjp(fn, primals, cotangents);
  std::vector<mx::array> res;
  for (int i : argnums) res.push_back(grads[i]);
  return res;
}

std::vector<mx::array> jvp_via_ref(
    const std::function<mx::array(const mx::array&, const mx::array&)>& ref,
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  // tangents are given for argnums only; zeros for the others
  std::vector<mx::array> full;
  for (size_t i = 0; i < primals.size(); ++i)
    full.push_back(mx::zeros_like(primals[i]));
  for (size_t j = 0; j < argnums.size(); ++j) full[argnums[j]] = tangents[j];
  auto fn = [&](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{ref(in[0], in[1])};
  };
  auto [outs, jv] = mx::jvp(fn, primals, full);
  return jv;
}

// ---------------------------------------------------------------------------
// Primitives
// ---------------------------------------------------------------------------

class FastUnary : public mx::UnaryPrimitive {
 public:
  FastUnary(mx::Stream s, Kind k) : mx::UnaryPrimitive(s), kind_(k) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    check_f32(x, name());
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    enc.set_output_array(out);
    if (x.flags().contiguous) {
      // Same layout as the input (this also covers transposed views);
      // reuse the input buffer when MLX says it may be donated.
      if (x.is_donatable() && x.itemsize() == out.itemsize()) {
        out.copy_shared_buffer(x);
      } else {
        out.set_data(
            mx::allocator::malloc(x.data_size() * out.itemsize()),
            x.data_size(),
            x.strides(),
            x.flags());
      }
      enc.dispatch([x = mx::array::unsafe_weak_copy(x),
                    out = mx::array::unsafe_weak_copy(out),
                    k = kind_]() mutable {
        metalnn_fastmath::unary_kernel(
            k, x.data<float>(), out.data<float>(), x.data_size());
      });
      return;
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    enc.dispatch([x = mx::array::unsafe_weak_copy(x),
                  out = mx::array::unsafe_weak_copy(out),
                  k = kind_]() mutable {
      const float* src = x.data<float>();
      float* dst = out.data<float>();
      const size_t n = last_dim(x);
      const int64_t st = last_stride(x);
      std::vector<float> buf;
      for_each_row(x.shape(), {&x.strides()}, [&](size_t r, const auto& off) {
        const float* row = row_ptr(src + off[0], st, n, buf);
        metalnn_fastmath::unary_kernel(k, row, dst + r * n, n);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(
        std::string("[") + name() + "] has no GPU implementation");
  }

  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override {
    const auto& a = grad_uses_output(kind_) ? outputs[0] : primals[0];
    return {fast_unary_grad(kind_, a, cotangents[0], stream())};
  }

  std::vector<mx::array> jvp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& tangents,
      const std::vector<int>& argnums) override {
    // The Jacobian is diagonal, so the JVP has the same form as the VJP.
    auto a = grad_uses_output(kind_) ? fast_unary(kind_, primals[0], stream())
                                     : primals[0];
    return {fast_unary_grad(kind_, a, tangents[0], stream())};
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override {
    return {{fast_unary(kind_, inputs[0], stream())}, axes};
  }

  METALNN_PRIMITIVE(kind_name(kind_), kind_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)

 private:
  Kind kind_;
};

// Fused backward of FastUnary: out = g * f'(.) computed from a (x or y).
class FastUnaryGrad : public mx::UnaryPrimitive {
 public:
  FastUnaryGrad(mx::Stream s, Kind k) : mx::UnaryPrimitive(s), kind_(k) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& a = inputs[0];
    const auto& g = inputs[1];
    check_f32(a, name());
    check_f32(g, name());
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(a);
    enc.set_input_array(g);
    enc.set_output_array(out);
    const bool fast = a.flags().row_contiguous && g.flags().row_contiguous;
    if (fast && g.is_donatable() && g.itemsize() == out.itemsize()) {
      out.copy_shared_buffer(g);
    } else if (fast && a.is_donatable() && a.itemsize() == out.itemsize()) {
      out.copy_shared_buffer(a);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    enc.dispatch([a = mx::array::unsafe_weak_copy(a),
                  g = mx::array::unsafe_weak_copy(g),
                  out = mx::array::unsafe_weak_copy(out),
                  fast,
                  k = kind_]() mutable {
      float* dst = out.data<float>();
      if (fast) {
        metalnn_fastmath::unary_grad_kernel(
            k, a.data<float>(), g.data<float>(), dst, out.size());
        return;
      }
      const size_t n = last_dim(out);
      const int64_t sa = last_stride(a), sg = last_stride(g);
      std::vector<float> ba, bg;
      for_each_row(
          out.shape(), {&a.strides(), &g.strides()},
          [&](size_t r, const auto& off) {
            const float* ra = row_ptr(a.data<float>() + off[0], sa, n, ba);
            const float* rg = row_ptr(g.data<float>() + off[1], sg, n, bg);
            metalnn_fastmath::unary_grad_kernel(k, ra, rg, dst + r * n, n);
          });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(
        std::string("[") + name() + "] has no GPU implementation");
  }

  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>&) override {
    auto k = kind_;
    auto s = stream();
    return vjp_via_ref(
        [k, s](const mx::array& a, const mx::array& g) {
          return ref_unary_grad(k, a, g, s);
        },
        primals, cotangents, argnums);
  }

  std::vector<mx::array> jvp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& tangents,
      const std::vector<int>& argnums) override {
    auto k = kind_;
    auto s = stream();
    return jvp_via_ref(
        [k, s](const mx::array& a, const mx::array& g) {
          return ref_unary_grad(k, a, g, s);
        },
        primals, tangents, argnums);
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override {
    // Elementwise: align the vmapped axes by moving them to the front.
    auto a = inputs[0], g = inputs[1];
    int out_ax = -1;
    if (axes[0] >= 0 || axes[1] >= 0) {
      if (axes[0] >= 0) a = mx::moveaxis(a, axes[0], 0, stream());
      if (axes[1] >= 0) g = mx::moveaxis(g, axes[1], 0, stream());
      if (axes[0] < 0) a = mx::expand_dims(a, 0, stream());
      if (axes[1] < 0) g = mx::expand_dims(g, 0, stream());
      out_ax = 0;
    }
    auto shape = mx::broadcast_shapes(a.shape(), g.shape());
    a = mx::broadcast_to(a, shape, stream());
    g = mx::broadcast_to(g, shape, stream());
    return {{fast_unary_grad(kind_, a, g, stream())}, {out_ax}};
  }

  METALNN_PRIMITIVE(kind_grad_name(kind_), kind_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)

 private:
  Kind kind_;
};

class FastSoftmax : public mx::UnaryPrimitive {
 public:
  explicit FastSoftmax(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    check_f32(x, name());
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    enc.set_output_array(out);
    const bool fast = x.flags().row_contiguous;
    if (fast && x.is_donatable() && x.itemsize() == out.itemsize()) {
      out.copy_shared_buffer(x);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    enc.dispatch([x = mx::array::unsafe_weak_copy(x),
                  out = mx::array::unsafe_weak_copy(out),
                  fast]() mutable {
      const size_t n = last_dim(x);
      if (n == 0 || x.size() == 0) return;
      float* dst = out.data<float>();
      const float* src = x.data<float>();
      if (fast) {
        const size_t rows = x.size() / n;
        for (size_t r = 0; r < rows; ++r)
          metalnn_fastmath::softmax_row(src + r * n, dst + r * n, n);
        return;
      }
      const int64_t st = last_stride(x);
      std::vector<float> buf;
      for_each_row(x.shape(), {&x.strides()}, [&](size_t r, const auto& off) {
        const float* row = row_ptr(src + off[0], st, n, buf);
        metalnn_fastmath::softmax_row(row, dst + r * n, n);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[FastSoftmax] has no GPU implementation");
  }

  std::vector<mx::array> vjp(
      const std::vector<mx::array>&,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>&,
      const std::vector<mx::array>& outputs) override {
    return {fast_softmax_grad(outputs[0], cotangents[0], stream())};
  }

  std::vector<mx::array> jvp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& tangents,
      const std::vector<int>&) override {
    // The softmax Jacobian diag(y) - y y^T is symmetric.
    auto y = fast_softmax(primals[0], stream());
    return {fast_softmax_grad(y, tangents[0], stream())};
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override {
    auto x = inputs[0];
    int ax = axes[0];
    if (ax >= 0 && ax == static_cast<int>(x.ndim()) - 1) {
      x = mx::moveaxis(x, ax, 0, stream());
      ax = 0;
    }
    return {{fast_softmax(x, stream())}, {ax}};
  }

  METALNN_PRIMITIVE("FastSoftmax")
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)
};

// out = y * (g - sum(g * y, -1, keepdims=True))
class FastSoftmaxGrad : public mx::UnaryPrimitive {
 public:
  explicit FastSoftmaxGrad(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& y = inputs[0];
    const auto& g = inputs[1];
    check_f32(y, name());
    check_f32(g, name());
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(y);
    enc.set_input_array(g);
    enc.set_output_array(out);
    const bool fast = y.flags().row_contiguous && g.flags().row_contiguous;
    // In-place is safe: each row reads all of y and g before writing.
    if (fast && g.is_donatable() && g.itemsize() == out.itemsize()) {
      out.copy_shared_buffer(g);
    } else if (fast && y.is_donatable() && y.itemsize() == out.itemsize()) {
      out.copy_shared_buffer(y);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    enc.dispatch([y = mx::array::unsafe_weak_copy(y),
                  g = mx::array::unsafe_weak_copy(g),
                  out = mx::array::unsafe_weak_copy(out),
                  fast]() mutable {
      const size_t n = last_dim(out);
      if (n == 0 || out.size() == 0) return;
      float* dst = out.data<float>();
      if (fast) {
        const size_t rows = out.size() / n;
        const float* py = y.data<float>();
        const float* pg = g.data<float>();
        for (size_t r = 0; r < rows; ++r)
          metalnn_fastmath::softmax_grad_row(
              py + r * n, pg + r * n, dst + r * n, n);
        return;
      }
      const int64_t sy = last_stride(y), sg = last_stride(g);
      std::vector<float> by, bg;
      for_each_row(
          out.shape(), {&y.strides(), &g.strides()},
          [&](size_t r, const auto& off) {
            const float* ry = row_ptr(y.data<float>() + off[0], sy, n, by);
            const float* rg = row_ptr(g.data<float>() + off[1], sg, n, bg);
            metalnn_fastmath::softmax_grad_row(ry, rg, dst + r * n, n);
          });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[FastSoftmaxGrad] has no GPU implementation");
  }

  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>&) override {
    auto s = stream();
    return vjp_via_ref(
        [s](const mx::array& y, const mx::array& g) {
          return ref_softmax_grad(y, g, s);
        },
        primals, cotangents, argnums);
  }

  std::vector<mx::array> jvp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& tangents,
      const std::vector<int>& argnums) override {
    auto s = stream();
    return jvp_via_ref(
        [s](const mx::array& y, const mx::array& g) {
          return ref_softmax_grad(y, g, s);
        },
        primals, tangents, argnums);
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override {
    auto y = inputs[0], g = inputs[1];
    int out_ax = -1;
    if (axes[0] >= 0 || axes[1] >= 0) {
      if (axes[0] >= 0) y = mx::moveaxis(y, axes[0], 0, stream());
      if (axes[1] >= 0) g = mx::moveaxis(g, axes[1], 0, stream());
      if (axes[0] < 0) y = mx::expand_dims(y, 0, stream());
      if (axes[1] < 0) g = mx::expand_dims(g, 0, stream());
      out_ax = 0;
    }
    auto shape = mx::broadcast_shapes(y.shape(), g.shape());
    y = mx::broadcast_to(y, shape, stream());
    g = mx::broadcast_to(g, shape, stream());
    return {{fast_softmax_grad(y, g, stream())}, {out_ax}};
  }

  METALNN_PRIMITIVE("FastSoftmaxGrad")
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)
};

// ---------------------------------------------------------------------------
// Graph-level ops
// ---------------------------------------------------------------------------

mx::array mlx_unary(Kind k, const mx::array& x, mx::Stream s) {
  using namespace mlx::core;
  switch (k) {
    case Kind::Exp:
      return exp(x, s);
    case Kind::Sigmoid:
      return sigmoid(x, s);
    case Kind::Silu:
      return multiply(x, sigmoid(x, s), s);
    case Kind::Tanh:
      return tanh(x, s);
    case Kind::GeluTanh: {
      auto c = array(0.7978845608028654f, x.dtype());
      auto a = array(0.044715f, x.dtype());
      auto inner = multiply(c, add(x, multiply(a, power(x, array(3, x.dtype()), s), s), s), s);
      return multiply(
          multiply(array(0.5f, x.dtype()), x, s),
          add(array(1.0f, x.dtype()), tanh(inner, s), s),
          s);
    }
  }
  throw std::logic_error("bad kind");
}

// Decide how to compute in float32. Returns false when the MLX op should be
// used instead (GPU stream, float64, complex).
bool use_native(const mx::array& x, const mx::Stream& s) {
  if (s.device != mx::Device::cpu) return false;
  auto d = x.dtype();
  if (d == mx::float64 || d == mx::complex64) return false;
  return true;
}

mx::Dtype result_dtype(const mx::array& x) {
  auto d = x.dtype();
  if (d == mx::float16 || d == mx::bfloat16 || d == mx::float32) return d;
  return mx::float32;  // integers / bool promote like mx.exp does
}

mx::array fast_unary(Kind k, const mx::array& x, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (!use_native(x, s)) return mlx_unary(k, x, s);
  auto rd = result_dtype(x);
  auto xf = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, s);
  auto y = mx::array(
      xf.shape(), mx::float32, std::make_shared<FastUnary>(s, k), {xf});
  return rd == mx::float32 ? y : mx::astype(y, rd, s);
}

mx::array fast_unary_grad(
    Kind k,
    const mx::array& a,
    const mx::array& g,
    mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  // Called from vjp/jvp with float32 primals/outputs; be permissive anyway.
  if (s.device != mx::Device::cpu || a.dtype() == mx::float64 ||
      g.dtype() == mx::float64)
    return ref_unary_grad(k, a, g, s);
  auto af = a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, s);
  auto gf = g.dtype() == mx::float32 ? g : mx::astype(g, mx::float32, s);
  if (af.shape() != gf.shape()) {
    auto shape = mx::broadcast_shapes(af.shape(), gf.shape());
    af = mx::broadcast_to(af, shape, s);
    gf = mx::broadcast_to(gf, shape, s);
  }
  return mx::array(
      af.shape(), mx::float32, std::make_shared<FastUnaryGrad>(s, k), {af, gf});
}

mx::array fast_softmax(const mx::array& x, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (x.ndim() == 0) {
    // softmax of a scalar over "the last axis" is 1
    return mx::reshape(mx::softmax(mx::reshape(x, {1}, s), -1, false, s), {}, s);
  }
  if (!use_native(x, s)) return mx::softmax(x, -1, false, s);
  auto rd = result_dtype(x);
  auto xf = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, s);
  auto y = mx::array(
      xf.shape(), mx::float32, std::make_shared<FastSoftmax>(s), {xf});
  return rd == mx::float32 ? y : mx::astype(y, rd, s);
}

mx::array fast_softmax_grad(
    const mx::array& y,
    const mx::array& g,
    mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (s.device != mx::Device::cpu || y.dtype() == mx::float64 ||
      g.dtype() == mx::float64 || y.ndim() == 0)
    return ref_softmax_grad(y, g, s);
  auto yf = y.dtype() == mx::float32 ? y : mx::astype(y, mx::float32, s);
  auto gf = g.dtype() == mx::float32 ? g : mx::astype(g, mx::float32, s);
  if (yf.shape() != gf.shape()) {
    auto shape = mx::broadcast_shapes(yf.shape(), gf.shape());
    yf = mx::broadcast_to(yf, shape, s);
    gf = mx::broadcast_to(gf, shape, s);
  }
  return mx::array(
      yf.shape(), mx::float32, std::make_shared<FastSoftmaxGrad>(s), {yf, gf});
}

}  // namespace

NB_MODULE(_fastmath, m) {
  m.doc() = "Vectorised, differentiable CPU primitives for MLX (metalnn.cpu.fastmath)";

  auto def_unary = [&m](const char* name, Kind k, const char* doc) {
    m.def(
        name,
        [k](const mx::array& x, mx::StreamOrDevice s) {
          return fast_unary(k, x, s);
        },
        nb::arg("x"),
        nb::kw_only(),
        nb::arg("stream") = nb::none(),
        doc);
  };
  def_unary("exp", Kind::Exp, "Element-wise exp(x).");
  def_unary("sigmoid", Kind::Sigmoid, "Element-wise 1 / (1 + exp(-x)).");
  def_unary("silu", Kind::Silu, "Element-wise x * sigmoid(x).");
  def_unary("tanh", Kind::Tanh, "Element-wise tanh(x).");
  def_unary(
      "gelu_tanh",
      Kind::GeluTanh,
      "Element-wise 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).");
  m.def(
      "softmax",
      [](const mx::array& x, mx::StreamOrDevice s) {
        return fast_softmax(x, s);
      },
      nb::arg("x"),
      nb::kw_only(),
      nb::arg("stream") = nb::none(),
      "Softmax over the last axis.");
  m.def(
      "softmax_grad",
      [](const mx::array& y, const mx::array& g, mx::StreamOrDevice s) {
        return fast_softmax_grad(y, g, s);
      },
      nb::arg("y"),
      nb::arg("g"),
      nb::kw_only(),
      nb::arg("stream") = nb::none(),
      "y * (g - sum(g * y, -1, keepdims=True)) (the softmax VJP).");
  m.def(
      "has_avx2",
      []() { return metalnn_fastmath::cpu_has_avx2_fma(); },
      "Whether the AVX2+FMA kernels can run on this CPU.");
  m.def(
      "set_force_scalar",
      [](bool v) { metalnn_fastmath::force_scalar_flag() = v; },
      nb::arg("value"),
      "Force the portable scalar kernels (testing/benchmarking only; not "
      "thread-safe with respect to running computations).");
  m.def("get_force_scalar", []() {
    return metalnn_fastmath::force_scalar_flag();
  });
  register_decode_step(m);
  register_ggml(m);
  register_im2col(m);
  register_qmatmul(m);
  register_train_ops(m);
  register_gated_delta(m);
  register_causal_attention(m);
  m.attr("mlx_version") = METALNN_MLX_VERSION;
  m.attr("build_tag") = metalnn_fastmath_build_tag;
}
