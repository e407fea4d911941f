// What the runtime executes is what the op list prices: a GptShard with a trace attached
// records, for every op it runs, its identity, its role (a weight gradient when it accumulated
// into a weight's gradient), the collective it called with the bytes it passed, and the GEMM
// shape it computed. For one microbatch through a one-stage shard (embedding, two layers, LM
// head) the record must equal embedding_ops + transformer_layer_ops x 2 + lm_head_ops, forward
// then backward with recomputation, under tensor and sequence parallelism and every recompute
// mode.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/layer_ops.h"
#include "runtime/communicator.h"
#include "runtime/gpt_model.h"
#include "runtime/op_executor.h"
#include "runtime/op_timer.h"

namespace ptdp {
namespace {

// Rank 0 of a tensor-parallel group of `size` ranks whose peers hold the same data: enough to
// drive every collective of a shard in one process (the values are not those of a real group;
// the test checks what runs, not the numbers).
class MirrorGroup final : public Communicator {
 public:
  explicit MirrorGroup(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }

 protected:
  struct Done final : Work {
    bool test() override { return true; }
    void wait() override {}
    void wait(CommDuration) override {}
  };
  static std::unique_ptr<Work> done() { return std::make_unique<Done>(); }
  std::unique_ptr<Work> start_all_reduce(void*, size_t, DType, DeviceStream) override {
    return done();
  }
  std::unique_ptr<Work> start_all_gather(const void* in, void* out, size_t n, DType t,
                                         DeviceStream) override {
    const size_t bytes = n * dtype_bytes(t);
    for (int r = 0; r < size_; ++r)
      std::memcpy(static_cast<char*>(out) + static_cast<size_t>(r) * bytes, in, bytes);
    return done();
  }
  std::unique_ptr<Work> start_reduce_scatter(const void* in, void* out, size_t n, DType t,
                                             DeviceStream) override {
    std::memmove(out, in, n * dtype_bytes(t));
    return done();
  }
  std::unique_ptr<Work> start_broadcast(void*, size_t, DType, int, DeviceStream) override {
    return done();
  }
  std::unique_ptr<Work> start_batch(std::span<const P2P>, DeviceStream) override {
    throw std::logic_error("no peers");
  }
  std::unique_ptr<Work> start_barrier() override { return done(); }
  std::unique_ptr<Communicator> make_split(int, int) override {
    throw std::logic_error("no split");
  }

 private:
  int size_;
};

ModelSpec gpt() {
  ModelSpec m;
  m.name = "trace-gpt";
  m.num_layers = 2;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.seq_length = 16;
  m.vocab_size = 100;
  return m;
}

ModelSpec llama_like() {
  ModelSpec m = gpt();
  m.name = "trace-gqa-swiglu";
  m.num_attention_heads = 8;
  m.num_query_groups = 4;
  m.swiglu = true;
  m.untie_embeddings_and_output_weights = true;
  m.ffn_hidden_size = 96;
  m.vocab_size = 101;
  return m;
}

std::vector<Op> listed(const ModelSpec& m, const ShardLayout& l) {
  const LayerShape s = runtime_layer_shape(m, l);
  const PassOps emb = embedding_ops(m, s), dense = transformer_layer_ops(m, s),
                head = lm_head_ops(m, s);
  const PassOps moe = m.is_moe() ? moe_layer_ops(m, s) : PassOps{};
  auto layer = [&](int64_t i) -> const PassOps& { return m.is_moe_layer(i) ? moe : dense; };
  std::vector<Op> ops;
  auto append = [&](const std::vector<Op>& v) { ops.insert(ops.end(), v.begin(), v.end()); };
  // Multi-token prediction modules after the head: each its embedding, projection, a layer of
  // the last layer's kind, and the head again; backward from the last module, before the head's.
  const PassOps mtp = m.mtp_num_layers > 0 ? mtp_projection_ops(m, s) : PassOps{};
  const PassOps& mtp_layer = layer(m.num_layers - 1);
  append(emb.forward);
  for (int64_t i = 0; i < m.num_layers; ++i) append(layer(i).forward);
  append(head.forward);
  for (int64_t k = 0; k < m.mtp_num_layers; ++k)
    for (const PassOps* part : {&emb, &mtp, &mtp_layer, &head}) append(part->forward);
  for (int64_t k = 0; k < m.mtp_num_layers; ++k) {
    append(head.backward);
    append(mtp_layer.recompute);
    append(mtp_layer.backward);
    append(mtp.backward);
    append(emb.backward);
  }
  append(head.backward);
  for (int64_t i = m.num_layers - 1; i >= 0; --i) {
    append(layer(i).recompute);
    append(layer(i).backward);
  }
  append(emb.backward);
  return ops;
}

std::vector<ExecutedOp> executed(const ModelSpec& m, const ShardLayout& l) {
  MirrorGroup group(static_cast<int>(l.t));
  GptShard shard(m, l, &group, 3);
  std::vector<int32_t> tokens(static_cast<size_t>(shard.tokens_per_microbatch()));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 37) % 97);
  std::vector<ExecutedOp> trace;
  shard.trace_ops(&trace);
  shard.forward(0, 0, tokens.data(), nullptr, nullptr);
  shard.backward(0, 0, nullptr, nullptr, 1.0);
  return trace;
}

struct Variant {
  int64_t t;
  bool sp;
  Recompute recompute;
  unsigned modules = kRecomputeCoreAttn;  // with selective (--recompute-modules)
};

// One rank's layout of a variant at micro-batch 2, in `type`.
ShardLayout layout_of(const Variant& v, DType type) {
  ShardLayout l;
  l.t = v.t;
  l.micro_batch = 2;
  l.sequence_parallel = v.sp;
  l.recompute = v.recompute;
  l.recompute_modules = v.modules;
  l.dtype = type;
  return l;
}

ModelSpec rotary() {
  ModelSpec m = llama_like();
  m.name = "trace-rotary";
  m.learned_position_embeddings = false;
  return m;
}

// DeepSeek's multi-head latent attention on a rotary model: a query latent, normalised latents,
// heads of 12 + 4 query/key channels and 10 value channels (narrower than the queries).
ModelSpec with_mla(ModelSpec m) {
  m.num_query_groups = 0;
  m.multi_latent_attention = true;
  m.qk_layernorm = true;
  m.q_lora_rank = 24;
  m.kv_lora_rank = 16;
  m.qk_head_dim = 12;
  m.qk_pos_emb_head_dim = 4;
  m.v_head_dim = 10;
  return m;
}

TEST(OpTrace, ExecutedOpsEqualTheListedOps) {
  const Variant variants[] = {
      {1, false, Recompute::kNone},
      {2, false, Recompute::kNone},
      {2, true, Recompute::kNone},
      {4, false, Recompute::kSelective},
      {2, true, Recompute::kSelective},
      {2, false, Recompute::kFull},
      {4, true, Recompute::kFull},
      // --recompute-modules: the MLP too (with sequence parallelism its all-gather and
      // reduce-scatter), and the MLP alone.
      {2, true, Recompute::kSelective, kRecomputeCoreAttn | kRecomputeMlp},
      {2, false, Recompute::kSelective, kRecomputeMlp},
      {2, true, Recompute::kSelective, kRecomputeCoreAttn | kRecomputeMoeAct},
      // layernorm: both layernorms rerun (with sequence parallelism, and their all-gathers),
      // with the MLP too, and alone without sequence parallelism.
      {2, true, Recompute::kSelective, kRecomputeCoreAttn | kRecomputeLayernorm},
      {2, true, Recompute::kSelective, kRecomputeLayernorm | kRecomputeMlp | kRecomputeMoeAct},
      {2, false, Recompute::kSelective, kRecomputeLayernorm},
      // shared_experts: an MoE layer's shared experts rerun (the "moe-shared" model below).
      {2, true, Recompute::kSelective, kRecomputeSharedExperts | kRecomputeMoeAct},
      // moe: the whole MoE layer, shared experts included, and with the layernorms.
      {2, true, Recompute::kSelective, kRecomputeCoreAttn | kRecomputeMoe},
      {1, false, Recompute::kSelective, kRecomputeMoe | kRecomputeLayernorm},
      // mla_up_proj: MLA's up projections and rotary embedding (with sequence parallelism the
      // latents' all-gather too), alone and with the attention core.
      {2, true, Recompute::kSelective, kRecomputeCoreAttn | kRecomputeMlaUpProj},
      {2, false, Recompute::kSelective, kRecomputeMlaUpProj},
  };
  ModelSpec flash = rotary();  // --use-flash-attn: the fused attention and its recomputation
  flash.name = "trace-flash";
  flash.flash_attention = true;
  // An MoE layer after a dense one, without expert parallelism: router, top-k, permutation,
  // the experts and the unpermutation, no all-to-all.
  ModelSpec moe = llama_like();
  moe.name = "trace-moe";
  moe.num_experts = 4;
  moe.moe_router_topk = 2;
  moe.moe_ffn_hidden_size = 48;
  moe.moe_first_dense_layers = 1;
  ModelSpec shared = moe;  // with a shared expert beside the routed ones
  shared.name = "trace-moe-shared";
  shared.moe_shared_expert_ffn_size = 32;
  // Qwen3's attention: --kv-channels wider than hidden / heads and --qk-layernorm's norms.
  ModelSpec qwen3 = flash;
  qwen3.name = "trace-qwen3";
  qwen3.kv_channels = 2 * qwen3.hidden_size / qwen3.num_attention_heads;
  qwen3.qk_layernorm = true;
  // DeepSeek's multi-head latent attention: the down projections on the rank's tokens, the
  // latents' norms, their all-gather (sequence parallelism) or gradients' all-reduce, the up
  // projections, values narrower than queries; with a query latent, and as an MoE model without.
  ModelSpec mla = with_mla(rotary());
  mla.name = "trace-mla";
  ModelSpec mla_moe = moe;
  mla_moe.name = "trace-mla-moe";
  mla_moe.num_query_groups = 0;
  mla_moe.learned_position_embeddings = false;
  mla_moe.flash_attention = true;
  mla_moe.multi_latent_attention = true;
  mla_moe.kv_lora_rank = 16;
  mla_moe.qk_head_dim = 8;
  mla_moe.qk_pos_emb_head_dim = 8;
  mla_moe.v_head_dim = 12;
  // DeepSeek-V3's multi-token prediction: two modules (their MoE layers as the last layer's) on
  // the MLA MoE model, one on the rotary dense one.
  ModelSpec mtp = mla_moe;
  mtp.name = "trace-mla-moe-mtp";
  mtp.mtp_num_layers = 2;
  ModelSpec mtp_dense = rotary();
  mtp_dense.name = "trace-rotary-mtp";
  mtp_dense.mtp_num_layers = 1;
  int checked = 0;
  // Mixed precision (--bf16) moves 2-byte activations: the listed bytes follow the layout's type.
  for (const ModelSpec& m :
       {gpt(), llama_like(), rotary(), flash, moe, shared, qwen3, mla, mla_moe, mtp, mtp_dense}) {
    for (const Variant& v : variants)
      for (const DType type : {DType::kF32, DType::kBF16}) {
        // MoE layers with tensor parallelism need sequence parallelism.
        if (m.is_moe() && v.t > 1 && !v.sp) continue;
        // shared_experts with shared experts only (the rules refuse it otherwise).
        if ((v.modules & kRecomputeSharedExperts) && m.moe_shared_expert_ffn_size == 0) continue;
        if ((v.modules & kRecomputeMoe) && !m.is_moe()) continue;  // MoE models only
        if ((v.modules & kRecomputeMlaUpProj) && !m.multi_latent_attention) continue;
        const ShardLayout l = layout_of(v, type);
        const std::vector<Op> want = listed(m, l);
        const std::vector<ExecutedOp> got = executed(m, l);
        const std::string where = m.name + " t" + std::to_string(v.t) + (v.sp ? " sp " : " ") +
                                  to_string(v.recompute) + " [" +
                                  recompute_modules_string(v.modules) + "] " + to_string(type);
        ASSERT_EQ(got.size(), want.size()) << where;
        for (size_t i = 0; i < want.size(); ++i) {
          const Op& w = want[i];
          const ExecutedOp& g = got[i];
          const std::string at = where + " op " + std::to_string(i) + " " + std::string(w.name());
          ASSERT_EQ(op_name(g.id), w.name()) << at;
          EXPECT_EQ(to_string(g.role), to_string(w.role)) << at;
          ASSERT_EQ(static_cast<int>(g.kind), static_cast<int>(w.kind)) << at;
          if (w.kind == OpKind::kCollective) {
            EXPECT_EQ(to_string(g.collective), to_string(w.collective)) << at;
            EXPECT_DOUBLE_EQ(g.bytes, w.bytes) << at;
          }
          if (w.kind == OpKind::kGemm) {
            EXPECT_EQ(g.m, w.m) << at;
            EXPECT_EQ(g.n, w.n) << at;
            EXPECT_EQ(g.k, w.k) << at;
            EXPECT_EQ(g.batch, w.batch) << at;
          }
          ++checked;
        }
      }
  }
  EXPECT_GT(checked, 2000);
}

// The trace is not vacuous: a shard with sequence parallelism runs all-gathers where one
// without runs all-reduces, and the recorded bytes follow the microbatch size.
TEST(OpTrace, TraceFollowsTheLayout) {
  ShardLayout a;
  a.t = 2;
  a.micro_batch = 1;
  ShardLayout b = a;
  b.sequence_parallel = true;
  b.micro_batch = 2;
  auto count = [](const std::vector<ExecutedOp>& ops, Collective c) {
    return std::count_if(ops.begin(), ops.end(), [&](const ExecutedOp& e) {
      return e.kind == OpKind::kCollective && e.collective == c;
    });
  };
  const auto plain = executed(gpt(), a), sp = executed(gpt(), b);
  EXPECT_EQ(count(plain, Collective::kReduceScatter), 0);
  EXPECT_GT(count(sp, Collective::kReduceScatter), 0);
  EXPECT_GT(count(plain, Collective::kAllReduce), count(sp, Collective::kAllReduce));
  double plain_bytes = 0, sp_bytes = 0;
  for (const ExecutedOp& e : plain)
    if (e.id == OpId::kQkv) plain_bytes = static_cast<double>(e.m);
  for (const ExecutedOp& e : sp)
    if (e.id == OpId::kQkv) sp_bytes = static_cast<double>(e.m);
  EXPECT_EQ(sp_bytes, 2 * plain_bytes);  // tokens of the QKV GEMM double with b
}

// The op executor (what the calibrator times) runs any op of the lists alone, with the GEMM
// shape and collective bytes the list states.
TEST(OpExecutor, RunsEveryListedOpAloneWithItsShape) {
  auto backend = make_backend("cpu");
  int ran = 0;
  ModelSpec flash = rotary();  // the fused attention's kernels run on two of its ops
  flash.flash_attention = true;
  ModelSpec qwen3 = flash;  // --kv-channels wider than hidden / heads and --qk-layernorm
  qwen3.kv_channels = 2 * qwen3.hidden_size / qwen3.num_attention_heads;
  qwen3.qk_layernorm = true;
  ModelSpec gpt_qk = gpt();  // the query and key norms as LayerNorms (with biases)
  gpt_qk.qk_layernorm = true;
  const ModelSpec mla = with_mla(flash);  // values narrower than queries, fused
  ModelSpec mla_unfused = mla;
  mla_unfused.flash_attention = false;
  mla_unfused.q_lora_rank = 0;
  mla_unfused.qk_layernorm = false;
  for (const ModelSpec& m :
       {gpt(), llama_like(), rotary(), flash, qwen3, gpt_qk, mla, mla_unfused}) {
    for (const Variant& v :
         {Variant{1, false, Recompute::kNone}, Variant{2, true, Recompute::kFull},
          Variant{4, false, Recompute::kSelective}})
      for (const DType type : {DType::kF32, DType::kBF16}) {  // ptdp calibrate --bf16's ops too
        const ShardLayout l = layout_of(v, type);
        MirrorGroup group(static_cast<int>(v.t));
        OpExecutor exec(*backend, &group, m, l);
        std::vector<ExecutedOp> trace;
        exec.trace_ops(&trace);
        for (const Op& op : listed(m, l)) {
          trace.clear();
          exec.run(op);
          ASSERT_EQ(trace.size(), 1u) << op.name();
          const ExecutedOp& g = trace[0];
          EXPECT_EQ(static_cast<int>(g.kind), static_cast<int>(op.kind)) << op.name();
          if (op.kind == OpKind::kGemm) {
            EXPECT_EQ(g.m, op.m) << op.name();
            EXPECT_EQ(g.n, op.n) << op.name();
            EXPECT_EQ(g.k, op.k) << op.name();
            EXPECT_EQ(g.batch, op.batch) << op.name();
          }
          if (op.kind == OpKind::kCollective) {
            EXPECT_EQ(g.collective, op.collective) << op.name();
            EXPECT_DOUBLE_EQ(g.bytes, op.bytes) << op.name();
          }
          ++ran;
        }
      }
  }
  EXPECT_GT(ran, 800);
  // An op ptdp run does not execute is refused.
  ShardLayout l;
  MirrorGroup one(1);
  OpExecutor exec(*backend, &one, gpt(), l);
  Op accumulate;
  accumulate.id = OpId::kWeightGradAccumulate;
  accumulate.kind = OpKind::kMemory;
  EXPECT_THROW(exec.run(accumulate), std::invalid_argument);
}

// An MoE layer's compute ops (router, top-k, permutation, the experts' grouped GEMMs and
// activations, and their backward) run alone through the runtime's own code, each GEMM at the
// op list's rows per expert with the local experts as its batch; its all-to-alls are refused
// (calibrate times all-to-all as a collective).
// On the CPU backend and on memory treated as a device's (cpu-staged: the GPU's path).
TEST(OpExecutor, RunsAnMoeLayersComputeOpsAlone) {
  int ran = 0, gemms = 0, refused = 0;
  for (const char* name : {"cpu", "cpu-staged"})
    for (const bool swiglu : {false, true}) {
      auto backend = make_backend(name);
      ModelSpec m = gpt();
      m.name = swiglu ? "trace-moe-swiglu" : "trace-moe";
      m.swiglu = swiglu;
      m.num_experts = 4;
      m.moe_router_topk = 2;
      m.moe_ffn_hidden_size = 48;
      m.moe_shared_expert_ffn_size = swiglu ? 32 : 0;  // the shared experts' output is added to
      m.moe_capacity_factor = swiglu ? 1.0 : 0.0;      // tokens over capacity are dropped
      for (const int64_t t : {1, 2})
        for (const int64_t ep : {1, 2})
          for (const DType type : {DType::kF32, DType::kBF16}) {
            ShardLayout l = layout_of({t, t > 1, Recompute::kNone}, type);
            l.ep = ep;
            LayerShape shape = runtime_layer_shape(m, l);
            shape.expert_parallel = ep;
            const PassOps moe = moe_layer_ops(m, shape);
            MirrorGroup group(static_cast<int>(t));
            OpExecutor exec(*backend, &group, m, l);
            std::vector<ExecutedOp> trace;
            exec.trace_ops(&trace);
            const std::string where = std::string(name) + " " + m.name + " t" + std::to_string(t) +
                                      " ep" + std::to_string(ep) + " " + to_string(type);
            for (const std::vector<Op>* pass : {&moe.forward, &moe.backward})
              for (const Op& op : *pass) {
                const std::string at = where + " " + std::string(op.name());
                if (op.kind == OpKind::kCollective &&
                    (op.group == CommGroup::kExpert || op.group == CommGroup::kExpertTensor)) {
                  EXPECT_THROW(exec.run(op), std::invalid_argument) << at;
                  ++refused;
                  continue;
                }
                trace.clear();
                exec.run(op);
                // Twice, as calibrate times it: the first run may not consume its inputs.
                trace.clear();
                exec.run(op);
                ASSERT_EQ(trace.size(), 1u) << at;
                const ExecutedOp& g = trace[0];
                EXPECT_EQ(g.id, op.id) << at;
                EXPECT_EQ(static_cast<int>(g.kind), static_cast<int>(op.kind)) << at;
                if (op.kind == OpKind::kGemm) {
                  EXPECT_EQ(g.m, op.m) << at;
                  EXPECT_EQ(g.n, op.n) << at;
                  EXPECT_EQ(g.k, op.k) << at;
                  EXPECT_EQ(g.batch, op.batch) << at;
                  ++gemms;
                }
                ++ran;
              }
          }
    }
  EXPECT_GT(ran, 500);
  EXPECT_GT(gemms, 200);
  EXPECT_EQ(refused, 2 * 2 * 2 * 2 * 4);  // dispatch and combine, forward and backward, at ep = 2
}

// Host timing: an op ended by end_op() does not take in what the pass does before its next op
// (freeing a microbatch's activations was the last op's time: a scatter-add of 1 us measured
// 80 us in the run).
TEST(OpTimer, BookkeepingAfterEndOpIsNoOpsTime) {
  const auto be = make_backend("cpu");
  std::vector<TimedOp> ops;
  OpTimer timer(*be, OpTimer::Clock::now(), &ops);
  timer.pass(0, 0);
  timer.begin(OpId::kInputLayernorm, OpRole::kForward);
  timer.end_op();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  timer.begin(OpId::kQkv, OpRole::kForward);
  timer.close();
  ASSERT_EQ(ops.size(), 2u);
  EXPECT_GE(ops[1].start - ops[0].end, 0.015);  // the sleep is in neither op
}

}  // namespace
}  // namespace ptdp
