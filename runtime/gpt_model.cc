#include "runtime/gpt_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <unordered_map>

#include "core/error.h"
#include "core/plan_rules.h"
#include "kernels/cpu/kernels.h"
#include "runtime/hash.h"

namespace ptdp {

namespace k = kernels;

void validate_shard_layout(const ModelSpec& m, const ShardLayout& s) {
  m.validate();
  // The plan rules of core/plan_rules.h on the plan this layout belongs to: one data-parallel
  // replica, p microbatches (a count any interleaved plan allows), each pipeline rank's layers
  // the sum of its chunks'.
  ParallelPlan plan;
  plan.tensor_parallel = s.t;
  plan.pipeline_parallel = s.p;
  plan.virtual_stages = s.v;
  plan.micro_batch_size = s.micro_batch;
  plan.global_batch_size = s.micro_batch * s.p;
  plan.schedule = s.v > 1 ? Schedule::kInterleaved1F1B : Schedule::k1F1B;
  plan.sequence_parallel = s.sequence_parallel;
  plan.recompute = s.recompute;
  const bool listed = !s.layers_per_stage.empty() && s.p > 0 && s.v > 0;
  if (listed) {
    if (static_cast<int64_t>(s.layers_per_stage.size()) != s.p * s.v)
      throw InputError("layers_per_stage", "needs one entry per model chunk (p * v = " +
                                               std::to_string(s.p * s.v) + ")");
    plan.layers_per_stage.assign(static_cast<size_t>(s.p), 0);
    for (size_t g = 0; g < s.layers_per_stage.size(); ++g)
      plan.layers_per_stage[g % static_cast<size_t>(s.p)] += s.layers_per_stage[g];
  }
  check_plan(m, plan);
  if (listed && layers_per_model_chunk(m, plan) != s.layers_per_stage)
    throw InputError("layers_per_stage", "the chunks of a pipeline rank must hold equal layers");
  // Not a plan rule: what this runtime executes.
  if (!m.learned_position_embeddings)
    throw InputError("--model",
                     "ptdp run implements learned position embeddings only; "
                     "this model uses rotary embeddings");
}

namespace {

// Deterministic initial values: a hash of (seed, parameter, global index).
uint64_t splitmix(uint64_t x) {
  return splitmix64(x);
}
float normal_at(uint64_t seed, uint64_t id, uint64_t index, double stddev) {
  const uint64_t a = splitmix(seed ^ splitmix(id ^ splitmix(index)));
  const uint64_t b = splitmix(a);
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  return static_cast<float>(stddev * std::sqrt(-2.0 * std::log(u1)) *
                            std::cos(6.283185307179586 * u2));
}

enum class Exec {
  // transformer layer, forward
  kInputNorm,
  kAttnAllGather,
  kQkv,
  kAttnScores,
  kAttnSoftmax,
  kAttnDropout,
  kAttnContext,
  kAttnProj,
  kAttnAllReduce,
  kAttnReduceScatter,
  kAttnBiasAdd,
  kPostNorm,
  kMlpAllGather,
  kFc1,
  kBiasGelu,
  kSwiglu,
  kFc2,
  kMlpAllReduce,
  kMlpReduceScatter,
  kMlpBiasAdd,
  // transformer layer, backward
  kMlpBiasAddBack,
  kMlpReduceScatterBack,
  kFc2Dgrad,
  kFc2Wgrad,
  kBiasGeluBack,
  kSwigluBack,
  kFc1Dgrad,
  kFc1InputGradAllReduce,
  kFc1Wgrad,
  kMlpAllGatherBack,
  kPostNormBack,
  kAttnBiasAddBack,
  kAttnReduceScatterBack,
  kAttnProjDgrad,
  kAttnProjWgrad,
  kAttnContextDgrad,
  kAttnContextWgrad,
  kAttnDropoutBack,
  kAttnSoftmaxBack,
  kAttnScoresDgrad,
  kAttnScoresWgrad,
  kQkvDgrad,
  kQkvInputGradAllReduce,
  kQkvWgrad,
  kAttnAllGatherBack,
  kInputNormBack,
  // embedding
  kWordLookup,
  kEmbAllReduce,
  kEmbReduceScatter,
  kPositionAdd,
  kEmbDropoutBack,
  kEmbGradAllGather,
  kWordGradScatterAdd,
  // LM head and loss
  kFinalNorm,
  kHeadAllGather,
  kHead,
  kCrossEntropy,
  kCrossEntropyAllReduce,
  kCrossEntropyBack,
  kHeadDgrad,
  kHeadWgrad,
  kHeadGradReduceScatter,
  kHeadInputGradAllReduce,
  kFinalNormBack,
};

const std::unordered_map<std::string, Exec>& op_names() {
  static const std::unordered_map<std::string, Exec> names = {
      {"input_layernorm", Exec::kInputNorm},
      {"attn_allgather", Exec::kAttnAllGather},
      {"qkv", Exec::kQkv},
      {"attn_scores", Exec::kAttnScores},
      {"attn_softmax", Exec::kAttnSoftmax},
      {"attn_dropout", Exec::kAttnDropout},
      {"attn_context", Exec::kAttnContext},
      {"attn_proj", Exec::kAttnProj},
      {"attn_allreduce", Exec::kAttnAllReduce},
      {"attn_reducescatter", Exec::kAttnReduceScatter},
      {"attn_bias_dropout_add", Exec::kAttnBiasAdd},
      {"post_attention_layernorm", Exec::kPostNorm},
      {"mlp_allgather", Exec::kMlpAllGather},
      {"fc1", Exec::kFc1},
      {"bias_gelu", Exec::kBiasGelu},
      {"swiglu", Exec::kSwiglu},
      {"fc2", Exec::kFc2},
      {"mlp_allreduce", Exec::kMlpAllReduce},
      {"mlp_reducescatter", Exec::kMlpReduceScatter},
      {"mlp_bias_dropout_add", Exec::kMlpBiasAdd},
      {"mlp_bias_dropout_add_backward", Exec::kMlpBiasAddBack},
      {"mlp_reducescatter_backward", Exec::kMlpReduceScatterBack},
      {"fc2_dgrad", Exec::kFc2Dgrad},
      {"fc2_wgrad", Exec::kFc2Wgrad},
      {"bias_gelu_backward", Exec::kBiasGeluBack},
      {"swiglu_backward", Exec::kSwigluBack},
      {"fc1_dgrad", Exec::kFc1Dgrad},
      {"fc1_input_grad_allreduce", Exec::kFc1InputGradAllReduce},
      {"fc1_wgrad", Exec::kFc1Wgrad},
      {"mlp_allgather_backward", Exec::kMlpAllGatherBack},
      {"post_attention_layernorm_backward", Exec::kPostNormBack},
      {"attn_bias_dropout_add_backward", Exec::kAttnBiasAddBack},
      {"attn_reducescatter_backward", Exec::kAttnReduceScatterBack},
      {"attn_proj_dgrad", Exec::kAttnProjDgrad},
      {"attn_proj_wgrad", Exec::kAttnProjWgrad},
      {"attn_context_dgrad", Exec::kAttnContextDgrad},
      {"attn_context_wgrad", Exec::kAttnContextWgrad},
      {"attn_dropout_backward", Exec::kAttnDropoutBack},
      {"attn_softmax_backward", Exec::kAttnSoftmaxBack},
      {"attn_scores_dgrad", Exec::kAttnScoresDgrad},
      {"attn_scores_wgrad", Exec::kAttnScoresWgrad},
      {"qkv_dgrad", Exec::kQkvDgrad},
      {"qkv_input_grad_allreduce", Exec::kQkvInputGradAllReduce},
      {"qkv_wgrad", Exec::kQkvWgrad},
      {"attn_allgather_backward", Exec::kAttnAllGatherBack},
      {"input_layernorm_backward", Exec::kInputNormBack},
      {"word_embedding_lookup", Exec::kWordLookup},
      {"embedding_allreduce", Exec::kEmbAllReduce},
      {"embedding_reducescatter", Exec::kEmbReduceScatter},
      {"embedding_position_dropout", Exec::kPositionAdd},
      {"embedding_dropout_backward", Exec::kEmbDropoutBack},
      {"embedding_grad_allgather", Exec::kEmbGradAllGather},
      {"word_embedding_grad_scatter_add", Exec::kWordGradScatterAdd},
      {"final_layernorm", Exec::kFinalNorm},
      {"lm_head_allgather", Exec::kHeadAllGather},
      {"lm_head", Exec::kHead},
      {"cross_entropy", Exec::kCrossEntropy},
      {"cross_entropy_allreduce", Exec::kCrossEntropyAllReduce},
      {"cross_entropy_backward", Exec::kCrossEntropyBack},
      {"lm_head_dgrad", Exec::kHeadDgrad},
      {"lm_head_wgrad", Exec::kHeadWgrad},
      {"lm_head_grad_reducescatter", Exec::kHeadGradReduceScatter},
      {"lm_head_input_grad_allreduce", Exec::kHeadInputGradAllReduce},
      {"final_layernorm_backward", Exec::kFinalNormBack},
  };
  return names;
}

std::vector<Exec> compile(const std::vector<ptdp::Op>& ops) {
  std::vector<Exec> program;
  for (const ptdp::Op& op : ops) {
    auto it = op_names().find(op.name);
    if (it == op_names().end())
      throw std::logic_error("ptdp run has no implementation of layer op '" + op.name + "'");
    program.push_back(it->second);
  }
  return program;
}

struct LayerParams {  // offsets into the flat buffers; -1 when absent
  int64_t ln1_g = -1, ln1_b = -1, qkv_w = -1, qkv_b = -1, proj_w = -1, proj_b = -1;
  int64_t ln2_g = -1, ln2_b = -1, fc1_w = -1, fc1_b = -1, fc2_w = -1, fc2_b = -1;
};

struct LayerActs {
  Buffer x, ln1, ln1_mean, ln1_rstd, ln1_full, q, k, v, probs, ctx, proj, h1;
  Buffer ln2, ln2_mean, ln2_rstd, ln2_full, fc1, act, fc2, out;
};

struct LayerGrads {  // the backward pass's scratch
  Buffer d_out, d_h1, d_fc2, d_act, d_pre, d_ln2_full, d_ln2, d_proj, d_ctx, d_probs, dq, dk, dv;
  Buffer d_qkv, d_ln1_full, d_ln1, d_x, tmp;
};

struct ChunkActs {
  std::vector<int32_t> inputs, targets;  // [b, s]
  Buffer emb;                            // word embedding before the position add
  std::vector<LayerActs> layers;
  Buffer lnf_in, lnf, lnf_mean, lnf_rstd, lnf_full, probs, stats, lse;
};

struct Chunk {
  int64_t first_layer = 0, num_layers = 0;
  bool first = false, last = false;
  std::vector<LayerParams> layers;
  int64_t word = -1, pos = -1, lnf_g = -1, lnf_b = -1, head = -1;
};

}  // namespace

struct GptShard::Impl {
  GptShard* self;
  Communicator* tp_comm;
  // Dimensions of this rank's shard.
  int64_t b, s, h, heads, groups, d, hl, gl, ffl, vocab, vl, v0, t;
  bool sp, biases;
  int64_t n_full, n_local;
  std::vector<Chunk> chunks;
  std::vector<Exec> layer_fwd, layer_bwd, layer_recompute, emb_fwd, emb_bwd, head_fwd, head_bwd;
  std::map<std::pair<int64_t, int64_t>, ChunkActs> stash;  // (chunk, microbatch)
  Buffer scratch;

  float* P(int64_t off) { return self->params_.data() + off; }
  float* G(int64_t off) { return self->grads_.data() + off; }
  int64_t qkv_width() const { return (hl + 2 * gl) * d; }
  int64_t fc1_width() const { return self->model_.swiglu ? 2 * ffl : ffl; }

  // Sequence-parallel data movement between [b, s/t, h] slices and the full [b, s, h].
  void gather_sequence(const Buffer& local, Buffer& full, int64_t width) {
    const int64_t sl = s / t, block = sl * width;
    full.resize(static_cast<size_t>(n_full * width));
    scratch.resize(static_cast<size_t>(t * n_local * width));
    tp_comm->all_gather(local.data(), scratch.data(), static_cast<size_t>(n_local * width));
    for (int64_t r = 0; r < t; ++r)
      for (int64_t bi = 0; bi < b; ++bi)
        std::memcpy(full.data() + (bi * s + r * sl) * width, scratch.data() + (r * b + bi) * block,
                    sizeof(float) * block);
  }
  void scatter_sequence(const Buffer& full, Buffer& local, int64_t width) {
    const int64_t sl = s / t, block = sl * width;
    scratch.resize(static_cast<size_t>(t * n_local * width));
    for (int64_t r = 0; r < t; ++r)
      for (int64_t bi = 0; bi < b; ++bi)
        std::memcpy(scratch.data() + (r * b + bi) * block, full.data() + (bi * s + r * sl) * width,
                    sizeof(float) * block);
    local.resize(static_cast<size_t>(n_local * width));
    tp_comm->reduce_scatter(scratch.data(), local.data(), static_cast<size_t>(n_local * width));
  }
  // Leaves a row-parallel block with sequence parallelism: [b, s, h] partial sums become this
  // rank's reduced [b, s/t, h] slice.
  void scatter_sequence_in_place(Buffer& x) {
    Buffer local;
    scatter_sequence(x, local, h);
    x.swap(local);
  }
  void all_reduce(Buffer& x) { tp_comm->all_reduce(x.data(), x.size()); }
  // out = residual + partial (+ bias): the bias-dropout-add closing each half of a layer.
  void residual_add(Buffer& out, const Buffer& residual, Buffer& partial, int64_t bias) {
    out = residual;
    add_into(out, partial);
    add_bias(out, bias, h);
    release(partial);
  }

  // Layernorm, or RMSNorm for models without biases (Llama).
  void norm_forward(const Buffer& x, int64_t g, int64_t beta, Buffer& y, Buffer& mean, Buffer& rstd,
                    int64_t n) {
    y.resize(static_cast<size_t>(n * h));
    rstd.resize(static_cast<size_t>(n));
    if (beta >= 0) {
      mean.resize(static_cast<size_t>(n));
      k::layernorm_forward(x.data(), P(g), P(beta), y.data(), mean.data(), rstd.data(), n, h);
    } else {
      k::rmsnorm_forward(x.data(), P(g), y.data(), rstd.data(), n, h);
    }
  }
  // dx = norm backward (overwritten).
  void norm_backward(const Buffer& x, int64_t g, int64_t beta, const Buffer& mean,
                     const Buffer& rstd, const Buffer& dy, Buffer& dx, int64_t n) {
    dx.resize(static_cast<size_t>(n * h));
    if (beta >= 0)
      k::layernorm_backward(x.data(), P(g), mean.data(), rstd.data(), dy.data(), dx.data(), G(g),
                            G(beta), n, h);
    else
      k::rmsnorm_backward(x.data(), P(g), rstd.data(), dy.data(), dx.data(), G(g), n, h);
  }
  static void add_into(Buffer& y, const Buffer& x) {
    for (size_t i = 0; i < y.size(); ++i) y[i] += x[i];
  }
  void add_bias(Buffer& y, int64_t bias, int64_t width) {
    if (bias < 0) return;
    const float* bb = P(bias);
    for (size_t i = 0; i < y.size(); ++i) y[i] += bb[static_cast<int64_t>(i) % width];
  }
  void bias_grad(const Buffer& dy, int64_t bias, int64_t width) {
    if (bias < 0) return;
    float* gb = G(bias);
    for (size_t i = 0; i < dy.size(); ++i) gb[static_cast<int64_t>(i) % width] += dy[i];
  }

  // Transformer layer, one op at a time.
  void layer_forward_op(Exec op, const LayerParams& W, LayerActs& A) {
    const Buffer& ln1_full = sp ? A.ln1_full : A.ln1;
    const Buffer& ln2_full = sp ? A.ln2_full : A.ln2;
    switch (op) {
      case Exec::kInputNorm:
        norm_forward(A.x, W.ln1_g, W.ln1_b, A.ln1, A.ln1_mean, A.ln1_rstd, n_local);
        break;
      case Exec::kAttnAllGather:
        gather_sequence(A.ln1, A.ln1_full, h);
        break;
      case Exec::kQkv: {
        Buffer qkv(static_cast<size_t>(n_full * qkv_width()));
        k::linear_forward(ln1_full.data(), P(W.qkv_w), W.qkv_b >= 0 ? P(W.qkv_b) : nullptr,
                          qkv.data(), n_full, h, qkv_width());
        A.q.resize(static_cast<size_t>(n_full * hl * d));
        A.k.resize(static_cast<size_t>(n_full * gl * d));
        A.v.resize(static_cast<size_t>(n_full * gl * d));
        for (int64_t i = 0; i < n_full; ++i) {
          const float* row = qkv.data() + i * qkv_width();
          std::memcpy(A.q.data() + i * hl * d, row, sizeof(float) * hl * d);
          std::memcpy(A.k.data() + i * gl * d, row + hl * d, sizeof(float) * gl * d);
          std::memcpy(A.v.data() + i * gl * d, row + (hl + gl) * d, sizeof(float) * gl * d);
        }
        break;
      }
      case Exec::kAttnScores:
        A.probs.resize(static_cast<size_t>(b * hl * s * s));
        k::attention_scores_forward(A.q.data(), A.k.data(), A.probs.data(), b, s, hl, gl, d);
        break;
      case Exec::kAttnSoftmax:
        k::causal_softmax_forward(A.probs.data(), b * hl, s);
        break;
      case Exec::kAttnDropout:  // no dropout in ptdp run (deterministic training)
        break;
      case Exec::kAttnContext:
        A.ctx.resize(static_cast<size_t>(n_full * hl * d));
        k::attention_context_forward(A.probs.data(), A.v.data(), A.ctx.data(), b, s, hl, gl, d);
        break;
      case Exec::kAttnProj:
        A.proj.resize(static_cast<size_t>(n_full * h));
        k::linear_forward<float>(A.ctx.data(), P(W.proj_w), nullptr, A.proj.data(), n_full, hl * d,
                                 h);
        break;
      case Exec::kAttnAllReduce:
        all_reduce(A.proj);
        break;
      case Exec::kAttnReduceScatter:
        scatter_sequence_in_place(A.proj);
        break;
      case Exec::kAttnBiasAdd:
        residual_add(A.h1, A.x, A.proj, W.proj_b);
        break;
      case Exec::kPostNorm:
        norm_forward(A.h1, W.ln2_g, W.ln2_b, A.ln2, A.ln2_mean, A.ln2_rstd, n_local);
        break;
      case Exec::kMlpAllGather:
        gather_sequence(A.ln2, A.ln2_full, h);
        break;
      case Exec::kFc1:
        A.fc1.resize(static_cast<size_t>(n_full * fc1_width()));
        k::linear_forward<float>(ln2_full.data(), P(W.fc1_w), nullptr, A.fc1.data(), n_full, h,
                                 fc1_width());
        break;
      case Exec::kBiasGelu:
        add_bias(A.fc1, W.fc1_b, ffl);
        A.act.resize(A.fc1.size());
        k::gelu_forward(A.fc1.data(), A.act.data(), static_cast<int64_t>(A.fc1.size()));
        break;
      case Exec::kSwiglu:
        A.act.resize(static_cast<size_t>(n_full * ffl));
        k::swiglu_forward(A.fc1.data(), A.act.data(), n_full, ffl);
        break;
      case Exec::kFc2:
        A.fc2.resize(static_cast<size_t>(n_full * h));
        k::linear_forward<float>(A.act.data(), P(W.fc2_w), nullptr, A.fc2.data(), n_full, ffl, h);
        break;
      case Exec::kMlpAllReduce:
        all_reduce(A.fc2);
        break;
      case Exec::kMlpReduceScatter:
        scatter_sequence_in_place(A.fc2);
        break;
      case Exec::kMlpBiasAdd:
        residual_add(A.out, A.h1, A.fc2, W.fc2_b);
        break;
      default:
        throw std::logic_error("not a forward op of a transformer layer");
    }
  }

  void layer_backward_op(Exec op, const LayerParams& W, LayerActs& A, LayerGrads& D) {
    const Buffer& ln1_full = sp ? A.ln1_full : A.ln1;
    const Buffer& ln2_full = sp ? A.ln2_full : A.ln2;
    // Without sequence parallelism (or with t = 1) the reduce-scatter/all-gather pairs are
    // absent and the gradient of a row-parallel output is the layer's incoming gradient.
    switch (op) {
      case Exec::kMlpBiasAddBack:
        bias_grad(D.d_out, W.fc2_b, h);
        D.d_h1 = D.d_out;
        D.d_fc2 = D.d_out;
        break;
      case Exec::kMlpReduceScatterBack:
        gather_sequence(D.d_out, D.d_fc2, h);
        break;
      case Exec::kFc2Dgrad:
        D.d_act.resize(static_cast<size_t>(n_full * ffl));
        k::linear_backward<float>(nullptr, P(W.fc2_w), D.d_fc2.data(), D.d_act.data(), nullptr,
                                  nullptr, n_full, ffl, h);
        break;
      case Exec::kFc2Wgrad:
        k::linear_backward<float>(A.act.data(), nullptr, D.d_fc2.data(), nullptr, G(W.fc2_w),
                                  nullptr, n_full, ffl, h);
        break;
      case Exec::kBiasGeluBack:
        D.d_pre.resize(A.fc1.size());
        k::gelu_backward(A.fc1.data(), D.d_act.data(), D.d_pre.data(),
                         static_cast<int64_t>(A.fc1.size()));
        bias_grad(D.d_pre, W.fc1_b, ffl);
        break;
      case Exec::kSwigluBack:
        D.d_pre.resize(A.fc1.size());
        k::swiglu_backward(A.fc1.data(), D.d_act.data(), D.d_pre.data(), n_full, ffl);
        break;
      case Exec::kFc1Dgrad:
        D.d_ln2_full.resize(static_cast<size_t>(n_full * h));
        k::linear_backward<float>(nullptr, P(W.fc1_w), D.d_pre.data(), D.d_ln2_full.data(), nullptr,
                                  nullptr, n_full, h, fc1_width());
        break;
      case Exec::kFc1InputGradAllReduce:
        all_reduce(D.d_ln2_full);
        break;
      case Exec::kFc1Wgrad:
        k::linear_backward<float>(ln2_full.data(), nullptr, D.d_pre.data(), nullptr, G(W.fc1_w),
                                  nullptr, n_full, h, fc1_width());
        break;
      case Exec::kMlpAllGatherBack:
        scatter_sequence(D.d_ln2_full, D.d_ln2, h);
        break;
      case Exec::kPostNormBack:
        norm_backward(A.h1, W.ln2_g, W.ln2_b, A.ln2_mean, A.ln2_rstd, sp ? D.d_ln2 : D.d_ln2_full,
                      D.tmp, n_local);
        add_into(D.d_h1, D.tmp);
        break;
      case Exec::kAttnBiasAddBack:
        bias_grad(D.d_h1, W.proj_b, h);
        D.d_x = D.d_h1;
        D.d_proj = D.d_h1;
        break;
      case Exec::kAttnReduceScatterBack:
        gather_sequence(D.d_h1, D.d_proj, h);
        break;
      case Exec::kAttnProjDgrad:
        D.d_ctx.resize(static_cast<size_t>(n_full * hl * d));
        k::linear_backward<float>(nullptr, P(W.proj_w), D.d_proj.data(), D.d_ctx.data(), nullptr,
                                  nullptr, n_full, hl * d, h);
        break;
      case Exec::kAttnProjWgrad:
        k::linear_backward<float>(A.ctx.data(), nullptr, D.d_proj.data(), nullptr, G(W.proj_w),
                                  nullptr, n_full, hl * d, h);
        break;
      case Exec::kAttnContextDgrad:
        D.d_probs.resize(A.probs.size());
        k::attention_context_backward<float>(A.probs.data(), A.v.data(), D.d_ctx.data(),
                                             D.d_probs.data(), nullptr, b, s, hl, gl, d);
        break;
      case Exec::kAttnContextWgrad:
        D.dv.resize(A.v.size());
        k::attention_context_backward<float>(A.probs.data(), A.v.data(), D.d_ctx.data(), nullptr,
                                             D.dv.data(), b, s, hl, gl, d);
        break;
      case Exec::kAttnDropoutBack:
        break;
      case Exec::kAttnSoftmaxBack:
        k::causal_softmax_backward(A.probs.data(), D.d_probs.data(), D.d_probs.data(), b * hl, s);
        break;
      case Exec::kAttnScoresDgrad:
        D.dq.resize(A.q.size());
        k::attention_scores_backward<float>(A.q.data(), A.k.data(), D.d_probs.data(), D.dq.data(),
                                            nullptr, b, s, hl, gl, d);
        break;
      case Exec::kAttnScoresWgrad:
        D.dk.resize(A.k.size());
        k::attention_scores_backward<float>(A.q.data(), A.k.data(), D.d_probs.data(), nullptr,
                                            D.dk.data(), b, s, hl, gl, d);
        break;
      case Exec::kQkvDgrad:
        D.d_qkv.resize(static_cast<size_t>(n_full * qkv_width()));
        for (int64_t i = 0; i < n_full; ++i) {
          float* row = D.d_qkv.data() + i * qkv_width();
          std::memcpy(row, D.dq.data() + i * hl * d, sizeof(float) * hl * d);
          std::memcpy(row + hl * d, D.dk.data() + i * gl * d, sizeof(float) * gl * d);
          std::memcpy(row + (hl + gl) * d, D.dv.data() + i * gl * d, sizeof(float) * gl * d);
        }
        D.d_ln1_full.resize(static_cast<size_t>(n_full * h));
        k::linear_backward<float>(nullptr, P(W.qkv_w), D.d_qkv.data(), D.d_ln1_full.data(), nullptr,
                                  nullptr, n_full, h, qkv_width());
        break;
      case Exec::kQkvInputGradAllReduce:
        all_reduce(D.d_ln1_full);
        break;
      case Exec::kQkvWgrad:
        k::linear_backward<float>(ln1_full.data(), nullptr, D.d_qkv.data(), nullptr, G(W.qkv_w),
                                  W.qkv_b >= 0 ? G(W.qkv_b) : nullptr, n_full, h, qkv_width());
        break;
      case Exec::kAttnAllGatherBack:
        scatter_sequence(D.d_ln1_full, D.d_ln1, h);
        break;
      case Exec::kInputNormBack:
        norm_backward(A.x, W.ln1_g, W.ln1_b, A.ln1_mean, A.ln1_rstd, sp ? D.d_ln1 : D.d_ln1_full,
                      D.tmp, n_local);
        add_into(D.d_x, D.tmp);
        break;
      default:
        throw std::logic_error("not a backward op of a transformer layer");
    }
  }

  // After a layer's forward pass, drop what the recompute mode does not keep.
  void drop_recomputed(LayerActs& A, Recompute r) {
    if (r == Recompute::kNone) return;
    release(A.probs);  // selective: the attention core is recomputed
    if (r == Recompute::kSelective) return;
    for (Buffer* x : {&A.ln1, &A.ln1_mean, &A.ln1_rstd, &A.ln1_full, &A.q, &A.k, &A.v, &A.ctx,
                      &A.h1, &A.ln2, &A.ln2_mean, &A.ln2_rstd, &A.ln2_full, &A.fc1, &A.act})
      release(*x);
  }

  // Vocabulary-parallel embedding and LM head.
  void embedding_op(Exec op, const Chunk& c, ChunkActs& A, Buffer& x, Buffer* dx) {
    const int64_t sl = sp ? s / t : s;
    const int64_t first_pos = sp ? self->layout_.tp * sl : 0;
    switch (op) {
      case Exec::kWordLookup: {
        A.emb.assign(static_cast<size_t>(n_full * h), 0.0f);
        const float* table = P(c.word);
        for (int64_t i = 0; i < n_full; ++i) {
          const int64_t tok = A.inputs[static_cast<size_t>(i)] - v0;
          if (tok >= 0 && tok < vl)
            std::memcpy(A.emb.data() + i * h, table + tok * h, sizeof(float) * h);
        }
        break;
      }
      case Exec::kEmbAllReduce:
        all_reduce(A.emb);
        break;
      case Exec::kEmbReduceScatter:
        scatter_sequence_in_place(A.emb);
        break;
      case Exec::kPositionAdd: {
        x = A.emb;
        release(A.emb);
        const float* pos = P(c.pos);
        for (int64_t bi = 0; bi < b; ++bi)
          for (int64_t j = 0; j < sl; ++j)
            for (int64_t e = 0; e < h; ++e)
              x[(bi * sl + j) * h + e] += pos[(first_pos + j) * h + e];
        break;
      }
      case Exec::kEmbDropoutBack: {
        float* gpos = G(c.pos);
        for (int64_t bi = 0; bi < b; ++bi)
          for (int64_t j = 0; j < sl; ++j)
            for (int64_t e = 0; e < h; ++e)
              gpos[(first_pos + j) * h + e] += (*dx)[(bi * sl + j) * h + e];
        break;
      }
      case Exec::kEmbGradAllGather: {
        Buffer full;
        gather_sequence(*dx, full, h);
        dx->swap(full);
        break;
      }
      case Exec::kWordGradScatterAdd: {
        float* gw = G(c.word);
        for (int64_t i = 0; i < n_full; ++i) {
          const int64_t tok = A.inputs[static_cast<size_t>(i)] - v0;
          if (tok < 0 || tok >= vl) continue;
          for (int64_t e = 0; e < h; ++e) gw[tok * h + e] += (*dx)[i * h + e];
        }
        break;
      }
      default:
        throw std::logic_error("not an embedding op");
    }
  }

  // Finishes the vocabulary-parallel cross-entropy from per-rank (max, sum of exp, target logit)
  // triples: lse = log-sum-exp over the whole vocabulary; probs become the softmax.
  double finish_cross_entropy(ChunkActs& A, const float* stats, int64_t ranks) {
    A.lse.resize(static_cast<size_t>(n_full));
    double loss = 0;
    for (int64_t i = 0; i < n_full; ++i) {
      float mx = -INFINITY;
      for (int64_t r = 0; r < ranks; ++r) mx = std::max(mx, stats[(r * n_full + i) * 3]);
      float sum = 0, target = 0;
      for (int64_t r = 0; r < ranks; ++r) {
        const float* st = stats + (r * n_full + i) * 3;
        sum += st[1] * std::exp(st[0] - mx);
        target += st[2];
      }
      const float lse = mx + std::log(sum);
      A.lse[static_cast<size_t>(i)] = lse;
      loss += static_cast<double>(lse - target);
    }
    const int64_t valid = std::min(vl, vocab - v0);
    for (int64_t i = 0; i < n_full; ++i) {
      float* row = A.probs.data() + i * vl;
      for (int64_t j = 0; j < vl; ++j)
        row[j] = j < valid ? std::exp(row[j] - A.lse[static_cast<size_t>(i)]) : 0.0f;
    }
    return loss / static_cast<double>(n_full);
  }

  double head_forward_op(Exec op, const Chunk& c, ChunkActs& A) {
    const Buffer& lnf_full = sp ? A.lnf_full : A.lnf;
    switch (op) {
      case Exec::kFinalNorm:
        norm_forward(A.lnf_in, c.lnf_g, c.lnf_b, A.lnf, A.lnf_mean, A.lnf_rstd, n_local);
        break;
      case Exec::kHeadAllGather:
        gather_sequence(A.lnf, A.lnf_full, h);
        break;
      case Exec::kHead:
        A.probs.resize(static_cast<size_t>(n_full * vl));  // logits until the loss is finished
        k::linear_forward<float>(lnf_full.data(), P(c.head), nullptr, A.probs.data(), n_full, h,
                                 vl);
        break;
      case Exec::kCrossEntropy: {
        const int64_t valid = std::min(vl, vocab - v0);
        A.stats.resize(static_cast<size_t>(n_full * 3));
        for (int64_t i = 0; i < n_full; ++i) {
          const float* row = A.probs.data() + i * vl;
          float mx = -INFINITY;
          for (int64_t j = 0; j < valid; ++j) mx = std::max(mx, row[j]);
          float sum = 0;
          for (int64_t j = 0; j < valid; ++j) sum += std::exp(row[j] - mx);
          const int64_t tgt = A.targets[static_cast<size_t>(i)] - v0;
          A.stats[static_cast<size_t>(i * 3)] = valid > 0 ? mx : -INFINITY;
          A.stats[static_cast<size_t>(i * 3 + 1)] = sum;
          A.stats[static_cast<size_t>(i * 3 + 2)] = tgt >= 0 && tgt < valid ? row[tgt] : 0.0f;
        }
        if (t == 1) return finish_cross_entropy(A, A.stats.data(), 1);
        break;
      }
      case Exec::kCrossEntropyAllReduce: {
        Buffer all(static_cast<size_t>(t * n_full * 3));
        tp_comm->all_gather(A.stats.data(), all.data(), A.stats.size());
        return finish_cross_entropy(A, all.data(), t);
      }
      default:
        throw std::logic_error("not an LM-head forward op");
    }
    return 0;
  }

  void head_backward_op(Exec op, const Chunk& c, ChunkActs& A, LayerGrads& D, double scale) {
    const Buffer& lnf_full = sp ? A.lnf_full : A.lnf;
    switch (op) {
      case Exec::kCrossEntropyBack: {
        // d(loss_scale * mean loss)/dlogits = (softmax - onehot) * scale / tokens, in place.
        const float f = static_cast<float>(scale / static_cast<double>(n_full));
        for (int64_t i = 0; i < n_full; ++i) {
          float* row = A.probs.data() + i * vl;
          for (int64_t j = 0; j < vl; ++j) row[j] *= f;
          const int64_t tgt = A.targets[static_cast<size_t>(i)] - v0;
          if (tgt >= 0 && tgt < vl) row[tgt] -= f;
        }
        break;
      }
      case Exec::kHeadDgrad:
        D.d_ln1_full.resize(static_cast<size_t>(n_full * h));
        k::linear_backward<float>(nullptr, P(c.head), A.probs.data(), D.d_ln1_full.data(), nullptr,
                                  nullptr, n_full, h, vl);
        break;
      case Exec::kHeadWgrad:
        k::linear_backward<float>(lnf_full.data(), nullptr, A.probs.data(), nullptr, G(c.head),
                                  nullptr, n_full, h, vl);
        break;
      case Exec::kHeadGradReduceScatter:
        scatter_sequence(D.d_ln1_full, D.d_ln1, h);
        break;
      case Exec::kHeadInputGradAllReduce:
        all_reduce(D.d_ln1_full);
        break;
      case Exec::kFinalNormBack:
        norm_backward(A.lnf_in, c.lnf_g, c.lnf_b, A.lnf_mean, A.lnf_rstd,
                      sp ? D.d_ln1 : D.d_ln1_full, D.d_out, n_local);
        break;
      default:
        throw std::logic_error("not an LM-head backward op");
    }
  }
};

GptShard::GptShard(const ModelSpec& m, const ShardLayout& layout, Communicator* tensor_group,
                   uint64_t seed)
    : model_(m), layout_(layout), impl_(std::make_unique<Impl>()) {
  validate_shard_layout(m, layout);
  Impl& I = *impl_;
  I.self = this;
  I.tp_comm = tensor_group;
  I.t = layout.t;
  I.b = layout.micro_batch;
  I.s = m.seq_length;
  I.h = m.hidden_size;
  I.heads = m.num_attention_heads;
  I.groups = m.query_groups();
  I.d = m.kv_channels();
  I.hl = I.heads / I.t;
  I.gl = I.groups / I.t;
  I.ffl = m.ffn_hidden() / I.t;
  I.vocab = m.vocab_size;
  I.vl = (m.vocab_size + I.t - 1) / I.t;
  I.v0 = layout.tp * I.vl;
  I.sp = layout.sequence_parallel && I.t > 1;
  I.biases = !m.swiglu;  // as ModelSpec counts them: Llama-style models have no biases
  I.n_full = I.b * I.s;
  I.n_local = I.sp ? I.n_full / I.t : I.n_full;

  ParallelPlan shape_plan;
  shape_plan.tensor_parallel = I.t;
  shape_plan.micro_batch_size = I.b;
  shape_plan.sequence_parallel = I.sp;
  shape_plan.recompute = layout.recompute;
  shape_plan.gradient_accumulation_fusion = true;  // gradients accumulate in place
  const LayerShape shape = layer_shape(shape_plan);
  const PassOps layer = transformer_layer_ops(m, shape);
  const PassOps emb = embedding_ops(m, shape), head = lm_head_ops(m, shape);
  I.layer_fwd = compile(layer.forward);
  I.layer_bwd = compile(layer.backward);
  I.layer_recompute = compile(layer.recompute);
  I.emb_fwd = compile(emb.forward);
  I.emb_bwd = compile(emb.backward);
  I.head_fwd = compile(head.forward);
  I.head_bwd = compile(head.backward);

  // Parameters, in two segments (word embedding, the rest), each padded to segment_multiple.
  struct Pending {
    ParamInfo info;
    std::function<void(float*)> init;
  };
  std::vector<Pending> pending;
  const double std_dev = 0.02;
  const double out_std = 0.02 / std::sqrt(2.0 * static_cast<double>(m.num_layers));
  auto add = [&](ParamInfo info, std::function<void(float*)> init) {
    if (info.real_size == 0) info.real_size = info.size;
    pending.push_back({std::move(info), std::move(init)});
    return static_cast<int64_t>(pending.size() - 1);
  };
  auto constant = [](int64_t n, float value) {
    return [n, value](float* x) { std::fill(x, x + n, value); };
  };
  // rows x cols local; global element of local (r, c) given by `index`.
  auto normal = [seed](std::string name, int64_t rows, int64_t cols, double sd,
                       std::function<int64_t(int64_t, int64_t)> index) {
    return [=, id = fnv1a(name)](float* x) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          x[r * cols + c] = normal_at(seed, id, static_cast<uint64_t>(index(r, c)), sd);
    };
  };
  const int64_t h = I.h, tp = layout.tp, d = I.d;
  auto replicated = [&](std::string name, int64_t n, float value, bool decay = false) {
    ParamInfo p;
    p.name = std::move(name);
    p.size = n;
    p.decay = decay;
    p.tp_replicated = true;
    p.sp_partial = I.sp;
    return add(p, constant(n, value));
  };
  // A vocabulary-parallel [V/t, h] table: this rank's rows of the global table, the padding
  // rows past the vocabulary (last shard) zero.
  auto vocab_table = [&](ParamInfo p, const std::string& values_of) {
    p.size = I.vl * h;
    p.real_size = std::max<int64_t>(0, std::min(I.vl, I.vocab - I.v0)) * h;
    const int64_t vl = I.vl, v0 = I.v0, vocab = I.vocab;
    auto values =
        normal(values_of, vl, h, std_dev, [=](int64_t r, int64_t c) { return (v0 + r) * h + c; });
    return add(p, [=](float* x) {
      values(x);
      for (int64_t r = std::max<int64_t>(0, vocab - v0); r < vl; ++r)
        std::fill(x + r * h, x + (r + 1) * h, 0.0f);
    });
  };
  auto word_embedding = [&](bool tied_copy) {
    ParamInfo p;
    p.name = tied_copy ? "output_layer.weight (tied copy)" : "embedding.word_embeddings.weight";
    p.segment = 0;
    p.tied_copy = tied_copy;
    return vocab_table(p, "embedding.word_embeddings.weight");
  };

  const int64_t stages = layout.p * layout.v;
  std::vector<int64_t> per_stage = layout.layers_per_stage;
  if (per_stage.empty()) per_stage.assign(static_cast<size_t>(stages), m.num_layers / stages);
  I.chunks.resize(static_cast<size_t>(layout.v));
  int64_t word_index = -1;
  struct ChunkIdx {
    std::vector<std::array<int64_t, 12>> layers;
    int64_t word = -1, pos = -1, lnf_g = -1, lnf_b = -1, head = -1;
  };
  std::vector<ChunkIdx> idx(static_cast<size_t>(layout.v));
  for (int64_t c = 0; c < layout.v; ++c) {
    Chunk& ch = I.chunks[static_cast<size_t>(c)];
    ChunkIdx& ix = idx[static_cast<size_t>(c)];
    const int64_t g = c * layout.p + layout.pp;
    ch.first = g == 0;
    ch.last = g == stages - 1;
    ch.first_layer = std::accumulate(per_stage.begin(), per_stage.begin() + g, int64_t{0});
    ch.num_layers = per_stage[static_cast<size_t>(g)];
    if (ch.first) {
      ix.word = word_index = word_embedding(false);
      ParamInfo p;
      p.name = "embedding.position_embeddings.weight";
      p.size = m.seq_length * h;
      p.tp_replicated = true;
      p.sp_partial = I.sp;
      ix.pos = add(p, normal(p.name, m.seq_length, h, std_dev,
                             [=](int64_t r, int64_t c2) { return r * h + c2; }));
    }
    for (int64_t l = 0; l < ch.num_layers; ++l) {
      const std::string pre = "layers." + std::to_string(ch.first_layer + l) + ".";
      std::array<int64_t, 12> L;
      L.fill(-1);
      L[0] = replicated(pre + "input_layernorm.weight", h, 1.0f);
      if (I.biases) L[1] = replicated(pre + "input_layernorm.bias", h, 0.0f);
      {  // QKV: rows [q of local heads | k of local groups | v of local groups]
        const int64_t heads = I.heads, groups = I.groups, hl = I.hl, gl = I.gl;
        auto global_row = [=](int64_t r) {
          if (r < hl * d) return tp * hl * d + r;
          r -= hl * d;
          if (r < gl * d) return heads * d + tp * gl * d + r;
          r -= gl * d;
          return (heads + groups) * d + tp * gl * d + r;
        };
        ParamInfo p;
        p.name = pre + "qkv.weight";
        p.size = I.qkv_width() * h;
        L[2] = add(p, normal(p.name, I.qkv_width(), h, std_dev,
                             [=](int64_t r, int64_t c2) { return global_row(r) * h + c2; }));
        if (I.biases) {
          ParamInfo pb;
          pb.name = pre + "qkv.bias";
          pb.size = I.qkv_width();
          pb.decay = false;
          L[3] = add(pb, constant(pb.size, 0.0f));
        }
      }
      {
        ParamInfo p;
        p.name = pre + "attn_proj.weight";
        p.size = h * I.hl * d;
        const int64_t in_local = I.hl * d, in = I.heads * d;
        L[4] = add(p, normal(p.name, h, in_local, out_std,
                             [=](int64_t r, int64_t c2) { return r * in + tp * in_local + c2; }));
        if (I.biases) L[5] = replicated(pre + "attn_proj.bias", h, 0.0f);
      }
      L[6] = replicated(pre + "post_attention_layernorm.weight", h, 1.0f);
      if (I.biases) L[7] = replicated(pre + "post_attention_layernorm.bias", h, 0.0f);
      {  // FC1: rows [gate | up] of the local columns for SwiGLU
        const int64_t ffl = I.ffl, ffn = m.ffn_hidden();
        ParamInfo p;
        p.name = pre + "fc1.weight";
        p.size = I.fc1_width() * h;
        L[8] = add(p, normal(p.name, I.fc1_width(), h, std_dev, [=](int64_t r, int64_t c2) {
                     const int64_t part = r / ffl, row = r % ffl;
                     return (part * ffn + tp * ffl + row) * h + c2;
                   }));
        if (I.biases) {
          ParamInfo pb;
          pb.name = pre + "fc1.bias";
          pb.size = ffl;
          pb.decay = false;
          L[9] = add(pb, constant(ffl, 0.0f));
        }
        ParamInfo p2;
        p2.name = pre + "fc2.weight";
        p2.size = h * ffl;
        L[10] = add(p2, normal(p2.name, h, ffl, out_std,
                               [=](int64_t r, int64_t c2) { return r * ffn + tp * ffl + c2; }));
        if (I.biases) L[11] = replicated(pre + "fc2.bias", h, 0.0f);
      }
      ix.layers.push_back(L);
    }
    if (ch.last) {
      ix.lnf_g = replicated("final_layernorm.weight", h, 1.0f);
      if (I.biases) ix.lnf_b = replicated("final_layernorm.bias", h, 0.0f);
      if (m.untie_embeddings_and_output_weights) {
        ParamInfo p;
        p.name = "output_layer.weight";
        ix.head = vocab_table(p, p.name);
      } else {
        ix.head = word_index >= 0 ? word_index : word_embedding(true);
      }
    }
  }

  // Offsets: segment 0 first, then segment 1, each padded.
  const int64_t mult = std::max<int64_t>(1, layout.segment_multiple);
  int64_t offset = 0;
  for (int seg = 0; seg < 2; ++seg) {
    Segment sg;
    sg.offset = offset;
    for (Pending& p : pending)
      if (p.info.segment == seg) {
        p.info.offset = offset;
        offset += p.info.size;
      }
    offset = sg.offset + (offset - sg.offset + mult - 1) / mult * mult;
    sg.size = offset - sg.offset;
    segments_.push_back(sg);
  }
  params_.assign(static_cast<size_t>(offset), 0.0f);
  grads_.assign(static_cast<size_t>(offset), 0.0f);
  for (Pending& p : pending) {
    p.init(params_.data() + p.info.offset);
    infos_.push_back(p.info);
  }
  auto off = [&](int64_t i) { return i < 0 ? int64_t{-1} : infos_[static_cast<size_t>(i)].offset; };
  for (int64_t c = 0; c < layout.v; ++c) {
    Chunk& ch = I.chunks[static_cast<size_t>(c)];
    const ChunkIdx& ix = idx[static_cast<size_t>(c)];
    ch.word = off(ix.word);
    ch.pos = off(ix.pos);
    ch.lnf_g = off(ix.lnf_g);
    ch.lnf_b = off(ix.lnf_b);
    ch.head = off(ix.head);
    for (const auto& L : ix.layers) {
      LayerParams W;
      W.ln1_g = off(L[0]);
      W.ln1_b = off(L[1]);
      W.qkv_w = off(L[2]);
      W.qkv_b = off(L[3]);
      W.proj_w = off(L[4]);
      W.proj_b = off(L[5]);
      W.ln2_g = off(L[6]);
      W.ln2_b = off(L[7]);
      W.fc1_w = off(L[8]);
      W.fc1_b = off(L[9]);
      W.fc2_w = off(L[10]);
      W.fc2_b = off(L[11]);
      ch.layers.push_back(W);
    }
  }
}

GptShard::~GptShard() = default;

bool GptShard::first_stage(int64_t chunk) const {
  return impl_->chunks[static_cast<size_t>(chunk)].first;
}
bool GptShard::last_stage(int64_t chunk) const {
  return impl_->chunks[static_cast<size_t>(chunk)].last;
}
int64_t GptShard::boundary_elements() const {
  return impl_->n_local * impl_->h;
}
int64_t GptShard::tokens_per_microbatch() const {
  return impl_->b * (impl_->s + 1);
}

int64_t GptShard::real_parameters() const {
  int64_t n = 0;
  for (const ParamInfo& p : infos_)
    if (!p.tied_copy) n += p.real_size;
  return n;
}

double GptShard::forward(int64_t chunk, int64_t mb, const int32_t* tokens, const Buffer* input,
                         Buffer* output) {
  Impl& I = *impl_;
  const Chunk& c = I.chunks[static_cast<size_t>(chunk)];
  ChunkActs& A = I.stash[{chunk, mb}];
  A.layers.resize(static_cast<size_t>(c.num_layers));
  Buffer x;
  // The first stage reads the inputs (tokens 0..s-1 of each sequence), the last the targets
  // (tokens 1..s).
  auto take = [&](std::vector<int32_t>& out, int64_t shift) {
    out.resize(static_cast<size_t>(I.n_full));
    for (int64_t bi = 0; bi < I.b; ++bi)
      for (int64_t j = 0; j < I.s; ++j)
        out[static_cast<size_t>(bi * I.s + j)] = tokens[bi * (I.s + 1) + j + shift];
  };
  if (c.first) take(A.inputs, 0);
  if (c.last) take(A.targets, 1);
  if (c.first) {
    for (Exec op : I.emb_fwd) I.embedding_op(op, c, A, x, nullptr);
  } else {
    if (!input || static_cast<int64_t>(input->size()) != I.n_local * I.h)
      throw std::logic_error("forward: missing or mis-sized input activation");
    x = *input;
  }
  for (int64_t l = 0; l < c.num_layers; ++l) {
    LayerActs& L = A.layers[static_cast<size_t>(l)];
    L.x.swap(x);
    for (Exec op : I.layer_fwd) I.layer_forward_op(op, c.layers[static_cast<size_t>(l)], L);
    x.swap(L.out);
    release(L.out);
    I.drop_recomputed(L, layout_.recompute);
  }
  if (!c.last) {
    *output = std::move(x);
    return 0;
  }
  A.lnf_in.swap(x);
  double loss = 0;
  for (Exec op : I.head_fwd) loss += I.head_forward_op(op, c, A);
  return loss;
}

void GptShard::backward(int64_t chunk, int64_t mb, const Buffer* grad_output, Buffer* grad_input,
                        double loss_scale) {
  Impl& I = *impl_;
  const Chunk& c = I.chunks[static_cast<size_t>(chunk)];
  auto it = I.stash.find({chunk, mb});
  if (it == I.stash.end()) throw std::logic_error("backward before forward");
  ChunkActs& A = it->second;
  LayerGrads D;
  if (c.last) {
    for (Exec op : I.head_bwd) I.head_backward_op(op, c, A, D, loss_scale);
  } else {
    if (!grad_output || static_cast<int64_t>(grad_output->size()) != I.n_local * I.h)
      throw std::logic_error("backward: missing or mis-sized output gradient");
    D.d_out = *grad_output;
  }
  for (int64_t l = c.num_layers - 1; l >= 0; --l) {
    LayerActs& L = A.layers[static_cast<size_t>(l)];
    const LayerParams& W = c.layers[static_cast<size_t>(l)];
    for (Exec op : I.layer_recompute) I.layer_forward_op(op, W, L);
    release(L.out);
    D.d_x.clear();
    for (Exec op : I.layer_bwd) I.layer_backward_op(op, W, L, D);
    D.d_out.swap(D.d_x);
    L = LayerActs();
  }
  if (c.first) {
    Buffer unused;
    for (Exec op : I.emb_bwd) I.embedding_op(op, c, A, unused, &D.d_out);
  } else {
    *grad_input = std::move(D.d_out);
  }
  I.stash.erase(it);
}

}  // namespace ptdp
