#include "runtime/op_executor.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <vector>

#include "kernels/cpu/hash.h"
#include "kernels/cpu/init.h"
#include "runtime/moe_layer.h"
#include "runtime/shard_context.h"

namespace ptdp {
namespace {

// The widest bias any op reads, and the parameter buffer: the largest weight (QKV, FC1, the
// vocabulary shard or the position table) followed by that bias.
int64_t widest_bias(const ShardDims& d) {
  return std::max({d.qkv_width(), d.fc1_width(), d.h});
}
int64_t dense_parameter_elements(const ShardDims& d) {
  // (MLA's projections: the up projections', the down projections')
  return std::max({d.qkv_width() * d.h, d.fc1_width() * d.h, d.vl * d.h, d.s * d.h,
                   d.hl * d.d * std::max(d.ql, d.h), d.kv_up_width() * d.kvl,
                   (d.kv_latent_width() + d.ql) * d.h});
}

// An MoE layer's parameters on this rank (runtime/moe_params.cc), laid out from offset 0 as
// the runtime lays them out; `total` gets their elements. Empty for a dense model.
MoeLayerParams moe_parameters(const ModelSpec& m, const ShardLayout& l, int64_t* total = nullptr) {
  int64_t next = 0;
  MoeLayerParams out;
  if (m.is_moe())
    out = add_moe_parameters(m, l, l.sequence_parallel && l.t > 1, 0, "moe.",
                             [&](const ParamInfo& p, const std::function<void(float*)>&) {
                               const int64_t at = next;
                               next += p.size;
                               return at;
                             });
  if (total) *total = next;
  return out;
}

// The pass an op of the lists runs in, as ShardContext::begin records it.
PassKind pass_of(OpRole role) {
  return role == OpRole::kForward     ? PassKind::kForward
         : role == OpRole::kRecompute ? PassKind::kRecompute
                                      : PassKind::kBackward;
}

// The parameter buffer: the largest dense weight (QKV, FC1, the vocabulary shard or the
// position table) or an MoE layer's weights, whichever is longer, followed by the widest bias.
int64_t parameter_elements_of(const ModelSpec& m, const ShardLayout& l, const ShardDims& d) {
  int64_t moe = 0;
  moe_parameters(m, l, &moe);
  return std::max(dense_parameter_elements(d), moe) + widest_bias(d);
}

}  // namespace

int64_t OpExecutor::parameter_elements(const ModelSpec& m, const ShardLayout& layout) {
  return parameter_elements_of(m, layout, shard_dims(m, layout));
}

// An MoE layer's ops run alone: the runtime's own code (runtime/moe_layer.cc) on inputs made
// once, which it keeps (MoeActs::keep_inputs) so that an op runs many times on the same inputs.
struct MoeRun {
  MoeContext ctx;
  MoeLayerParams W;
  MoeActs A;
  Buffer x, out, d_out, d_x;  // the layer's MLP input and output and their gradients
  Buffer dprob;               // values for A.dprob (host memory), made like the other inputs
  bool routed = false;        // A holds a routing of x (top-k, permutation)
  MoeRun(const ModelSpec& m, const MoeDims& d, DType type)
      : ctx(m, d), x(type), out(type), d_out(type), d_x(type) {
    A.keep_inputs = true;
    // The routed rows take bf16 in a bf16 model, else fp32 (runtime/moe_layer.h); the logits,
    // their gradients and the probabilities' are fp32.
    const DType routed = moe_routed_type(type);
    for (Buffer* b :
         {&A.permuted, &A.x, &A.fc1, &A.act, &A.y, &A.combined, &A.d_y, &A.d_act, &A.d_pre, &A.d_x})
      *b = Buffer(routed);
    for (Buffer* b : {&A.logits, &A.dlogits, &dprob}) *b = Buffer(DType::kF32);
  }
};

struct OpExecutor::State {
  ShardContext ctx;
  DType dtype;    // of weights and activations (the layout's)
  Buffer params;  // one weight of the largest shape any op reads, and a bias
  Buffer grads{DType::kF32};
  FlatMap param_map, grad_map;              // each buffer from offset 0
  Buffer a, b, c, d, e, f;                  // operands (of the layout's type), sized per op
  Buffer m1{DType::kF32}, m2{DType::kF32};  // statistics: mean, rstd, lse, cross-entropy stats
  // A fused attention's own: q, k, v, out, lse, d out, dq, dk, dv; `stats_for` is the size of
  // q for which out and lse hold the forward pass of q, k, v (0: not computed).
  Buffer fq, fk, fv, fo, flse{DType::kF32}, fdo, fdq, fdk, fdv;
  int64_t stats_for = 0;
  std::vector<int32_t> tokens;
  std::unique_ptr<MoeRun> moe;  // made on an MoE op's first run
  const Buffer* input = &a;     // the first operand of the op run last (touch_input)

  State(Backend& be, Communicator* tp, const ShardDims& dims, DType type)
      : ctx(be, tp, dims), dtype(type), params(type) {}

  // Sizes x to n elements of deterministic values spread as a layer's activations are. Filled
  // once per size: a repeated run (ptdp calibrate times many) times the op's kernel, not the
  // making of its inputs; what an earlier op left in a buffer of the same size stays finite.
  //
  // The values are Gaussian with the spread of a projection's output at initialization (weights
  // of standard deviation 0.02 times unit-variance normalized inputs: 0.02 sqrt(h)), in a
  // pseudo-random order. A transcendental kernel's time depends on them: the CPU's tanh (GeLU)
  // took 619 us on an evenly spaced periodic pattern in [-0.5, 0.5) and 1,080 us on the
  // activations of a run (the 4-layer hidden-256 test model at t = 2), the branches of its
  // argument ranges taken at random.
  void fill(Buffer& x, int64_t n) {
    int64_t& done = filled[&x];
    if (done == n && elems(x) == n) return;
    resize(x, n);
    // Made in fp32 on the host, then stored in x's type, in the backend's memory.
    std::vector<float> values(static_cast<size_t>(n));
    const auto spread = static_cast<float>(0.02 * std::sqrt(static_cast<double>(ctx.dims.h)));
    const std::array<float, kNormals>& normal = standard_normals();
    for (int64_t i = 0; i < n; ++i)
      values[static_cast<size_t>(i)] = spread * normal[splitmix64(static_cast<uint64_t>(i)) >> 48];
    upload_floats(ctx.be, values.data(), x.ptr(), n);
    done = n;
  }
  // 2^16 standard normal values, drawn from by a hash of the element's index: 3 ns an element
  // where drawing each afresh took 47 (10 s for the logits of GPT-2 at b = 4).
  static constexpr size_t kNormals = size_t{1} << 16;
  static const std::array<float, kNormals>& standard_normals() {
    static const std::array<float, kNormals> table = [] {
      std::array<float, kNormals> t{};
      for (size_t i = 0; i < kNormals; ++i) t[i] = kernels::hashed_normal(0, 0, i, 1.0);
      return t;
    }();
    return table;
  }
  std::map<const Buffer*, int64_t> filled;
};

OpExecutor::OpExecutor(Backend& backend, Communicator* tensor_group, const ModelSpec& m,
                       const ShardLayout& layout)
    : s_(std::make_unique<State>(backend, tensor_group, shard_dims(m, layout), layout.dtype)),
      model_(m),
      layout_(layout) {
  validate_shard_layout(m, layout);
  const ShardDims& d = s_->ctx.dims;
  s_->fill(s_->params, parameter_elements_of(m, layout, d));
  s_->fill(s_->grads, elems(s_->params));
  s_->param_map.map(0, elems(s_->params), s_->params.ptr());
  s_->grad_map.map(0, elems(s_->grads), s_->grads.ptr());
  s_->ctx.params = &s_->param_map;
  s_->ctx.grads = &s_->grad_map;
  s_->tokens.resize(static_cast<size_t>(d.n_full));
  for (int64_t i = 0; i < d.n_full; ++i)
    s_->tokens[static_cast<size_t>(i)] = static_cast<int32_t>((i * 31) % d.vocab);
}

OpExecutor::~OpExecutor() = default;

void OpExecutor::touch_input() const {
  const Buffer& x = *s_->input;
  if (!x.on_host()) {  // a device: a kernel that reads and writes it back unchanged
    s_->ctx.be.scale(const_cast<Buffer&>(x).ptr(), elems(x), 1.0);
    return;
  }
  uint32_t sum = 0;  // every byte read, whatever the type
  const auto* p = static_cast<const uint8_t*>(x.raw());
  for (size_t i = 0; i < x.bytes(); ++i) sum += p[i];
  volatile uint32_t sink = sum;
  (void)sink;
}

bool OpExecutor::flush_from_caches() const {
  State& S = *s_;
  Backend& be = S.ctx.be;
  for (const Buffer* x : {&S.params, &S.grads, &S.a, &S.b, &S.c, &S.d, &S.e, &S.f, &S.m1, &S.m2,
                          &S.fq, &S.fk, &S.fv, &S.fo, &S.flse, &S.fdo, &S.fdq, &S.fdk, &S.fdv})
    if (!be.flush_from_caches(x->raw(), x->bytes())) return false;
  if (S.moe) {
    MoeRun& M = *S.moe;
    MoeActs& A = M.A;
    for (const Buffer* x :
         {&M.x, &M.out, &M.d_out, &M.d_x, &A.logits, &A.permuted, &A.x, &A.fc1, &A.act, &A.y,
          &A.combined, &A.d_y, &A.d_act, &A.d_pre, &A.d_x, &A.dlogits})
      if (!be.flush_from_caches(x->raw(), x->bytes())) return false;
  }
  return be.flush_from_caches(S.tokens.data(), S.tokens.size() * sizeof(int32_t));
}

void OpExecutor::trace_ops(std::vector<ExecutedOp>* sink) {
  s_->ctx.trace = sink;
}

void OpExecutor::run(const Op& op) {
  State& S = *s_;
  const ActivationDType precision(S.dtype);
  S.input = &S.a;
  if (is_moe_op(op.id)) {
    run_moe(op);
    return;
  }
  ShardContext& c = S.ctx;
  const ShardDims& d = c.dims;
  Backend& be = c.be;
  const int64_t bias = elems(S.params) - widest_bias(d);
  auto gemm = [&] {
    switch (op.role == OpRole::kForward || op.role == OpRole::kRecompute ? 0
            : op.role == OpRole::kWeightGrad                             ? 2
                                                                         : 1) {
      case 0:  // y[m, n] = x[m, k] W[n, k]^T
        S.fill(S.a, op.m * op.k);
        resize(S.b, op.m * op.n);
        c.linear(S.a.ptr(), 0, -1, S.b.ptr(), op.m, op.k, op.n);
        break;
      case 1:  // dx[m, n] = dy[m, k] W[k, n]
        S.fill(S.a, op.m * op.k);
        resize(S.b, op.m * op.n);
        c.linear_dgrad(0, S.a.ptr(), S.b.ptr(), op.m, op.n, op.k);
        break;
      default:  // dW[n, m] += dy[k, n]^T x[k, m]
        S.fill(S.a, op.k * op.m);
        S.fill(S.b, op.k * op.n);
        c.linear_wgrad(S.a.ptr(), S.b.ptr(), 0, -1, op.k, op.m, op.n);
        break;
    }
  };
  c.begin(op.id, pass_of(op.role));
  const int64_t q = d.n_full * d.hl * d.d, kv = d.n_full * d.gl * d.d;
  // The values and the attention's output (narrower than Q and K with MLA).
  const int64_t v = d.n_full * d.gl * d.dv, out = d.n_full * d.hl * d.dv;
  const int64_t scores = d.b * d.hl * d.s * d.s;
  if (op.fused) {
    // A fused (flash) attention, as ptdp run executes it (runtime/transformer_layer.cc): the
    // forward kernel on attn_scores, the backward kernel on attn_scores_recompute, nothing on
    // the other ops of the core (their GEMM shapes are recorded all the same).
    const int64_t lse = d.b * d.hl * d.s;
    S.fill(S.fq, q), S.fill(S.fk, kv), S.fill(S.fv, kv);
    auto forward = [&] {
      resize(S.fo, q), resize(S.flse, lse);
      be.flash_attention_forward(S.fq.ptr(), S.fk.ptr(), S.fv.ptr(), S.fo.ptr(), S.flse.data(), d.b,
                                 d.s, d.s, d.hl, d.gl, d.d);
      S.stats_for = q;
    };
    if (op.id == OpId::kAttnScores) {
      forward();
    } else if (op.id == OpId::kAttnScoresRecompute) {
      if (S.stats_for != q) forward();  // once: the backward needs a real forward's lse
      S.fill(S.fdo, q), resize(S.fdq, q), resize(S.fdk, kv), resize(S.fdv, kv);
      be.flash_attention_backward(S.fq.ptr(), S.fk.ptr(), S.fv.ptr(), S.fo.ptr(), S.flse.data(),
                                  S.fdo.ptr(), S.fdq.ptr(), S.fdk.ptr(), S.fdv.ptr(), d.b, d.s, d.s,
                                  d.hl, d.gl, d.d);
    }
    if (op.kind == OpKind::kGemm) c.gemm_done(op.m, op.n, op.k, op.batch);
    return;
  }
  switch (op.kind) {
    case OpKind::kCollective: {
      // The op's buffer as the op list counts it: the output of an all-gather, the input of a
      // reduce-scatter, the buffer of an all-reduce.
      const int64_t n = static_cast<int64_t>(op.bytes / static_cast<double>(dtype_bytes(op.dtype)));
      // In the op's element type: activations, or fp32 statistics (the cross-entropy's).
      const bool stats = op.dtype != S.dtype;
      Buffer& x = stats ? S.m1 : S.a;
      Buffer& y = stats ? S.m2 : S.b;
      if (op.collective == Collective::kAllReduce) {
        S.fill(x, n);
        c.all_reduce(x);
      } else if (op.collective == Collective::kAllGather) {
        S.fill(x, n / d.t);
        resize(y, n);
        c.all_gather(x.ptr(), y.ptr(), n / d.t);
      } else {
        S.fill(x, n);
        resize(y, n / d.t);
        c.reduce_scatter(x.ptr(), y.ptr(), n / d.t);
      }
      return;
    }
    case OpKind::kGemm:
      switch (op.id) {
        case OpId::kAttnScores:
          S.fill(S.a, q), S.fill(S.b, kv), resize(S.c, scores);
          be.attention_scores(S.a.ptr(), S.b.ptr(), S.c.ptr(), d.b, d.s, d.hl, d.gl, d.d);
          c.gemm_done(d.s, d.s, d.d, d.b * d.hl);
          return;
        case OpId::kAttnContext:
          S.fill(S.a, scores), S.fill(S.b, v), resize(S.c, out);
          be.attention_context(S.a.ptr(), S.b.ptr(), S.c.ptr(), d.b, d.s, d.hl, d.gl, d.dv);
          c.gemm_done(d.s, d.dv, d.s, d.b * d.hl);
          return;
        case OpId::kAttnScoresDq:
        case OpId::kAttnScoresDk:
          S.fill(S.a, q), S.fill(S.b, kv), S.fill(S.c, scores), resize(S.e, q), resize(S.f, kv);
          be.attention_scores_backward(
              S.a.ptr(), S.b.ptr(), S.c.ptr(), op.id == OpId::kAttnScoresDq ? S.e.ptr() : nullptr,
              op.id == OpId::kAttnScoresDk ? S.f.ptr() : nullptr, d.b, d.s, d.hl, d.gl, d.d);
          if (op.id == OpId::kAttnScoresDq)
            c.gemm_done(d.s, d.d, d.s, d.b * d.hl);
          else
            c.gemm_done(d.d, d.s, d.s, d.b * d.hl);
          return;
        case OpId::kAttnContextDprobs:
        case OpId::kAttnContextDv:
          S.fill(S.a, scores), S.fill(S.b, v), S.fill(S.c, out), resize(S.e, scores);
          resize(S.f, v);
          be.attention_context_backward(S.a.ptr(), S.b.ptr(), S.c.ptr(),
                                        op.id == OpId::kAttnContextDprobs ? S.e.ptr() : nullptr,
                                        op.id == OpId::kAttnContextDv ? S.f.ptr() : nullptr, d.b,
                                        d.s, d.hl, d.gl, d.dv);
          if (op.id == OpId::kAttnContextDprobs)
            c.gemm_done(d.s, d.s, d.dv, d.b * d.hl);
          else
            c.gemm_done(d.s, d.dv, d.s, d.b * d.hl);
          return;
        // QKV as the layer runs it (runtime/transformer_layer.cc): the projection with its bias
        // and the split of its output into Q, K and V; backward, the join of dQ, dK and dV
        // before the input gradient, and the bias's gradient beside the weight's. (Timed as bare
        // GEMMs, the three were a third short of a GPT-2-124M run's on an H200: 10-12 us each.)
        case OpId::kQkv:
          if (op.n != d.qkv_width()) break;
          S.fill(S.a, op.m * op.k);
          resize_for_overwrite(S.b, op.m * op.n);
          c.linear(S.a.ptr(), 0, d.qkv_bias ? bias : -1, S.b.ptr(), op.m, op.k, op.n);
          resize_for_overwrite(S.c, op.m * d.hl * d.d);
          resize_for_overwrite(S.e, op.m * d.gl * d.d);
          resize_for_overwrite(S.f, op.m * d.gl * d.d);
          be.split_columns3(S.b.ptr(), S.c.ptr(), S.e.ptr(), S.f.ptr(), op.m, d.hl * d.d,
                            d.gl * d.d, d.gl * d.d);
          return;
        // FC1 as the layer runs it: its bias in the GEMM.
        case OpId::kFc1:
          if (op.n != d.fc1_width() || !d.biases) break;
          S.fill(S.a, op.m * op.k);
          resize_for_overwrite(S.b, op.m * op.n);
          c.linear(S.a.ptr(), 0, bias, S.b.ptr(), op.m, op.k, op.n);
          return;
        case OpId::kQkvDgrad:
          if (op.k != d.qkv_width()) break;
          S.fill(S.c, op.m * d.hl * d.d), S.fill(S.e, op.m * d.gl * d.d);
          S.fill(S.f, op.m * d.gl * d.d);
          S.input = &S.c;
          resize_for_overwrite(S.d, op.m * op.k);
          be.concat_columns3(S.c.ptr(), S.e.ptr(), S.f.ptr(), S.d.ptr(), op.m, d.hl * d.d,
                             d.gl * d.d, d.gl * d.d);
          resize_for_overwrite(S.b, op.m * op.n);
          c.linear_dgrad(0, S.d.ptr(), S.b.ptr(), op.m, op.n, op.k);
          return;
        case OpId::kQkvWgrad:
          if (op.n != d.qkv_width() || !d.qkv_bias) break;
          S.fill(S.a, op.k * op.m);
          S.fill(S.b, op.k * op.n);
          c.linear_wgrad(S.a.ptr(), S.b.ptr(), 0, bias, op.k, op.m, op.n);
          return;
        default:
          break;
      }
      gemm();
      return;
    case OpKind::kMemory:
      break;
  }
  const int64_t rows = d.n_local, ffn = d.n_full * d.ffl;
  const int64_t logits = d.n_full * d.vl, valid = std::min(d.vl, d.vocab - d.v0);
  switch (op.id) {
    case OpId::kInputLayernorm:
    case OpId::kPostAttentionLayernorm:
    case OpId::kFinalLayernorm:
      S.fill(S.a, rows * d.h);
      c.norm_forward(S.a, 0, d.biases ? bias : -1, S.b, S.m1, S.m2, rows);
      return;
    case OpId::kInputLayernormBackward:
    case OpId::kPostAttentionLayernormBackward:
    case OpId::kFinalLayernormBackward:
      S.fill(S.a, rows * d.h), S.fill(S.m1, rows), S.fill(S.m2, rows), S.fill(S.e, rows * d.h);
      // A layer's norms add their input gradient into the residual stream's (the final norm's
      // is the stream's), as the runtime does (runtime/transformer_layer.cc).
      if (op.id != OpId::kFinalLayernormBackward) {
        S.fill(S.b, rows * d.h);
        c.norm_backward_add(S.a, 0, d.biases ? bias : -1, S.m1, S.m2, S.e, S.b, rows);
      } else {
        c.norm_backward(S.a, 0, d.biases ? bias : -1, S.m1, S.m2, S.e, S.f, rows);
      }
      return;
    case OpId::kQkLayernorm: {  // the queries' and keys' norms, d channels a row
      const int64_t heads = d.n_full * (d.hl + d.gl);
      S.fill(S.a, heads * d.d);
      c.norm_forward(S.a, 0, d.biases ? bias : -1, S.b, S.m1, S.m2, heads, d.d);
      return;
    }
    case OpId::kQkLayernormBackward: {
      const int64_t heads = d.n_full * (d.hl + d.gl);
      S.fill(S.a, heads * d.d), S.fill(S.m1, heads), S.fill(S.m2, heads);
      S.fill(S.e, heads * d.d);
      c.norm_backward(S.a, 0, d.biases ? bias : -1, S.m1, S.m2, S.e, S.f, heads, d.d);
      return;
    }
    case OpId::kAttnSoftmax:
      S.fill(S.a, scores);
      be.causal_softmax(S.a.ptr(), d.b * d.hl, d.s);
      return;
    case OpId::kAttnSoftmaxBackward:
      S.fill(S.a, scores), S.fill(S.b, scores);
      be.causal_softmax_backward(S.a.ptr(), S.b.ptr(), S.b.ptr(), d.b * d.hl, d.s);
      return;
    case OpId::kLatentLayernorm:  // MLA's latents' norms, on the rank's tokens
    case OpId::kLatentLayernormBackward:
      for (const int64_t width : {d.ql, d.kvl}) {
        if (width == 0) continue;
        S.fill(S.a, rows * width), S.fill(S.m1, rows), S.fill(S.m2, rows);
        if (op.id == OpId::kLatentLayernorm) {
          c.norm_forward(S.a, 0, -1, S.b, S.m1, S.m2, rows, width);
        } else {
          S.fill(S.e, rows * width);
          c.norm_backward(S.a, 0, -1, S.m1, S.m2, S.e, S.f, rows, width);
        }
      }
      return;
    case OpId::kRotaryEmbedding:
    case OpId::kRotaryEmbeddingBackward: {
      const bool inverse = op.id == OpId::kRotaryEmbeddingBackward;
      if (d.mla) {  // the queries' rotated channels and the one shared rotated key
        S.fill(S.a, d.n_full * d.hl * d.dr), S.fill(S.b, d.n_full * d.dr);
        be.rope(S.a.ptr(), d.b, d.s, d.hl, d.dr, d.rotary_base, inverse);
        be.rope(S.b.ptr(), d.b, d.s, 1, d.dr, d.rotary_base, inverse);
        return;
      }
      S.fill(S.a, q), S.fill(S.b, kv);
      be.rope(S.a.ptr(), d.b, d.s, d.hl, d.d, d.rotary_base, inverse);
      be.rope(S.b.ptr(), d.b, d.s, d.gl, d.d, d.rotary_base, inverse);
      return;
    }
    case OpId::kAttnDropout:
    case OpId::kAttnDropoutBackward:  // ptdp run has no dropout: nothing runs
      return;
    case OpId::kAttnBiasDropoutAdd:
    case OpId::kMlpBiasDropoutAdd:
      S.fill(S.a, rows * d.h), S.fill(S.b, rows * d.h);
      c.residual_add(S.c, S.a, S.b, d.biases ? bias : -1);
      return;
    case OpId::kAttnBiasDropoutAddBackward:
    case OpId::kMlpBiasDropoutAddBackward:
      S.fill(S.a, rows * d.h);
      c.residual_add_backward(S.a, S.b, S.c, d.biases ? bias : -1);
      return;
    case OpId::kBiasGelu:  // GELU alone: FC1 adds the bias (above)
      S.fill(S.a, ffn), resize(S.b, ffn);
      be.gelu(S.a.ptr(), S.b.ptr(), ffn);
      return;
    case OpId::kBiasGeluBackward:
      S.fill(S.a, ffn), S.fill(S.b, ffn), resize(S.c, ffn);
      be.gelu_backward_bias_grad(S.a.ptr(), S.b.ptr(), S.c.ptr(), d.biases ? c.G(bias) : nullptr,
                                 ffn / d.ffl, d.ffl);
      return;
    case OpId::kSwiglu:
      S.fill(S.a, 2 * ffn), resize(S.b, ffn);
      be.swiglu(S.a.ptr(), S.b.ptr(), d.n_full, d.ffl);
      return;
    case OpId::kSwigluBackward:
      S.fill(S.a, 2 * ffn), S.fill(S.b, ffn), resize(S.c, 2 * ffn);
      be.swiglu_backward(S.a.ptr(), S.b.ptr(), S.c.ptr(), d.n_full, d.ffl);
      return;
    case OpId::kWordEmbeddingLookup:
      resize(S.a, d.n_full * d.h);
      be.vocab_embedding_lookup(S.tokens.data(), c.P(0), S.a.ptr(), d.n_full, d.h, d.v0, d.vl);
      return;
    case OpId::kWordEmbeddingGradScatterAdd:
      S.fill(S.a, d.n_full * d.h);
      be.vocab_embedding_grad(S.tokens.data(), S.a.ptr(), c.G(0), d.n_full, d.h, d.v0, d.vl);
      return;
    case OpId::kEmbeddingPositionDropout: {
      const int64_t sl = rows / d.b;
      S.fill(S.a, rows * d.h);
      be.add_positions(S.a.ptr(), c.P(0), d.b, sl, d.h, 0);
      return;
    }
    case OpId::kEmbeddingDropoutBackward: {
      const int64_t sl = rows / d.b;
      S.fill(S.a, rows * d.h);
      be.position_grad(S.a.ptr(), c.G(0), d.b, sl, d.h, 0);
      return;
    }
    case OpId::kCrossEntropy:
      S.fill(S.a, logits), resize(S.m1, d.n_full * kCrossEntropyStatsPerToken),
          resize(S.m2, d.n_full);
      be.cross_entropy_stats(S.a.ptr(), S.tokens.data(), S.m1.data(), d.n_full, d.vl, valid, d.v0);
      if (d.t == 1)
        be.cross_entropy_loss(S.m1.data(), 1, S.a.ptr(), S.m2.data(), d.n_full, d.vl, valid);
      return;
    case OpId::kCrossEntropyBackward:  // as the runtime: the pair's second half (a lse each row)
      S.fill(S.a, logits), S.fill(S.m2, d.n_full);
      be.cross_entropy_backward_from_lse(S.a.ptr(), S.m2.data(), S.tokens.data(), d.n_full, d.vl,
                                         valid, d.v0, 1.0);
      return;
    default:
      throw std::invalid_argument("ptdp run does not execute op '" + std::string(op.name()) + "'");
  }
}

void OpExecutor::run_moe(const Op& op) {
  State& S = *s_;
  ShardContext& c = S.ctx;
  const std::string name(op.name());
  if (op.kind == OpKind::kCollective)
    throw std::invalid_argument("op '" + name +
                                "' runs over the expert groups: ptdp calibrate times its "
                                "all-to-all as a collective, not alone");
  if (!S.moe) {
    const ShardLayout& l = layout_;
    S.moe = std::make_unique<MoeRun>(
        model_, moe_dims(model_, l.t, l.ep, l.ep_rank, l.etp, l.etp_rank), S.dtype);
    S.moe->W = moe_parameters(model_, l);
  }
  MoeRun& M = *S.moe;
  MoeActs& A = M.A;
  const MoeDims& md = M.ctx.dims();
  const int64_t n = c.dims.n_local, h = c.dims.h, E = md.experts, El = md.local_experts;
  if (!M.routed) {  // a routing of the layer's input, made once and not recorded
    std::vector<ExecutedOp>* trace = c.trace;
    c.trace = nullptr;
    S.fill(M.x, n * h);
    S.fill(A.logits, n * E);
    moe_forward_op(c, M.ctx, OpId::kRouterTopk, M.W, M.x, M.out, A);
    moe_forward_op(c, M.ctx, OpId::kMoePermute, M.W, M.x, M.out, A);
    c.trace = trace;
    M.routed = true;
  }
  // The experts' buffers at `rows` rows per local expert, as a balanced routing gives them
  // (the op list's shapes): GEMMs take the count from the op, activations from the layer.
  auto experts = [&](int64_t rows) {
    A.recv.assign(static_cast<size_t>(md.ep * El), 0);
    std::fill_n(A.recv.begin(), El, rows);
    if (md.etp > 1) {
      A.gathered.assign(static_cast<size_t>(md.etp * El), 0);
      std::fill_n(A.gathered.begin(), El, rows);
    }
    const int64_t r = El * rows;
    for (auto [x, width] : {std::pair{&A.x, h},
                            {&A.fc1, md.fc1_width()},
                            {&A.act, md.ffe},
                            {&A.d_y, h},
                            {&A.d_act, md.ffe},
                            {&A.d_pre, md.fc1_width()}})
      S.fill(*x, r * width);
  };
  const int64_t balanced = (n * md.topk * md.etp + El - 1) / El;
  const int64_t gemm_rows = op.role == OpRole::kWeightGrad ? op.k : op.m;
  switch (op.id) {
    case OpId::kRouter:
    case OpId::kMoePermute:
    case OpId::kRouterWgrad:
      S.input = &M.x;
      if (op.id == OpId::kRouterWgrad) S.fill(A.dlogits, n * E);
      break;
    case OpId::kRouterTopk:
      S.input = &A.logits;
      break;
    case OpId::kExpertFc1:
    case OpId::kExpertFc2:
    case OpId::kExpertFc2Dgrad:
    case OpId::kExpertFc2Wgrad:
    case OpId::kExpertFc1Dgrad:
    case OpId::kExpertFc1Wgrad:
      experts(gemm_rows);
      S.input = op.id == OpId::kExpertFc1 ? &A.x : op.id == OpId::kExpertFc2 ? &A.act : &A.d_y;
      break;
    case OpId::kExpertActivation:
    case OpId::kExpertActivationBackward:
      experts(balanced);
      S.input = &A.fc1;
      break;
    case OpId::kMoeUnpermute:
      S.fill(combined_rows(md, A), A.rows * h);
      if (md.shared) S.fill(M.out, n * h);
      S.input = &combined_rows(md, A);
      break;
    case OpId::kMoeUnpermuteBackward:
      S.fill(M.d_out, n * h);
      S.fill(combined_rows(md, A), A.rows * h);
      S.input = &M.d_out;
      break;
    case OpId::kMoePermuteBackward:
      S.fill(A.d_x, A.rows * h);
      if (md.shared) S.fill(M.d_x, n * h);
      S.input = &A.d_x;
      break;
    case OpId::kRouterTopkBackward:
      // The probabilities' gradients are host memory (runtime/moe_layer.h).
      S.fill(M.dprob, n * md.topk);
      A.dprob.resize(static_cast<size_t>(n * md.topk));
      download_floats(c.be, M.dprob.ptr(), A.dprob.data(), n * md.topk);
      S.input = &M.dprob;
      break;
    case OpId::kRouterDgrad:
      S.fill(A.dlogits, n * E);
      S.fill(M.d_x, n * h);
      S.input = &A.dlogits;
      break;
    default:
      throw std::logic_error("op '" + name + "' of an MoE layer has no inputs made");
  }
  c.begin(op.id, pass_of(op.role));
  if (pass_of(op.role) != PassKind::kBackward)
    moe_forward_op(c, M.ctx, op.id, M.W, M.x, M.out, A);
  else
    moe_backward_op(c, M.ctx, op.id, M.W, M.x, M.d_out, M.d_x, A);
}

}  // namespace ptdp
