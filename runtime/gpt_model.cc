#include "runtime/gpt_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "core/error.h"
#include "core/plan_rules.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/hash.h"
#include "kernels/cpu/init.h"
#include "runtime/context_parallel.h"
#include "runtime/embedding_head.h"
#include "runtime/fsdp.h"
#include "runtime/moe_layer.h"
#include "runtime/shard_context.h"
#include "runtime/transformer_layer.h"

namespace ptdp {

void validate_shard_layout(const ModelSpec& m, const ShardLayout& s) {
  m.validate();
  if (s.dtype != DType::kF32 && s.dtype != DType::kBF16 && s.dtype != DType::kF16)
    throw InputError("--bf16", "ptdp run trains in fp32, bf16 or fp16, not " + to_string(s.dtype));
  // The plan rules of core/plan_rules.h on the plan this layout belongs to: one data-parallel
  // replica, p microbatches (a count any interleaved plan allows), each pipeline rank's layers
  // the sum of its chunks'.
  ParallelPlan plan;
  plan.tensor_parallel = s.t;
  plan.pipeline_parallel = s.p;
  plan.context_parallel = s.cp;
  plan.cp_comm = s.cp_a2a_size <= 1 || s.cp <= 1 ? CpComm::kP2P
                 : s.cp_a2a_size == s.cp         ? CpComm::kA2A
                                                 : CpComm::kA2AP2P;
  if (plan.cp_comm == CpComm::kA2AP2P) plan.hierarchical_cp = s.cp_a2a_size;
  plan.virtual_stages = s.v;
  plan.micro_batch_size = s.micro_batch;
  plan.global_batch_size = s.micro_batch * s.p;
  plan.schedule = s.v > 1 ? Schedule::kInterleaved1F1B : Schedule::k1F1B;
  plan.sequence_parallel = s.sequence_parallel;
  plan.recompute = s.recompute;
  plan.recompute_layers = s.recompute_layers;
  plan.recompute_modules = s.recompute_modules;
  if (m.is_moe()) {
    plan.expert_parallel = s.ep;
    plan.expert_tensor_parallel = s.etp;
    // The smallest data-parallel size the expert grid fits in (etp * ep | t * d).
    plan.data_parallel = std::max<int64_t>(1, s.ep * s.etp / std::gcd(s.ep * s.etp, s.t));
    plan.global_batch_size *= plan.data_parallel;
  } else if (s.ep != 1 || s.etp != 1) {
    throw InputError("--expert-model-parallel-size", "needs an MoE model (num_experts > 0)");
  }
  if (m.is_moe() && s.t > 1 && !s.sequence_parallel)
    throw InputError("--sequence-parallel",
                     "MoE layers with tensor parallelism need sequence parallelism (as in "
                     "Megatron-Core)");
  const bool listed = !s.layers_per_stage.empty() && s.p > 0 && s.v > 0;
  if (listed) {
    if (static_cast<int64_t>(s.layers_per_stage.size()) != s.p * s.v)
      throw InputError("layers_per_stage", "needs one entry per model chunk (p * v = " +
                                               std::to_string(s.p * s.v) + ")");
    plan.layers_per_chunk = s.layers_per_stage;  // a pipeline layout, chunk by chunk
  }
  check_plan(m, plan);
  if (s.cp_rank < 0 || s.cp_rank >= s.cp)
    throw InputError("--context-parallel-size", "rank " + std::to_string(s.cp_rank) +
                                                    " is outside the context-parallel group");
}

LayerShape runtime_layer_shape(const ModelSpec&, const ShardLayout& l) {
  LayerShape s;
  s.tensor_parallel = l.t;
  s.micro_batch = l.micro_batch;
  s.sequence_parallel = l.sequence_parallel && l.t > 1;
  s.recompute = l.recompute;
  s.recompute_modules = l.recompute_modules;
  s.fused_grad_accumulation = true;  // gradients accumulate in place
  s.main_grad_bytes = 4;
  s.activation_dtype = l.dtype;
  // Fused (flash) attention where the model asks for it or context parallelism needs it
  // (ShardDims::flash), as the planner prices it. The list's context-parallel ring steps are
  // run inside the attention ops (runtime/context_parallel.h), so compile() leaves them out.
  s.context_parallel = l.cp;
  // The heads all-to-all's ranks: all of them (Ulysses), A of a2a+p2p, or none (the ring).
  if (l.cp > 1 && l.cp_a2a_size > 1) {
    s.cp_comm = l.cp_a2a_size == l.cp ? CpComm::kA2A : CpComm::kA2AP2P;
    if (s.cp_comm == CpComm::kA2AP2P) s.hierarchical_cp = l.cp_a2a_size;
  }
  return s;
}

namespace {

// An MoE layer's forward (and recomputation) ops: the dense layer's and the routed path's.
bool is_moe_layer_forward_op(OpId id) {
  return is_layer_forward_op(id) || (id >= OpId::kRouter && id <= OpId::kMoeUnpermute);
}

bool is_mtp_op(OpId id) {
  return id >= OpId::kMtpNorms && id <= OpId::kMtpProjOutputScatterBackward;
}

// The ops ptdp run executes: all but the separate gradient-accumulation passes (the runtime
// accumulates weight gradients in place, as Megatron's fused accumulation does).
std::vector<OpId> compile(const std::vector<ptdp::Op>& ops, bool (*runs)(OpId)) {
  std::vector<OpId> program;
  for (const ptdp::Op& op : ops) {
    if (op.id == OpId::kCpKvExchange || op.id == OpId::kCpKvExchangeBackward ||
        op.id == OpId::kCpOutAllToAll || op.id == OpId::kCpOutAllToAllBackward)
      continue;
    if (!runs(op.id))
      throw std::logic_error("ptdp run has no implementation of layer op '" +
                             std::string(op.name()) + "'");
    program.push_back(op.id);
  }
  return program;
}

// A multi-token prediction module's own parameters (ChunkParams: the word embedding it looks
// up, its final norm and the shared output layer). Its layer follows the decoder's in Chunk.
struct MtpParams {
  ChunkParams head;
  int64_t enorm_g = -1, enorm_b = -1, hnorm_g = -1, hnorm_b = -1, eh = -1;
};

struct Chunk {
  int64_t first_layer = 0, num_layers = 0;
  bool first = false, last = false;
  // Per layer: the decoder's num_layers, then (last chunk) one per MTP module.
  std::vector<LayerParams> layers;
  std::vector<MoeLayerParams> moe;  // per layer; used where the layer is an MoE layer
  std::vector<bool> is_moe;
  ChunkParams params;
  std::vector<MtpParams> mtp;  // the last chunk's multi-token prediction modules
  // Per part of the chunk, in the order of the forward pass (the embedding, each layer, the
  // final norm and LM head, each MTP module): the ranges of the flat buffers holding its
  // parameters, one per segment it has parameters in, in segment order.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> parts;
};

// While an MoE layer runs, the dense MLP ops are its shared experts, of their own width.
struct SharedExpertWidth {
  SharedExpertWidth(ShardContext& c, const MoeContext* moe, bool active) : c(c), saved(c.dims.ffl) {
    if (active && moe) c.dims.ffl = moe->dims().shared_ffl;
  }
  ~SharedExpertWidth() { c.dims.ffl = saved; }
  ShardContext& c;
  int64_t saved;
};

}  // namespace

struct GptShard::Impl {
  std::unique_ptr<Backend> own_backend;
  std::unique_ptr<ShardContext> ctx;
  std::vector<Chunk> chunks;
  std::vector<OpId> layer_fwd, layer_bwd, layer_recompute, emb_fwd, emb_bwd, head_fwd, head_bwd;
  std::map<std::pair<int64_t, int64_t>, ChunkActs> stash;  // (chunk, microbatch)
  // MoE models: the MoE layers' programs, context and what each keeps for its backward pass.
  std::unique_ptr<MoeContext> moe;
  std::vector<OpId> moe_fwd, moe_bwd, moe_recompute;
  std::map<std::array<int64_t, 3>, MoeActs> moe_stash;  // (chunk, microbatch, layer)
  // Per op id: whether it computes a weight gradient (role kWeightGrad in the dense or the MoE
  // layer's backward list), which a zero-bubble schedule defers to the W pass.
  std::array<bool, kNumOpIds> weight_grad{};
  // Zero-bubble W passes still to run: per (chunk, microbatch), per layer, the activations and
  // output gradients the layer's weight-gradient GEMMs read.
  struct Deferred {
    LayerActs A;
    LayerGrads D;
  };
  std::map<std::pair<int64_t, int64_t>, std::vector<Deferred>> deferred;
  // Multi-token prediction: the projection's programs (mtp_projection_ops), what each module
  // keeps per (chunk, microbatch) for its backward pass, and the sum of the modules' losses
  // (unweighted) since GptShard::take_mtp_loss.
  std::vector<OpId> mtp_fwd, mtp_bwd;
  struct MtpActs {
    ChunkActs head;             // its tokens, layer, final norm, logits and masked loss
    Buffer x_e, cat, cat_full;  // the embedding (enorm's input), eh_proj's input
    Buffer e_mean{DType::kF32}, e_rstd{DType::kF32}, h_mean{DType::kF32}, h_rstd{DType::kF32};
  };
  std::map<std::pair<int64_t, int64_t>, std::vector<MtpActs>> mtp_stash;
  double mtp_loss = 0;
  MegatronFsdp* fsdp = nullptr;  // runtime/fsdp.h: maps each layer's windows around its passes
};

GptShard::GptShard(const ModelSpec& m, const ShardLayout& layout, Communicator* tensor_group,
                   uint64_t seed, Backend* backend)
    : model_(m), layout_(layout), impl_(std::make_unique<Impl>()) {
  validate_shard_layout(m, layout);
  Impl& J = *impl_;
  if (!backend) {
    J.own_backend = make_backend("cpu");
    backend = J.own_backend.get();
  }
  const ShardDims I = shard_dims(m, layout);
  J.ctx = std::make_unique<ShardContext>(*backend, tensor_group, I);

  const LayerShape shape = runtime_layer_shape(m, layout);
  const PassOps layer = transformer_layer_ops(m, shape);
  const PassOps emb = embedding_ops(m, shape), head = lm_head_ops(m, shape);
  J.layer_fwd = compile(layer.forward, is_layer_forward_op);
  J.layer_bwd = compile(layer.backward, is_layer_backward_op);
  auto mark_weight_grads = [&J](const PassOps& list) {
    for (const ptdp::Op& op : list.backward)
      if (op.role == OpRole::kWeightGrad) J.weight_grad[static_cast<size_t>(op.id)] = true;
  };
  mark_weight_grads(layer);
  J.layer_recompute = compile(layer.recompute, is_layer_forward_op);
  J.emb_fwd = compile(emb.forward, is_embedding_op);
  J.emb_bwd = compile(emb.backward, is_embedding_op);
  J.head_fwd = compile(head.forward, is_head_forward_op);
  J.head_bwd = compile(head.backward, is_head_backward_op);
  if (m.mtp_num_layers > 0) {
    const PassOps mtp = mtp_projection_ops(m, shape);
    J.mtp_fwd = compile(mtp.forward, is_mtp_op);
    J.mtp_bwd = compile(mtp.backward, is_mtp_op);
  }
  if (m.is_moe()) {
    const MoeDims md =
        moe_dims(m, layout.t, layout.ep, layout.ep_rank, layout.etp, layout.etp_rank);
    J.moe = std::make_unique<MoeContext>(m, md);
    J.moe_fwd = moe_forward_program(J.layer_fwd, md);
    J.moe_bwd = moe_backward_program(J.layer_bwd, md);
    // An MoE layer's recomputation is its op list's, at this rank's expert layout (whose
    // dispatch and combine ops run where ep > 1 and etp > 1, as moe_dims has them).
    LayerShape moe_shape = shape;
    moe_shape.expert_parallel = layout.ep;
    moe_shape.expert_tensor_parallel = layout.etp;
    J.moe_recompute = compile(moe_layer_ops(m, moe_shape).recompute, is_moe_layer_forward_op);
    mark_weight_grads(moe_layer_ops(m, shape));  // the router's and experts'
  }

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
      kernels::fill_hashed_normal(x, rows, cols, seed, id, sd, index);
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
      const int64_t real_rows = std::clamp<int64_t>(vocab - v0, 0, vl);
      std::fill(x + real_rows * h, x + vl * h, 0.0f);
    });
  };
  auto word_embedding = [&](bool tied_copy, const char* copy_name = "output_layer.weight") {
    ParamInfo p;
    p.name =
        tied_copy ? std::string(copy_name) + " (tied copy)" : "embedding.word_embeddings.weight";
    p.segment = 0;
    p.tied_copy = tied_copy;
    return vocab_table(p, "embedding.word_embeddings.weight");
  };

  const int64_t stages = layout.p * layout.v;
  std::vector<int64_t> per_stage = layout.layers_per_stage;
  if (per_stage.empty()) per_stage.assign(static_cast<size_t>(stages), m.num_layers / stages);
  J.chunks.resize(static_cast<size_t>(layout.v));
  int64_t word_index = -1;
  using MoeIdx = MoeLayerParams;  // parameter indices until the offsets are known
  // One transformer layer's parameters (named `pre`...; an MoE layer's routed experts too).
  auto add_layer = [&](const std::string& pre, bool moe_layer) {
    std::array<int64_t, 22> L;
    L.fill(-1);
    L[0] = replicated(pre + "input_layernorm.weight", h, 1.0f);
    if (I.biases) L[1] = replicated(pre + "input_layernorm.bias", h, 0.0f);
    if (I.mla) {
      // The down projections [width, h], whole on every rank (gradients partial over the
      // ranks' tokens with sequence parallelism, as a norm's), and the latents' norms.
      auto whole = [&](const std::string& name, int64_t rows) {
        ParamInfo p;
        p.name = pre + name;
        p.size = rows * h;
        p.tp_replicated = true;
        p.sp_partial = I.sp;
        return add(
            p, normal(p.name, rows, h, std_dev, [=](int64_t r, int64_t c2) { return r * h + c2; }));
      };
      // The up projections, column-parallel: the local heads' rows of [heads x per_head, in].
      auto up = [&](const std::string& name, int64_t per_head, int64_t in) {
        ParamInfo p;
        p.name = pre + name;
        const int64_t rows = I.hl * per_head;
        p.size = rows * in;
        return add(p, normal(p.name, rows, in, std_dev,
                             [=](int64_t r, int64_t c2) { return (tp * rows + r) * in + c2; }));
      };
      if (I.ql > 0) {
        L[16] = whole("q_down_proj.weight", I.ql);
        if (I.qk_norm) L[17] = replicated(pre + "q_layernorm.weight", I.ql, 1.0f);
      }
      L[18] = up(I.ql > 0 ? "q_up_proj.weight" : "q_proj.weight", d, I.ql > 0 ? I.ql : h);
      L[19] = whole("kv_down_proj.weight", I.kv_latent_width());
      if (I.qk_norm) L[20] = replicated(pre + "kv_layernorm.weight", I.kvl, 1.0f);
      L[21] = up("kv_up_proj.weight", I.dn + I.dv, I.kvl);
    } else {  // QKV: rows [q of local heads | k of local groups | v of local groups]
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
      if (I.qkv_bias) {
        ParamInfo pb;
        pb.name = pre + "qkv.bias";
        pb.size = I.qkv_width();
        pb.decay = false;
        L[3] = add(pb, constant(pb.size, 0.0f));
      }
    }
    if (m.qk_layernorm && !I.mla) {  // one norm of d for every query head, one for every key head
      auto head_norm = [&](const std::string& name, float value) {
        const int64_t at = replicated(pre + name, d, value);
        pending[static_cast<size_t>(at)].info.tp_partial = true;
        return at;
      };
      L[12] = head_norm("q_layernorm.weight", 1.0f);
      if (I.biases) L[13] = head_norm("q_layernorm.bias", 0.0f);
      L[14] = head_norm("k_layernorm.weight", 1.0f);
      if (I.biases) L[15] = head_norm("k_layernorm.bias", 0.0f);
    }
    {
      ParamInfo p;
      p.name = pre + "attn_proj.weight";
      p.size = h * I.hl * I.dv;
      const int64_t in_local = I.hl * I.dv, in = I.heads * I.dv;
      L[4] = add(p, normal(p.name, h, in_local, out_std,
                           [=](int64_t r, int64_t c2) { return r * in + tp * in_local + c2; }));
      if (I.biases) L[5] = replicated(pre + "attn_proj.bias", h, 0.0f);
    }
    L[6] = replicated(pre + "post_attention_layernorm.weight", h, 1.0f);
    if (I.biases) L[7] = replicated(pre + "post_attention_layernorm.bias", h, 0.0f);
    // An MoE layer's dense MLP is its shared experts (absent without them).
    const std::string mlp = moe_layer ? pre + "shared_experts." : pre;
    if (!moe_layer || m.moe_shared_expert_ffn_size > 0) {  // FC1: rows [gate | up] for SwiGLU
      const int64_t ffn = moe_layer ? m.moe_shared_expert_ffn_size : m.ffn_hidden();
      const int64_t ffl = ffn / layout.t;
      ParamInfo p;
      p.name = mlp + "fc1.weight";
      const int64_t fc1_rows = m.swiglu ? 2 * ffl : ffl;
      p.size = fc1_rows * h;
      L[8] = add(p, normal(p.name, fc1_rows, h, std_dev, [=](int64_t r, int64_t c2) {
                   const int64_t part = r / ffl, row = r % ffl;
                   return (part * ffn + tp * ffl + row) * h + c2;
                 }));
      if (I.biases) {
        ParamInfo pb;
        pb.name = mlp + "fc1.bias";
        pb.size = ffl;
        pb.decay = false;
        L[9] = add(pb, constant(ffl, 0.0f));
      }
      ParamInfo p2;
      p2.name = mlp + "fc2.weight";
      p2.size = h * ffl;
      L[10] = add(p2, normal(p2.name, h, ffl, out_std,
                             [=](int64_t r, int64_t c2) { return r * ffn + tp * ffl + c2; }));
      if (I.biases) L[11] = replicated(mlp + "fc2.bias", h, 0.0f);
    }
    return std::pair{L, moe_layer ? add_moe_parameters(m, layout, I.sp, seed, pre, add) : MoeIdx{}};
  };
  struct ChunkIdx {
    std::vector<std::array<int64_t, 22>> layers;
    std::vector<MoeIdx> moe;
    int64_t word = -1, pos = -1, lnf_g = -1, lnf_b = -1, head = -1;
    struct Mtp {
      int64_t word = -1, enorm_g = -1, enorm_b = -1, hnorm_g = -1, hnorm_b = -1, eh = -1;
      int64_t lnf_g = -1, lnf_b = -1;
    };
    std::vector<Mtp> mtp;
    // Where each part's parameters begin in `pending` (embedding, layers, head), and the end
    // (and of each MTP module).
    std::vector<int64_t> part_begin;
  };
  std::vector<ChunkIdx> idx(static_cast<size_t>(layout.v));
  for (int64_t c = 0; c < layout.v; ++c) {
    Chunk& ch = J.chunks[static_cast<size_t>(c)];
    ChunkIdx& ix = idx[static_cast<size_t>(c)];
    const int64_t g = c * layout.p + layout.pp;
    ch.first = g == 0;
    ch.last = g == stages - 1;
    ch.first_layer = std::accumulate(per_stage.begin(), per_stage.begin() + g, int64_t{0});
    ch.num_layers = per_stage[static_cast<size_t>(g)];
    ix.part_begin.push_back(static_cast<int64_t>(pending.size()));
    if (ch.first) ix.word = word_index = word_embedding(false);
    if (ch.first && m.learned_position_embeddings) {
      ParamInfo p;
      p.name = "embedding.position_embeddings.weight";
      p.size = m.max_positions() * h;  // positions past seq_length are never looked up
      p.tp_replicated = true;
      p.sp_partial = I.sp;
      ix.pos = add(p, normal(p.name, m.max_positions(), h, std_dev,
                             [=](int64_t r, int64_t c2) { return r * h + c2; }));
    }
    for (int64_t l = 0; l < ch.num_layers; ++l) {
      ix.part_begin.push_back(static_cast<int64_t>(pending.size()));
      const int64_t global = ch.first_layer + l;
      const auto [L, moe_params] =
          add_layer("layers." + std::to_string(global) + ".", m.is_moe_layer(global));
      ix.moe.push_back(moe_params);
      ix.layers.push_back(L);
    }
    ix.part_begin.push_back(static_cast<int64_t>(pending.size()));
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
    ix.part_begin.push_back(static_cast<int64_t>(pending.size()));
    // Multi-token prediction modules, each a part: the norms of its embedding and hidden state,
    // eh_proj (column-parallel, 2h -> h), a layer of the decoder's last layer's kind, its final
    // norm. Its inputs are looked up in the first stage's word embedding where this rank holds
    // it, else in the tied output layer, else in a copy kept equal to the first stage's as the
    // tied copy is (the first module's part holds it).
    for (int64_t k = 0; ch.last && k < m.mtp_num_layers; ++k) {
      const std::string pre = "mtp.layers." + std::to_string(k) + ".";
      ChunkIdx::Mtp& mx = ix.mtp.emplace_back();
      mx.word = word_index >= 0 ? word_index
                : !m.untie_embeddings_and_output_weights
                    ? ix.head
                    : (k == 0 ? word_embedding(true, "mtp.embedding.word_embeddings.weight")
                              : ix.mtp.front().word);
      mx.enorm_g = replicated(pre + "enorm.weight", h, 1.0f);
      if (I.biases) mx.enorm_b = replicated(pre + "enorm.bias", h, 0.0f);
      mx.hnorm_g = replicated(pre + "hnorm.weight", h, 1.0f);
      if (I.biases) mx.hnorm_b = replicated(pre + "hnorm.bias", h, 0.0f);
      {
        ParamInfo p;
        p.name = pre + "eh_proj.weight";
        const int64_t rows = h / layout.t;
        p.size = rows * 2 * h;
        mx.eh = add(p, normal(p.name, rows, 2 * h, std_dev,
                              [=](int64_t r, int64_t c2) { return (tp * rows + r) * 2 * h + c2; }));
      }
      const auto [L, moe_params] = add_layer(pre + "transformer_layer.", m.mtp_layer_is_moe());
      ix.moe.push_back(moe_params);
      ix.layers.push_back(L);
      mx.lnf_g = replicated(pre + "final_layernorm.weight", h, 1.0f);
      if (I.biases) mx.lnf_b = replicated(pre + "final_layernorm.bias", h, 0.0f);
      ix.part_begin.push_back(static_cast<int64_t>(pending.size()));
    }
  }

  // Offsets: segment 0 first, then segment 1 (and 2), each padded.
  int64_t offset = 0;
  for (int seg = 0; seg < (m.is_moe() ? 3 : 2); ++seg) {
    const int64_t mult =
        std::max<int64_t>(1, seg == 2 ? layout.expert_segment_multiple : layout.segment_multiple);
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
  flat_size_ = offset;
  for (Pending& p : pending) infos_.push_back(p.info);
  auto off = [&](int64_t i) { return i < 0 ? int64_t{-1} : infos_[static_cast<size_t>(i)].offset; };
  for (int64_t c = 0; c < layout.v; ++c) {
    Chunk& ch = J.chunks[static_cast<size_t>(c)];
    const ChunkIdx& ix = idx[static_cast<size_t>(c)];
    for (size_t part = 0; part + 1 < ix.part_begin.size(); ++part) {
      // A part's parameters in one segment are consecutive there (offsets follow `pending`).
      std::vector<std::pair<int64_t, int64_t>>& ranges = ch.parts.emplace_back();
      for (int seg = 0; seg < static_cast<int>(segments_.size()); ++seg) {
        int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
        for (int64_t i = ix.part_begin[part]; i < ix.part_begin[part + 1]; ++i) {
          const ParamInfo& p = infos_[static_cast<size_t>(i)];
          if (p.segment != seg || p.size == 0) continue;
          lo = std::min(lo, p.offset);
          hi = std::max(hi, p.offset + p.size);
        }
        if (hi > lo) ranges.emplace_back(lo, hi);
      }
    }
    ch.params.word = off(ix.word);
    ch.params.pos = off(ix.pos);
    ch.params.lnf_g = off(ix.lnf_g);
    ch.params.lnf_b = off(ix.lnf_b);
    ch.params.head = off(ix.head);
    for (const ChunkIdx::Mtp& mx : ix.mtp) {
      MtpParams& mp = ch.mtp.emplace_back();
      mp.head = {off(mx.word), -1, off(mx.lnf_g), off(mx.lnf_b), ch.params.head};
      mp.enorm_g = off(mx.enorm_g);
      mp.enorm_b = off(mx.enorm_b);
      mp.hnorm_g = off(mx.hnorm_g);
      mp.hnorm_b = off(mx.hnorm_b);
      mp.eh = off(mx.eh);
    }
    for (size_t li = 0; li < ix.layers.size(); ++li) {
      const auto& L = ix.layers[li];
      const MoeIdx& mx = ix.moe[li];
      MoeLayerParams MW;
      MW.router = off(mx.router);
      for (size_t e = 0; e < mx.fc1_w.size(); ++e) {
        MW.fc1_w.push_back(off(mx.fc1_w[e]));
        MW.fc1_b.push_back(off(mx.fc1_b[e]));
        MW.fc2_w.push_back(off(mx.fc2_w[e]));
        MW.fc2_b.push_back(off(mx.fc2_b[e]));
      }
      ch.moe.push_back(MW);
      const auto layer = static_cast<int64_t>(li);  // past the decoder's: an MTP module's
      ch.is_moe.push_back(layer < ch.num_layers ? m.is_moe_layer(ch.first_layer + layer)
                                                : m.mtp_layer_is_moe());
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
      W.qn_g = off(L[12]);
      W.qn_b = off(L[13]);
      W.kn_g = off(L[14]);
      W.kn_b = off(L[15]);
      W.q_down_w = off(L[16]);
      W.qlat_g = off(L[17]);
      W.q_up_w = off(L[18]);
      W.kv_down_w = off(L[19]);
      W.kvlat_g = off(L[20]);
      W.kv_up_w = off(L[21]);
      ch.layers.push_back(W);
    }
  }
  // What this rank holds of the flat arrays: all of them, or with Megatron-FSDP its shard of
  // each segment (the distributed optimizer's), and of the weights also what stays whole (all
  // but the decoder layers'). The rest is mapped while a layer's passes run (runtime/fsdp.h).
  std::vector<std::pair<int64_t, int64_t>> held_params, held_grads;
  if (layout.fsdp >= FsdpSharding::kOptimGrads) {
    for (size_t seg = 0; seg < segments_.size(); ++seg) held_grads.push_back(own_shard(seg));
    held_params = held_grads;
    if (layout.fsdp == FsdpSharding::kOptimGradsParams) {
      for (int64_t part = 0; part < static_cast<int64_t>(J.chunks[0].parts.size()); ++part)
        if (!fsdp_unit(0, part))
          for (const auto& r : J.chunks[0].parts[static_cast<size_t>(part)])
            held_params.push_back(r);
    } else {
      held_params = {{0, offset}};
    }
  } else {
    held_params = held_grads = {{0, offset}};
  }
  auto allocate = [&](std::vector<std::pair<int64_t, int64_t>> ranges, DType type, FlatMap& map) {
    std::sort(ranges.begin(), ranges.end());
    std::vector<std::pair<int64_t, int64_t>> merged;
    for (const auto& r : ranges) {
      if (r.second <= r.first) continue;
      if (!merged.empty() && r.first <= merged.back().second)
        merged.back().second = std::max(merged.back().second, r.second);
      else
        merged.push_back(r);
    }
    int64_t n = 0;
    for (const auto& [lo, hi] : merged) n += hi - lo;
    DeviceBuffer buffer(*backend, type, n);
    n = 0;
    for (const auto& [lo, hi] : merged) {
      map.map(lo, hi, buffer.ptr().at(n));
      n += hi - lo;
    }
    return buffer;
  };
  params_ = allocate(held_params, layout.dtype, param_map_);
  grads_ = allocate(held_grads, DType::kF32, grad_map_);
  J.ctx->params = &param_map_;
  J.ctx->grads = &grad_map_;
  // Initial values are computed on the host in fp32 (rounded to bf16 for a bf16 model, as
  // Megatron casts its initialised fp32 weights) and uploaded parameter by parameter (the parts
  // of it held here).
  std::vector<float> host;
  for (Pending& p : pending) {
    host.assign(static_cast<size_t>(p.info.size), 0.0f);
    p.init(host.data());
    param_map_.for_each_mapped(
        p.info.offset, p.info.offset + p.info.size, [&](int64_t lo, int64_t hi, Ptr at) {
          upload_floats(*backend, host.data() + (lo - p.info.offset), at, hi - lo);
        });
  }
}

GptShard::~GptShard() = default;

namespace {

// Shards of segment `seg` under `l` (ShardLayout::segment_multiple, the experts' their own).
int64_t shards_of(const ShardLayout& l, size_t seg) {
  return std::max<int64_t>(1, seg == 2 ? l.expert_segment_multiple : l.segment_multiple);
}

}  // namespace

std::pair<int64_t, int64_t> GptShard::own_shard(size_t seg) const {
  const Segment& s = segments_.at(seg);
  const int64_t rank = seg == 2 ? layout_.expert_shard_rank : layout_.shard_rank;
  const int64_t shard = s.size / shards_of(layout_, seg);
  return {s.offset + rank * shard, s.offset + (rank + 1) * shard};
}

std::vector<size_t> block_counts(const Segment& s, int64_t blocks, int64_t lo, int64_t hi) {
  const int64_t block = s.size / blocks;
  std::vector<size_t> out(static_cast<size_t>(blocks));
  for (int64_t q = 0; q < blocks; ++q) {
    const int64_t begin = s.offset + q * block;
    out[static_cast<size_t>(q)] = static_cast<size_t>(
        std::max<int64_t>(0, std::min(hi, begin + block) - std::max(lo, begin)));
  }
  return out;
}

std::vector<size_t> GptShard::shard_counts(size_t seg, int64_t lo, int64_t hi) const {
  return block_counts(segments_.at(seg), shards_of(layout_, seg), lo, hi);
}

const std::vector<std::vector<std::pair<int64_t, int64_t>>>& GptShard::parts(int64_t chunk) const {
  return impl_->chunks.at(static_cast<size_t>(chunk)).parts;
}

bool GptShard::fsdp_unit(int64_t chunk, int64_t part) const {
  const Chunk& ch = impl_->chunks.at(static_cast<size_t>(chunk));
  return part >= 1 && part <= ch.num_layers;
}

void GptShard::set_fsdp(MegatronFsdp* fsdp) {
  if (fsdp && (layout_.p != 1 || layout_.v != 1))
    throw std::logic_error("Megatron-FSDP runs one pipeline stage of one chunk");
  impl_->fsdp = fsdp;
}

std::vector<std::pair<int64_t, int64_t>> GptShard::part_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const Chunk& ch : impl_->chunks)
    for (const auto& ranges : ch.parts) out.insert(out.end(), ranges.begin(), ranges.end());
  return out;
}

namespace {

// Calls `hook` (if any) for each range of part `part` of `ch`, the op timer closed first so that
// what the hook waits for or starts is not counted as the previous op's time.
void call_part_hook(const GptShard::PartHook* hook, const Chunk& ch, int64_t part,
                    ShardContext& c) {
  if (!hook) return;
  if (c.timer) c.timer->close();
  for (const auto& [lo, hi] : ch.parts[static_cast<size_t>(part)]) (*hook)(lo, hi);
}

// Megatron-FSDP's hook `f` for `part` (when the shard has it), the op timer closed first.
void call_fsdp(GptShard::Impl& I, void (MegatronFsdp::*f)(int64_t), int64_t part) {
  if (!I.fsdp) return;
  if (I.ctx->timer) I.ctx->timer->close();
  (I.fsdp->*f)(part);
}

// The embedding's and the head's ops (the decoder's, and each MTP module's): forward into x /
// returning the loss; backward from dx / into D, the gradient `d_output` (when not empty) added
// to the final norm's output gradient before its backward pass (an MTP module's hand-back).
void embedding_forward(GptShard::Impl& I, const ChunkParams& W, ChunkActs& A, Buffer& x) {
  for (OpId op : I.emb_fwd) {
    I.ctx->begin(op, PassKind::kForward);
    embedding_op(*I.ctx, op, W, A, x, nullptr);
  }
}
void embedding_backward(GptShard::Impl& I, const ChunkParams& W, ChunkActs& A, Buffer& dx) {
  Buffer unused;
  for (OpId op : I.emb_bwd) {
    I.ctx->begin(op, PassKind::kBackward);
    embedding_op(*I.ctx, op, W, A, unused, &dx);
  }
}
double head_forward(GptShard::Impl& I, const ChunkParams& W, ChunkActs& A) {
  double loss = 0;
  for (OpId op : I.head_fwd) {
    I.ctx->begin(op, PassKind::kForward);
    loss += head_forward_op(*I.ctx, op, W, A);
  }
  return loss;
}
void head_backward(GptShard::Impl& I, const ChunkParams& W, ChunkActs& A, LayerGrads& D,
                   double loss_scale, const Buffer& d_output) {
  ShardContext& c = *I.ctx;
  for (OpId op : I.head_bwd) {
    if (op == OpId::kFinalLayernormBackward && !d_output.empty())
      c.be.add((c.dims.sp ? D.d_ln1 : D.d_ln1_full).ptr(), d_output.ptr(), elems(d_output));
    c.begin(op, PassKind::kBackward);
    head_backward_op(c, op, W, A, D, loss_scale);
  }
}

// Layer l of chunk `chunk` (past the decoder's layers: an MTP module's) forward for microbatch
// mb: x, its input, becomes its output; L keeps what its backward pass needs under `rec`.
void layer_forward(GptShard::Impl& I, const ShardLayout& layout, const Chunk& ch, int64_t chunk,
                   int64_t mb, int64_t l, Recompute rec, LayerActs& L, Buffer& x) {
  ShardContext& c = *I.ctx;
  L.x.swap(x);
  const bool moe = ch.is_moe[static_cast<size_t>(l)];
  SharedExpertWidth width(c, I.moe.get(), moe);
  MoeActs* M = moe ? &I.moe_stash[{chunk, mb, l}] : nullptr;
  const unsigned modules = layout.recompute_modules_of(moe);
  L.rerun_attention = rec == Recompute::kSelective && (modules & kRecomputeCoreAttn);
  for (OpId op : moe ? I.moe_fwd : I.layer_fwd) {
    c.begin(op, PassKind::kForward);
    if (is_moe_op(op))
      moe_forward_op(c, *I.moe, op, ch.moe[static_cast<size_t>(l)], L.ln2, L.fc2, *M);
    else
      layer_forward_op(c, op, ch.layers[static_cast<size_t>(l)], L);
  }
  c.end_op();
  x.swap(L.out);
  release(L.out);
  drop_recomputed(L, rec, modules);
  if (M && rec == Recompute::kSelective) {
    if (modules & kRecomputeMoe)
      release_routed(*M);  // the whole layer is rerun from its input
    else if (modules & kRecomputeMoeAct)
      release(M->act);  // the experts' FC2 input: their activation is rerun
  }
}

// Its backward pass: recomputes what `rec` dropped, then D.d_out (the output's gradient) gives
// D.d_x (the input's); with `defer`, without the weight-gradient GEMMs (the W pass's).
void layer_backward(GptShard::Impl& I, const ShardLayout& layout, const Chunk& ch, int64_t chunk,
                    int64_t mb, int64_t l, Recompute rec, LayerActs& L, LayerGrads& D, bool defer) {
  ShardContext& c = *I.ctx;
  const LayerParams& W = ch.layers[static_cast<size_t>(l)];
  const bool moe = ch.is_moe[static_cast<size_t>(l)];
  SharedExpertWidth width(c, I.moe.get(), moe);
  MoeActs* M = moe ? &I.moe_stash[{chunk, mb, l}] : nullptr;
  const MoeLayerParams& MW = ch.moe[static_cast<size_t>(l)];
  if (rec != Recompute::kNone) {
    for (OpId op : moe ? I.moe_recompute : I.layer_recompute) {
      c.begin(op, PassKind::kRecompute);
      if (is_moe_op(op))
        moe_forward_op(c, *I.moe, op, MW, L.ln2, L.fc2, *M);
      else
        layer_forward_op(c, op, W, L);
    }
    c.end_op();
    // The recomputed MLP's output (its FC2's, reduced): the residual it fed is kept.
    if (rec == Recompute::kSelective && (layout.recompute_modules_of(moe) & kRecomputeMlp))
      release(L.fc2);
  }
  release(L.out);
  D.d_x.clear();
  // The gradient of the post-attention layernorm's output (its sequence-parallel slice).
  Buffer& d_ln2 = c.dims.sp ? D.d_ln2 : D.d_ln2_full;
  for (OpId op : moe ? I.moe_bwd : I.layer_bwd) {
    if (defer && I.weight_grad[static_cast<size_t>(op)]) continue;  // the W pass's
    // The fused attention's recomputation of the scores is the backward list's one recompute.
    c.begin(op, op == OpId::kAttnScoresRecompute ? PassKind::kRecompute : PassKind::kBackward);
    if (is_moe_op(op))
      moe_backward_op(c, *I.moe, op, MW, L.ln2, D.d_out, d_ln2, *M);
    else
      layer_backward_op(c, op, W, L, D);
  }
  c.end_op();
}

// What an MTP module's layer recomputes: the decoder's mode, except block recomputation
// (--recompute-num-layers with full), which Megatron-Core does not apply to it.
Recompute mtp_recompute(const ShardLayout& l) {
  return l.recompute == Recompute::kFull && l.recompute_layers > 0 ? Recompute::kNone : l.recompute;
}

// Module k's tokens (Megatron-Core rolls the inputs and labels left once a module, and masks
// what rolled past the end): at global position i the input t[i + k + 1] and the target
// t[i + k + 2], for i < s - k - 1; beyond, input 0 and no loss. The loss's runs of rows, and
// its divisor: the module's targets over the whole sequence, shared by the cp ranks.
void mtp_tokens(const ShardDims& d, const int32_t* tokens, int64_t k, ChunkActs& A) {
  const int64_t s = d.s_attn, shift = k + 1, sl = s / d.cp;
  A.inputs.assign(static_cast<size_t>(d.n_full), 0);
  A.targets.assign(static_cast<size_t>(d.n_full), 0);
  A.masked = true;
  A.loss_rows.clear();
  for (int64_t bi = 0; bi < d.b; ++bi) {
    const int32_t* seq = tokens + bi * (s + 1);
    for (const PositionRun& run : context_runs(s, d.cp, d.cpr, 0, sl)) {
      const int64_t valid = std::clamp<int64_t>(s - shift - run.global, 0, run.len);
      for (int64_t i = 0; i < valid; ++i) {
        const auto row = static_cast<size_t>(bi * sl + run.local + i);
        A.inputs[row] = seq[run.global + i + shift];
        A.targets[row] = seq[run.global + i + shift + 1];
      }
      if (valid > 0) A.loss_rows.emplace_back(bi * sl + run.local, valid);
    }
  }
  A.loss_tokens = static_cast<double>(d.b * (s - shift)) / static_cast<double>(d.cp);
}

// MTP module k's forward pass (mtp_projection_ops between the embedding's and the head's ops):
// its embedding of the rolled tokens and `hidden` (the previous module's output, the first's
// the decoder's final norm's; this rank's sequence-parallel rows) each normalised and
// concatenated, eh_proj, the layer, its final norm, the shared output layer and the masked loss.
// Returns that loss (unweighted).
double mtp_forward(GptShard::Impl& I, const ModelSpec& m, const ShardLayout& layout,
                   const Chunk& ch, int64_t chunk, int64_t mb, int64_t k, const int32_t* tokens,
                   const Buffer& hidden, GptShard::Impl::MtpActs& T) {
  ShardContext& c = *I.ctx;
  const ShardDims& d = c.dims;
  const MtpParams& P = ch.mtp[static_cast<size_t>(k)];
  const int64_t h = d.h, hl = h / d.t;
  mtp_tokens(d, tokens, k, T.head);
  T.head.loss_weight = m.mtp_loss_scaling_factor / static_cast<double>(m.mtp_num_layers);
  Buffer x;
  embedding_forward(I, P.head, T.head, x);
  Buffer y;  // eh_proj's output columns, [n, h / t]
  for (OpId op : I.mtp_fwd) {
    c.begin(op, PassKind::kForward);
    switch (op) {
      case OpId::kMtpNorms: {
        Buffer e_n, h_n;
        c.norm_forward(x, P.enorm_g, P.enorm_b, e_n, T.e_mean, T.e_rstd, d.n_local);
        c.norm_forward(hidden, P.hnorm_g, P.hnorm_b, h_n, T.h_mean, T.h_rstd, d.n_local);
        resize_for_overwrite(T.cat, d.n_local * 2 * h);
        c.be.concat_columns3(e_n.ptr(), h_n.ptr(), e_n.ptr(), T.cat.ptr(), d.n_local, h, h, 0);
        T.x_e.swap(x);
        break;
      }
      case OpId::kMtpProjAllGather:
        c.gather_sequence(T.cat, T.cat_full, 2 * h);
        release(T.cat);
        break;
      case OpId::kMtpEhProj: {
        const Buffer& in = d.sp ? T.cat_full : T.cat;
        resize_for_overwrite(y, d.n_full * hl);
        c.linear(in.ptr(), P.eh, -1, y.ptr(), d.n_full, 2 * h, hl);
        break;
      }
      case OpId::kMtpProjOutputAllGather: {
        // Every rank's columns side by side, then (sequence parallelism) this rank's rows.
        Buffer shards, full;
        resize_for_overwrite(shards, d.t * d.n_full * hl);
        c.all_gather(y.ptr(), shards.ptr(), d.n_full * hl);
        resize_for_overwrite(full, d.n_full * h);
        c.be.sequence_unshard(shards.ptr(), full.ptr(), d.t, d.n_full, d.t, hl);
        if (d.sp) {
          c.be.sequence_shard(full.ptr(), shards.ptr(), d.t, d.b, d.s, h);
          resize_for_overwrite(y, d.n_local * h);
          c.be.copy(shards.ptr().at(d.tp * d.n_local * h), y.ptr(), d.n_local * h);
        } else {
          y.swap(full);
        }
        break;
      }
      default:
        throw std::logic_error("not an MTP forward op");
    }
  }
  x.swap(y);
  T.head.layers.resize(1);
  layer_forward(I, layout, ch, chunk, mb, ch.num_layers + k, mtp_recompute(layout),
                T.head.layers[0], x);
  T.head.lnf_in.swap(x);
  return head_forward(I, P.head, T.head);
}

// Its backward pass. d_hidden: on entry the gradient of this module's output that the next
// module handed back (empty for the last), on return the gradient of `hidden`.
void mtp_backward(GptShard::Impl& I, const ShardLayout& layout, const Chunk& ch, int64_t chunk,
                  int64_t mb, int64_t k, const Buffer& hidden, double loss_scale,
                  GptShard::Impl::MtpActs& T, Buffer& d_hidden) {
  ShardContext& c = *I.ctx;
  const ShardDims& d = c.dims;
  const MtpParams& P = ch.mtp[static_cast<size_t>(k)];
  const int64_t h = d.h, hl = h / d.t;
  LayerGrads D;
  head_backward(I, P.head, T.head, D, loss_scale, d_hidden);
  const int64_t l = ch.num_layers + k;
  layer_backward(I, layout, ch, chunk, mb, l, mtp_recompute(layout), T.head.layers[0], D, false);
  T.head.layers.clear();
  if (ch.is_moe[static_cast<size_t>(l)]) I.moe_stash.erase({chunk, mb, l});
  Buffer d_full = std::move(D.d_x);  // the layer input's gradient, [n, h] after the gathers
  Buffer dy, d_cat;                  // eh_proj's output columns' and its input's gradients
  auto output_columns = [&] {        // this rank's h / t columns of d_full
    if (d.t == 1) return dy.swap(d_full);
    Buffer shards;
    resize_for_overwrite(shards, d.n_full * h);
    c.be.sequence_shard(d_full.ptr(), shards.ptr(), d.t, d.n_full, d.t, hl);
    resize_for_overwrite(dy, d.n_full * hl);
    c.be.copy(shards.ptr().at(d.tp * d.n_full * hl), dy.ptr(), d.n_full * hl);
  };
  for (OpId op : I.mtp_bwd) {
    c.begin(op, PassKind::kBackward);
    switch (op) {
      case OpId::kMtpProjOutputScatterBackward: {
        Buffer full;
        c.gather_sequence(d_full, full, h);
        d_full.swap(full);
        break;
      }
      case OpId::kMtpEhProjDgrad:
        output_columns();
        resize_for_overwrite(d_cat, d.n_full * 2 * h);
        c.linear_dgrad(P.eh, dy.ptr(), d_cat.ptr(), d.n_full, 2 * h, hl);
        break;
      case OpId::kMtpEhProjWgrad:
        c.linear_wgrad((d.sp ? T.cat_full : T.cat).ptr(), dy.ptr(), P.eh, -1, d.n_full, 2 * h, hl);
        release(T.cat);
        release(T.cat_full);
        release(dy);
        break;
      case OpId::kMtpProjInputGradReduce:
        if (d.sp) {
          Buffer local;
          c.scatter_sequence(d_cat, local, 2 * h);
          d_cat.swap(local);
        } else {
          c.all_reduce(d_cat);
        }
        break;
      case OpId::kMtpNormsBackward: {
        Buffer d_en, d_hn, d_xe;
        resize_for_overwrite(d_en, d.n_local * h);
        resize_for_overwrite(d_hn, d.n_local * h);
        c.be.split_columns3(d_cat.ptr(), d_en.ptr(), d_hn.ptr(), d_en.ptr(), d.n_local, h, h, 0);
        release(d_cat);
        c.norm_backward(T.x_e, P.enorm_g, P.enorm_b, T.e_mean, T.e_rstd, d_en, d_full, d.n_local);
        c.norm_backward(hidden, P.hnorm_g, P.hnorm_b, T.h_mean, T.h_rstd, d_hn, d_hidden,
                        d.n_local);
        break;
      }
      default:
        throw std::logic_error("not an MTP backward op");
    }
  }
  // The embedding's gradient (d_full now holds enorm's input gradient) into the word table.
  embedding_backward(I, P.head, T.head, d_full);
  c.end_op();
}
}  // namespace

bool GptShard::first_stage(int64_t chunk) const {
  return impl_->chunks[static_cast<size_t>(chunk)].first;
}
bool GptShard::last_stage(int64_t chunk) const {
  return impl_->chunks[static_cast<size_t>(chunk)].last;
}
int64_t GptShard::boundary_elements() const {
  return impl_->ctx->dims.n_local * impl_->ctx->dims.h;
}
int64_t GptShard::tokens_per_microbatch() const {
  return impl_->ctx->dims.b * (impl_->ctx->dims.s_attn + 1);
}
void GptShard::set_context_group(Communicator* group, Communicator* a2a_group,
                                 Communicator* ring_group) {
  if (group && group->size() != layout_.cp)
    throw std::logic_error("the context-parallel group's size differs from the layout's cp");
  const int64_t a = impl_->ctx->dims.cp_a2a_size;
  const bool hierarchical = a > 1 && a < layout_.cp;
  if (hierarchical &&
      (!a2a_group || a2a_group->size() != a || !ring_group || ring_group->size() != layout_.cp / a))
    throw std::logic_error("a2a+p2p needs its all-to-all and ring groups");
  ShardContext& c = *impl_->ctx;
  c.cp = group;
  c.cp_heads = hierarchical ? a2a_group : group;
  c.cp_ring = hierarchical ? ring_group : group;
}
Backend& GptShard::backend() {
  return impl_->ctx->be;
}
void GptShard::trace_ops(std::vector<ExecutedOp>* sink) {
  impl_->ctx->trace = sink;
}
void GptShard::time_ops(OpTimer* timer) {
  impl_->ctx->timer = timer;
}
void GptShard::set_expert_groups(Communicator* ep, Communicator* etp) {
  if (impl_->moe) impl_->moe->set_groups(ep, etp);
}

double GptShard::expert_load() const {
  return impl_->moe ? impl_->moe->measured_load() : 0.0;
}

double GptShard::take_mtp_loss() {
  return std::exchange(impl_->mtp_loss, 0.0);
}

int64_t GptShard::real_parameters() const {
  int64_t n = 0;
  for (const ParamInfo& p : infos_)
    if (!p.tied_copy) n += p.real_size;
  return n;
}

double GptShard::forward(int64_t chunk, int64_t mb, const int32_t* tokens, const Buffer* input,
                         Buffer* output, const PartHook* before) {
  Impl& I = *impl_;
  ShardContext& c = *I.ctx;
  const ShardDims& d = c.dims;
  const Chunk& ch = I.chunks[static_cast<size_t>(chunk)];
  const ActivationDType precision(layout_.dtype);
  // Parts as in backward: 0 the embedding, 1 + l layer l, num_layers + 1 the head,
  // num_layers + 2 + k MTP module k.
  // Megatron-FSDP maps a part's windows around its pass (runtime/fsdp.h), its waits outside
  // any op's time, as a part hook's.
  auto part_needed = [&](int64_t part) {
    call_part_hook(before, ch, part, c);
    call_fsdp(I, &MegatronFsdp::before_forward, part);
  };
  auto part_ran = [&](int64_t part) { call_fsdp(I, &MegatronFsdp::after_forward, part); };
  if (d.cp > 1 && !c.cp) throw std::logic_error("forward: context parallelism without its group");
  ChunkActs& A = I.stash[{chunk, mb}];
  A.layers.resize(static_cast<size_t>(ch.num_layers));
  Buffer x;
  // The first stage reads the inputs (tokens 0..s-1 of each sequence), the last the targets
  // (tokens 1..s).
  // With context parallelism, this rank's two chunks of each sequence.
  auto window = [&](std::vector<int32_t>& out, int64_t shift) {
    out.resize(static_cast<size_t>(d.n_full));
    if (d.cp > 1)
      context_token_window(tokens, out.data(), d.b, d.s_attn, d.cp, d.cpr, shift);
    else
      kernels::token_window(tokens, out.data(), d.b, d.s, shift);
  };
  if (ch.first) window(A.inputs, 0);
  if (ch.last) window(A.targets, 1);
  if (ch.first) {
    part_needed(0);
    embedding_forward(I, ch.params, A, x);
    part_ran(0);
  } else {
    if (!input || elems(*input) != d.n_local * d.h)
      throw std::logic_error("forward: missing or mis-sized input activation");
    c.copy(*input, x);
  }
  for (int64_t l = 0; l < ch.num_layers; ++l) {
    part_needed(l + 1);
    layer_forward(I, layout_, ch, chunk, mb, l, layout_.recompute_of(l),
                  A.layers[static_cast<size_t>(l)], x);
    part_ran(l + 1);
  }
  if (!ch.last) {
    *output = std::move(x);
    return 0;
  }
  A.lnf_in.swap(x);
  part_needed(ch.num_layers + 1);
  const double loss = head_forward(I, ch.params, A);
  part_ran(ch.num_layers + 1);
  if (!ch.mtp.empty()) {
    std::vector<Impl::MtpActs>& modules = I.mtp_stash[{chunk, mb}];
    modules.resize(ch.mtp.size());
    for (size_t k = 0; k < ch.mtp.size(); ++k) {
      part_needed(ch.num_layers + 2 + static_cast<int64_t>(k));
      const Buffer& hidden = k == 0 ? A.lnf : modules[k - 1].head.lnf;
      I.mtp_loss += mtp_forward(I, model_, layout_, ch, chunk, mb, static_cast<int64_t>(k), tokens,
                                hidden, modules[k]);
      part_ran(ch.num_layers + 2 + static_cast<int64_t>(k));
    }
  }
  return loss;
}

void GptShard::backward(int64_t chunk, int64_t mb, const Buffer* grad_output, Buffer* grad_input,
                        double loss_scale, const PartHook* ready) {
  backward_pass(chunk, mb, grad_output, grad_input, loss_scale, ready, false);
}

void GptShard::backward_input(int64_t chunk, int64_t mb, const Buffer* grad_output,
                              Buffer* grad_input, double loss_scale) {
  backward_pass(chunk, mb, grad_output, grad_input, loss_scale, nullptr, true);
}

void GptShard::backward_weight(int64_t chunk, int64_t mb, const PartHook* ready) {
  Impl& I = *impl_;
  ShardContext& c = *I.ctx;
  const Chunk& ch = I.chunks[static_cast<size_t>(chunk)];
  auto it = I.deferred.find({chunk, mb});
  if (it == I.deferred.end()) throw std::logic_error("weight pass before its input pass");
  const ActivationDType precision(layout_.dtype);
  auto part_done = [&](int64_t part) { call_part_hook(ready, ch, part, c); };
  if (ch.last) {  // the MTP modules' and the head's gradients came in the input pass
    for (auto k = static_cast<int64_t>(ch.mtp.size()) - 1; k >= 0; --k)
      part_done(ch.num_layers + 2 + k);
    part_done(ch.num_layers + 1);
  }
  for (int64_t l = ch.num_layers - 1; l >= 0; --l) {
    Impl::Deferred& w = it->second[static_cast<size_t>(l)];
    const bool moe = ch.is_moe[static_cast<size_t>(l)];
    SharedExpertWidth width(c, I.moe.get(), moe);
    const std::vector<OpId>& program = moe ? I.moe_bwd : I.layer_bwd;
    for (OpId op : program) {
      if (!I.weight_grad[static_cast<size_t>(op)]) continue;
      c.begin(op, PassKind::kBackward);
      if (is_moe_op(op)) {
        // The router's and experts' weight gradients read what the input pass left in the
        // layer's MoE stash, and the router's input (the post-attention norm's output).
        Buffer unused;
        moe_backward_op(c, *I.moe, op, ch.moe[static_cast<size_t>(l)], w.A.ln2, unused, unused,
                        I.moe_stash.at({chunk, mb, l}));
      } else {
        layer_backward_op(c, op, ch.layers[static_cast<size_t>(l)], w.A, w.D);
      }
    }
    c.end_op();
    w = Impl::Deferred();
    if (moe) I.moe_stash.erase({chunk, mb, l});
    part_done(l + 1);
  }
  if (ch.first) part_done(0);
  I.deferred.erase(it);
}

void GptShard::backward_pass(int64_t chunk, int64_t mb, const Buffer* grad_output,
                             Buffer* grad_input, double loss_scale, const PartHook* ready,
                             bool defer) {
  Impl& I = *impl_;
  ShardContext& c = *I.ctx;
  const ShardDims& d = c.dims;
  const Chunk& ch = I.chunks[static_cast<size_t>(chunk)];
  auto it = I.stash.find({chunk, mb});
  if (it == I.stash.end()) throw std::logic_error("backward before forward");
  const ActivationDType precision(layout_.dtype);
  ChunkActs& A = it->second;
  // The W pass's entry, made here even for a chunk of no decoder layers (whose W pass has only
  // its parts to report).
  if (defer) I.deferred[{chunk, mb}].resize(static_cast<size_t>(ch.num_layers));
  // The parts of the chunk are 0 (embedding), 1 + l (layer l), num_layers + 1 (head) and
  // num_layers + 2 + k (MTP module k).
  auto part_done = [&](int64_t part) {
    call_fsdp(I, &MegatronFsdp::after_backward, part);
    call_part_hook(ready, ch, part, c);
  };
  auto part_starts = [&](int64_t part) { call_fsdp(I, &MegatronFsdp::before_backward, part); };
  if (I.fsdp && defer) throw std::logic_error("Megatron-FSDP with deferred weight gradients");
  LayerGrads D;
  if (ch.last) {
    // The MTP modules from the last: each hands the gradient of its hidden input (the previous
    // module's output, the first the final norm's) back, added before that norm's backward.
    Buffer d_hidden;
    if (!ch.mtp.empty()) {
      std::vector<Impl::MtpActs>& modules = I.mtp_stash.at({chunk, mb});
      for (auto k = static_cast<int64_t>(ch.mtp.size()) - 1; k >= 0; --k) {
        part_starts(ch.num_layers + 2 + k);
        mtp_backward(I, layout_, ch, chunk, mb, k, k == 0 ? A.lnf : modules[k - 1].head.lnf,
                     loss_scale, modules[static_cast<size_t>(k)], d_hidden);
        part_done(ch.num_layers + 2 + k);
      }
      I.mtp_stash.erase({chunk, mb});
    }
    part_starts(ch.num_layers + 1);
    head_backward(I, ch.params, A, D, loss_scale, d_hidden);
    part_done(ch.num_layers + 1);
  } else {
    if (!grad_output || elems(*grad_output) != d.n_local * d.h)
      throw std::logic_error("backward: missing or mis-sized output gradient");
    c.copy(*grad_output, D.d_out);
  }
  for (int64_t l = ch.num_layers - 1; l >= 0; --l) {
    LayerActs& L = A.layers[static_cast<size_t>(l)];
    const bool moe = ch.is_moe[static_cast<size_t>(l)];
    part_starts(l + 1);
    layer_backward(I, layout_, ch, chunk, mb, l, layout_.recompute_of(l), L, D, defer);
    if (defer) {  // what the weight-gradient GEMMs read, kept for the W pass
      std::vector<Impl::Deferred>& kept = I.deferred[{chunk, mb}];
      kept.resize(static_cast<size_t>(ch.num_layers));
      Impl::Deferred& w = kept[static_cast<size_t>(l)];
      // The GEMM inputs: the norms' outputs (with sequence parallelism the gathered copies only
      // MLA's query projection keeps, the rank's rows moved below).
      Buffer& ln1 = d.sp ? L.ln1_full : L.ln1;
      Buffer& ln2 = d.sp ? L.ln2_full : L.ln2;
      for (auto [from, to] : {std::pair{&L.act, &w.A.act},
                              {&ln2, d.sp ? &w.A.ln2_full : &w.A.ln2},
                              {&L.ctx, &w.A.ctx},
                              {&ln1, d.sp ? &w.A.ln1_full : &w.A.ln1},
                              {&D.d_fc2, &w.D.d_fc2},
                              {&D.d_pre, &w.D.d_pre},
                              {&D.d_proj, &w.D.d_proj},
                              {&D.d_qkv, &w.D.d_qkv},
                              // MLA's up projections' inputs and output gradients, and the down
                              // projections' output gradients
                              {&L.q_lat_full, &w.A.q_lat_full},
                              {&L.q_lat, &w.A.q_lat},
                              {&L.kv_lat_full, &w.A.kv_lat_full},
                              {&L.kv_lat, &w.A.kv_lat},
                              {&D.dq, &w.D.dq},
                              {&D.d_kvu, &w.D.d_kvu},
                              {&D.d_kvc, &w.D.d_kvc},
                              {&D.d_q_lat_in, &w.D.d_q_lat_in}})
        to->swap(*from);
      // With sequence parallelism the norms' outputs on this rank's tokens: what the W pass
      // gathers again for QKV and FC1 (kAttnInputRegather, kMlpInputRegather), and what MLA's
      // down projections and an MoE layer's router read (kept in w.A.ln1 and w.A.ln2 above
      // without sequence parallelism).
      if (d.sp) {
        w.A.ln1.swap(L.ln1);
        w.A.ln2.swap(L.ln2);
      }
    }
    D.d_out.swap(D.d_x);
    L = LayerActs();
    if (moe && !defer) I.moe_stash.erase({chunk, mb, l});  // else the W pass's
    part_done(l + 1);
  }
  if (ch.first) {
    part_starts(0);
    embedding_backward(I, ch.params, A, D.d_out);
    part_done(0);
  } else {
    *grad_input = std::move(D.d_out);
  }
  c.end_op();
  I.stash.erase(it);
}

}  // namespace ptdp
