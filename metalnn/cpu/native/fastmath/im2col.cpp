// im2col / col2im as differentiable MLX CPU primitives (1-D, 2-D and 3-D),
// multi-threaded over (plane, kernel offset) rows / planes. See
// im2col_kernels.h for the layouts and metalnn/cpu/im2col.py for the Python API.
//
//   im2col: x [N, C, *S] -> cols [N, C*K, L]   (torch.nn.functional.unfold)
//   col2im: cols [N, C*K, L] -> x [N, C, *S]   (torch.nn.functional.fold)
//
// The two are adjoint, so each one's VJP is the other; both are linear, so
// their JVPs are themselves applied to the tangent.

#include "im2col.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "im2col_kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "primitive.h"
#include "threadpool.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using metalnn_im2col::Geometry;

namespace {

// Kernel, stride, padding and dilation of a window sweep (1..3 spatial axes).
struct Window {
  int n = 0;
  std::vector<int64_t> k, s, p, d;

  bool operator==(const Window& o) const {
    return n == o.n && k == o.k && s == o.s && p == o.p && d == o.d;
  }

  // Geometry for spatial input sizes `in` (length n).
  Geometry geometry(const std::vector<int64_t>& in) const {
    Geometry g;
    const int off = 3 - n;
    for (int i = 0; i < n; ++i) {
      g.in[off + i] = in[i];
      g.k[off + i] = k[i];
      g.s[off + i] = s[i];
      g.p[off + i] = p[i];
      g.d[off + i] = d[i];
      g.out[off + i] = metalnn_im2col::out_size(in[i], k[i], s[i], p[i], d[i]);
    }
    return g;
  }
};

std::string describe(const char* who, const Window& w) {
  std::ostringstream msg;
  auto list = [&](const std::vector<int64_t>& v) {
    msg << "(";
    for (size_t i = 0; i < v.size(); ++i) msg << (i ? ", " : "") << v[i];
    msg << ")";
  };
  msg << "[" << who << "] kernel ";
  list(w.k);
  msg << ", stride ";
  list(w.s);
  msg << ", padding ";
  list(w.p);
  msg << ", dilation ";
  list(w.d);
  return msg.str();
}

Window make_window(
    const char* who,
    const std::vector<int>& k,
    const std::vector<int>& s,
    const std::vector<int>& p,
    const std::vector<int>& d) {
  Window w;
  w.n = static_cast<int>(k.size());
  if (w.n < 1 || w.n > 3 || s.size() != k.size() || p.size() != k.size() || d.size() != k.size()) {
    std::ostringstream msg;
    msg << "[" << who << "] kernel, stride, padding and dilation need 1 to 3 values each, all of the "
        << "same length; got " << k.size() << ", " << s.size() << ", " << p.size() << ", " << d.size();
    throw std::invalid_argument(msg.str());
  }
  for (int i = 0; i < w.n; ++i) {
    w.k.push_back(k[i]);
    w.s.push_back(s[i]);
    w.p.push_back(p[i]);
    w.d.push_back(d[i]);
    if (k[i] < 1 || s[i] < 1 || d[i] < 1 || p[i] < 0)
      throw std::invalid_argument(
          describe(who, w) + ": kernel, stride and dilation must be >= 1 and padding >= 0");
  }
  return w;
}

std::vector<int64_t> spatial(const mx::Shape& shape, int n) {
  return std::vector<int64_t>(shape.end() - n, shape.end());
}

void check_geometry(const char* who, const Window& w, const Geometry& g) {
  for (int i = 0; i < 3; ++i) {
    if (g.out[i] < 1) {
      throw std::invalid_argument(
          describe(who, w) + ": the window does not fit the (padded) input, so there are no output positions");
    }
  }
}

mx::array im2col_op(const mx::array& x, const Window& w, mx::StreamOrDevice sd);
mx::array col2im_op(
    const mx::array& cols,
    const std::vector<int64_t>& size,
    const Window& w,
    mx::StreamOrDevice sd);

template <typename T>
void run_im2col(const mx::array& x, mx::array& out, const Geometry& g) {
  const int64_t n_batch = x.shape(0), channels = x.shape(1);
  const int nd = static_cast<int>(x.ndim()) - 2;
  int64_t st[3] = {0, 0, 0};
  for (int i = 0; i < nd; ++i) st[3 - nd + i] = x.strides()[2 + i];
  const int64_t sn = x.strides()[0], sc = x.strides()[1];
  const int64_t K = g.K(), L = g.L();
  const T* src = x.data<T>();
  T* dst = out.data<T>();
  const size_t rows = static_cast<size_t>(n_batch * channels * K);
  const size_t grain = static_cast<size_t>(std::max<int64_t>(1, 32768 / std::max<int64_t>(L, 1)));
  metalnn_native::parallel_for(rows, grain, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) {
      const int64_t plane = static_cast<int64_t>(r) / K, kidx = static_cast<int64_t>(r) % K;
      const int64_t nn = plane / channels, c = plane % channels;
      metalnn_im2col::im2col_row<T>(src + nn * sn + c * sc, st, g, kidx, dst + static_cast<int64_t>(r) * L);
    }
  });
}

template <typename T>
void run_col2im(const mx::array& cols, mx::array& out, const Geometry& g) {
  const int64_t planes = out.shape(0) * out.shape(1);
  const int64_t K = g.K(), L = g.L(), S = g.S();
  const T* src = cols.data<T>();
  T* dst = out.data<T>();
  const size_t grain = static_cast<size_t>(std::max<int64_t>(1, 32768 / std::max<int64_t>(K * L, 1)));
  metalnn_native::parallel_for(static_cast<size_t>(planes), grain, [&](size_t begin, size_t end) {
    for (size_t pl = begin; pl < end; ++pl) {
      T* plane = dst + static_cast<int64_t>(pl) * S;
      std::fill(plane, plane + S, T(0));
      metalnn_im2col::col2im_plane<T>(src + static_cast<int64_t>(pl) * K * L, g, plane);
    }
  });
}

class Im2Col : public mx::UnaryPrimitive {
 public:
  Im2Col(mx::Stream s, Window w) : mx::UnaryPrimitive(s), w_(std::move(w)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    enc.set_output_array(out);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const Geometry g = w_.geometry(spatial(x.shape(), w_.n));
    enc.dispatch([x = mx::array::unsafe_weak_copy(x), out = mx::array::unsafe_weak_copy(out), g]() mutable {
      if (out.size() == 0) return;
      switch (x.itemsize()) {
        case 1:
          return run_im2col<uint8_t>(x, out, g);
        case 2:
          return run_im2col<uint16_t>(x, out, g);
        case 4:
          return run_im2col<uint32_t>(x, out, g);
        case 8:
          return run_im2col<uint64_t>(x, out, g);
      }
      throw std::invalid_argument("[Im2Col] unsupported element size");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[Im2Col] has no GPU implementation");
  }

  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>&,
      const std::vector<mx::array>&) override {
    const auto& x = primals[0];
    auto dx = col2im_op(cotangents[0], spatial(x.shape(), w_.n), w_, stream());
    return {mx::astype(dx, x.dtype(), stream())};
  }

  std::vector<mx::array> jvp(
      const std::vector<mx::array>&,
      const std::vector<mx::array>& tangents,
      const std::vector<int>&) override {
    return {im2col_op(tangents[0], w_, stream())};
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override {
    // Fold the mapped axis into the batch axis and unfold it again.
    auto x = inputs[0];
    if (axes[0] < 0) return {{im2col_op(x, w_, stream())}, {-1}};
    x = mx::moveaxis(x, axes[0], 0, stream());
    const int b = x.shape(0);
    auto shape = x.shape();
    shape.erase(shape.begin());
    shape[0] *= b;
    auto y = im2col_op(mx::reshape(x, shape, stream()), w_, stream());
    auto yshape = y.shape();
    yshape[0] /= b;
    yshape.insert(yshape.begin(), b);
    return {{mx::reshape(y, yshape, stream())}, {0}};
  }

  METALNN_PRIMITIVE("Im2Col", w_)

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& x = inputs[0];
    const Geometry g = w_.geometry(spatial(x.shape(), w_.n));
    return {{x.shape(0), static_cast<int>(x.shape(1) * g.K()), static_cast<int>(g.L())}};
  }

 private:
  Window w_;
};

class Col2Im : public mx::UnaryPrimitive {
 public:
  Col2Im(mx::Stream s, std::vector<int64_t> size, Window w)
      : mx::UnaryPrimitive(s), size_(std::move(size)), w_(std::move(w)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& cols = inputs[0];
    if (!cols.flags().row_contiguous)
      throw std::logic_error("[Col2Im] expects a row-contiguous input (the graph op makes it so)");
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(cols);
    enc.set_output_array(out);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const Geometry g = w_.geometry(size_);
    enc.dispatch([cols = mx::array::unsafe_weak_copy(cols), out = mx::array::unsafe_weak_copy(out), g]() mutable {
      if (out.size() == 0) return;
      if (out.dtype() == mx::float32) return run_col2im<float>(cols, out, g);
      if (out.dtype() == mx::float64) return run_col2im<double>(cols, out, g);
      throw std::invalid_argument("[Col2Im] computes in float32 or float64 only");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[Col2Im] has no GPU implementation");
  }

  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>&,
      const std::vector<mx::array>&) override {
    return {mx::astype(im2col_op(cotangents[0], w_, stream()), primals[0].dtype(), stream())};
  }

  std::vector<mx::array> jvp(
      const std::vector<mx::array>&,
      const std::vector<mx::array>& tangents,
      const std::vector<int>&) override {
    return {col2im_op(tangents[0], size_, w_, stream())};
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override {
    auto c = inputs[0];
    if (axes[0] < 0) return {{col2im_op(c, size_, w_, stream())}, {-1}};
    c = mx::moveaxis(c, axes[0], 0, stream());
    const int b = c.shape(0);
    auto shape = c.shape();
    shape.erase(shape.begin());
    shape[0] *= b;
    auto y = col2im_op(mx::reshape(c, shape, stream()), size_, w_, stream());
    auto yshape = y.shape();
    yshape[0] /= b;
    yshape.insert(yshape.begin(), b);
    return {{mx::reshape(y, yshape, stream())}, {0}};
  }

  METALNN_PRIMITIVE("Col2Im", size_, w_)

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& c = inputs[0];
    const Geometry g = w_.geometry(size_);
    mx::Shape shape = {c.shape(0), static_cast<int>(c.shape(1) / g.K())};
    for (auto v : size_) shape.push_back(static_cast<int>(v));
    return {shape};
  }

 private:
  std::vector<int64_t> size_;
  Window w_;
};

mx::Stream cpu_stream(const char* who, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (s.device != mx::Device::cpu)
    throw std::invalid_argument(std::string("[") + who + "] runs on CPU streams only");
  return s;
}

mx::array im2col_op(const mx::array& x, const Window& w, mx::StreamOrDevice sd) {
  auto s = cpu_stream("im2col", sd);
  if (static_cast<int>(x.ndim()) != w.n + 2) {
    std::ostringstream msg;
    msg << "[im2col] expected an input of rank " << w.n + 2 << " [N, C, *spatial] for a " << w.n
        << "-D window, got shape " << x.shape();
    throw std::invalid_argument(msg.str());
  }
  const Geometry g = w.geometry(spatial(x.shape(), w.n));
  check_geometry("im2col", w, g);
  mx::Shape shape = {x.shape(0), static_cast<int>(x.shape(1) * g.K()), static_cast<int>(g.L())};
  return mx::array(shape, x.dtype(), std::make_shared<Im2Col>(s, w), {x});
}

mx::array col2im_op(
    const mx::array& cols,
    const std::vector<int64_t>& size,
    const Window& w,
    mx::StreamOrDevice sd) {
  auto s = cpu_stream("col2im", sd);
  if (static_cast<int>(size.size()) != w.n) {
    std::ostringstream msg;
    msg << "[col2im] output_size has " << size.size() << " values for a " << w.n << "-D window";
    throw std::invalid_argument(msg.str());
  }
  const Geometry g = w.geometry(size);
  check_geometry("col2im", w, g);
  if (cols.ndim() != 3 || cols.shape(1) % g.K() != 0 || cols.shape(2) != g.L()) {
    std::ostringstream msg;
    msg << "[col2im] expected columns [N, C*" << g.K() << ", " << g.L() << "] for output size "
        << mx::Shape(size.begin(), size.end()) << ", got shape " << cols.shape();
    throw std::invalid_argument(msg.str());
  }
  const auto dt = cols.dtype();
  if (!mx::issubdtype(dt, mx::floating)) {
    std::ostringstream msg;
    msg << "[col2im] sums overlapping windows, so it needs a floating-point input; got " << dt;
    throw std::invalid_argument(msg.str());
  }
  // Half-precision inputs are summed in float32 and rounded once.
  const bool widen = dt == mx::float16 || dt == mx::bfloat16;
  auto c = widen ? mx::astype(cols, mx::float32, s) : cols;
  c = mx::contiguous(c, false, s);
  mx::Shape shape = {c.shape(0), static_cast<int>(c.shape(1) / g.K())};
  for (auto v : size) shape.push_back(static_cast<int>(v));
  auto y = mx::array(shape, c.dtype(), std::make_shared<Col2Im>(s, size, w), {c});
  return widen ? mx::astype(y, dt, s) : y;
}

}  // namespace

void register_im2col(nb::module_& m) {
  m.def(
      "im2col",
      [](const mx::array& x,
         const std::vector<int>& kernel,
         const std::vector<int>& stride,
         const std::vector<int>& padding,
         const std::vector<int>& dilation,
         mx::StreamOrDevice s) {
        return im2col_op(x, make_window("im2col", kernel, stride, padding, dilation), s);
      },
      nb::arg("x"),
      nb::arg("kernel"),
      nb::arg("stride"),
      nb::arg("padding"),
      nb::arg("dilation"),
      nb::kw_only(),
      nb::arg("stream") = nb::none(),
      "x [N, C, *spatial] -> columns [N, C*prod(kernel), L] (torch.nn.functional.unfold layout).");
  m.def(
      "col2im",
      [](const mx::array& cols,
         const std::vector<int>& output_size,
         const std::vector<int>& kernel,
         const std::vector<int>& stride,
         const std::vector<int>& padding,
         const std::vector<int>& dilation,
         mx::StreamOrDevice s) {
        auto w = make_window("col2im", kernel, stride, padding, dilation);
        std::vector<int64_t> size(output_size.begin(), output_size.end());
        for (auto v : size)
          if (v < 1) throw std::invalid_argument("[col2im] output_size values must be >= 1");
        return col2im_op(cols, size, w, s);
      },
      nb::arg("cols"),
      nb::arg("output_size"),
      nb::arg("kernel"),
      nb::arg("stride"),
      nb::arg("padding"),
      nb::arg("dilation"),
      nb::kw_only(),
      nb::arg("stream") = nb::none(),
      "columns [N, C*prod(kernel), L] -> [N, C, *output_size], summing overlaps "
      "(torch.nn.functional.fold).");
  m.def(
      "set_num_threads",
      [](int n) { metalnn_native::set_num_threads(n); },
      nb::arg("n"),
      "Threads (the calling one included) the native CPU primitives may use.");
  m.def("get_num_threads", []() { return metalnn_native::get_num_threads(); });
  m.def(
      "free_num_threads",
      []() { return metalnn_native::free_threads(metalnn_native::get_num_threads()); },
      "Threads a native loop starting now would use: get_num_threads(), fewer while other processes keep "
      "cores busy (the BLAS shim's thread governor).");
}
