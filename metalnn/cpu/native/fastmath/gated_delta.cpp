// The gated delta rule's per-token recurrence as two MLX primitives (float32, CPU streams):
//
//   gated_delta(q, k, v, g, beta, h0) -> (o, state)
//     q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]; h0 [B, H, K, V]
//     o [B, T, H, V]; state [B, H, K, V]
//
// GatedDelta runs each (batch, head) pair's recurrence on one thread of the pool (pairs in
// parallel) and keeps the state before every block of kBlock tokens (B*H*ceil(T/kBlock) states);
// its VJP is GatedDeltaVJP, which recomputes each block's states from its checkpoint and walks
// the tokens backwards (gated_delta_kernels.h has the formulas). Second derivatives, JVPs and
// vmap are not provided (they raise).

#include "gated_delta.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "gated_delta_kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "primitive.h"
#include "threadpool.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

using Arrays = std::vector<mx::array>;
constexpr int64_t kBlock = 64;  // tokens between state checkpoints

void alloc(mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
}

bool use_avx2() {
#if METALNN_FM_X86
  return metalnn_fastmath::use_avx2();
#else
  return false;
#endif
}

struct Dims {
  int64_t B, T, H, K, V;
  int64_t blocks() const { return (T + kBlock - 1) / kBlock; }
};

Dims dims_of(const mx::array& q, const mx::array& v) {
  return {q.shape(0), q.shape(1), q.shape(2), q.shape(3), v.shape(3)};
}

// Head (b, h)'s strided view of row-contiguous q, k, v, g, beta.
metalnn_gd::HeadIn head_in(const Dims& d, int64_t b, int64_t h, const float* q, const float* k, const float* v,
                           const float* g, const float* beta) {
  const int64_t qo = (b * d.T * d.H + h) * d.K, vo = (b * d.T * d.H + h) * d.V, go = b * d.T * d.H + h;
  return {q + qo, k + qo, v + vo, g + go, beta + go, d.H * d.K, d.H * d.K, d.H * d.V, d.H};
}

class PrimitiveBase : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const Arrays&, Arrays&) override {
    throw std::runtime_error(std::string("[") + name() + "] has no GPU implementation");
  }
  Arrays jvp(const Arrays&, const Arrays&, const std::vector<int>&) override {
    throw std::runtime_error(std::string("[") + name() + "] has no JVP (use the gated delta rule's MLX forms)");
  }
  std::pair<Arrays, std::vector<int>> vmap(const Arrays&, const std::vector<int>&) override {
    throw std::runtime_error(std::string("[") + name() + "] has no vmap (use the gated delta rule's MLX forms)");
  }
};

Arrays gated_delta_vjp_op(const Arrays& primals, const mx::array& ckpt, const mx::array& d_o,
                          const mx::array& d_state, mx::Stream s);

// inputs q, k, v, g, beta, h0; outputs o, state, checkpoints [B, H, blocks, K, V]
class GatedDelta : public PrimitiveBase {
 public:
  using PrimitiveBase::PrimitiveBase;

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    for (auto& o : outputs) {
      alloc(o);
      enc.set_output_array(o);
    }
    enc.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]), k = mx::array::unsafe_weak_copy(inputs[1]),
                  v = mx::array::unsafe_weak_copy(inputs[2]), g = mx::array::unsafe_weak_copy(inputs[3]),
                  beta = mx::array::unsafe_weak_copy(inputs[4]), h0 = mx::array::unsafe_weak_copy(inputs[5]),
                  o = mx::array::unsafe_weak_copy(outputs[0]), st = mx::array::unsafe_weak_copy(outputs[1]),
                  ck = mx::array::unsafe_weak_copy(outputs[2])]() mutable {
      const Dims d = dims_of(q, v);
      const int64_t kv = d.K * d.V, nb_ = d.blocks();
      const float *pq = q.data<float>(), *pk = k.data<float>(), *pv = v.data<float>(), *pg = g.data<float>(),
                  *pb = beta.data<float>(), *ph = h0.data<float>();
      float *po = o.data<float>(), *ps = st.data<float>(), *pc = ck.data<float>();
      const bool avx = use_avx2();
      metalnn_native::parallel_for(static_cast<size_t>(d.B * d.H), 1, [&](size_t i0, size_t i1) {
        for (size_t i = i0; i < i1; ++i) {
          const int64_t b = static_cast<int64_t>(i) / d.H, h = static_cast<int64_t>(i) % d.H;
          const auto in = head_in(d, b, h, pq, pk, pv, pg, pb);
          float* S = ps + i * kv;
          std::copy(ph + i * kv, ph + (i + 1) * kv, S);
          float* out = po + (b * d.T * d.H + h) * d.V;
#if METALNN_FM_X86
          if (avx) {
            metalnn_gd::forward_head_avx2(in, S, out, d.H * d.V, d.T, d.K, d.V, kBlock, pc + i * nb_ * kv);
            continue;
          }
#endif
          metalnn_gd::forward_head_generic(in, S, out, d.H * d.V, d.T, d.K, d.V, kBlock, pc + i * nb_ * kv);
        }
      });
      (void)avx;
    });
  }

  // The checkpoints never leave the op (the binding returns o and the state), so their
  // cotangent is ignored.
  Arrays vjp(const Arrays& primals, const Arrays& cotangents, const std::vector<int>& argnums,
             const Arrays& outputs) override {
    auto grads = gated_delta_vjp_op(primals, outputs[2], cotangents[0], cotangents[1], stream());
    Arrays res;
    for (int i : argnums) res.push_back(grads[i]);
    return res;
  }

  std::vector<mx::Shape> output_shapes(const Arrays& in) override {
    const Dims d = dims_of(in[0], in[2]);
    return {in[2].shape(), in[5].shape(), mx::Shape{int(d.B), int(d.H), int(d.blocks()), int(d.K), int(d.V)}};
  }

  METALNN_PRIMITIVE("MetalnnGatedDelta")
};

// inputs q, k, v, g, beta, checkpoints, d_o, d_state; outputs dq, dk, dv, dg, dbeta, dh0
class GatedDeltaVJP : public PrimitiveBase {
 public:
  using PrimitiveBase::PrimitiveBase;

  void eval_cpu(const Arrays& inputs, Arrays& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    for (auto& o : outputs) {
      alloc(o);
      enc.set_output_array(o);
    }
    std::vector<mx::array> in, out;
    for (auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
    for (auto& a : outputs) out.push_back(mx::array::unsafe_weak_copy(a));
    enc.dispatch([in = std::move(in), out = std::move(out)]() mutable {
      const Dims d = dims_of(in[0], in[2]);
      const int64_t kv = d.K * d.V, nb_ = d.blocks();
      const float *pq = in[0].data<float>(), *pk = in[1].data<float>(), *pv = in[2].data<float>(),
                  *pg = in[3].data<float>(), *pb = in[4].data<float>(), *pc = in[5].data<float>(),
                  *pdo = in[6].data<float>(), *pds = in[7].data<float>();
      float *dq = out[0].data<float>(), *dk = out[1].data<float>(), *dv = out[2].data<float>(),
            *dg = out[3].data<float>(), *dbeta = out[4].data<float>(), *dh = out[5].data<float>();
      const bool avx = use_avx2();
      metalnn_native::parallel_for(static_cast<size_t>(d.B * d.H), 1, [&](size_t i0, size_t i1) {
        std::vector<float> work((kBlock + 1) * kv + kBlock * d.V);
        for (size_t i = i0; i < i1; ++i) {
          const int64_t b = static_cast<int64_t>(i) / d.H, h = static_cast<int64_t>(i) % d.H;
          const auto hin = head_in(d, b, h, pq, pk, pv, pg, pb);
          // the gradients share the inputs' layouts: same offsets and strides
          const int64_t qo = hin.q - pq, vo = hin.v - pv, go = hin.g - pg;
          float* dS = dh + i * kv;
          std::copy(pds + i * kv, pds + (i + 1) * kv, dS);
#if METALNN_FM_X86
          if (avx) {
            metalnn_gd::backward_head_avx2(hin, pc + i * nb_ * kv, pdo + vo, d.H * d.V, dS, dq + qo, dk + qo,
                                           dv + vo, dg + go, dbeta + go, d.T, d.K, d.V, kBlock, work.data());
            continue;
          }
#endif
          metalnn_gd::backward_head_generic(hin, pc + i * nb_ * kv, pdo + vo, d.H * d.V, dS, dq + qo, dk + qo,
                                            dv + vo, dg + go, dbeta + go, d.T, d.K, d.V, kBlock, work.data());
        }
      });
      (void)avx;
    });
  }

  Arrays vjp(const Arrays&, const Arrays&, const std::vector<int>&, const Arrays&) override {
    throw std::runtime_error("[MetalnnGatedDeltaVJP] second derivatives of the native gated delta rule are not "
                             "implemented (use the gated delta rule's MLX forms)");
  }

  std::vector<mx::Shape> output_shapes(const Arrays& in) override {
    return {in[0].shape(), in[1].shape(), in[2].shape(), in[3].shape(), in[4].shape(),
            mx::Shape{in[5].shape(0), in[5].shape(1), in[5].shape(3), in[5].shape(4)}};
  }

  METALNN_PRIMITIVE("MetalnnGatedDeltaVJP")
};

mx::array rowc_f32(const mx::array& a, mx::Stream s) {
  auto b = a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, s);
  return mx::contiguous(b, false, s);
}

Arrays gated_delta_vjp_op(const Arrays& primals, const mx::array& ckpt, const mx::array& d_o,
                          const mx::array& d_state, mx::Stream s) {
  Arrays in;
  for (int i = 0; i < 5; ++i) in.push_back(primals[i]);
  in.push_back(ckpt);
  in.push_back(rowc_f32(d_o, s));
  in.push_back(rowc_f32(d_state, s));
  std::vector<mx::Shape> shapes;
  for (int i = 0; i < 6; ++i) shapes.push_back(primals[i].shape());
  return mx::array::make_arrays(shapes, std::vector<mx::Dtype>(6, mx::float32), std::make_shared<GatedDeltaVJP>(s),
                                in);
}

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

std::string shape_str(const mx::array& a) {
  std::ostringstream os;
  os << a.shape();
  return os.str();
}

Arrays gated_delta_op(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g,
                      const mx::array& beta, const mx::array& h0, mx::Stream s) {
  require(s.device == mx::Device::cpu, "[gated_delta] runs on CPU streams only");
  require(q.ndim() == 4 && v.ndim() == 4, "[gated_delta] q, k, v must be [B, T, H, D], got q " + shape_str(q) +
                                              ", v " + shape_str(v));
  const int B = q.shape(0), T = q.shape(1), H = q.shape(2), K = q.shape(3), V = v.shape(3);
  require(k.shape() == q.shape(), "[gated_delta] k must have q's shape " + shape_str(q) + ", got " + shape_str(k));
  require(v.shape(0) == B && v.shape(1) == T && v.shape(2) == H,
          "[gated_delta] v must be [B, T, H, V] with q's B, T, H, got " + shape_str(v));
  require(g.shape() == mx::Shape{B, T, H} && beta.shape() == mx::Shape{B, T, H},
          "[gated_delta] g and beta must be [B, T, H], got " + shape_str(g) + " and " + shape_str(beta));
  require(h0.shape() == mx::Shape{B, H, K, V},
          "[gated_delta] h0 must be [B, H, K, V], got " + shape_str(h0));
  require(V <= metalnn_gd::kMaxV, "[gated_delta] value head dimension above 1024");
  for (const auto* a : {&q, &k, &v, &g, &beta, &h0})
    require(a->dtype() == mx::float32, "[gated_delta] inputs must be float32");
  Arrays in;
  for (const auto* a : {&q, &k, &v, &g, &beta, &h0}) in.push_back(mx::contiguous(*a, false, s));
  const int blocks = static_cast<int>((T + kBlock - 1) / kBlock);
  auto outs = mx::array::make_arrays({v.shape(), h0.shape(), mx::Shape{B, H, blocks, K, V}},
                                     {mx::float32, mx::float32, mx::float32}, std::make_shared<GatedDelta>(s), in);
  return {outs[0], outs[1]};
}

}  // namespace

void register_gated_delta(nb::module_& m) {
  m.def(
      "gated_delta",
      [](const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g, const mx::array& beta,
         const mx::array& h0, mx::StreamOrDevice s) { return gated_delta_op(q, k, v, g, beta, h0, mx::to_stream(s)); },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("h0"), nb::kw_only(),
      nb::arg("stream") = nb::none(),
      "The gated delta rule's recurrence (float32, CPU): q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H], "
      "h0 [B, H, K, V] -> (o [B, T, H, V], state [B, H, K, V]); differentiable once (mx.grad / mx.vjp).");
}
