// Products with weights packed in a GGML tensor type as differentiable MLX CPU primitives (see
// ggml_kernels.h for the kernels, ggml_types.h for the formats, and metalnn/cpu/ggml.py for the
// Python API).
//
//   ggml_matmul(x, w, type_id):   x [..., K] @ W.T -> [..., N] float32
//   ggml_dequantize(w, type_id):  W [N, K] float32, bit for bit as metalnn.ggml's MLX decoder
//
// w is uint8 [N, K / block_size * type_size]: each row its blocks. The product runs
// multi-threaded over the rows of W. The input gradient g @ W is MLX's matmul with the
// dequantized weight (in row slices of at most 2^24 values); the packed weight has no gradient
// (a zero one, as it is not trainable).

#include "ggml.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ggml_kernels.h"
#include "ggml_product.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "primitive.h"
#include "strided.h"
#include "threadpool.h"

namespace mx = mlx::core;
namespace nb = nanobind;
namespace gg = metalnn_ggml;
using metalnn_native::contiguous_data;

namespace {

// Work (values decoded or multiplied) below which a chunk of rows is not worth another thread.
constexpr int64_t kGrainWork = 1 << 16;

// Decoded values at most in one slice of the weight in the input gradient.
constexpr int64_t kGradientSliceValues = int64_t(1) << 24;

size_t grain_rows(int64_t work_per_row) {
  return static_cast<size_t>(std::max<int64_t>(1, kGrainWork / std::max<int64_t>(work_per_row, 1)));
}

// out [M, N] = x [M, K] @ W.T
void run_matmul(const mx::array& x, const mx::array& w, mx::array& out, const gg::TypeInfo& t) {
  const int64_t K = x.shape(-1), N = w.shape(0);
  const int64_t M = static_cast<int64_t>(x.size()) / K;
  std::vector<float> xkeep;
  std::vector<uint8_t> wkeep;
  gg::PreparedProduct p;
  p.prepare(t, contiguous_data<uint8_t>(w, wkeep), N, K, contiguous_data<float>(x, xkeep), M, out.data<float>());
  metalnn_native::parallel_for(static_cast<size_t>(N), grain_rows(K * std::max<int64_t>(M, 2)),
                               [&](size_t r0, size_t r1) {
                                 p.run_rows(static_cast<int64_t>(r0), static_cast<int64_t>(r1));
                               });
}

void run_dequantize(const mx::array& w, mx::array& out, const gg::TypeInfo& t) {
  const int64_t N = w.shape(0), K = out.shape(1);
  std::vector<uint8_t> wkeep;
  const uint8_t* wp = contiguous_data<uint8_t>(w, wkeep);
  const bool avx2 = gg::use_avx2();
  float* o = out.data<float>();
  metalnn_native::parallel_for(static_cast<size_t>(N), grain_rows(2 * K), [&](size_t r0, size_t r1) {
    gg::dequantize_rows(t, wp, K, o, static_cast<int64_t>(r0), static_cast<int64_t>(r1), avx2);
  });
}

// ---------------------------------------------------------------------------
// Graph-level ops (declared here, defined below the primitives)
// ---------------------------------------------------------------------------

mx::array ggml_matmul_op(const mx::array& x, const mx::array& w, int type, mx::StreamOrDevice sd);
mx::array ggml_dequantize_op(const mx::array& w, int type, mx::StreamOrDevice sd);

const gg::TypeInfo& type_info(int type) {
  const gg::TypeInfo* t = gg::find_type(type);
  if (t == nullptr) throw std::invalid_argument("[ggml] unsupported GGML type id " + std::to_string(type));
  return *t;
}

int64_t unpacked_width(const mx::array& w, const gg::TypeInfo& t) {
  return static_cast<int64_t>(w.shape(1)) / t.size * t.block;
}

// ---------------------------------------------------------------------------
// Primitives
// ---------------------------------------------------------------------------

class GGMLMatmul : public mx::UnaryPrimitive {
 public:
  GGMLMatmul(mx::Stream s, int type) : mx::UnaryPrimitive(s), type_(type) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const gg::TypeInfo& t = type_info(type_);
    enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), w = mx::array::unsafe_weak_copy(inputs[1]),
                  out = mx::array::unsafe_weak_copy(out), &t]() mutable {
      if (out.size() == 0) return;
      if (x.size() == 0 || w.size() == 0) {
        std::fill(out.data<float>(), out.data<float>() + out.size(), 0.0f);
        return;
      }
      run_matmul(x, w, out, t);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[GGMLMatmul] has no GPU implementation");
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<mx::array> grads;
    for (int i : argnums) {
      if (i == 0) {
        grads.push_back(mx::astype(input_gradient(cotangents[0], primals[1]), primals[0].dtype(), stream()));
      } else {
        grads.push_back(mx::zeros_like(primals[i], stream()));
      }
    }
    return grads;
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override {
    for (size_t j = 0; j < argnums.size(); ++j) {
      if (argnums[j] == 0) return {ggml_matmul_op(tangents[j], primals[1], type_, stream())};
    }
    auto shape = primals[0].shape();
    shape.back() = primals[1].shape(0);
    return {mx::zeros(shape, mx::float32, stream())};
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                           const std::vector<int>& axes) override {
    if (axes.size() > 1 && axes[1] >= 0)
      throw std::invalid_argument("[ggml_matmul] vmap over the packed weight is not supported");
    auto x = inputs[0];
    if (axes[0] < 0) return {{ggml_matmul_op(x, inputs[1], type_, stream())}, {-1}};
    x = mx::moveaxis(x, axes[0], 0, stream());
    return {{ggml_matmul_op(x, inputs[1], type_, stream())}, {0}};
  }

  METALNN_PRIMITIVE("GGMLMatmul", type_)

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  // g [..., N] @ W (float32 [..., K]) with W decoded again (no float copy of the weight is kept
  // from the forward pass), in slices of at most kGradientSliceValues decoded values, so that a
  // large weight (an output head) is never decoded whole.
  mx::array input_gradient(const mx::array& cotangent, const mx::array& w) {
    const auto s = stream();
    const int N = w.shape(0);
    const int K = static_cast<int>(unpacked_width(w, type_info(type_)));
    auto g = mx::astype(cotangent, mx::float32, s);
    const int rows = static_cast<int>(std::max<int64_t>(1, kGradientSliceValues / std::max(K, 1)));
    if (N <= rows) return mx::matmul(g, ggml_dequantize_op(w, type_, s), s);
    auto shape = g.shape();
    shape.back() = K;
    g = mx::reshape(g, {-1, N}, s);
    const int M = g.shape(0), row_bytes = w.shape(1);
    std::optional<mx::array> dx;
    for (int r0 = 0; r0 < N; r0 += rows) {
      const int r1 = std::min(N, r0 + rows);
      auto part = mx::matmul(mx::slice(g, {0, r0}, {M, r1}, s),
                             ggml_dequantize_op(mx::slice(w, {r0, 0}, {r1, row_bytes}, s), type_, s), s);
      dx = dx ? mx::add(*dx, part, s) : part;
    }
    return mx::reshape(*dx, shape, s);
  }

  int type_;
};

class GGMLDequantize : public mx::UnaryPrimitive {
 public:
  GGMLDequantize(mx::Stream s, int type) : mx::UnaryPrimitive(s), type_(type) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(inputs[0]);
    enc.set_output_array(out);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const gg::TypeInfo& t = type_info(type_);
    enc.dispatch([w = mx::array::unsafe_weak_copy(inputs[0]), out = mx::array::unsafe_weak_copy(out), &t]() mutable {
      if (out.size() == 0) return;
      run_dequantize(w, out, t);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[GGMLDequantize] has no GPU implementation");
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>&,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<mx::array> grads;
    for (int i : argnums) grads.push_back(mx::zeros_like(primals[i], stream()));
    return grads;
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>&,
                             const std::vector<int>&) override {
    const gg::TypeInfo& t = type_info(type_);
    return {mx::zeros({primals[0].shape(0), static_cast<int>(unpacked_width(primals[0], t))}, mx::float32,
                      stream())};
  }

  METALNN_PRIMITIVE("GGMLDequantize", type_)

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), static_cast<int>(unpacked_width(inputs[0], type_info(type_)))}};
  }

 private:
  int type_;
};

// ---------------------------------------------------------------------------
// Graph-level ops
// ---------------------------------------------------------------------------

mx::Stream cpu_stream(const char* who, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (s.device != mx::Device::cpu) throw std::invalid_argument(std::string("[") + who + "] runs on CPU streams only");
  return s;
}

// Checks the packed weight and returns its type.
const gg::TypeInfo& check_weight(const char* who, const mx::array& w, int type) {
  const gg::TypeInfo* t = gg::find_type(type);
  std::ostringstream msg;
  msg << "[" << who << "] ";
  if (t == nullptr) {
    msg << "GGML type id " << type << " has no native kernel (block types only)";
    throw std::invalid_argument(msg.str());
  }
  if (w.dtype() != mx::uint8 || w.ndim() != 2) {
    msg << "expected a packed uint8 weight [N, row_bytes], got " << w.dtype() << " of shape " << w.shape();
    throw std::invalid_argument(msg.str());
  }
  if (w.shape(1) % t->size) {
    msg << "a " << t->name << " row of " << w.shape(1) << " bytes is not whole " << t->size << "-byte blocks";
    throw std::invalid_argument(msg.str());
  }
  return *t;
}

mx::array ggml_matmul_op(const mx::array& x, const mx::array& w, int type, mx::StreamOrDevice sd) {
  auto s = cpu_stream("ggml_matmul", sd);
  const gg::TypeInfo& t = check_weight("ggml_matmul", w, type);
  const int64_t K = unpacked_width(w, t);
  if (x.ndim() < 1 || x.shape(-1) != K) {
    std::ostringstream msg;
    msg << "[ggml_matmul] x must be [..., " << K << "] for a " << t.name << " weight of shape " << w.shape()
        << "; got shape " << x.shape();
    throw std::invalid_argument(msg.str());
  }
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    std::ostringstream msg;
    msg << "[ggml_matmul] x must be float32, float16 or bfloat16; got " << x.dtype();
    throw std::invalid_argument(msg.str());
  }
  const auto xf = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, s);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<GGMLMatmul>(s, type), {xf, w});
}

mx::array ggml_dequantize_op(const mx::array& w, int type, mx::StreamOrDevice sd) {
  auto s = cpu_stream("ggml_dequantize", sd);
  const gg::TypeInfo& t = check_weight("ggml_dequantize", w, type);
  return mx::array({w.shape(0), static_cast<int>(unpacked_width(w, t))}, mx::float32,
                   std::make_shared<GGMLDequantize>(s, type), {w});
}

// A compiled-in table by name, as its bytes (tests compare them with metalnn.ggml.grids).
nb::bytes table_bytes(const std::string& name) {
  auto bytes = [](const void* p, size_t n) { return nb::bytes(static_cast<const char*>(p), n); };
  if (name == "iq2xxs_grid") return bytes(gg::kIQ2XXSGrid, sizeof(gg::kIQ2XXSGrid));
  if (name == "iq2xs_grid") return bytes(gg::kIQ2XSGrid, sizeof(gg::kIQ2XSGrid));
  if (name == "iq2s_grid") return bytes(gg::kIQ2SGrid, sizeof(gg::kIQ2SGrid));
  if (name == "iq3xxs_grid") return bytes(gg::kIQ3XXSGrid, sizeof(gg::kIQ3XXSGrid));
  if (name == "iq3s_grid") return bytes(gg::kIQ3SGrid, sizeof(gg::kIQ3SGrid));
  if (name == "iq1s_grid") return bytes(gg::kIQ1SGrid, sizeof(gg::kIQ1SGrid));
  if (name == "ksigns_iq2xs") return bytes(gg::kKSignsIQ2XS, sizeof(gg::kKSignsIQ2XS));
  if (name == "kvalues_iq4nl") return bytes(gg::kValuesIQ4NL, sizeof(gg::kValuesIQ4NL));
  if (name == "kvalues_mxfp4") return bytes(gg::kValuesMXFP4, sizeof(gg::kValuesMXFP4));
  throw std::invalid_argument("[ggml_table] unknown table " + name);
}

}  // namespace

void register_ggml(nb::module_& m) {
  m.def(
      "ggml_matmul",
      [](const mx::array& x, const mx::array& w, int type_id, mx::StreamOrDevice s) {
        return ggml_matmul_op(x, w, type_id, s);
      },
      nb::arg("x"),
      nb::arg("w"),
      nb::arg("type_id"),
      nb::kw_only(),
      nb::arg("stream") = nb::none(),
      "x @ W.T with W packed in the GGML type `type_id` (uint8 [N, row_bytes]); float32 result.");
  m.def(
      "ggml_dequantize",
      [](const mx::array& w, int type_id, mx::StreamOrDevice s) { return ggml_dequantize_op(w, type_id, s); },
      nb::arg("w"),
      nb::arg("type_id"),
      nb::kw_only(),
      nb::arg("stream") = nb::none(),
      "The float32 matrix [N, K] of a packed GGML weight, bit for bit as metalnn.ggml decodes it.");
  m.def(
      "ggml_type_ids",
      []() {
        std::vector<int> ids;
        for (const auto& t : gg::kTypes) ids.push_back(t.id);
        return ids;
      },
      "GGUF type ids of the GGML types the native kernels run.");
  m.def(
      "ggml_register_type_ids",
      []() {
        std::vector<int> ids;
        for (const auto& t : gg::kTypes)
          if (gg::has_register_kernel(t.id)) ids.push_back(t.id);
        return ids;
      },
      "GGUF type ids with an AVX2 register kernel (the others decode a block at a time).");
  m.def("ggml_table", &table_bytes, nb::arg("name"), "A compiled-in table (i-quant grids, sign and value tables).");
  m.def(
      "ggml_set_force_scalar",
      [](bool v) { gg::force_scalar_flag() = v; },
      nb::arg("value"),
      "Run the portable GGML kernels even where AVX2 is available (tests and benchmarks).");
  m.def("ggml_get_force_scalar", []() { return gg::force_scalar_flag().load(); });
  m.def(
      "ggml_set_register_rows",
      [](int v) { gg::register_rows_setting() = std::max(0, v); },
      nb::arg("rows"),
      "Input rows up to which the register kernels run (more: the decoded-rows kernel).");
  m.def("ggml_get_register_rows", []() { return gg::register_rows_setting().load(); });
  m.def(
      "ggml_set_int8_rows",
      [](int v) { gg::int8_rows_setting() = std::max(0, v); },
      nb::arg("rows"),
      "Input rows up to which the register kernels take the input quantized to int8 (0: always float32).");
  m.def("ggml_get_int8_rows", []() { return gg::int8_rows_setting().load(); });
  m.def(
      "ggml_set_split_inputs",
      [](bool v) { gg::split_inputs_setting() = v; },
      nb::arg("value"),
      "Q4_K, Q5_K and Q6_K products take float inputs as two int8 levels (False: float32 inputs).");
  m.def("ggml_get_split_inputs", []() { return gg::split_inputs_setting().load(); });
  m.def("ggml_has_avx2", []() { return gg::cpu_has_avx2(); });
}
