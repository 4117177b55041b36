// Products with MLX affine-quantized matrices as differentiable MLX CPU
// primitives (see qmatmul_kernels.h for the format and the kernels, and
// metalnn/cpu/qmatmul.py for the Python API).
//
//   quantized_matmul(x, w, scales, biases, transpose=True):
//       x [..., K] @ W.T -> [..., N]   (transpose=False: x [..., N] @ W -> [..., K])
//   dequantize(w, scales, biases) -> W [N, K] (float32)
//
// W [N, K] is the matrix that mx.dequantize(w, scales, biases) gives. The
// products run multi-threaded over the rows of W (transpose=True) or over its
// column groups (transpose=False); the input gradient of one is the other.
// The quantized weight has no gradient (as in MLX); gradients for scales and
// biases, and forward derivatives, come from MLX's own ops.

#include "qmatmul.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "primitive.h"
#include "qmatmul_kernels.h"
#include "threadpool.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using metalnn_qmm::Layout;

namespace {

// Work (multiply-adds) below which a chunk is not worth another thread.
constexpr int64_t kGrainWork = 1 << 18;

// ---------------------------------------------------------------------------
// Gathering inputs of any layout and float dtype into contiguous buffers
// ---------------------------------------------------------------------------

// Element conversion of the gathers: floats through float32, other types as they are.
template <typename D, typename S>
D convert(S v) {
  if constexpr (std::is_same_v<S, D>) {
    return v;
  } else {
    return static_cast<D>(static_cast<float>(v));
  }
}

// Copies `a` (any strides) in row-major order into dst, converting to D.
template <typename S, typename D>
void gather_as(const mx::array& a, D* dst) {
  const S* src = a.data<S>();
  const size_t n = a.size();
  if (n == 0) return;
  if (a.flags().row_contiguous) {
    for (size_t i = 0; i < n; ++i) dst[i] = convert<D>(src[i]);
    return;
  }
  const int nd = static_cast<int>(a.ndim());
  const int64_t inner = a.shape(nd - 1), st = a.strides()[nd - 1];
  std::vector<int> idx(static_cast<size_t>(std::max(nd - 1, 0)), 0);
  int64_t off = 0;
  for (size_t row = 0, rows = n / static_cast<size_t>(inner); row < rows; ++row) {
    for (int64_t i = 0; i < inner; ++i) *dst++ = convert<D>(src[off + i * st]);
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

// Contiguous float32 copy of a float array of any dtype and layout.
void gather_float(const mx::array& a, float* dst) {
  switch (a.dtype()) {
    case mx::float32:
      return gather_as<float, float>(a, dst);
    case mx::float16:
      return gather_as<mx::float16_t, float>(a, dst);
    case mx::bfloat16:
      return gather_as<mx::bfloat16_t, float>(a, dst);
    default:
      throw std::invalid_argument("[quantized_matmul] expected a float32, float16 or bfloat16 array");
  }
}

// Float32 view of `a` as a contiguous buffer: the array's own data when it is
// row-contiguous float32, else a converted copy kept in `keep`.
const float* float_data(const mx::array& a, std::vector<float>& keep) {
  if (a.dtype() == mx::float32 && a.flags().row_contiguous) return a.data<float>();
  keep.resize(a.size());
  gather_float(a, keep.data());
  return keep.data();
}

// dst[i] = a.flat[begin + i] for a row-contiguous float array.
void convert_range(const mx::array& a, size_t begin, size_t n, float* dst) {
  switch (a.dtype()) {
    case mx::float32:
      std::copy_n(a.data<float>() + begin, n, dst);
      return;
    case mx::float16:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(a.data<mx::float16_t>()[begin + i]);
      return;
    case mx::bfloat16:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(a.data<mx::bfloat16_t>()[begin + i]);
      return;
    default:
      throw std::invalid_argument("[quantized_matmul] expected a float32, float16 or bfloat16 array");
  }
}

const uint8_t* weight_data(const mx::array& w, std::vector<uint32_t>& keep) {
  if (w.flags().row_contiguous) return reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
  keep.resize(w.size());
  gather_as<uint32_t, uint32_t>(w, keep.data());
  return reinterpret_cast<const uint8_t*>(keep.data());
}

// ---------------------------------------------------------------------------
// Evaluation
// ---------------------------------------------------------------------------

// out [M, N] = x [M, K] @ W.T
void run_matvec(const mx::array& x, const mx::array& w, const mx::array& s, const mx::array& b, mx::array& out,
                Layout L) {
  const int64_t N = w.shape(0), K = L.K, ng = L.groups();
  const int64_t M = static_cast<int64_t>(x.size()) / K;
  const bool avx2 = metalnn_qmm::use_avx2();
  const int block = metalnn_qmm::block_perm(L.bits, avx2);

  // One buffer: the input rows in kernel order, their group sums, and (for inputs that are not
  // contiguous float32) a float32 copy to read them from.
  std::vector<float> buf;
  std::vector<float> xkeep;
  const float* xin = float_data(x, xkeep);
  buf.resize(static_cast<size_t>(M * K + M * ng));
  float* xp = buf.data();
  float* xsum = xp + M * K;
  for (int64_t m = 0; m < M; ++m) metalnn_qmm::prepare_row(xin + m * K, xp + m * K, xsum + m * ng, L, block);

  std::vector<uint32_t> wkeep;
  metalnn_qmm::MatvecArgs a{};
  a.L = L;
  a.w = weight_data(w, wkeep);
  a.N = N;
  a.M = M;
  a.x = xp;
  a.xsum = xsum;
  a.out = out.data<float>();
  // Scales and biases: used in place when float32 and contiguous; contiguous
  // half-precision ones are converted per chunk of rows; others gathered first.
  std::vector<float> skeep, bkeep;
  const bool direct = s.dtype() == mx::float32 && b.dtype() == mx::float32;
  const bool per_chunk = !direct && s.flags().row_contiguous && b.flags().row_contiguous;
  if (!per_chunk) {
    a.s = float_data(s, skeep);
    a.b = float_data(b, bkeep);
  }
  const size_t grain = static_cast<size_t>(std::max<int64_t>(1, kGrainWork / std::max<int64_t>(K * M, 1)));
  metalnn_native::parallel_for(static_cast<size_t>(N), grain, [&](size_t r0, size_t r1) {
    if (!per_chunk) return metalnn_qmm::dispatch_bits<metalnn_qmm::MatvecRows>(L.bits, a, r0, r1, avx2);
    std::vector<float> ls(static_cast<size_t>((r1 - r0) * ng)), lb(ls.size());
    convert_range(s, r0 * ng, ls.size(), ls.data());
    convert_range(b, r0 * ng, lb.size(), lb.data());
    metalnn_qmm::MatvecArgs c = a;
    c.w += static_cast<int64_t>(r0) * L.row_bytes();
    c.s = ls.data();
    c.b = lb.data();
    c.out += r0;
    metalnn_qmm::dispatch_bits<metalnn_qmm::MatvecRows>(L.bits, c, int64_t(0), static_cast<int64_t>(r1 - r0), avx2);
  });
}

// out [M, K] = g [M, N] @ W
void run_axpy(const mx::array& g, const mx::array& w, const mx::array& s, const mx::array& b, mx::array& out,
              Layout L) {
  const int64_t N = w.shape(0), ng = L.groups();
  const int64_t M = static_cast<int64_t>(g.size()) / N;
  const bool avx2 = metalnn_qmm::use_avx2();
  std::vector<float> gkeep, skeep, bkeep;
  std::vector<uint32_t> wkeep;
  metalnn_qmm::AxpyArgs a{};
  a.L = L;
  a.w = weight_data(w, wkeep);
  a.s = float_data(s, skeep);
  a.b = float_data(b, bkeep);
  a.N = N;
  a.M = M;
  a.g = float_data(g, gkeep);
  a.out = out.data<float>();
  const size_t grain =
      static_cast<size_t>(std::max<int64_t>(1, kGrainWork / std::max<int64_t>(N * M * L.group, 1)));
  metalnn_native::parallel_for(static_cast<size_t>(ng), grain, [&](size_t g0, size_t g1) {
    metalnn_qmm::dispatch_bits<metalnn_qmm::AxpyColumns>(L.bits, a, static_cast<int64_t>(g0),
                                                          static_cast<int64_t>(g1), avx2);
  });
}

void run_dequantize(const mx::array& w, const mx::array& s, const mx::array& b, mx::array& out, Layout L) {
  const int64_t N = w.shape(0);
  const bool avx2 = metalnn_qmm::use_avx2();
  std::vector<float> skeep, bkeep;
  std::vector<uint32_t> wkeep;
  const uint8_t* wp = weight_data(w, wkeep);
  const float* sp = float_data(s, skeep);
  const float* bp = float_data(b, bkeep);
  float* dst = out.data<float>();
  const size_t grain = static_cast<size_t>(std::max<int64_t>(1, kGrainWork / std::max<int64_t>(L.K, 1)));
  metalnn_native::parallel_for(static_cast<size_t>(N), grain, [&](size_t r0, size_t r1) {
    metalnn_qmm::dispatch_bits<metalnn_qmm::DequantizeRows>(L.bits, L, wp, sp, bp, dst, static_cast<int64_t>(r0),
                                                             static_cast<int64_t>(r1), avx2);
  });
}

// ---------------------------------------------------------------------------
// Graph-level ops (declared here, defined below the primitives)
// ---------------------------------------------------------------------------

mx::array qmatmul_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     bool transpose, int group_size, int bits, mx::StreamOrDevice sd);

mx::array dequantize_op(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                        int bits, mx::StreamOrDevice sd);

mx::array qmatmul_reference(const std::vector<mx::array>& in, bool transpose, int group_size, int bits,
                            mx::Stream s) {
  return mx::quantized_matmul(in[0], in[1], in[2], in[3], transpose, group_size, bits, "affine", s);
}

// ---------------------------------------------------------------------------
// Primitives
// ---------------------------------------------------------------------------

// The layout of a packed weight ``w`` ([N, K * bits / 32] uint32 words).
Layout layout_of(const mx::array& w, int group, int bits) {
  Layout L;
  L.bits = bits;
  L.group = group;
  L.K = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  return L;
}

class AffineQuantizedMatmul : public mx::UnaryPrimitive {
 public:
  AffineQuantizedMatmul(mx::Stream s, int group_size, int bits, bool transpose)
      : mx::UnaryPrimitive(s), group_(group_size), bits_(bits), transpose_(transpose) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const Layout L = layout_of(inputs[1], group_, bits_);
    enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), w = mx::array::unsafe_weak_copy(inputs[1]),
                  s = mx::array::unsafe_weak_copy(inputs[2]), b = mx::array::unsafe_weak_copy(inputs[3]),
                  out = mx::array::unsafe_weak_copy(out), L, t = transpose_]() mutable {
      if (out.size() == 0) return;
      if (x.size() == 0 || w.size() == 0) {
        std::fill(out.data<float>(), out.data<float>() + out.size(), 0.0f);
        return;
      }
      if (t) {
        run_matvec(x, w, s, b, out, L);
      } else {
        run_axpy(x, w, s, b, out, L);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[AffineQuantizedMatmul] has no GPU implementation");
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<mx::array> grads;
    std::vector<int> others;
    for (int i : argnums) {
      if (i != 0) others.push_back(i);
    }
    std::vector<mx::array> other_grads;
    if (!others.empty()) {
      // Scales and biases (and the weight, which MLX refuses): MLX's own derivative.
      // Differentiate with respect to those inputs only (MLX has no gradient for the weight).
      auto fn = [this, &primals, &others](const std::vector<mx::array>& in) {
        auto all = primals;
        for (size_t j = 0; j < others.size(); ++j) all[others[j]] = in[j];
        return std::vector<mx::array>{qmatmul_reference(all, transpose_, group_, bits_, stream())};
      };
      std::vector<mx::array> wrt;
      for (int i : others) wrt.push_back(primals[i]);
      auto cot = mx::astype(cotangents[0], mx::promote_types(primals[0].dtype(), primals[2].dtype()), stream());
      other_grads = mx::vjp(fn, wrt, {cot}).second;
    }
    size_t k = 0;
    for (int i : argnums) {
      if (i == 0) {
        const auto& x = primals[0];
        auto dx = qmatmul_op(cotangents[0], primals[1], primals[2], primals[3], !transpose_, group_, bits_, stream());
        grads.push_back(mx::astype(dx, x.dtype(), stream()));
      } else {
        grads.push_back(other_grads[k++]);
      }
    }
    return grads;
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override {
    // Linear in x; the scales and biases enter through MLX's own derivative.
    std::optional<mx::array> result;
    bool others = false;
    for (size_t j = 0; j < argnums.size(); ++j) {
      if (argnums[j] == 0) {
        result = qmatmul_op(tangents[j], primals[1], primals[2], primals[3], transpose_, group_, bits_, stream());
      } else {
        others = true;
      }
    }
    if (others) {
      std::vector<int> idx;
      std::vector<mx::array> wrt, tan;
      for (size_t j = 0; j < argnums.size(); ++j) {
        if (argnums[j] != 0) {
          idx.push_back(argnums[j]);
          wrt.push_back(primals[argnums[j]]);
          tan.push_back(tangents[j]);
        }
      }
      auto fn = [this, &primals, &idx](const std::vector<mx::array>& in) {
        auto all = primals;
        for (size_t j = 0; j < idx.size(); ++j) all[idx[j]] = in[j];
        return std::vector<mx::array>{qmatmul_reference(all, transpose_, group_, bits_, stream())};
      };
      auto extra = mx::jvp(fn, wrt, tan).second[0];
      result = result ? mx::add(*result, extra, stream()) : extra;
    }
    return {*result};
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                           const std::vector<int>& axes) override {
    for (size_t i = 1; i < axes.size(); ++i) {
      if (axes[i] >= 0)
        throw std::invalid_argument("[quantized_matmul] vmap over the quantized weight, scales or biases is not "
                                    "supported");
    }
    auto x = inputs[0];
    if (axes[0] < 0) return {{qmatmul_op(x, inputs[1], inputs[2], inputs[3], transpose_, group_, bits_, stream())},
                             {-1}};
    x = mx::moveaxis(x, axes[0], 0, stream());
    return {{qmatmul_op(x, inputs[1], inputs[2], inputs[3], transpose_, group_, bits_, stream())}, {0}};
  }

  METALNN_PRIMITIVE("AffineQuantizedMatmul", group_, bits_, transpose_)

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    const int n = inputs[1].shape(0), k = inputs[1].shape(1) * 32 / bits_;
    shape.back() = transpose_ ? n : k;
    return {shape};
  }

 private:
  int group_, bits_;
  bool transpose_;
};

class AffineDequantize : public mx::UnaryPrimitive {
 public:
  AffineDequantize(mx::Stream s, int group_size, int bits) : mx::UnaryPrimitive(s), group_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const Layout L = layout_of(inputs[0], group_, bits_);
    enc.dispatch([w = mx::array::unsafe_weak_copy(inputs[0]), s = mx::array::unsafe_weak_copy(inputs[1]),
                  b = mx::array::unsafe_weak_copy(inputs[2]), out = mx::array::unsafe_weak_copy(out), L]() mutable {
      if (out.size() == 0) return;
      run_dequantize(w, s, b, out, L);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[AffineDequantize] has no GPU implementation");
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    auto [wrt, fn] = reference_of(primals, argnums);
    return mx::vjp(fn, wrt, cotangents).second;
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override {
    auto [wrt, fn] = reference_of(primals, argnums);
    return mx::jvp(fn, wrt, tangents).second;
  }

  METALNN_PRIMITIVE("AffineDequantize", group_, bits_)

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[0].shape(1) * 32 / bits_}};
  }

 private:
  // MLX's dequantize as a function of the inputs listed in argnums (the others fixed).
  std::pair<std::vector<mx::array>, std::function<std::vector<mx::array>(const std::vector<mx::array>&)>>
  reference_of(const std::vector<mx::array>& primals, const std::vector<int>& argnums) {
    std::vector<mx::array> wrt;
    for (int i : argnums) wrt.push_back(primals[i]);
    auto fn = [this, primals, argnums](const std::vector<mx::array>& in) {
      auto all = primals;
      for (size_t j = 0; j < argnums.size(); ++j) all[argnums[j]] = in[j];
      return std::vector<mx::array>{mx::astype(
          mx::dequantize(all[0], all[1], all[2], group_, bits_, "affine", std::nullopt, std::nullopt, stream()),
          mx::float32, stream())};
    };
    return {wrt, fn};
  }

  int group_, bits_;
};

// ---------------------------------------------------------------------------
// Graph-level ops
// ---------------------------------------------------------------------------

mx::Stream cpu_stream(const char* who, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (s.device != mx::Device::cpu)
    throw std::invalid_argument(std::string("[") + who + "] runs on CPU streams only");
  return s;
}

bool is_float(mx::Dtype d) {
  return d == mx::float32 || d == mx::float16 || d == mx::bfloat16;
}

// Checks w / scales / biases and returns K (the unpacked row width).
int check_weight(const char* who, const mx::array& w, const mx::array& scales, const mx::array& biases,
                 int group_size, int bits) {
  std::ostringstream msg;
  msg << "[" << who << "] ";
  if (!metalnn_qmm::supported_bits(bits)) {
    msg << "bits must be one of 1, 2, 3, 4, 5, 6, 8; got " << bits;
    throw std::invalid_argument(msg.str());
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    msg << "group_size must be 32, 64 or 128; got " << group_size;
    throw std::invalid_argument(msg.str());
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2) {
    msg << "expected a packed uint32 weight [N, K * bits / 32], got " << w.dtype() << " of shape " << w.shape();
    throw std::invalid_argument(msg.str());
  }
  const int64_t k64 = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  if (static_cast<int64_t>(w.shape(1)) * 32 % bits || k64 % group_size) {
    msg << "a weight of " << w.shape(1) << " uint32 words per row does not hold whole groups of " << group_size
        << " " << bits << "-bit values";
    throw std::invalid_argument(msg.str());
  }
  const int K = static_cast<int>(k64);
  const mx::Shape expect = {w.shape(0), K / group_size};
  if (scales.shape() != expect || biases.shape() != expect) {
    msg << "scales and biases must have shape " << expect << " for a weight of shape " << w.shape() << " ("
        << bits << " bits, groups of " << group_size << "); got " << scales.shape() << " and " << biases.shape();
    throw std::invalid_argument(msg.str());
  }
  if (!is_float(scales.dtype()) || !is_float(biases.dtype())) {
    msg << "scales and biases must be float32, float16 or bfloat16; got " << scales.dtype() << " and "
        << biases.dtype();
    throw std::invalid_argument(msg.str());
  }
  return K;
}

mx::array qmatmul_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     bool transpose, int group_size, int bits, mx::StreamOrDevice sd) {
  auto s = cpu_stream("quantized_matmul", sd);
  const int K = check_weight("quantized_matmul", w, scales, biases, group_size, bits);
  const int N = w.shape(0);
  const int inner = transpose ? K : N;
  if (x.ndim() < 1 || x.shape(-1) != inner) {
    std::ostringstream msg;
    msg << "[quantized_matmul] x must be [..., " << inner << "] for a weight of shape [" << N << ", " << K << "] ("
        << (transpose ? "x @ W.T" : "x @ W") << "); got shape " << x.shape();
    throw std::invalid_argument(msg.str());
  }
  if (!is_float(x.dtype())) {
    std::ostringstream msg;
    msg << "[quantized_matmul] x must be float32, float16 or bfloat16; got " << x.dtype();
    throw std::invalid_argument(msg.str());
  }
  auto shape = x.shape();
  shape.back() = transpose ? N : K;
  auto y = mx::array(shape, mx::float32, std::make_shared<AffineQuantizedMatmul>(s, group_size, bits, transpose),
                     {x, w, scales, biases});
  const auto rd = mx::promote_types(x.dtype(), scales.dtype());
  return rd == mx::float32 ? y : mx::astype(y, rd, s);
}

mx::array dequantize_op(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                        int bits, mx::StreamOrDevice sd) {
  auto s = cpu_stream("dequantize", sd);
  const int K = check_weight("dequantize", w, scales, biases, group_size, bits);
  return mx::array({w.shape(0), K}, mx::float32, std::make_shared<AffineDequantize>(s, group_size, bits),
                   {w, scales, biases});
}

}  // namespace

void register_qmatmul(nb::module_& m) {
  m.def(
      "quantized_matmul",
      [](const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases, bool transpose,
         int group_size, int bits, mx::StreamOrDevice s) {
        return qmatmul_op(x, w, scales, biases, transpose, group_size, bits, s);
      },
      nb::arg("x"),
      nb::arg("w"),
      nb::arg("scales"),
      nb::arg("biases"),
      nb::kw_only(),
      nb::arg("transpose") = true,
      nb::arg("group_size") = 64,
      nb::arg("bits") = 4,
      nb::arg("stream") = nb::none(),
      "x @ W.T (transpose=True) or x @ W with W = mx.dequantize(w, scales, biases) (affine mode); float32 "
      "math, result in the promoted dtype of x and scales.");
  m.def(
      "dequantize",
      [](const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
         mx::StreamOrDevice s) { return dequantize_op(w, scales, biases, group_size, bits, s); },
      nb::arg("w"),
      nb::arg("scales"),
      nb::arg("biases"),
      nb::kw_only(),
      nb::arg("group_size") = 64,
      nb::arg("bits") = 4,
      nb::arg("stream") = nb::none(),
      "W = scales * q + biases (affine mode) as float32 [N, K].");
  m.def(
      "set_quantized_force_scalar",
      [](bool v) { metalnn_qmm::force_scalar_flag() = v; },
      nb::arg("value"),
      "Run the portable quantized kernels even where AVX2 is available (tests and benchmarks).");
  m.def("get_quantized_force_scalar", []() { return metalnn_qmm::force_scalar_flag().load(); });
  m.def("quantized_has_avx2", []() { return metalnn_qmm::cpu_has_avx2_fma(); });
}
