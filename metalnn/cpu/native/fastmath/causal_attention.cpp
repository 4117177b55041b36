// Causal self-attention (queries and keys at the same positions) as two MLX primitives, float32,
// CPU streams:
//
//   causal_attention(q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D], scale)
//     -> o [B, T, Hq, D] (position-major: merging the heads after it is free)
//
// Each (batch, query head) pair is one task of the thread pool (backward, with grouped heads,
// each writes its own key/value gradients, summed over the group at the end). A query row's scores, softmax and output are formed for the keys it sees only (half the products
// of a full attention matrix) and never stored: the forward pass keeps the rows' logsumexp, the
// backward pass (CausalAttentionVJP) recomputes the probabilities from it. D must be 32, 64 or
// 128 (causal_attention_kernels.h has the loops). Second derivatives, JVPs and vmap raise.

#include "causal_attention.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "causal_attention_kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "primitive.h"
#include "threadpool.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

using Arrays = std::vector<mx::array>;

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
  int64_t B, Hq, Hkv, T, D;
};

Dims dims_of(const mx::array& q, const mx::array& k) {
  return {q.shape(0), q.shape(1), k.shape(1), q.shape(2), q.shape(3)};
}

template <int D>
void forward_unit(bool avx, const float* q, const float* k, const float* v, int64_t rep, int64_t T, float scale,
                  float* o, int64_t o_st, float* lse) {
#if METALNN_FM_X86
  if (avx) return metalnn_attn::forward_unit_avx2<D>(q, k, v, rep, T, scale, o, o_st, D, lse);
#endif
  (void)avx;
  metalnn_attn::forward_unit_generic<D>(q, k, v, rep, T, scale, o, o_st, D, lse);
}

template <int D>
void backward_unit(bool avx, const float* q, const float* k, const float* v, const float* o, const float* dout,
                   int64_t o_st, const float* lse, int64_t rep, int64_t T, float scale, float* dq, float* dk,
                   float* dv) {
#if METALNN_FM_X86
  if (avx) return metalnn_attn::backward_unit_avx2<D>(q, k, v, o, dout, o_st, D, lse, rep, T, scale, dq, dk, dv);
#endif
  (void)avx;
  metalnn_attn::backward_unit_generic<D>(q, k, v, o, dout, o_st, D, lse, rep, T, scale, dq, dk, dv);
}

class PrimitiveBase : public mx::Primitive {
 public:
  PrimitiveBase(mx::Stream s, float scale) : mx::Primitive(s), scale_(scale) {}
  void eval_gpu(const Arrays&, Arrays&) override {
    throw std::runtime_error(std::string("[") + name() + "] has no GPU implementation");
  }
  Arrays jvp(const Arrays&, const Arrays&, const std::vector<int>&) override {
    throw std::runtime_error(std::string("[") + name() + "] has no JVP");
  }
  std::pair<Arrays, std::vector<int>> vmap(const Arrays&, const std::vector<int>&) override {
    throw std::runtime_error(std::string("[") + name() + "] has no vmap");
  }

 protected:
  float scale_;
};

Arrays attention_vjp_op(const Arrays& primals, const mx::array& o, const mx::array& lse, const mx::array& d_o,
                        float scale, mx::Stream s);

// inputs q, k, v (row-contiguous); outputs o [B, T, Hq, D], lse [B, Hq, T]
class CausalAttention : public PrimitiveBase {
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
                  v = mx::array::unsafe_weak_copy(inputs[2]), o = mx::array::unsafe_weak_copy(outputs[0]),
                  lse = mx::array::unsafe_weak_copy(outputs[1]), scale = scale_]() mutable {
      const Dims d = dims_of(q, k);
      const int64_t rep = d.Hq / d.Hkv, TD = d.T * d.D;
      const float *pq = q.data<float>(), *pk = k.data<float>(), *pv = v.data<float>();
      float *po = o.data<float>(), *pl = lse.data<float>();
      const bool avx = use_avx2();
      // one task per (batch, query head): the forward pass accumulates nothing across heads
      metalnn_native::parallel_for(static_cast<size_t>(d.B * d.Hq), 1, [&](size_t u0, size_t u1) {
        for (size_t u = u0; u < u1; ++u) {
          const int64_t b = static_cast<int64_t>(u) / d.Hq, h = static_cast<int64_t>(u) % d.Hq;
          const int64_t kv = b * d.Hkv + h / rep;
          const float* qu = pq + u * TD;
          const float *ku = pk + kv * TD, *vu = pv + kv * TD;
          float* ou = po + b * d.T * d.Hq * d.D + h * d.D;
          float* lu = pl + u * d.T;
          const int64_t st = d.Hq * d.D;
          switch (d.D) {
            case 32: forward_unit<32>(avx, qu, ku, vu, 1, d.T, scale, ou, st, lu); break;
            case 64: forward_unit<64>(avx, qu, ku, vu, 1, d.T, scale, ou, st, lu); break;
            default: forward_unit<128>(avx, qu, ku, vu, 1, d.T, scale, ou, st, lu); break;
          }
        }
      });
    });
  }

  // The logsumexp output never leaves the op (the binding returns o only): its cotangent is ignored.
  Arrays vjp(const Arrays& primals, const Arrays& cotangents, const std::vector<int>& argnums,
             const Arrays& outputs) override {
    auto grads = attention_vjp_op(primals, outputs[0], outputs[1], cotangents[0], scale_, stream());
    Arrays res;
    for (int i : argnums) res.push_back(grads[i]);
    return res;
  }

  std::vector<mx::Shape> output_shapes(const Arrays& in) override {
    const auto& q = in[0];
    return {mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)}, mx::Shape{q.shape(0), q.shape(1), q.shape(2)}};
  }

  METALNN_PRIMITIVE("MetalnnCausalAttention", scale_)
};

// inputs q, k, v, o, lse, d_o; outputs dq, dk, dv (row-contiguous, shaped like q, k, v)
class CausalAttentionVJP : public PrimitiveBase {
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
    enc.dispatch([in = std::move(in), out = std::move(out), scale = scale_]() mutable {
      const Dims d = dims_of(in[0], in[1]);
      const int64_t rep = d.Hq / d.Hkv, TD = d.T * d.D;
      const float *pq = in[0].data<float>(), *pk = in[1].data<float>(), *pv = in[2].data<float>(),
                  *po = in[3].data<float>(), *pl = in[4].data<float>(), *pdo = in[5].data<float>();
      float *dq = out[0].data<float>(), *dk = out[1].data<float>(), *dv = out[2].data<float>();
      const bool avx = use_avx2();
      // one task per (batch, query head); with grouped heads each writes its own key and value
      // gradients, summed over the group afterwards
      std::vector<float> partial(rep > 1 ? 2 * d.B * d.Hq * TD : 0);
      float *dkp = rep > 1 ? partial.data() : dk, *dvp = rep > 1 ? partial.data() + d.B * d.Hq * TD : dv;
      metalnn_native::parallel_for(static_cast<size_t>(d.B * d.Hq), 1, [&](size_t u0, size_t u1) {
        for (size_t u = u0; u < u1; ++u) {
          const int64_t b = static_cast<int64_t>(u) / d.Hq, h = static_cast<int64_t>(u) % d.Hq;
          const int64_t kv = b * d.Hkv + h / rep;
          const int64_t qoff = u * TD, ooff = b * d.T * d.Hq * d.D + h * d.D;
          const int64_t st = d.Hq * d.D;
          const float* lu = pl + u * d.T;
#define METALNN_ATTN_BWD(DD)                                                                                    \
  backward_unit<DD>(avx, pq + qoff, pk + kv * TD, pv + kv * TD, po + ooff, pdo + ooff, st, lu, 1, d.T, scale, \
                    dq + qoff, dkp + u * TD, dvp + u * TD)
          switch (d.D) {
            case 32: METALNN_ATTN_BWD(32); break;
            case 64: METALNN_ATTN_BWD(64); break;
            default: METALNN_ATTN_BWD(128); break;
          }
#undef METALNN_ATTN_BWD
        }
      });
      if (rep > 1) {
        const size_t n = static_cast<size_t>(d.B * d.Hkv * TD);
        metalnn_native::parallel_for(n, 16384, [&](size_t i0, size_t i1) {
          for (size_t i = i0; i < i1; ++i) {
            const int64_t kv = static_cast<int64_t>(i) / TD, e = static_cast<int64_t>(i) % TD;
            const int64_t first = (kv / d.Hkv * d.Hq + kv % d.Hkv * rep) * TD + e;
            float sk = 0.0f, sv = 0.0f;
            for (int64_t r = 0; r < rep; ++r) {
              sk += dkp[first + r * TD];
              sv += dvp[first + r * TD];
            }
            dk[i] = sk;
            dv[i] = sv;
          }
        });
      }
    });
  }

  Arrays vjp(const Arrays&, const Arrays&, const std::vector<int>&, const Arrays&) override {
    throw std::runtime_error("[MetalnnCausalAttentionVJP] second derivatives of the native causal attention are "
                             "not implemented");
  }

  std::vector<mx::Shape> output_shapes(const Arrays& in) override {
    return {in[0].shape(), in[1].shape(), in[2].shape()};
  }

  METALNN_PRIMITIVE("MetalnnCausalAttentionVJP", scale_)
};

Arrays attention_vjp_op(const Arrays& primals, const mx::array& o, const mx::array& lse, const mx::array& d_o,
                        float scale, mx::Stream s) {
  auto g = d_o.dtype() == mx::float32 ? d_o : mx::astype(d_o, mx::float32, s);
  Arrays in{primals[0], primals[1], primals[2], o, lse, mx::contiguous(g, false, s)};
  return mx::array::make_arrays({primals[0].shape(), primals[1].shape(), primals[2].shape()},
                                {mx::float32, mx::float32, mx::float32},
                                std::make_shared<CausalAttentionVJP>(s, scale), in);
}

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

std::string shape_str(const mx::array& a) {
  std::ostringstream os;
  os << a.shape();
  return os.str();
}

mx::array causal_attention_op(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                              mx::Stream s) {
  require(s.device == mx::Device::cpu, "[causal_attention] runs on CPU streams only");
  require(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4,
          "[causal_attention] q, k, v must be [B, H, T, D], got " + shape_str(q) + ", " + shape_str(k) + ", " +
              shape_str(v));
  require(k.shape() == v.shape(), "[causal_attention] k " + shape_str(k) + " and v " + shape_str(v) +
                                      " must have one shape");
  require(k.shape(0) == q.shape(0) && k.shape(2) == q.shape(2) && k.shape(3) == q.shape(3),
          "[causal_attention] k " + shape_str(k) + " must match q " + shape_str(q) + " in batch, length and D");
  require(k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0,
          "[causal_attention] query heads must be a multiple of key/value heads, got " + shape_str(q) + " and " +
              shape_str(k));
  const int D = q.shape(3);
  require(D == 32 || D == 64 || D == 128, "[causal_attention] head_dim must be 32, 64 or 128, got " +
                                              std::to_string(D));
  for (const auto* a : {&q, &k, &v}) require(a->dtype() == mx::float32, "[causal_attention] inputs must be float32");
  Arrays in;
  for (const auto* a : {&q, &k, &v}) in.push_back(mx::contiguous(*a, false, s));
  auto outs = mx::array::make_arrays(
      {mx::Shape{q.shape(0), q.shape(2), q.shape(1), D}, mx::Shape{q.shape(0), q.shape(1), q.shape(2)}},
      {mx::float32, mx::float32}, std::make_shared<CausalAttention>(s, scale), in);
  return outs[0];
}

}  // namespace

void register_causal_attention(nb::module_& m) {
  m.def(
      "causal_attention",
      [](const mx::array& q, const mx::array& k, const mx::array& v, float scale, mx::StreamOrDevice s) {
        return causal_attention_op(q, k, v, scale, mx::to_stream(s));
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"), nb::kw_only(), nb::arg("stream") = nb::none(),
      "Causal softmax(q k^T * scale) v for q [B, Hq, T, D], k, v [B, Hkv, T, D] (float32, CPU, D 32/64/128); "
      "returns o as [B, T, Hq, D]. Differentiable once.");
}
