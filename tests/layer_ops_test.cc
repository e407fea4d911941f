// The layer op list: FLOPs match the closed forms, tensor parallelism divides the math and adds
// the collectives Megatron-LM issues.
#include "core/layer_ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "core/presets.h"
#include "planner/cost_model.h"

namespace ptdp {
namespace {

double flops(const std::vector<Op>& ops) {
  double f = 0;
  for (const Op& op : ops) f += op.flops();
  return f;
}

std::vector<OpId> ids_of(const std::vector<Op>& ops) {
  std::vector<OpId> ids;
  for (const Op& op : ops) ids.push_back(op.id);
  return ids;
}

int count(const std::vector<Op>& ops, Collective c) {
  int n = 0;
  for (const Op& op : ops) n += op.kind == OpKind::kCollective && op.collective == c;
  return n;
}

TEST(LayerOps, ForwardFlopsMatchSc21) {
  const ModelSpec m = resolve_model("gpt3-175b");
  const double b = 2, s = 2048, h = 12288;
  const PassOps ops = transformer_layer_ops(m, LayerShape{1, 2, false, Recompute::kNone});
  // 24 b s h^2 (1 + s / (6 h)) per layer forward; backward twice that.
  const double fwd = 24 * b * s * h * h * (1 + s / (6 * h));
  EXPECT_NEAR(flops(ops.forward), fwd, fwd * 1e-12);
  EXPECT_NEAR(flops(ops.backward), 2 * fwd, fwd * 1e-12);
  EXPECT_TRUE(ops.recompute.empty());
}

// Model FLOPs (and MFU) count the causal half of the attention pairs whatever runs the
// attention, as Megatron-LM's num_floating_point_operations does; a fused attention or context
// parallelism change only the time and the hardware FLOPs (found by exploratory testing: MFU
// moved by 3-20% with --use-flash-attn), and the unfused attention's hardware FLOPs count every
// pair. MFU stays under 100% at long sequences (it was 102.7% for Llama 3 8B at 1M tokens when
// every pair counted).
TEST(LayerOps, ModelFlopsDoNotDependOnTheAttentionKernel) {
  const ModelSpec m = resolve_model("gpt3-175b");
  const CostModel cost(m, resolve_cluster("dgx-a100-80gb"), resolve_profile("a100-80gb"));
  ParallelPlan p;
  p.tensor_parallel = 8;
  p.pipeline_parallel = 16;
  p.data_parallel = 8;
  p.global_batch_size = 1536;
  p.recompute = Recompute::kFull;
  const Prediction plain = cost.predict(p);
  // SC'21 eq. 3 without the recomputed forward, 72 B s l h^2 (1 + s/6h + V/12lh), with the
  // attention pairs' s/6h halved.
  const double B = 1536, s = 2048, l = 96, h = 12288, V = 51200;
  const double causal = 72 * B * s * l * h * h * (1 + s / (12 * h) + V / (12 * l * h));
  EXPECT_NEAR(plain.model_flops / causal, 1.0, 1e-3);
  // Counting every pair is SC'21's equation 3 itself, the convention of published TFLOP/s that
  // do not halve the attention (docs/validation.md).
  const double eq3 = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h));
  EXPECT_NEAR(plain.model_flops_all_pairs / eq3, 1.0, 1e-3);
  EXPECT_NEAR(plain.model_tflops_per_gpu_all_pairs / plain.model_tflops_per_gpu,
              plain.model_flops_all_pairs / plain.model_flops, 1e-12);
  EXPECT_NEAR(plain.hardware_flops / causal,
              (1 + s / (6 * h) + V / (12 * l * h) + 1.0 / 3 * (1 + s / (6 * h))) /
                  (1 + s / (12 * h) + V / (12 * l * h)),
              1e-3);  // every pair, and full recomputation's forward again
  ModelSpec flash = m;
  flash.flash_attention = true;
  const Prediction fused =
      CostModel(flash, resolve_cluster("dgx-a100-80gb"), resolve_profile("a100-80gb")).predict(p);
  EXPECT_DOUBLE_EQ(fused.model_flops, plain.model_flops);
  EXPECT_DOUBLE_EQ(fused.model_flops_all_pairs, plain.model_flops_all_pairs);
  EXPECT_LT(fused.hardware_flops, plain.hardware_flops);  // the causal half of the attention
  p.context_parallel = 2;
  p.data_parallel = 4;
  EXPECT_DOUBLE_EQ(cost.predict(p).model_flops, plain.model_flops);
  EXPECT_DOUBLE_EQ(cost.predict(p).model_flops_all_pairs, plain.model_flops_all_pairs);
}

TEST(LayerOps, TensorParallelDividesMathAndAddsAllReduces) {
  const ModelSpec m = resolve_model("gpt3-175b");
  const PassOps one = transformer_layer_ops(m, LayerShape{1, 1, false, Recompute::kFull});
  const PassOps eight = transformer_layer_ops(m, LayerShape{8, 1, false, Recompute::kFull});
  EXPECT_NEAR(flops(eight.forward) * 8, flops(one.forward), flops(one.forward) * 1e-12);
  EXPECT_EQ(count(eight.forward, Collective::kAllReduce), 2);
  EXPECT_EQ(count(eight.backward, Collective::kAllReduce), 2);
  EXPECT_EQ(count(eight.recompute, Collective::kAllReduce), 2);  // full recompute redoes them
  EXPECT_EQ(count(one.forward, Collective::kAllReduce), 0);
}

TEST(LayerOps, SequenceParallelUsesAllGatherAndReduceScatter) {
  const ModelSpec m = resolve_model("gpt3-175b");
  const PassOps sp = transformer_layer_ops(m, LayerShape{8, 1, true, Recompute::kSelective});
  // Two entering the column-parallel blocks, two leaving them backward, and two gathering the
  // column-parallel GEMMs' inputs again for their weight gradients (Megatron keeps their rows
  // only): weight-gradient ops, each just before its GEMM's input gradient.
  EXPECT_EQ(count(sp.forward, Collective::kAllGather) + count(sp.backward, Collective::kAllGather),
            6);
  for (const auto& ids : {std::pair{OpId::kMlpInputRegather, OpId::kFc1Dgrad},
                          std::pair{OpId::kAttnInputRegather, OpId::kQkvDgrad}}) {
    const OpId regather = ids.first, dgrad = ids.second;  // (clang: no lambda capture of a binding)
    const auto at = std::find_if(sp.backward.begin(), sp.backward.end(),
                                 [&](const Op& op) { return op.id == regather; });
    ASSERT_NE(at, sp.backward.end());
    EXPECT_EQ(at->role, OpRole::kWeightGrad);
    EXPECT_EQ(at->bytes, 2048.0 * 12288 * 2);
    ASSERT_NE(at + 1, sp.backward.end());
    EXPECT_EQ((at + 1)->id, dgrad);
  }
  EXPECT_EQ(count(sp.forward, Collective::kReduceScatter) +
                count(sp.backward, Collective::kReduceScatter),
            4);
  EXPECT_EQ(count(sp.forward, Collective::kAllReduce) + count(sp.backward, Collective::kAllReduce),
            0);
  // Selective recompute redoes only the attention core: two batched GEMMs, no collective.
  EXPECT_EQ(sp.recompute.size(), 4u);
  EXPECT_EQ(count(sp.recompute, Collective::kAllGather), 0);
}

// Megatron starts the input's second all-gather before the input-gradient GEMM and waits after
// it: what is priced is what that GEMM does not hide, and no late rank's arrival. zb-h1 runs it
// in the W pass, alone: whole. With --tp-comm-overlap the input gradient's reduce-scatter goes
// behind the weight-gradient GEMM (the input-gradient GEMM is taken).
TEST(LayerOps, SequenceParallelRegatherIsPricedBehindItsInputGradientGemm) {
  const ModelSpec m = resolve_model("gpt3-175b");
  ClusterSpec c = resolve_cluster("dgx-a100-80gb");
  c.resize(8);
  ParallelPlan p;
  p.tensor_parallel = 8;
  p.sequence_parallel = true;
  p.global_batch_size = 8;
  const CostModel cm(m, c, resolve_profile("a100-80gb"));
  const std::vector<Op> ops = transformer_layer_ops(m, cm.priced_layer_shape(p)).backward;
  const std::vector<double> exposed = cm.exposed_times(ops, p);
  ParallelPlan zb = p;
  zb.schedule = Schedule::kZeroBubbleH1;
  zb.pipeline_parallel = 2;
  const std::vector<double> deferred = cm.exposed_times(ops, zb);
  ParallelPlan overlap = p;
  overlap.tp_comm_overlap = true;
  const std::vector<double> overlapped = cm.exposed_times(ops, overlap);
  int regathers = 0;
  for (size_t i = 0; i + 1 < ops.size(); ++i) {
    if (!is_input_regather(ops[i].id)) continue;
    ++regathers;
    ASSERT_EQ(ops[i + 1].kind, OpKind::kGemm);
    const double alone = cm.op_time(ops[i], p);
    EXPECT_GT(alone, 0.0);
    EXPECT_DOUBLE_EQ(exposed[i], std::max(0.0, alone - exposed[i + 1])) << ops[i].name();
    EXPECT_DOUBLE_EQ(deferred[i], alone) << ops[i].name();
    // dgrad, wgrad, then the reduce-scatter: it pays the wgrad GEMM t - 1 more kernel gaps.
    ASSERT_EQ(ops[i + 2].role, OpRole::kWeightGrad);
    ASSERT_EQ(ops[i + 3].collective, Collective::kReduceScatter);
    EXPECT_GT(overlapped[i + 2], exposed[i + 2]) << ops[i + 2].name();
    EXPECT_DOUBLE_EQ(overlapped[i + 1], exposed[i + 1]) << ops[i + 1].name();
  }
  EXPECT_EQ(regathers, 2);
}

TEST(LayerOps, LmHeadFlopsAreSixTokensHiddenVocab) {
  const ModelSpec m = resolve_model("gpt3-175b");
  const PassOps head = lm_head_ops(m, LayerShape{4, 1, false, Recompute::kNone});
  const double tokens = 2048, expect = 2 * tokens * 12288.0 * 51200 / 4;
  EXPECT_NEAR(flops(head.forward), expect, expect * 1e-12);
  EXPECT_NEAR(flops(head.backward), 2 * expect, expect * 1e-12);
}

// dK and dV (attn_scores_dk, attn_context_dv) are what the QKV input gradient needs, so they
// are B work; only GEMMs against weights, the embedding's table gradient and the separate
// accumulation passes are W, the part a zero-bubble schedule may defer.
TEST(LayerOps, WeightGradientRoleIsExactlyTheWeightGemmsAndAccumulation) {
  const ModelSpec m = resolve_model("gpt3-175b");
  for (bool fused : {true, false}) {
    LayerShape s{8, 1, false, Recompute::kNone};
    s.fused_grad_accumulation = fused;
    std::vector<Op> all;
    for (const PassOps& p : {transformer_layer_ops(m, s), embedding_ops(m, s), lm_head_ops(m, s)})
      all.insert(all.end(), p.backward.begin(), p.backward.end());
    std::vector<std::string> weight;
    for (const Op& op : all) {
      EXPECT_NE(op.role, OpRole::kForward) << op.name();
      if (op.role == OpRole::kWeightGrad) weight.emplace_back(op.name());
    }
    std::vector<std::string> expect = {"fc2_wgrad", "fc1_wgrad", "attn_proj_wgrad", "qkv_wgrad"};
    if (!fused) expect.push_back("weight_grad_accumulate");
    expect.push_back("word_embedding_grad_scatter_add");
    if (!fused) expect.push_back("embedding_grad_accumulate");
    expect.push_back("lm_head_wgrad");
    if (!fused) expect.push_back("output_grad_accumulate");
    EXPECT_EQ(weight, expect) << "fused " << fused;
    for (const Op& op : all) {
      if (op.id == OpId::kAttnScoresDk || op.id == OpId::kAttnContextDv ||
          op.id == OpId::kAttnScoresDq || op.id == OpId::kAttnContextDprobs) {
        EXPECT_EQ(op.role, OpRole::kInputGrad) << op.name();
      }
    }
  }
}

TEST(LayerOps, EveryOpStatesItsRoleAndElementType) {
  const ModelSpec m = resolve_model("gpt3-175b");
  for (Recompute r : {Recompute::kSelective, Recompute::kFull}) {
    LayerShape s{4, 1, true, r};
    s.activation_dtype = DType::kF32;
    const PassOps layer = transformer_layer_ops(m, s);
    for (const Op& op : layer.forward) EXPECT_EQ(op.role, OpRole::kForward) << op.name();
    ASSERT_FALSE(layer.recompute.empty());
    for (const Op& op : layer.recompute) EXPECT_EQ(op.role, OpRole::kRecompute) << op.name();
    for (const Op& op : layer.forward) EXPECT_EQ(op.dtype, DType::kF32) << op.name();
  }
  // Bytes follow the element type: fp32 collectives move twice the bf16 bytes; memory-bound
  // ops move more (their 1-byte dropout masks stay 1 byte).
  LayerShape half{2, 1, false, Recompute::kNone}, full = half;
  full.activation_dtype = DType::kF32;
  const PassOps a = transformer_layer_ops(m, half), b = transformer_layer_ops(m, full);
  ASSERT_EQ(a.forward.size(), b.forward.size());
  for (size_t i = 0; i < a.forward.size(); ++i) {
    if (a.forward[i].kind == OpKind::kCollective) {
      EXPECT_DOUBLE_EQ(b.forward[i].bytes, 2 * a.forward[i].bytes) << a.forward[i].name();
    } else if (a.forward[i].kind == OpKind::kMemory) {
      EXPECT_GT(b.forward[i].bytes, 1.5 * a.forward[i].bytes) << a.forward[i].name();
    }
  }
}

// The vocabulary-parallel loss exchanges fp32 (max, sum-exp, target) per token by all-gather,
// as ptdp run executes it: the gathered buffer holds t times one rank's stats.
TEST(LayerOps, CrossEntropyExchangeIsAnAllGatherOfThreeFloatsPerToken) {
  const ModelSpec m = resolve_model("gpt3-175b");
  for (int64_t t : {2, 8}) {
    const PassOps head = lm_head_ops(m, LayerShape{t, 2, false, Recompute::kNone});
    const Op* ce = nullptr;
    for (const Op& op : head.forward)
      if (op.id == OpId::kCrossEntropyAllGather) ce = &op;
    ASSERT_NE(ce, nullptr);
    EXPECT_EQ(ce->collective, Collective::kAllGather);
    EXPECT_EQ(ce->dtype, DType::kF32);
    EXPECT_DOUBLE_EQ(ce->bytes, static_cast<double>(t) * 2 * 2048 * 3 * 4);
  }
  const PassOps one = lm_head_ops(m, LayerShape{1, 2, false, Recompute::kNone});
  for (const Op& op : one.forward) EXPECT_NE(op.kind, OpKind::kCollective) << op.name();
}

// --cp-comm-type: the ring's cp - 1 send/recv steps, one all-gather of the whole sequence's K
// and V, or Ulysses' two all-to-alls. A rank sends as many K/V bytes with the ring as with the
// all-gather; the attention does the same arithmetic all three ways, and only a2a changes its
// shapes (all s queries of heads / cp heads).
TEST(LayerOps, ContextParallelCommTypes) {
  ModelSpec m = resolve_model("llama3-8b");  // 32 heads, 8 query groups
  m.seq_length = 8192;
  LayerShape s;
  s.tensor_parallel = 2;
  s.context_parallel = 4;
  auto context = [](const std::vector<Op>& ops) {
    std::vector<Op> out;
    for (const Op& op : ops)
      if (op.kind == OpKind::kCollective && op.group == CommGroup::kContext) out.push_back(op);
    return out;
  };
  s.cp_comm = CpComm::kP2P;
  const PassOps ring = transformer_layer_ops(m, s);
  s.cp_comm = CpComm::kAllGather;
  const PassOps gather = transformer_layer_ops(m, s);
  s.cp_comm = CpComm::kA2A;
  const PassOps ulysses = transformer_layer_ops(m, s);

  const std::vector<Op> steps = context(ring.forward);
  ASSERT_EQ(steps.size(), 3u);
  const double block = steps[0].bytes;  // this rank's K and V: 2 tokens (8 / 2) groups 128 dims
  EXPECT_DOUBLE_EQ(block, 2.0 * (8192 / 4) * (8 / 2) * 128 * 2);
  for (const Op& op : steps) EXPECT_EQ(op.collective, Collective::kSendRecv);
  for (const Op& op : context(ring.backward)) EXPECT_DOUBLE_EQ(op.bytes, 2 * block);

  const std::vector<Op> all = context(gather.forward);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].collective, Collective::kAllGather);
  EXPECT_DOUBLE_EQ(all[0].bytes * 3 / 4, 3 * block);  // each rank's share: the ring's steps
  const std::vector<Op> all_back = context(gather.backward);
  ASSERT_EQ(all_back.size(), 1u);  // K and V gathered again, their gradients reduce-scattered
  EXPECT_DOUBLE_EQ(all_back[0].bytes, 2 * all[0].bytes);

  const std::vector<Op> a2a = context(ulysses.forward);
  ASSERT_EQ(a2a.size(), 2u);
  const double q = (8192 / 4) * (32 / 2) * 128 * 2;  // this rank's queries
  EXPECT_EQ(a2a[0].id, OpId::kCpKvExchange);
  EXPECT_DOUBLE_EQ(a2a[0].bytes, q + block);
  EXPECT_EQ(a2a[1].id, OpId::kCpOutAllToAll);
  EXPECT_DOUBLE_EQ(a2a[1].bytes, q);
  const std::vector<Op> a2a_back = context(ulysses.backward);
  ASSERT_EQ(a2a_back.size(), 2u);
  EXPECT_EQ(a2a_back[0].id, OpId::kCpOutAllToAllBackward);
  EXPECT_DOUBLE_EQ(a2a_back[0].bytes + a2a_back[1].bytes, 2 * q + block);
  for (const Op& op : a2a) EXPECT_EQ(op.collective, Collective::kAllToAll);

  for (const PassOps* p : {&gather, &ulysses}) {
    EXPECT_DOUBLE_EQ(flops(p->forward), flops(ring.forward));
    EXPECT_DOUBLE_EQ(flops(p->backward), flops(ring.backward));
  }
  for (const Op& op : ulysses.forward)
    if (op.id == OpId::kAttnScores) {
      EXPECT_EQ(op.m, 8192);   // all queries
      EXPECT_EQ(op.batch, 4);  // 16 local heads / cp
    }
  // Ulysses keeps the attention's output twice: in the heads layout for the attention's backward
  // pass, on the rank's tokens for the projection's (2 bytes of s/cp x h/t more), unless
  // selective recomputation recomputes the attention from its inputs.
  LayerShape ring_shape = s;
  ring_shape.cp_comm = CpComm::kP2P;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, s) - layer_activation_bytes(m, ring_shape),
                   2.0 * (8192 / 4) * 4096 / 2);
  // Selective recomputation redoes the attention with its communication (Transformer Engine's
  // context-parallel attention is one checkpointed function).
  s.recompute = Recompute::kSelective;
  ring_shape.recompute = Recompute::kSelective;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, s), layer_activation_bytes(m, ring_shape));
  EXPECT_EQ(context(transformer_layer_ops(m, s).recompute).size(), 2u);
}

// a2a+p2p (--hierarchical-context-parallel-sizes 2 4 at t 2, cp 8; Llama 3 8B's 4 query groups
// per rank, which a2a at cp 8 cannot split): Ulysses' all-to-alls within groups of 2 (each rank's
// Q, K and V in, the output back, as a2a's at cp 2 would move them), then 3 ring steps of the
// p2p ring's block (the group's 2 s / 8 tokens of half the heads); the attention covers the
// group's s / 4 queries of 8 heads, the same arithmetic as the ring's, and keeps the output
// twice as Ulysses does.
TEST(LayerOps, HierarchicalContextParallelIsAllToAllsThenARing) {
  ModelSpec m = resolve_model("llama3-8b");
  m.seq_length = 8192;
  LayerShape s;
  s.tensor_parallel = 2;
  s.context_parallel = 8;
  const PassOps ring = transformer_layer_ops(m, s);
  s.cp_comm = CpComm::kA2AP2P;
  s.hierarchical_cp = 2;
  const PassOps hier = transformer_layer_ops(m, s);
  std::vector<Op> fwd;
  for (const Op& op : hier.forward)
    if (op.kind == OpKind::kCollective && op.group == CommGroup::kContext) fwd.push_back(op);
  ASSERT_EQ(fwd.size(), 5u);
  const double block = 2.0 * (8192 / 8) * (8 / 2) * 128 * 2;  // one rank's K and V
  const double q = (8192 / 8) * (32 / 2) * 128 * 2;           // its queries
  EXPECT_EQ(fwd[0].collective, Collective::kAllToAll);
  EXPECT_DOUBLE_EQ(fwd[0].bytes, q + block);
  for (int i = 1; i <= 3; ++i) {
    EXPECT_EQ(fwd[static_cast<size_t>(i)].collective, Collective::kSendRecv);
    EXPECT_DOUBLE_EQ(fwd[static_cast<size_t>(i)].bytes, block);
  }
  EXPECT_EQ(fwd[4].id, OpId::kCpOutAllToAll);
  EXPECT_DOUBLE_EQ(fwd[4].bytes, q);
  EXPECT_DOUBLE_EQ(flops(hier.forward), flops(ring.forward));
  EXPECT_DOUBLE_EQ(flops(hier.backward), flops(ring.backward));
  for (const Op& op : hier.forward)
    if (op.id == OpId::kAttnScores) {
      EXPECT_EQ(op.m, 8192 / 4);  // the group's queries
      EXPECT_EQ(op.batch, 8);     // 16 local heads / 2
    }
  LayerShape ring_shape = s;
  ring_shape.cp_comm = CpComm::kP2P;
  ring_shape.hierarchical_cp = 0;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, s) - layer_activation_bytes(m, ring_shape),
                   2.0 * (8192 / 8) * 4096 / 2);
}

// --recompute-modules mlp: selective recomputation reruns the dense MLP from the residual, as
// Megatron-Core checkpoints a dense MLP whose FC1 holds the pre-MLP layernorm (Transformer
// Engine's spec): the layernorm, then with sequence parallelism its all-gather, FC1, SwiGLU, FC2
// and the reduce-scatter, as the forward list runs them. It keeps neither the layernorm's
// output (FC1's input, 2 bytes per token and hidden unit, over t with SP) nor the activation's
// inputs and FC2's input: (2 x 2 + 2) b s ffn / t bytes for SwiGLU in 16 bits. With core_attn
// too, the attention core's recomputation comes first. An MoE layer's experts are not the dense
// MLP: its list and memory do not change.
TEST(LayerOps, RecomputeModulesMlpRerunsTheDenseMlp) {
  const ModelSpec m = resolve_model("llama3-8b");
  LayerShape s;
  s.tensor_parallel = 4;
  s.sequence_parallel = true;
  s.recompute = Recompute::kSelective;
  const PassOps core = transformer_layer_ops(m, s);
  const double core_bytes = layer_activation_bytes(m, s);
  s.recompute_modules = kRecomputeCoreAttn | kRecomputeMlp;
  const PassOps both = transformer_layer_ops(m, s);
  std::vector<OpId> mlp_ids;
  for (size_t i = core.recompute.size(); i < both.recompute.size(); ++i)
    mlp_ids.push_back(both.recompute[i].id);
  EXPECT_EQ(mlp_ids,
            (std::vector<OpId>{OpId::kPostAttentionLayernorm, OpId::kMlpAllGather, OpId::kFc1,
                               OpId::kSwiglu, OpId::kFc2, OpId::kMlpReduceScatter}));
  for (size_t i = 0; i < core.recompute.size(); ++i)
    EXPECT_EQ(both.recompute[i].id, core.recompute[i].id);
  for (const Op& op : both.recompute) EXPECT_EQ(op.role, OpRole::kRecompute);
  const double tokens = 1.0 * m.seq_length;  // b = 1
  EXPECT_DOUBLE_EQ(
      core_bytes - layer_activation_bytes(m, s),
      ((2.0 * 2 + 2) * static_cast<double>(m.ffn_hidden()) + 2.0 * m.hidden_size) * tokens / 4);
  s.recompute_modules = kRecomputeMlp;  // the MLP alone: the attention core keeps its lse
  EXPECT_EQ(transformer_layer_ops(m, s).recompute.size(), mlp_ids.size());
  ModelSpec moe = resolve_model("mixtral-8x7b");
  LayerShape ms;
  ms.tensor_parallel = 2;
  ms.sequence_parallel = true;
  ms.recompute = Recompute::kSelective;
  const double moe_core = moe_layer_activation_bytes(moe, ms);
  const size_t moe_list = moe_layer_ops(moe, ms).recompute.size();
  ms.recompute_modules = kRecomputeCoreAttn | kRecomputeMlp;
  EXPECT_DOUBLE_EQ(moe_layer_activation_bytes(moe, ms), moe_core);
  EXPECT_EQ(moe_layer_ops(moe, ms).recompute.size(), moe_list);
  // moe_act: the experts' activation is rerun after the attention core; FC2's input (2 bytes per
  // element of each processed row's ffn) is not kept. Mixtral 8x7B at t 2 with SP, ep 1, etp 1:
  // this rank's s / 2 tokens, 2 rows each, of all 14336 columns.
  ms.recompute_modules = kRecomputeCoreAttn | kRecomputeMoeAct;
  const PassOps act = moe_layer_ops(moe, ms);
  ASSERT_EQ(act.recompute.size(), moe_list + 1);
  EXPECT_EQ(act.recompute.back().id, OpId::kExpertActivation);
  EXPECT_EQ(act.recompute.back().role, OpRole::kRecompute);
  const double rows = moe.seq_length / 2.0 * 2;
  EXPECT_NEAR(moe_core - moe_layer_activation_bytes(moe, ms), 2.0 * rows * 14336, 1e-6 * moe_core);
}

// --recompute-modules layernorm (Megatron-Core with Transformer Engine's layer spec): only a
// layernorm that is a module of its own is rerun, which is an MoE layer's pre-MLP layernorm.
// The layernorm before the attention is fused into the QKV projection and a dense layer's
// pre-MLP one into FC1, so in a dense layer layernorm changes neither the list nor the memory
// (with mlp the MLP's checkpoint reruns its layernorm anyway). An MoE layer (Mixtral: no shared
// experts) reruns its post-attention layernorm for its router and experts and keeps its output
// no more: 2 bytes per token and hidden unit in 16 bits, over t with sequence parallelism.
TEST(LayerOps, RecomputeModulesLayernormRerunsTheMoeLayersPreMlpLayernorm) {
  using I = OpId;
  const ModelSpec m = resolve_model("llama3-8b");
  LayerShape s;
  s.tensor_parallel = 4;
  s.sequence_parallel = true;
  s.recompute = Recompute::kSelective;
  const std::vector<OpId> core = ids_of(transformer_layer_ops(m, s).recompute);
  const double core_bytes = layer_activation_bytes(m, s);
  s.recompute_modules = kRecomputeCoreAttn | kRecomputeLayernorm;
  EXPECT_EQ(ids_of(transformer_layer_ops(m, s).recompute), core);
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, s), core_bytes);
  LayerShape mlp = s;
  mlp.recompute_modules = kRecomputeMlp;
  LayerShape mlp_norm = s;
  mlp_norm.recompute_modules = kRecomputeMlp | kRecomputeLayernorm;
  EXPECT_EQ(ids_of(transformer_layer_ops(m, mlp_norm).recompute),
            ids_of(transformer_layer_ops(m, mlp).recompute));
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, mlp_norm), layer_activation_bytes(m, mlp));
  const ModelSpec moe = resolve_model("mixtral-8x7b");
  LayerShape ms;
  ms.tensor_parallel = 2;
  ms.sequence_parallel = true;
  ms.recompute = Recompute::kSelective;
  const std::vector<OpId> moe_core = ids_of(moe_layer_ops(moe, ms).recompute);
  const double moe_bytes = moe_layer_activation_bytes(moe, ms);
  ms.recompute_modules = kRecomputeCoreAttn | kRecomputeLayernorm;
  std::vector<OpId> want = moe_core;
  want.push_back(I::kPostAttentionLayernorm);
  EXPECT_EQ(ids_of(moe_layer_ops(moe, ms).recompute), want);
  EXPECT_DOUBLE_EQ(moe_bytes - moe_layer_activation_bytes(moe, ms),
                   2.0 * moe.seq_length * moe.hidden_size / 2);
  ms.sequence_parallel = false;  // its output was whole on every tensor-parallel rank
  const double whole = moe_layer_activation_bytes(moe, ms);
  ms.recompute_modules = kRecomputeCoreAttn;
  EXPECT_DOUBLE_EQ(moe_layer_activation_bytes(moe, ms) - whole,
                   2.0 * moe.seq_length * moe.hidden_size);
}

// --recompute-modules shared_experts: an MoE layer's shared experts rerun from their input as
// mlp reruns a dense MLP (Qwen2-57B-A14B at t 2 with SP: the all-gather, FC1, SwiGLU, FC2 and the
// reduce-scatter of its 20480-wide shared expert, after the attention core), keeping neither
// SwiGLU's two inputs nor FC2's: (2 x 2 + 2) s b 20480 / t bytes less. mlp changes nothing there.
TEST(LayerOps, RecomputeModulesSharedExpertsRerunTheSharedMlp) {
  using I = OpId;
  const ModelSpec m = resolve_model("qwen2-57b-a14b");
  LayerShape s;
  s.tensor_parallel = 2;
  s.sequence_parallel = true;
  s.recompute = Recompute::kSelective;
  const std::vector<OpId> core = ids_of(moe_layer_ops(m, s).recompute);
  const double core_bytes = moe_layer_activation_bytes(m, s);
  s.recompute_modules = kRecomputeCoreAttn | kRecomputeMlp;
  EXPECT_EQ(ids_of(moe_layer_ops(m, s).recompute), core);
  EXPECT_DOUBLE_EQ(moe_layer_activation_bytes(m, s), core_bytes);
  s.recompute_modules = kRecomputeCoreAttn | kRecomputeSharedExperts;
  std::vector<OpId> want = core;
  want.insert(want.end(), {I::kMlpAllGather, I::kFc1, I::kSwiglu, I::kFc2, I::kMlpReduceScatter});
  EXPECT_EQ(ids_of(moe_layer_ops(m, s).recompute), want);
  EXPECT_DOUBLE_EQ(core_bytes - moe_layer_activation_bytes(m, s),
                   (2.0 * 2 + 2) * m.seq_length * 20480 / 2);
  // A dense layer of the same plan has no shared experts: nothing more.
  LayerShape dense = s;
  dense.recompute_modules = kRecomputeCoreAttn;
  EXPECT_EQ(ids_of(transformer_layer_ops(m, s).recompute),
            ids_of(transformer_layer_ops(m, dense).recompute));
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, s), layer_activation_bytes(m, dense));
}

// --recompute-modules moe: the whole MoE layer rerun from its input (Mixtral 8x7B at t 2 with SP
// and ep 4: router, top-k, permutation, dispatch all-to-all, the experts, combine all-to-all and
// unpermutation after the attention core), keeping nothing of the routed path: every routed term
// of the memory model goes, the layer's input stays.
TEST(LayerOps, RecomputeModulesMoeRerunsTheWholeMoeLayer) {
  using I = OpId;
  const ModelSpec m = resolve_model("mixtral-8x7b");
  LayerShape s;
  s.tensor_parallel = 2;
  s.sequence_parallel = true;
  s.expert_parallel = 4;
  s.recompute = Recompute::kSelective;
  const std::vector<OpId> core = ids_of(moe_layer_ops(m, s).recompute);
  const double core_bytes = moe_layer_activation_bytes(m, s);
  s.recompute_modules = kRecomputeCoreAttn | kRecomputeMoe;
  std::vector<OpId> want = core;
  want.insert(want.end(),
              {I::kRouter, I::kRouterTopk, I::kMoePermute, I::kMoeDispatch, I::kExpertFc1,
               I::kExpertActivation, I::kExpertFc2, I::kMoeCombine, I::kMoeUnpermute});
  EXPECT_EQ(ids_of(moe_layer_ops(m, s).recompute), want);
  for (const Op& op : moe_layer_ops(m, s).recompute) EXPECT_EQ(op.role, OpRole::kRecompute);
  // What stays is the attention's part and the layer's inputs: the same as with a layer of no
  // routed tokens.
  LayerShape none = s;
  none.recompute_modules = kRecomputeCoreAttn;
  const double attention_only =
      layer_activation_bytes(m, none) -
      (2.0 * 2 + 2) * m.seq_length * static_cast<double>(m.ffn_hidden()) / 2;
  EXPECT_DOUBLE_EQ(moe_layer_activation_bytes(m, s), attention_only);
  EXPECT_LT(moe_layer_activation_bytes(m, s), core_bytes);
  // moe_act with moe: the activation once.
  s.recompute_modules |= kRecomputeMoeAct;
  EXPECT_EQ(ids_of(moe_layer_ops(m, s).recompute), want);
}

TEST(LayerOps, EveryOpIdHasADistinctName) {
  std::set<std::string_view> names;
  for (int i = 0; i < kNumOpIds; ++i) {
    const std::string_view n = op_name(static_cast<OpId>(i));
    EXPECT_FALSE(n.empty());
    EXPECT_TRUE(names.insert(n).second) << n;
  }
}

}  // namespace
}  // namespace ptdp
