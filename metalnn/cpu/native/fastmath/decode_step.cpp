// Llama-family decoder blocks for one new position of each sequence, as MLX CPU primitives
// (metalnn/cpu/decode_step.py is the Python API). One block:
//
//   n1  = rms_norm(x) * g1
//   q, k, v = q_proj(n1), k_proj(n1), v_proj(n1)   (+ biases; per-head RMSNorm of q and k; RoPE at `offset`)
//   h   = x + o_proj(softmax(q . [K, k] * scale) [V, v])   (K, V: the cache's positions before `offset`;
//                                                         grouped-query heads, optional window)
//   n2  = rms_norm(h) * g2
//   out = h + down_proj(act(gate_proj(n2)) * up_proj(n2))
//
// Decoding a small model is bound by everything around the products: built from separate MLX ops
// a block is ~40 graph nodes, each with its own dispatch, buffers and thread wake-ups. Here a block
// is one node (DecoderBlockStep), and a model's whole run of such blocks can be one node too
// (DecoderStackStep); the projections that read the same input run as one multi-threaded pass over
// their rows (q, k and v; gate and up), the attention one pass over the heads.
//
// Weights: packed in a GGML block type (the kernels of ggml_kernels.h, as GGMLMatmul runs them, so
// the products equal the unfused ones) or float32 [N, K]. The KV caches are only read by the steps.
// DecoderBlockStep reads a block's buffers [B, Hkv, capacity, head_dim] (float32) and outputs the
// new position's key and value [B, Hkv, 1, head_dim], which the caller writes into the cache with
// MLX's slice update. DecoderStackStep reads every block's keys and values from one buffer, the
// stack's cache [blocks, 2, B, Hkv, capacity, head_dim], and outputs the new keys and values packed
// in one array, which one CacheColumnWrite node puts into that buffer; it also runs T > 1 new
// positions a sequence (a prompt's rest after a cached prefix, draft tokens to verify) as rows
// b * T + t, each attending to the cache and to the new positions up to its own. The write works in place: MLX
// lets a single-output node take its input's buffer when nothing else holds it (a multi-output
// primitive never gets that: each of its outputs keeps its own reference to every input until it
// is evaluated, which is why the write is a node of its own). One buffer for the whole stack makes
// that one node a step instead of two a block (each node costs MLX's bookkeeping on the thread that
// also builds the next step, and on two cores that thread's time is taken from the products).
// Inference only: the primitives have no gradient.

#include "decode_step.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_attention.h"
#include "ggml_product.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "primitive.h"
#include "strided.h"
#include "threadpool.h"
#include "train_ops.h"

namespace mx = mlx::core;
namespace nb = nanobind;
namespace gg = metalnn_ggml;

namespace {

// The projections of a block, in the order of their weight inputs.
enum Projection { kQ = 0, kK, kV, kO, kGate, kUp, kDown, kProjections };
constexpr const char* kProjectionNames[kProjections] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                        "gate_proj", "up_proj", "down_proj"};

// Inputs before the optional ones: x, the two norm gains, the seven weights, the two cache
// buffers and the RoPE inverse frequencies. Then one bias per projection that has one (in
// projection order), then the q and k norm gains when qk_norm, then with row_positions each
// sequence's own position (int32 [B]: a batch of sequences of different lengths, each left-aligned
// in the cache; sequence m reads its columns before positions[m] instead of before offset).
enum Input { kX = 0, kGain1, kGain2, kWeights, kKCache = kWeights + kProjections, kVCache, kInvFreq, kFixedInputs };

constexpr int64_t kGrainWork = 1 << 16;  // work below which a chunk is not worth another thread

struct BlockSpec {
  int heads = 0, kv_heads = 0, head_dim = 0, rope_dims = 0;
  bool rope_traditional = false;
  float rope_scale = 1.0f, attn_scale = 1.0f, eps = 1e-5f, qk_eps = 1e-6f;
  int window = 0;  // 0: every cached position
  bool qk_norm = false;
  bool gelu = false;  // the gate's activation: tanh GELU, else SiLU
  std::array<int, kProjections> types{};  // GGML type id, or -1 for a float32 weight
  std::array<bool, kProjections> bias{};
  int offset = 0;  // position of the new token (cached positions before it)
  bool row_positions = false;  // an int32 [B] input gives each sequence's position
  int new_positions = 1;  // T: new positions a sequence (rows b * T + t; the stack step's only)

  bool operator==(const BlockSpec&) const = default;

  int bias_input(int p) const {
    int i = kFixedInputs;
    for (int j = 0; j < p; ++j) i += bias[j];
    return i;
  }
  int qk_norm_input() const {
    return bias_input(kProjections);
  }
  int positions_input() const {
    return qk_norm_input() + (qk_norm ? 2 : 0);
  }
  int num_inputs() const {
    return positions_input() + (row_positions ? 1 : 0);
  }
};

// One projection's product out [M, N] = x [M, K] @ W.T, run over ranges of W's rows.
class ProjectionProduct {
 public:
  void prepare(const void* w, int64_t N, int type, const float* x, int64_t M, int64_t K, float* out) {
    N_ = N;
    K_ = K;
    M_ = M;
    x_ = x;
    out_ = out;
    if (type >= 0) {
      packed_.prepare(*gg::find_type(type), static_cast<const uint8_t*>(w), N_, K, x, M, out);
      float_w_ = nullptr;
    } else {
      float_w_ = static_cast<const float*>(w);
    }
  }

  void run_rows(int64_t r0, int64_t r1) const {
    if (float_w_ == nullptr) {
      packed_.run_rows(r0, r1);
      return;
    }
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t m = 0; m < M_; ++m) out_[m * N_ + r] = dot(float_w_ + r * K_, x_ + m * K_, K_);
  }

  int64_t rows() const {
    return N_;
  }

 private:
  static float dot(const float* a, const float* b, int64_t n) {
    float acc[8] = {};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
  }

  gg::PreparedProduct packed_;
  const float* float_w_ = nullptr;
  const float* x_ = nullptr;
  float* out_ = nullptr;
  int64_t N_ = 0, K_ = 0, M_ = 0;
};

// Runs the products of `group` (all reading inputs of width K) as one multi-threaded pass over
// their rows together.
void run_products(std::initializer_list<const ProjectionProduct*> group, int64_t K, int64_t M) {
  int64_t total = 0;
  for (const auto* p : group) total += p->rows();
  const size_t grain = static_cast<size_t>(std::max<int64_t>(1, kGrainWork / std::max<int64_t>(K * std::max<int64_t>(M, 2), 1)));
  metalnn_native::parallel_for(static_cast<size_t>(total), grain, [&](size_t a, size_t b) {
    int64_t base = 0;
    for (const auto* p : group) {
      const int64_t lo = std::max<int64_t>(static_cast<int64_t>(a), base);
      const int64_t hi = std::min<int64_t>(static_cast<int64_t>(b), base + p->rows());
      if (lo < hi) p->run_rows(lo - base, hi - base);
      base += p->rows();
    }
  });
}

// y[m] = x[m] / sqrt(mean(x[m]^2) + eps) * gain, rows of width D.
void rms_norm_rows(const float* x, const float* gain, float eps, int64_t M, int64_t D, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * D;
    float ss = 0.0f;
    for (int64_t i = 0; i < D; ++i) ss += xm[i] * xm[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) y[m * D + i] = xm[i] * r * gain[i];
  }
}

void add_bias(float* y, const float* bias, int64_t M, int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < N; ++i) y[m * N + i] += bias[i];
}

// RoPE of `count` heads of width hd (consecutive in x) with the cos / sin of each rotated pair.
void rope_heads(float* x, int64_t count, const BlockSpec& sp, const std::vector<float>& cs,
                const std::vector<float>& sn) {
  const int hd = sp.head_dim, half = sp.rope_dims / 2;
  for (int64_t h = 0; h < count; ++h) {
    float* v = x + h * hd;
    for (int i = 0; i < half; ++i) {
      const int a = sp.rope_traditional ? 2 * i : i, b = sp.rope_traditional ? 2 * i + 1 : i + half;
      const float x1 = v[a], x2 = v[b];
      v[a] = x1 * cs[i] - x2 * sn[i];
      v[b] = x1 * sn[i] + x2 * cs[i];
    }
  }
}

// The sizes of one block's step: M sequences of width D, MLP width I, cache capacity `cap`.
struct BlockShape {
  int64_t M = 0, D = 0, I = 0, cap = 0;
};

// The block for M rows: B = M / T sequences of T = sp.new_positions new positions each (row
// b * T + t at the sequence's position + t); see the file comment. `data[i]`: input i's values (the
// layout of `Input`), row-major; `data[kX]` the block's input [M, D]. Writes the block's output y
// [M, D] and the new positions' keys and values k_out, v_out [B, T, Hkv, hd] ([M, Hkv, hd]).
// `rows[p]`: projection p's weight rows.
void run_block(const BlockSpec& sp, const std::vector<const void*>& data, const std::array<int64_t, kProjections>& rows,
               const BlockShape& shape, float* y, float* k_out, float* v_out) {
  const int64_t D = shape.D, M = shape.M, I = shape.I, cap = shape.cap, pos = sp.offset, T = sp.new_positions;
  const int hd = sp.head_dim, H = sp.heads, G = sp.kv_heads, rep = H / G;
  const int64_t nq = int64_t(H) * hd, nkv = int64_t(G) * hd;
  const auto floats = [&](int i) { return static_cast<const float*>(data[i]); };
  const float* x = floats(kX);
  const auto bias = [&](int p) { return floats(sp.bias_input(p)); };

  std::vector<float> n1(M * D), q(M * nq), k(M * nkv), v(M * nkv), att(M * nq), h(M * D), gate(M * I), up(M * I);
  std::array<ProjectionProduct, kProjections> proj;
  const auto prepare = [&](int p, const float* src, int64_t width, float* dst) {
    proj[p].prepare(data[kWeights + p], rows[p], sp.types[p], src, M, width, dst);
  };

  // attention input projections
  rms_norm_rows(x, floats(kGain1), sp.eps, M, D, n1.data());
  prepare(kQ, n1.data(), D, q.data());
  prepare(kK, n1.data(), D, k.data());
  prepare(kV, n1.data(), D, v.data());
  run_products({&proj[kQ], &proj[kK], &proj[kV]}, D, M);
  if (sp.bias[kQ]) add_bias(q.data(), bias(kQ), M, nq);
  if (sp.bias[kK]) add_bias(k.data(), bias(kK), M, nkv);
  if (sp.bias[kV]) add_bias(v.data(), bias(kV), M, nkv);
  if (sp.qk_norm) {
    rms_norm_rows(q.data(), floats(sp.qk_norm_input()), sp.qk_eps, M * H, hd, q.data());
    rms_norm_rows(k.data(), floats(sp.qk_norm_input() + 1), sp.qk_eps, M * G, hd, k.data());
  }
  // each sequence's first new position (offset unless the batch holds sequences of different
  // lengths), clamped to the cache: a position outside it must not make the attention read outside
  // it; row m's position: its sequence's first plus m % T
  const int32_t* positions =
      sp.row_positions ? static_cast<const int32_t*>(data[sp.positions_input()]) : nullptr;
  const auto first_position = [&](int64_t b) {
    return positions ? std::clamp<int64_t>(positions[b], 0, std::max<int64_t>(cap - T, 0)) : pos;
  };
  const auto position = [&](int64_t m) { return first_position(m / T) + m % T; };
  if (sp.rope_dims > 0) {
    // theta = position * scale * inv_freq in float32, as MLX's rope
    const int half = sp.rope_dims / 2;
    const float* inv = floats(kInvFreq);
    std::vector<float> cs(half), sn(half);
    for (int64_t m = 0; m < M; ++m) {
      if (m == 0 || positions || T > 1) {
        const float p = static_cast<float>(position(m)) * sp.rope_scale;
        for (int i = 0; i < half; ++i) {
          cs[i] = std::cos(p * inv[i]);
          sn[i] = std::sin(p * inv[i]);
        }
      }
      rope_heads(q.data() + m * nq, H, sp, cs, sn);
      rope_heads(k.data() + m * nkv, G, sp, cs, sn);
    }
  }

  // the new positions' keys and values: [B, T, Hkv, hd]
  std::copy(k.begin(), k.end(), k_out);
  std::copy(v.begin(), v.end(), v_out);
  const float* kc = floats(kKCache);  // [B, Hkv, cap, hd]
  const float* vc = floats(kVCache);

  // attention of row m (position p) over columns [start, p]: the cached ones before its sequence's
  // first new position p0, then the new ones p0 .. p, one (row, head) at a time; start: the
  // window's first column
  int64_t longest = 1;
  for (int64_t m = 0; m < M; ++m)
    longest = std::max(longest, std::min<int64_t>(position(m) + 1, sp.window > 0 ? sp.window : cap));
  const size_t head_grain =
      static_cast<size_t>(std::max<int64_t>(1, kGrainWork / std::max<int64_t>(2 * longest * hd, 1)));
  metalnn_native::parallel_for(static_cast<size_t>(M * H), head_grain, [&](size_t a, size_t b) {
    std::vector<float> s(static_cast<size_t>(longest));
    for (size_t mh = a; mh < b; ++mh) {
      const int64_t m = static_cast<int64_t>(mh) / H, hh = static_cast<int64_t>(mh) % H, g = hh / rep;
      const int64_t b = m / T, t = m % T, p0 = first_position(b), pm = p0 + t;
      const int64_t start = sp.window > 0 ? std::max<int64_t>(0, pm - sp.window + 1) : 0;
      const int64_t cached = std::max<int64_t>(0, p0 - start), first_new = std::max<int64_t>(0, start - p0);
      const int64_t new_row = b * T + first_new;  // (the first new position in the window)
      const metalnn_decode::HeadAttention head{q.data() + (m * H + hh) * hd,
                                               kc + ((b * G + g) * cap + start) * hd,
                                               vc + ((b * G + g) * cap + start) * hd,
                                               k.data() + (new_row * G + g) * hd,
                                               v.data() + (new_row * G + g) * hd,
                                               cached + t - first_new + 1,
                                               hd,
                                               sp.attn_scale,
                                               cached,
                                               nkv};
      metalnn_decode::attend_head(head, s.data(), att.data() + (m * H + hh) * hd);
    }
  });

  // output projection and residual
  prepare(kO, att.data(), nq, h.data());
  run_products({&proj[kO]}, nq, M);
  if (sp.bias[kO]) add_bias(h.data(), bias(kO), M, D);
  for (int64_t i = 0; i < M * D; ++i) h[i] += x[i];

  // feed-forward and residual
  rms_norm_rows(h.data(), floats(kGain2), sp.eps, M, D, n1.data());
  prepare(kGate, n1.data(), D, gate.data());
  prepare(kUp, n1.data(), D, up.data());
  run_products({&proj[kGate], &proj[kUp]}, D, M);
  if (sp.bias[kGate]) add_bias(gate.data(), bias(kGate), M, I);
  if (sp.bias[kUp]) add_bias(up.data(), bias(kUp), M, I);
  metalnn_fastmath::unary_kernel(sp.gelu ? metalnn_fastmath::Kind::GeluTanh : metalnn_fastmath::Kind::Silu,
                                 gate.data(), gate.data(), static_cast<size_t>(M * I));
  for (int64_t i = 0; i < M * I; ++i) gate[i] *= up[i];
  prepare(kDown, gate.data(), I, y);
  run_products({&proj[kDown]}, I, M);
  if (sp.bias[kDown]) add_bias(y, bias(kDown), M, D);
  for (int64_t i = 0; i < M * D; ++i) y[i] += h[i];
}

// Every input as a row-major buffer: its own memory, or a copy kept in `copies` when strided.
struct RowMajorInputs {
  std::vector<std::vector<float>> float_copies;
  std::vector<std::vector<uint8_t>> byte_copies;
  std::vector<std::vector<int32_t>> int_copies;
  std::vector<const void*> data;

  explicit RowMajorInputs(const std::vector<mx::array>& in)
      : float_copies(in.size()), byte_copies(in.size()), int_copies(in.size()), data(in.size(), nullptr) {
    for (size_t i = 0; i < in.size(); ++i) {
      if (in[i].dtype() == mx::uint8) {
        data[i] = metalnn_native::contiguous_data<uint8_t>(in[i], byte_copies[i]);
      } else if (in[i].dtype() == mx::int32 || in[i].dtype() == mx::uint32) {  // (token ids: read as int32)
        data[i] = metalnn_native::contiguous_data<int32_t>(in[i], int_copies[i]);
      } else {
        data[i] = metalnn_native::contiguous_data<float>(in[i], float_copies[i]);
      }
    }
  }
};

// A block's sizes from its inputs in the layout of `Input` (x [B, 1, D], caches [B, Hkv, cap, hd]).
BlockShape block_shape(const mx::array& x, const mx::array& up_weight, const mx::array& keys) {
  const int64_t D = x.shape(-1);
  return BlockShape{static_cast<int64_t>(x.size()) / D, D, up_weight.shape(0), keys.shape(2)};
}

std::array<int64_t, kProjections> weight_rows(const std::vector<mx::array>& in, size_t first_weight) {
  std::array<int64_t, kProjections> rows{};
  for (int p = 0; p < kProjections; ++p) rows[p] = in[first_weight + p].shape(0);
  return rows;
}

// Allocates every output and hands the inputs and outputs to the CPU stream's encoder; returns
// weak copies of both for the dispatched task.
std::pair<std::vector<mx::array>, std::vector<mx::array>> encode(mx::cpu::CommandEncoder& enc,
                                                                 const std::vector<mx::array>& inputs,
                                                                 std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  for (const auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  std::vector<mx::array> in, out;
  for (const auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
  for (const auto& a : outputs) out.push_back(mx::array::unsafe_weak_copy(a));
  return {std::move(in), std::move(out)};
}

// What the decoding primitives share: they run on the CPU only and have no gradient.
class DecodingPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("[") + name() + "] has no GPU implementation");
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>&, const std::vector<int>&,
                             const std::vector<mx::array>&) override {
    throw std::invalid_argument(std::string("[") + name() +
                                "] is for decoding only and has no gradient; differentiate the model without a cache");
  }
};

class DecoderBlockStep : public DecodingPrimitive {
 public:
  DecoderBlockStep(mx::Stream s, BlockSpec sp) : DecodingPrimitive(s), sp_(sp) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    auto [in, out] = encode(enc, inputs, outputs);
    enc.dispatch([in = std::move(in), out = std::move(out), sp = sp_]() mutable {
      if (in[kX].size() == 0) return;
      const RowMajorInputs rm(in);
      run_block(sp, rm.data, weight_rows(in, kWeights), block_shape(in[kX], in[kWeights + kUp], in[kKCache]),
                out[0].data<float>(), out[1].data<float>(), out[2].data<float>());
    });
  }

  METALNN_PRIMITIVE("DecoderBlockStep", sp_)

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& kc = inputs[kKCache];
    return {inputs[kX].shape(), {kc.shape(0), kc.shape(1), 1, kc.shape(3)}, {kc.shape(0), kc.shape(1), 1, kc.shape(3)}};
  }

 private:
  BlockSpec sp_;
};

// The parameters of a run of blocks (everything but x, the caches and the positions), checked, made
// row-contiguous and laid out once: the stack step's node then has only x, the positions and the
// caches as inputs (a step's graph, its dispatch and its checks are then the same size whatever the
// model's parameter count: ~300 parameter inputs made the graph's traversal and encoding alone
// ~1 ms a token for a 30-block model on the thread that also builds the next step).
struct StackParams {
  std::vector<BlockSpec> specs;                // offset and row_positions: set per step
  std::vector<mx::array> arrays;               // held for the steps that read them
  std::vector<std::vector<const void*>> data;  // block b's inputs in the layout of `Input` (x, caches, positions: null)
  std::vector<std::array<int64_t, kProjections>> rows;
  int D = 0;
  // The final RMSNorm and output head after the last block (head_rows 0: none, the step outputs the
  // last block's output): gain [D] and epsilon, weight [head_rows, D] of GGML type head_type (-1:
  // float32). With them the step outputs logits [B, T, head_rows] (or each sequence's last: [B, 1, ...]).
  const float* head_gain = nullptr;
  const void* head_weight = nullptr;
  int head_type = -1;
  int64_t head_rows = 0;
  float head_eps = 0.0f;
  // The token table before the first block (embed_rows 0: none, the step's input is x [B, T, D]):
  // [embed_rows, D] of GGML type embed_type (-1: float32), its rows multiplied by embed_scale. With
  // it the step's input is token ids [B, T] (int32 or uint32; an id outside the table reads its
  // nearest row: the step never reads outside the table).
  const void* embed_weight = nullptr;
  int embed_type = -1;
  int64_t embed_rows = 0;
  float embed_scale = 1.0f;
  bool embed_scaled = false;

  // The step's output for x (or token ids) `in` [B, T(, D)]: logits [B, T, head_rows] ([B, 1,
  // head_rows] with last_only: each sequence's last position's), else the last block's [B, T, D].
  mx::Shape output_shape(const mx::Shape& in, bool last_only) const {
    if (head_rows) return {in[0], last_only ? 1 : in[1], static_cast<int>(head_rows)};
    return embed_rows ? mx::Shape{in[0], in[1], D} : in;
  }

  // x [M, D]: rows `ids` of the table (scaled).
  void embed(const int32_t* ids, int64_t M, float* x) const {
    const bool avx2 = gg::use_avx2();
    const gg::TypeInfo* t = embed_type >= 0 ? gg::find_type(embed_type) : nullptr;
    const int64_t row_bytes = t ? D / t->block * t->size : D * int64_t(sizeof(float));
    for (int64_t m = 0; m < M; ++m) {
      const int64_t id = std::clamp<int64_t>(ids[m], 0, embed_rows - 1);
      const uint8_t* row = static_cast<const uint8_t*>(embed_weight) + id * row_bytes;
      float* out = x + m * D;
      if (t) {
        gg::dequantize_rows(*t, row, D, out, 0, 1, avx2);
      } else {
        std::copy(reinterpret_cast<const float*>(row), reinterpret_cast<const float*>(row) + D, out);
      }
      if (embed_scaled)
        for (int64_t i = 0; i < D; ++i) out[i] *= embed_scale;
    }
  }

  int packed_size(int rows) const {  // rows: B * T
    int n = 0;
    for (const auto& sp : specs) n += 2 * rows * sp.kv_heads * sp.head_dim;
    return n;
  }
};

// A run of blocks, each as `DecoderBlockStep`, one after another for T new positions a sequence
// (one when decoding; a prompt's rest or draft tokens to verify): outputs the last block's output
// [B, T, D] (or, with a head, the logits [B, T, V] of the final norm and head after it; [B, 1, V],
// each sequence's last position's, with last_only) and every block's new keys and values, packed
// float32 [sum over blocks of 2 * B * T * Hkv * hd] (block b's keys, then its values, each
// [B, T, Hkv, hd]), which `CacheColumnWrite` puts into the stack's cache. One graph node and one
// task for the whole stack; its inputs are [x (or, with a token table, the token ids [B, T]),
// positions (with row_positions), the stack's cache [blocks, 2, B, Hkv, cap, hd]].
class DecoderStackStep : public DecodingPrimitive {
 public:
  DecoderStackStep(mx::Stream s, std::shared_ptr<const StackParams> params, int offset, bool row_positions,
                   bool last_only)
      : DecodingPrimitive(s),
        params_(std::move(params)),
        offset_(offset),
        row_positions_(row_positions),
        last_only_(last_only) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    auto [in, out] = encode(enc, inputs, outputs);
    enc.dispatch([in = std::move(in), out = std::move(out), p = params_, offset = offset_,
                  row_positions = row_positions_, last_only = last_only_]() mutable {
      if (in[kX].size() == 0) return;
      const mx::array& cache = in.back();
      const RowMajorInputs rm(in);
      const float* slabs = static_cast<const float*>(rm.data.back());
      const int64_t slab = static_cast<int64_t>(cache.size()) / std::max<int64_t>(1, 2 * cache.shape(0));
      const int64_t D = p->D, B = in[kX].shape(0), T = in[kX].shape(1), M = B * T;
      std::vector<float> ping(static_cast<size_t>(M * D)), pong(static_cast<size_t>(M * D)), embedded;
      const float* x = static_cast<const float*>(rm.data[kX]);
      if (p->embed_rows) {
        embedded.resize(static_cast<size_t>(M * D));
        p->embed(static_cast<const int32_t*>(rm.data[kX]), M, embedded.data());
        x = embedded.data();
      }
      float* packed = out[1].data<float>();
      for (size_t b = 0; b < p->specs.size(); ++b) {
        BlockSpec sp = p->specs[b];
        sp.offset = offset;
        sp.row_positions = row_positions;
        sp.new_positions = static_cast<int>(T);
        std::vector<const void*> data = p->data[b];
        data[kX] = x;
        data[kKCache] = slabs + 2 * b * slab;
        data[kVCache] = slabs + (2 * b + 1) * slab;
        if (row_positions) data[sp.positions_input()] = rm.data[1];
        const auto& rows = p->rows[b];
        const BlockShape shape{M, D, rows[kUp], cache.shape(4)};
        const bool last = b + 1 == p->specs.size() && p->head_rows == 0;  // (y: the output)
        float* y = last ? out[0].data<float>() : (b % 2 ? pong.data() : ping.data());
        const int64_t kv = M * sp.kv_heads * sp.head_dim;
        run_block(sp, data, rows, shape, y, packed, packed + kv);
        packed += 2 * kv;
        x = y;
      }
      if (p->head_rows) {  // the final norm and the output head (on each sequence's last row)
        std::vector<float> lasts;
        int64_t rows = M;
        if (last_only && T > 1) {
          lasts.resize(static_cast<size_t>(B * D));
          for (int64_t b = 0; b < B; ++b) std::copy(x + ((b + 1) * T - 1) * D, x + (b + 1) * T * D, &lasts[b * D]);
          x = lasts.data();
          rows = B;
        }
        std::vector<float> normed(static_cast<size_t>(rows * D));
        metalnn_train_ops::rms_norm_rows(x, p->head_gain, normed.data(), static_cast<size_t>(rows), D, p->head_eps);
        ProjectionProduct head;
        head.prepare(p->head_weight, p->head_rows, p->head_type, normed.data(), rows, D, out[0].data<float>());
        run_products({&head}, D, rows);
      }
    });
  }

  METALNN_PRIMITIVE("DecoderStackStep", params_, offset_, row_positions_, last_only_)

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& x = inputs[kX];
    return {params_->output_shape(x.shape(), last_only_), {params_->packed_size(x.shape(0) * x.shape(1))}};
  }

 private:
  std::shared_ptr<const StackParams> params_;
  int offset_;
  bool row_positions_;
  bool last_only_;
};

// A cache write's output and encoding: `out` takes the cache's (inputs[0]) buffer when `in_place`,
// else a new one; returns the inputs for the task, which calls `start_write` first.
std::vector<mx::array> encode_cache_write(mx::cpu::CommandEncoder& enc, const std::vector<mx::array>& inputs,
                                          mx::array& out, bool in_place) {
  if (in_place) {
    out.copy_shared_buffer(inputs[0]);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  std::vector<mx::array> in;
  for (const auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
  return in;
}

// In the task: the output's buffer, the cache copied into it first unless written in place.
float* start_write(const mx::array& cache, mx::array& out, bool in_place) {
  float* dst = out.data<float>();
  if (!in_place) {
    std::vector<float> keep;
    const float* src = metalnn_native::contiguous_data<float>(cache, keep);
    std::copy(src, src + cache.size(), dst);
  }
  return dst;
}

// The stack's cache [blocks, 2, B, Hkv, cap, hd] with T new columns written in every block's keys
// and values: each sequence's keys (or values) [T, Hkv, hd], taken from `packed` (the stack step's
// second output: block b's keys [B, T, Hkv, hd], then its values), at columns `offset` .. offset + T
// (or, with row_positions, from the sequence's own position, clamped to the buffer as the step
// clamps it). Writes in place when MLX may hand the output the cache's buffer (nothing else holds
// it), else into a copy.
class CacheColumnWrite : public DecodingPrimitive {
 public:
  CacheColumnWrite(mx::Stream s, int offset, bool row_positions, int columns)
      : DecodingPrimitive(s), offset_(offset), row_positions_(row_positions), columns_(columns) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    const mx::array& cache = inputs[0];
    mx::array& out = outputs[0];
    const bool in_place = cache.is_donatable() && cache.flags().row_contiguous;
    auto in = encode_cache_write(enc, inputs, out, in_place);
    enc.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(out), in_place, offset = offset_,
                  row_positions = row_positions_, T = int64_t(columns_)]() mutable {
      const mx::array& c = in[0];
      float* dst = start_write(c, out, in_place);
      const int64_t slabs = int64_t(c.shape(0)) * c.shape(1), B = c.shape(2), G = c.shape(3), cap = c.shape(4),
                    hd = c.shape(5);
      if (cap == 0) return;
      const float* rows = in[1].data<float>();
      const int32_t* positions = row_positions ? in[2].data<int32_t>() : nullptr;
      if (T > cap) return;
      for (int64_t i = 0; i < slabs; ++i, rows += B * T * G * hd, dst += B * G * cap * hd) {
        for (int64_t b = 0; b < B; ++b) {
          const int64_t first = std::clamp<int64_t>(positions ? positions[b] : offset, 0, cap - T);
          for (int64_t t = 0; t < T; ++t)
            for (int64_t g = 0; g < G; ++g) {
              const float* row = rows + ((b * T + t) * G + g) * hd;
              std::copy(row, row + hd, dst + ((b * G + g) * cap + first + t) * hd);
            }
        }
      }
    });
  }

  METALNN_PRIMITIVE("CacheColumnWrite", offset_, row_positions_, columns_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)

 private:
  int offset_;
  bool row_positions_;
  int columns_;
};

// The stack's cache [blocks, 2, B, Hkv, cap, hd] with block `slot`'s keys and values [B, Hkv, T, hd]
// (inputs 1 and 2) written at columns start .. start + T: several positions at once (a prompt's
// rest, draft tokens to verify), block after block as the stack's attention layers run. Always in
// place in a row-contiguous buffer that owns its memory, the `StackCache`'s: the readers of the
// buffer before this write (the earlier blocks' attention over their own slots) are tasks queued on
// this stream before it, so they read first, and MLX's donation test cannot be asked instead: it
// fails while the stream thread has not yet released an earlier reader's buffers, so it depends on
// timing and would copy the whole stack's cache for every block when it fails.
class StackColumnsWrite : public DecodingPrimitive {
 public:
  StackColumnsWrite(mx::Stream s, int slot, int start) : DecodingPrimitive(s), slot_(slot), start_(start) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    const mx::array& cache = inputs[0];
    mx::array& out = outputs[0];
    // (the whole buffer, not a view into another array's, and memory MLX allocated)
    const bool in_place = cache.flags().row_contiguous && cache.data_size() == cache.size() &&
                          cache.data_shared_ptr()->is_owned() && cache.data<void>() == cache.buffer().raw_ptr();
    auto in = encode_cache_write(enc, inputs, out, in_place);
    enc.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(out), in_place, slot = slot_,
                  start = start_]() mutable {
      const mx::array& c = in[0];
      float* dst = start_write(c, out, in_place);
      const int64_t B = c.shape(2), G = c.shape(3), cap = c.shape(4), hd = c.shape(5), T = in[1].shape(2);
      for (int kv = 0; kv < 2; ++kv) {
        std::vector<float> keep;
        const float* rows = metalnn_native::contiguous_data<float>(in[1 + kv], keep);
        float* slab = dst + (int64_t(slot) * 2 + kv) * B * G * cap * hd;
        for (int64_t bg = 0; bg < B * G; ++bg)
          std::copy(rows + bg * T * hd, rows + (bg + 1) * T * hd, slab + (bg * cap + start) * hd);
      }
    });
  }

  METALNN_PRIMITIVE("StackColumnsWrite", slot_, start_)
  METALNN_OUTPUTS_SHAPED_LIKE_INPUT(0, 1)

 private:
  int slot_;
  int start_;
};

[[noreturn]] void refuse(const std::string& what) {
  throw std::invalid_argument("[decoder_block_step] " + what);
}

template <class T>
std::string shape_str(const T& shape) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << (shape.size() == 1 ? ",)" : ")");
  return s.str();
}

void expect(const mx::array& a, const char* name, std::initializer_list<int> shape, mx::Dtype dtype) {
  const mx::Shape want(shape);
  if (a.shape() != want || a.dtype() != dtype) {
    std::ostringstream msg;
    msg << name << " must be " << dtype << " of shape " << shape_str(want) << ", got " << a.dtype() << " of shape "
        << shape_str(a.shape());
    refuse(msg.str());
  }
}

// A weight [N, K] as the projection's type stores it (packed rows of blocks, or float32).
void expect_weight(const mx::array& w, const char* name, int type, int64_t N, int64_t K) {
  if (type < 0) {
    expect(w, name, {static_cast<int>(N), static_cast<int>(K)}, mx::float32);
    return;
  }
  const gg::TypeInfo* t = gg::find_type(type);
  if (t == nullptr) refuse(std::string(name) + ": GGML type id " + std::to_string(type) + " has no native kernel");
  if (K % t->block) refuse(std::string(name) + ": width " + std::to_string(K) + " is not whole " + t->name + " blocks");
  expect(w, name, {static_cast<int>(N), static_cast<int>(K / t->block * t->size)}, mx::uint8);
}

void check_spec(const BlockSpec& sp) {
  if (sp.heads <= 0 || sp.kv_heads <= 0 || sp.heads % sp.kv_heads || sp.head_dim <= 0)
    refuse("heads must be a positive multiple of kv_heads, head_dim positive");
  if (sp.rope_dims < 0 || sp.rope_dims % 2 || sp.rope_dims > sp.head_dim)
    refuse("rope_dims must be even and at most head_dim, got " + std::to_string(sp.rope_dims));
}

// Checks a block's parameters for width D; `at(i)` is input i of the layout of `Input`.
template <class At>
void check_block_params(const BlockSpec& sp, const At& at, int D) {
  const int hd = sp.head_dim;
  const int nq = sp.heads * hd, nkv = sp.kv_heads * hd;
  const int I = at(kWeights + kUp).ndim() == 2 ? at(kWeights + kUp).shape(0) : 0;
  expect(at(kGain1), "input_layernorm gain", {D}, mx::float32);
  expect(at(kGain2), "post_attention_layernorm gain", {D}, mx::float32);
  const std::array<std::array<int64_t, 2>, kProjections> dims = {{{nq, D}, {nkv, D}, {nkv, D}, {D, nq}, {I, D},
                                                                  {I, D}, {D, I}}};
  for (int p = 0; p < kProjections; ++p) {
    expect_weight(at(kWeights + p), kProjectionNames[p], sp.types[p], dims[p][0], dims[p][1]);
    if (sp.bias[p]) expect(at(sp.bias_input(p)), kProjectionNames[p], {static_cast<int>(dims[p][0])}, mx::float32);
  }
  expect(at(kInvFreq), "inv_freq", {sp.rope_dims / 2}, mx::float32);
  if (sp.qk_norm) {
    expect(at(sp.qk_norm_input()), "q_norm gain", {hd}, mx::float32);
    expect(at(sp.qk_norm_input() + 1), "k_norm gain", {hd}, mx::float32);
  }
}

// Checks x [B, 1, D]; returns D.
int check_x(const mx::array& x) {
  if (x.ndim() != 3 || x.shape(1) != 1 || x.dtype() != mx::float32)
    refuse("x must be float32 [B, 1, D] (one new position a sequence), got " + shape_str(x.shape()));
  return x.shape(2);
}

// Checks what changes from step to step: the caches (for x's batch), the offset and the positions.
template <class At>
void check_block_state(const BlockSpec& sp, const At& at) {
  const int B = at(kX).shape(0), hd = sp.head_dim;
  const auto& kc = at(kKCache);
  if (kc.ndim() != 4 || kc.shape(0) != B || kc.shape(1) != sp.kv_heads || kc.shape(3) != hd || kc.dtype() != mx::float32)
    refuse("the key cache must be float32 [" + std::to_string(B) + ", " + std::to_string(sp.kv_heads) +
           ", capacity, " + std::to_string(hd) + "], got " + shape_str(kc.shape()));
  expect(at(kVCache), "the value cache", {kc.shape(0), kc.shape(1), kc.shape(2), kc.shape(3)}, mx::float32);
  if (sp.offset < 0 || sp.offset >= kc.shape(2))
    refuse("offset " + std::to_string(sp.offset) + " is outside the cache capacity " + std::to_string(kc.shape(2)));
  // (the positions' values are checked when the step runs: they are not known before)
  if (sp.row_positions) expect(at(sp.positions_input()), "positions", {B}, mx::int32);
}

// Checks a block's inputs; `at(i)` is input i of the layout of `Input`.
template <class At>
void check_block_inputs(const BlockSpec& sp, const At& at) {
  check_block_params(sp, at, check_x(at(kX)));
  check_block_state(sp, at);
}

// "[decoder_block_step] what" as "[decoder_block_step] block b: what".
[[noreturn]] void refuse_in_block(size_t b, const std::invalid_argument& e) {
  refuse("block " + std::to_string(b) + ": " + std::string(e.what()).substr(std::string("[decoder_block_step] ").size()));
}

std::vector<mx::array> decoder_block_step_op(const std::vector<mx::array>& inputs, const BlockSpec& sp,
                                             mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (s.device != mx::Device::cpu) refuse("runs on CPU streams only");
  check_spec(sp);
  if (static_cast<int>(inputs.size()) != sp.num_inputs())
    refuse("expected " + std::to_string(sp.num_inputs()) + " input arrays for these options, got " +
           std::to_string(inputs.size()));
  check_block_inputs(sp, [&](int i) -> const mx::array& { return inputs[i]; });
  const auto& x = inputs[kX];
  const auto& kc = inputs[kKCache];
  const mx::Shape row = {kc.shape(0), kc.shape(1), 1, kc.shape(3)};
  return mx::array::make_arrays({x.shape(), row, row}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<DecoderBlockStep>(s, sp), inputs);
}

// A run of blocks' parameters: per block, in the layout of `Input` without x, the caches and the
// positions: the two gains, the seven weights, inv_freq, the biases, the q and k norm gains.
// With a head (see `StackParams`): its norm gain, weight, GGML type and epsilon.
struct HeadArgs {
  mx::array gain, weight;
  int type;
  float eps;
};

// With a token table (see `StackParams`): the table, its GGML type and the scale of its rows.
struct EmbedArgs {
  mx::array weight;
  int type;
  std::optional<float> scale;
};

std::shared_ptr<StackParams> make_stack_params(std::vector<mx::array> params, std::vector<BlockSpec> specs,
                                               const std::optional<HeadArgs>& head,
                                               const std::optional<EmbedArgs>& embed) {
  if (specs.empty()) refuse("a stack step needs at least one block");
  size_t want = 0;
  for (auto& sp : specs) {
    check_spec(sp);
    sp.row_positions = true;  // (the layout has room for the positions; each step sets its own)
    want += static_cast<size_t>(sp.num_inputs() - 4);  // (all but x, the two caches and the positions)
  }
  if (params.size() != want)
    refuse("expected " + std::to_string(want) + " parameter arrays for these blocks, got " + std::to_string(params.size()));
  if (head) {
    params.push_back(head->gain);
    params.push_back(head->weight);
  }
  if (embed) params.push_back(embed->weight);
  mx::eval(params);
  for (auto& a : params) {
    if (!a.flags().row_contiguous) {
      a = mx::contiguous(a);
      mx::eval(a);
    }
  }
  auto made = std::make_shared<StackParams>();
  StackParams& out = *made;
  out.D = params[0].ndim() == 1 ? params[0].shape(0) : 0;
  size_t at = 0;
  for (size_t b = 0; b < specs.size(); ++b) {
    const BlockSpec& sp = specs[b];
    std::vector<const mx::array*> slots(static_cast<size_t>(sp.num_inputs()), nullptr);
    for (int i = 1; i < sp.num_inputs(); ++i) {
      if (i == kKCache || i == kVCache || i == sp.positions_input()) continue;
      slots[i] = &params[at++];
    }
    try {
      check_block_params(sp, [&](int i) -> const mx::array& { return *slots[i]; }, out.D);
    } catch (const std::invalid_argument& e) {
      refuse_in_block(b, e);
    }
    std::vector<const void*> data(slots.size(), nullptr);
    for (size_t i = 0; i < slots.size(); ++i)
      if (slots[i] != nullptr) data[i] = slots[i]->data<uint8_t>();
    std::array<int64_t, kProjections> rows{};
    for (int p = 0; p < kProjections; ++p) rows[p] = slots[kWeights + p]->shape(0);
    out.data.push_back(std::move(data));
    out.rows.push_back(rows);
  }
  if (head) {
    const mx::array& gain = params[at];
    const mx::array& weight = params[at + 1];
    const int64_t V = weight.ndim() == 2 ? weight.shape(0) : 0;
    expect(gain, "the final norm's gain", {out.D}, mx::float32);
    if (V <= 0) refuse("the output head must be a matrix [vocab, " + std::to_string(out.D) + "], got " + shape_str(weight.shape()));
    expect_weight(weight, "the output head", head->type, V, out.D);
    out.head_gain = gain.data<float>();
    out.head_weight = weight.data<uint8_t>();
    out.head_type = head->type;
    out.head_rows = V;
    out.head_eps = head->eps;
    at += 2;
  }
  if (embed) {
    const mx::array& table = params[at];
    const int64_t V = table.ndim() == 2 ? table.shape(0) : 0;
    if (V <= 0) refuse("the token table must be a matrix [vocab, " + std::to_string(out.D) + "], got " + shape_str(table.shape()));
    expect_weight(table, "the token table", embed->type, V, out.D);
    out.embed_weight = table.data<uint8_t>();
    out.embed_type = embed->type;
    out.embed_rows = V;
    out.embed_scaled = embed->scale.has_value();
    out.embed_scale = embed->scale.value_or(1.0f);
  }
  out.specs = std::move(specs);
  out.arrays = std::move(params);
  return made;
}

// What Python holds of a `StackParams` (the steps' nodes share it).
struct StackParamsHandle {
  std::shared_ptr<const StackParams> params;
};

// The stack step and its cache write: [out, the stack's cache with the new positions written] (see
// `DecoderStackStep`); x: [B, T, D] (token ids [B, T] with a table); cache: [blocks, 2, B, Hkv,
// capacity, head_dim], every block's keys and values.
std::vector<mx::array> decoder_stack_step_op(const mx::array& x, const std::optional<mx::array>& positions,
                                             const mx::array& cache, const std::shared_ptr<const StackParams>& params,
                                             int offset, bool last_only, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (s.device != mx::Device::cpu) refuse("runs on CPU streams only");
  const bool row_positions = positions.has_value();
  const size_t n = params->specs.size();
  if (params->embed_rows) {
    if (x.ndim() != 2 || x.shape(1) < 1 || (x.dtype() != mx::int32 && x.dtype() != mx::uint32))
      refuse("the token ids must be int32 or uint32 [B, T] (T >= 1 new positions a sequence), got " +
             shape_str(x.shape()));
  } else if (x.ndim() != 3 || x.shape(1) < 1 || x.shape(2) != params->D || x.dtype() != mx::float32) {
    refuse("x must be float32 [B, T, " + std::to_string(params->D) + "] (T >= 1 new positions a sequence), got " +
           shape_str(x.shape()));
  }
  const int T = x.shape(1);
  const int B = x.shape(0), G = params->specs[0].kv_heads, hd = params->specs[0].head_dim;
  for (size_t b = 1; b < n; ++b)
    if (params->specs[b].kv_heads != G || params->specs[b].head_dim != hd)
      refuse("block " + std::to_string(b) + ": kv_heads " + std::to_string(params->specs[b].kv_heads) +
             " and head_dim " + std::to_string(params->specs[b].head_dim) + " differ from block 0's (" +
             std::to_string(G) + ", " + std::to_string(hd) + "): the stack's cache needs one layout");
  if (cache.ndim() != 6 || cache.shape(0) != static_cast<int>(n) || cache.shape(1) != 2 || cache.shape(2) != B ||
      cache.shape(3) != G || cache.shape(5) != hd || cache.dtype() != mx::float32)
    refuse("the cache must be float32 [" + std::to_string(n) + ", 2, " + std::to_string(B) + ", " +
           std::to_string(G) + ", capacity, " + std::to_string(hd) + "] (blocks, keys and values, batch, kv_heads, "
           "capacity, head_dim), got " + std::string(cache.dtype() == mx::float32 ? "" : "a non-float32 array ") +
           shape_str(cache.shape()));
  if (offset < 0 || offset + T > cache.shape(4))
    refuse("positions " + std::to_string(offset) + " .. " + std::to_string(offset + T - 1) +
           " are outside the cache capacity " + std::to_string(cache.shape(4)));
  if (row_positions) expect(*positions, "positions", {B}, mx::int32);
  std::vector<mx::array> inputs = {x};
  if (row_positions) inputs.push_back(*positions);
  inputs.push_back(cache);
  auto outs = mx::array::make_arrays({params->output_shape(x.shape(), last_only), {params->packed_size(B * T)}},
                                     {mx::float32, mx::float32},
                                     std::make_shared<DecoderStackStep>(s, params, offset, row_positions, last_only),
                                     inputs);
  std::vector<mx::array> write_inputs = {cache, outs[1]};
  if (row_positions) write_inputs.push_back(*positions);
  mx::array written(cache.shape(), mx::float32, std::make_shared<CacheColumnWrite>(s, offset, row_positions, T),
                    std::move(write_inputs));
  return {outs[0], written};
}

// The stack's cache with block `slot`'s keys and values [B, Hkv, T, hd] written at columns
// start .. start + T (see `StackColumnsWrite`).
mx::array stack_columns_write_op(const mx::array& cache, const mx::array& keys, const mx::array& values, int slot,
                                 int start, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  auto fail = [](const std::string& what) { throw std::invalid_argument("[stack_columns_write] " + what); };
  if (s.device != mx::Device::cpu) fail("runs on CPU streams only");
  if (cache.ndim() != 6 || cache.shape(1) != 2 || cache.dtype() != mx::float32)
    fail("the cache must be float32 [blocks, 2, B, kv_heads, capacity, head_dim], got " + shape_str(cache.shape()));
  if (slot < 0 || slot >= cache.shape(0))
    fail("slot " + std::to_string(slot) + " is outside the cache's " + std::to_string(cache.shape(0)) + " blocks");
  for (const auto* a : {&keys, &values}) {
    const char* name = a == &keys ? "keys" : "values";
    if (a->ndim() != 4 || a->shape(0) != cache.shape(2) || a->shape(1) != cache.shape(3) ||
        a->shape(3) != cache.shape(5) || a->dtype() != mx::float32)
      fail(std::string(name) + " must be float32 [" + std::to_string(cache.shape(2)) + ", " +
           std::to_string(cache.shape(3)) + ", T, " + std::to_string(cache.shape(5)) + "], got " +
           shape_str(a->shape()));
  }
  if (keys.shape(2) != values.shape(2)) fail("keys and values hold different numbers of positions");
  if (start < 0 || start + keys.shape(2) > cache.shape(4))
    fail("columns " + std::to_string(start) + " .. " + std::to_string(start + keys.shape(2)) +
         " are outside the cache capacity " + std::to_string(cache.shape(4)));
  return mx::array(cache.shape(), mx::float32, std::make_shared<StackColumnsWrite>(s, slot, start),
                   {cache, keys, values});
}

// Integers and floats of a BlockSpec as the Python side lists them (see `register_decode_step`).
constexpr int kSpecInts = 8 + 2 * kProjections, kSpecFloats = 4;

BlockSpec spec_from(const int* v, const float* f, int offset, bool row_positions) {
  BlockSpec sp;
  sp.heads = v[0];
  sp.kv_heads = v[1];
  sp.head_dim = v[2];
  sp.rope_dims = v[3];
  sp.rope_traditional = v[4] != 0;
  sp.window = std::max(0, v[5]);
  sp.qk_norm = v[6] != 0;
  sp.gelu = v[7] != 0;
  for (int p = 0; p < kProjections; ++p) {
    sp.types[p] = v[8 + p];
    sp.bias[p] = v[8 + kProjections + p] != 0;
  }
  sp.rope_scale = f[0];
  sp.attn_scale = f[1];
  sp.eps = f[2];
  sp.qk_eps = f[3];
  sp.offset = offset;
  sp.row_positions = row_positions;
  return sp;
}

}  // namespace

void register_decode_step(nb::module_& m) {

  m.def(
      "decoder_block_step",
      [](const std::vector<mx::array>& inputs, int heads, int kv_heads, int head_dim, int rope_dims,
         bool rope_traditional, float rope_scale, float attn_scale, float eps, float qk_eps, int window,
         bool qk_norm, bool gelu, const std::vector<int>& types, const std::vector<bool>& bias, int offset,
         bool row_positions, mx::StreamOrDevice s) {
        if (types.size() != kProjections || bias.size() != kProjections)
          refuse("types and bias must list the 7 projections (q, k, v, o, gate, up, down)");
        std::vector<int> v = {heads, kv_heads, head_dim, rope_dims, rope_traditional, window, qk_norm, gelu};
        for (int p = 0; p < kProjections; ++p) v.push_back(types[p]);
        for (int p = 0; p < kProjections; ++p) v.push_back(bias[p]);
        const float f[kSpecFloats] = {rope_scale, attn_scale, eps, qk_eps};
        return decoder_block_step_op(inputs, spec_from(v.data(), f, offset, row_positions), s);
      },
      nb::arg("inputs"),
      nb::kw_only(),
      nb::arg("heads"),
      nb::arg("kv_heads"),
      nb::arg("head_dim"),
      nb::arg("rope_dims"),
      nb::arg("rope_traditional"),
      nb::arg("rope_scale"),
      nb::arg("attn_scale"),
      nb::arg("eps"),
      nb::arg("qk_eps"),
      nb::arg("window"),
      nb::arg("qk_norm"),
      nb::arg("gelu"),
      nb::arg("types"),
      nb::arg("bias"),
      nb::arg("offset"),
      nb::arg("row_positions") = false,
      nb::arg("stream") = nb::none(),
      "One Llama-family decoder block for one new position a sequence: [out, new key, new value] "
      "(see metalnn/cpu/decode_step.py for the inputs).");

  nb::class_<StackParamsHandle>(m, "StackParams",
                          "A run of decoder blocks' parameters for decoder_stack_step, checked and held "
                          "(see metalnn/cpu/decode_step.py).")
      .def(
          "__init__",
          [](StackParamsHandle* self, const std::vector<mx::array>& params, const std::vector<int>& ints,
             const std::vector<float>& floats, std::optional<mx::array> head_gain, std::optional<mx::array> head_weight,
             int head_type, float head_eps, std::optional<mx::array> embed_weight, int embed_type,
             std::optional<float> embed_scale) {
            if (ints.empty() || ints.size() % kSpecInts || floats.size() * kSpecInts != ints.size() * kSpecFloats)
              refuse("ints and floats must hold " + std::to_string(kSpecInts) + " and " +
                     std::to_string(kSpecFloats) + " numbers a block");
            if (head_gain.has_value() != head_weight.has_value())
              refuse("a head needs both head_gain and head_weight");
            std::vector<BlockSpec> specs;
            for (size_t b = 0; b < ints.size() / kSpecInts; ++b)
              specs.push_back(spec_from(ints.data() + b * kSpecInts, floats.data() + b * kSpecFloats, 0, false));
            std::optional<HeadArgs> head;
            if (head_gain) head = HeadArgs{*head_gain, *head_weight, head_type, head_eps};
            std::optional<EmbedArgs> embed;
            if (embed_weight) embed = EmbedArgs{*embed_weight, embed_type, embed_scale};
            new (self) StackParamsHandle{make_stack_params(params, std::move(specs), head, embed)};
          },
          nb::arg("params"), nb::arg("ints"), nb::arg("floats"), nb::kw_only(), nb::arg("head_gain") = nb::none(),
          nb::arg("head_weight") = nb::none(), nb::arg("head_type") = -1, nb::arg("head_eps") = 1e-5f,
          nb::arg("embed_weight") = nb::none(), nb::arg("embed_type") = -1, nb::arg("embed_scale") = nb::none())
      .def("__len__", [](const StackParamsHandle& h) { return h.params->specs.size(); });

  m.def(
      "decoder_stack_step",
      [](const mx::array& x, const mx::array& cache, const StackParamsHandle& params, int offset,
         std::optional<mx::array> positions, bool last_only, mx::StreamOrDevice s) {
        return decoder_stack_step_op(x, positions, cache, params.params, offset, last_only, s);
      },
      nb::arg("x"),
      nb::arg("cache"),
      nb::arg("params"),
      nb::kw_only(),
      nb::arg("offset"),
      nb::arg("positions") = nb::none(),
      nb::arg("last_only") = false,
      nb::arg("stream") = nb::none(),
      "Consecutive decoder blocks, each as decoder_block_step, as one node, and the stack's cache with "
      "the new positions written: [out, cache] (see metalnn/cpu/decode_step.py).");

  m.def("stack_columns_write", &stack_columns_write_op, nb::arg("cache"), nb::arg("keys"), nb::arg("values"),
        nb::kw_only(), nb::arg("slot"), nb::arg("start"), nb::arg("stream") = nb::none(),
        "The stack's cache with block slot's keys and values [B, Hkv, T, head_dim] written at columns "
        "start .. start + T, in place (see metalnn/cpu/decode_step.py).");
}
