// The memory model against the closed forms of Korthikanti et al. 2022 (Table 2;
// 18 bytes per parameter; 6 + 12/d with the distributed optimizer; in-flight microbatches).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <set>

#include "core/layer_ops.h"
#include "core/plan_rules.h"
#include "core/presets.h"
#include "core/schedule.h"
#include "planner/comm_model.h"
#include "planner/cost_model.h"

namespace ptdp {
namespace {

ModelSpec gpt175() {
  return resolve_model("gpt3-175b");
}

TEST(ActivationMemory, MatchesKorthikantiTable2) {
  const ModelSpec m = gpt175();
  const double s = 2048, h = 12288, a = 96;
  for (int64_t b : {1, 2}) {
    for (int64_t t : {1, 2, 8}) {
      const double sbh = s * static_cast<double>(b) * h, td = static_cast<double>(t);
      const LayerShape none{t, b, false, Recompute::kNone};
      const double expect =
          t == 1 ? sbh * (34 + 5 * a * s / h) : sbh * (10 + 24 / td + 5 * a * s / (h * td));
      EXPECT_NEAR(layer_activation_bytes(m, none), expect, expect * 1e-12)
          << "t=" << t << " b=" << b;
      const LayerShape sel{t, b, false, Recompute::kSelective};
      const double expect_sel = t == 1 ? sbh * 34 : sbh * (10 + 24 / td);
      EXPECT_NEAR(layer_activation_bytes(m, sel), expect_sel, expect_sel * 1e-12);
      const LayerShape full{t, b, false, Recompute::kFull};
      EXPECT_DOUBLE_EQ(layer_activation_bytes(m, full), 2 * sbh);
      if (t > 1) {
        const LayerShape sp{t, b, true, Recompute::kNone};
        const double expect_sp = sbh * (34 + 5 * a * s / h) / td;
        EXPECT_NEAR(layer_activation_bytes(m, sp), expect_sp, expect_sp * 1e-12);
        const LayerShape sp_sel{t, b, true, Recompute::kSelective};
        EXPECT_NEAR(layer_activation_bytes(m, sp_sel), sbh * 34 / td, sbh * 34 / td * 1e-12);
        const LayerShape sp_full{t, b, true, Recompute::kFull};
        EXPECT_DOUBLE_EQ(layer_activation_bytes(m, sp_full), 2 * sbh / td);
      }
    }
  }
}

// Korthikanti's 34 sbh + 5 a s^2 b counts two hidden dropout masks (1 sbh each) and, per
// attention score, a dropout mask (1) and the dropped-out probabilities (2) besides the softmax
// output (2). Without dropout they go; with flash attention no score is kept at all, only a
// log-sum-exp per row (fp32: 2 units of a s b).
TEST(ActivationMemory, DropoutAndFlashAttentionTerms) {
  ModelSpec m = gpt175();
  const double s = 2048, h = 12288, a = 96, b = 1;
  const double sbh = s * b * h;
  const LayerShape shape{1, 1, false, Recompute::kNone};
  EXPECT_NEAR(layer_activation_bytes(m, shape), sbh * 34 + 5 * a * s * s * b, 1);
  m.hidden_dropout = 0;
  EXPECT_NEAR(layer_activation_bytes(m, shape), sbh * 32 + 5 * a * s * s * b, 1);
  m.attention_dropout = 0;
  EXPECT_NEAR(layer_activation_bytes(m, shape), sbh * 32 + 2 * a * s * s * b, 1);
  m.flash_attention = true;  // one fp32 log-sum-exp per row and head
  EXPECT_NEAR(layer_activation_bytes(m, shape), sbh * 32 + 4 * a * s * b, 1);
  m.attention_dropout = 0.1;  // flash attention applies dropout inside the kernel
  EXPECT_NEAR(layer_activation_bytes(m, shape), sbh * 32 + 4 * a * s * b, 1);
  const LayerShape selective{1, 1, false, Recompute::kSelective};
  EXPECT_NEAR(layer_activation_bytes(m, selective), sbh * 32, 1);
}

// FP8 training: Transformer Engine's linear layers save their inputs as FP8 for the backward
// pass (QKV and FC1 inputs: s b h bytes each instead of 2 s b h; FC2's: 4 s b h instead of
// 8 s b h), and the projection an FP8 copy of its input beside the 16-bit attention output a
// fused attention keeps (found by a review against Transformer Engine's source: all of them
// were counted at 16 bits). GPT-3's shape without dropout: 32 sbh -> 27 sbh.
TEST(ActivationMemory, Fp8SavesTheLinearLayersInputsInFp8) {
  ModelSpec m = gpt175();
  m.hidden_dropout = m.attention_dropout = 0;
  m.flash_attention = true;
  const double s = 2048, h = 12288, a = 96;
  const double sbh = s * h;
  LayerShape shape{1, 1, false, Recompute::kNone};
  EXPECT_NEAR(layer_activation_bytes(m, shape), sbh * 32 + 4 * a * s, 1);
  shape.fp8 = true;
  // LN inputs 4, QKV input 1, Q K V 6, projection 2 + 1, FC1 input 1, GELU input 8, FC2 input 4.
  EXPECT_NEAR(layer_activation_bytes(m, shape), sbh * 27 + 4 * a * s, 1);
  m.flash_attention = false;  // the unfused attention keeps the scores, not its output
  EXPECT_NEAR(layer_activation_bytes(m, shape), sbh * 25 + 2 * a * s * s, 1);
  // Full recomputation keeps each layer's 16-bit input alone, FP8 or not.
  shape.recompute = Recompute::kFull;
  EXPECT_NEAR(layer_activation_bytes(m, shape), sbh * 2, 1);
}

TEST(ActivationMemory, GqaAndSwigluShrinkAndGrowTheRightTerms) {
  ModelSpec m = resolve_model("llama2-70b");
  const LayerShape shape{8, 1, true, Recompute::kSelective};
  const double gqa = layer_activation_bytes(m, shape);
  m.num_query_groups = m.num_attention_heads;  // no GQA: K and V as large as Q
  EXPECT_GT(layer_activation_bytes(m, shape), gqa);
}

ClusterSpec a100(int64_t gpus) {
  ClusterSpec c = resolve_cluster("dgx-a100-80gb");
  c.resize(gpus);
  return c;
}

// GPT-3 175B at t = 8, p = 16, d = 8 (SC'21's 1024-GPU layout, batch 1024).
ParallelPlan gpt175_on_1024() {
  ParallelPlan p;
  p.tensor_parallel = 8;
  p.pipeline_parallel = 16;
  p.data_parallel = 8;
  p.global_batch_size = 1024;
  return p;
}

// A single stage with a large vocabulary: 1F1B frees each microbatch's logits (LM head
// backward) before that microbatch's layers run backward, so they add only what exceeds a
// layer's backward working set; GPipe keeps them while other microbatches' layers run backward,
// so they add whole. The working set is the larger of the attention's and the MLP's phases.
TEST(ActivationMemory, LogitsMeetTheBackwardWorkingSetOnlyWhereTheScheduleLetsThem) {
  ModelSpec m = resolve_model("gpt-1.7b");
  m.vocab_size = 262144;
  m.cross_entropy_fusion = true;
  CostModel cost(m, a100(8), resolve_profile("a100-80gb"));
  ParallelPlan p;
  p.data_parallel = 8;
  p.micro_batch_size = 1;
  p.global_batch_size = 32;
  p.validate(m);
  const std::vector<int64_t> moe;
  const double transient = ActivationMemory(m, p, DType::kBF16, moe).transient_on_stage(0);
  const double logits = 2048.0 * 262144.0 * 2.0;
  ASSERT_GT(logits, transient);
  LayerShape shape = layer_shape(p);
  EXPECT_DOUBLE_EQ(transient, layer_backward_working_bytes(m, shape, false));
  const MemoryBreakdown one_f_one_b = cost.memory(p);
  EXPECT_DOUBLE_EQ(one_f_one_b.buffers, logits - transient);
  p.schedule = Schedule::kGPipe;
  EXPECT_DOUBLE_EQ(cost.memory(p).buffers, logits);
}

TEST(StateMemory, EighteenBytesPerParameterAndDistributedOptimizer) {
  const ModelSpec m = gpt175();
  const ClusterSpec c = a100(1024);
  CostModel cost(m, c, resolve_profile("a100-80gb"));
  ParallelPlan p = gpt175_on_1024();
  p.recompute = Recompute::kFull;
  const MemoryBreakdown plain = cost.memory(p);
  const double params = plain.weights / 2.0;
  EXPECT_DOUBLE_EQ(plain.weights + plain.gradients + plain.optimizer, 18.0 * params);
  p.distributed_optimizer = true;
  const MemoryBreakdown dist = cost.memory(p);
  EXPECT_DOUBLE_EQ(dist.weights + dist.gradients + dist.optimizer, (6.0 + 12.0 / 8.0) * params);
  // The most loaded rank's parameters: 6 layers plus the word and position embeddings, / t,
  // but for what every tensor-parallel rank holds whole (norms, the biases added after
  // row-parallel reductions, the position table: found by exploratory testing, where t = 2 put
  // a tiny model's weights 13% under what ptdp run allocates).
  const double kept = m.replicated_parameters_per_layer(), positions = 2048.0 * 12288.0;
  EXPECT_DOUBLE_EQ(kept, (2 * 2 + 2) * 12288.0);  // two LayerNorms with biases, two biases
  EXPECT_DOUBLE_EQ(m.position_embedding_parameters(), positions);
  const double expect = 6 * ((m.parameters_per_layer() - kept) / 8 + kept) +
                        (m.embedding_parameters() - positions) / 8 + positions;
  EXPECT_DOUBLE_EQ(params, expect);
}

// FP8 training keeps Transformer Engine's FP8 copies of the linear layers' weights, a byte an
// element each: two on Hopper (the weight and its transpose, Hopper's FP8 GEMMs taking only
// the TN layout), one on Blackwell; the embedding and the output layer, which run in 16 bits,
// keep none (found by a review against Transformer Engine's source: one byte for every
// parameter put Llama 3 70B at t4 p4 3.7 GiB a GPU under on H100s).
TEST(StateMemory, Fp8KeepsCopiesOfTheLinearWeightsOnly) {
  const ModelSpec m = resolve_model("llama3-70b");
  ParallelPlan p;
  p.tensor_parallel = 4;
  p.pipeline_parallel = 4;
  p.data_parallel = 4;
  p.global_batch_size = 128;
  p.sequence_parallel = true;
  p.distributed_optimizer = true;
  p.recompute = Recompute::kSelective;
  for (const char* name : {"dgx-h100", "dgx-b200"}) {
    ClusterSpec c = resolve_cluster(name);
    c.resize(64);
    const CostModel cost(m, c,
                         resolve_profile(name == std::string("dgx-h100") ? "h100-sxm" : "b200"));
    ParallelPlan fp8 = p;
    fp8.fp8 = true;
    const int64_t copies = c.gpu.fp8_weight_copies;
    EXPECT_EQ(copies, name == std::string("dgx-h100") ? 2 : 1);
    // The peak stage's weights: 16-bit parameters plus the copies of its linear layers' (its
    // parameters less the embedding, the final norm and the output layer; the layers' own norms,
    // 2 h each, are a few thousandths of them and counted with them).
    const double weights = cost.memory(fp8).weights;
    int matched = 0;
    for (int64_t r = 0; r < p.pipeline_parallel; ++r) {
      const double stage = cost.parameters_on_stage(p, r);
      const double outer = cost.non_layer_parameters_on_stage(p, r);
      if (std::abs(weights - (2 * stage + copies * (stage - outer))) < 1e-9 * weights) {
        ++matched;
        EXPECT_GT(outer, 0.01 * stage) << name << ": the peak is an end stage";
      }
    }
    EXPECT_EQ(matched, 1) << name;
  }
}

// Sequence parallelism leaves the gradients of what every tensor-parallel rank holds whole as
// partial sums over its slice of the sequence: predict adds their all-reduce over the
// tensor-parallel group (as ptdp run does it, runtime/grad_sync.cc), and only then.
TEST(StateMemory, SequenceParallelAllReducesTheReplicatedGradients) {
  const ModelSpec m = gpt175();
  const ClusterSpec c = a100(1024);
  CostModel cost(m, c, resolve_profile("a100-80gb"));
  ParallelPlan p = gpt175_on_1024();
  for (int64_t r : {0, 7, 15}) EXPECT_EQ(cost.sequence_parallel_grad_sync_time(p, r), 0.0) << r;
  const Prediction plain = cost.predict(p);
  p.sequence_parallel = true;
  // Six layers a stage, each with two LayerNorms (weight and bias) and two row-parallel biases;
  // the first stage also the learned positions, the last the final LayerNorm.
  const double h = 12288.0, layer = 6 * (2 * 2 + 2) * h;
  const double expect[3] = {layer + 2048 * h, layer, layer + 2 * h};
  const int64_t stages[3] = {0, 7, 15};
  for (int i = 0; i < 3; ++i) {
    const double bytes = expect[i] * gradient_bytes_per_parameter(p);
    EXPECT_DOUBLE_EQ(cost.sequence_parallel_grad_sync_time(p, stages[i]),
                     cost.comm().collective_time(Collective::kAllReduce, bytes,
                                                 tensor_group_span(c, p), cost.gradient_dtype(p)))
        << stages[i];
  }
  // On the most loaded stage (the first: the word embedding's shard and the positions), after
  // the data-parallel reduction, which sequence parallelism leaves as it was.
  const Prediction sp = cost.predict(p);
  EXPECT_NEAR(sp.breakdown.dp_comm,
              plain.breakdown.dp_comm + cost.sequence_parallel_grad_sync_time(p, 0),
              1e-12 * sp.breakdown.dp_comm);
}

TEST(StateMemory, ActivationsFollowTheScheduleInFlightCounts) {
  const ModelSpec m = gpt175();
  const double p = 8, v = 3, layers = 12;
  ParallelPlan plan;
  plan.pipeline_parallel = 8;
  plan.global_batch_size = 64;
  plan.schedule = Schedule::k1F1B;
  // 1F1B: the first stage holds p microbatches, the last one 1.
  EXPECT_DOUBLE_EQ(inflight_layer_activations(plan, 0, 12), p * layers);
  EXPECT_DOUBLE_EQ(inflight_layer_activations(plan, 7, 12), 1 * layers);
  // Interleaving multiplies the first stage's by (1 + (p-1)/(p v)).
  plan.schedule = Schedule::kInterleaved1F1B;
  plan.virtual_stages = 3;
  EXPECT_DOUBLE_EQ(inflight_layer_activations(plan, 0, 12), p * layers * (1 + (p - 1) / (p * v)));
  // GPipe keeps every microbatch.
  plan.schedule = Schedule::kGPipe;
  EXPECT_DOUBLE_EQ(inflight_layer_activations(plan, 0, 12), 64 * layers);
  // Fewer microbatches than stages: at most m in flight.
  plan.schedule = Schedule::k1F1B;
  plan.global_batch_size = 4;
  EXPECT_DOUBLE_EQ(inflight_layer_activations(plan, 0, 12), 4 * layers);
  (void)m;
}

// A layout's chunks differ in kind as well as in layers: a rank's activations are each chunk's
// own bytes (its dense and MoE layers, rank 0's boundary per chunk-microbatch) held along the
// rank's interleaved order, not the stage's average layer times its in-flight layers.
TEST(StateMemory, ALayoutsChunksKeepTheirOwnLayersActivations) {
  ModelSpec m;
  m.num_layers = 4;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.seq_length = 128;
  m.vocab_size = 256;
  m.num_experts = 8;
  m.moe_router_topk = 2;
  m.moe_ffn_hidden_size = 512;  // MoE layers keep far more than the dense ones
  m.moe_first_dense_layers = 2;
  m.attention_dropout = m.hidden_dropout = 0;
  ASSERT_NO_THROW(m.validate());
  ParallelPlan p;
  p.pipeline_parallel = 2;
  p.virtual_stages = 2;
  p.schedule = Schedule::kInterleaved1F1B;
  p.global_batch_size = 8;
  p.layers_per_chunk = {2, 0, 2, 0};  // rank 0: the two dense layers, then the two MoE layers
  ASSERT_NO_THROW(p.validate(m));
  const std::vector<int64_t> moe = moe_layers_per_chunk(m, p);
  ASSERT_EQ(moe, (std::vector<int64_t>{0, 0, 2, 0}));
  const ActivationMemory a(m, p, DType::kBF16, moe);
  LayerShape shape = layer_shape(p);
  shape.activation_dtype = DType::kBF16;
  shape.expert_load = expert_load(m, p.expert_parallel);
  const double dense = layer_activation_bytes(m, shape),
               routed = moe_layer_activation_bytes(m, shape);
  ASSERT_GT(routed, 2 * dense);
  const double boundary = 128.0 * 64 * 2;
  const ScheduleSpec spec = schedule_spec(p, false);
  const double want =
      interleaved_peak_in_flight(spec, 0, {2 * dense + boundary, 2 * routed + boundary});
  EXPECT_DOUBLE_EQ(a.on_stage(0) - a.transient_on_stage(0), want);
  // The stage-average reading (every chunk the rank's mean layer) would differ.
  const double average =
      interleaved_peak_in_flight(spec, 0, {dense + routed + boundary, dense + routed + boundary});
  EXPECT_NE(want, average);
}

// The memory model's in-flight counts are the schedule generator's, rank by rank.
TEST(StateMemory, InFlightCountsMatchTheScheduleGenerator) {
  for (Schedule kind :
       {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B, Schedule::kZeroBubbleH1}) {
    for (int64_t p : {2, 4, 8}) {
      for (int64_t m : {p / 2, p, 2 * p, 4 * p}) {
        for (int64_t v : {1, 2, 3}) {
          if ((kind == Schedule::kInterleaved1F1B) != (v > 1)) continue;
          if (v > 1 && m % p != 0) continue;
          ParallelPlan plan;
          plan.pipeline_parallel = p;
          plan.global_batch_size = m;
          plan.virtual_stages = v;
          plan.schedule = kind;
          ScheduleSpec spec = schedule_spec(plan, false);
          const PipelineSchedule s = make_pipeline_schedule(spec);
          for (int64_t r = 0; r < p; ++r) {
            const double chunks = inflight_layer_activations(plan, r, v * 6) / 6.0;
            EXPECT_DOUBLE_EQ(chunks, static_cast<double>(peak_chunks_in_flight(s, r)))
                << to_string(kind) << " p" << p << " m" << m << " v" << v << " rank " << r;
          }
        }
      }
    }
  }
}

// `gpus` DGX H100 GPUs.
ClusterSpec h100s(int64_t gpus) {
  ClusterSpec c = resolve_cluster("dgx-h100");
  c.resize(gpus);
  return c;
}

// Llama 2 7B on one DGX H100 at p = 1, d = 8 (bf16, fp32 gradients), full recompute.
ParallelPlan llama7b_on_8(FsdpSharding fsdp) {
  ParallelPlan p;
  p.data_parallel = 8;
  p.global_batch_size = 64;
  p.recompute = Recompute::kFull;
  p.fsdp = fsdp;
  p.distributed_optimizer = fsdp != FsdpSharding::kNoShard;
  return p;
}

// Megatron-FSDP (megatron/core/distributed/fsdp): optim_grads keeps 1/d of the layer units'
// gradients plus the whole gradients of two units (one being computed, one being reduced) and
// of what is outside the units (embedding, final norm, output layer); optim_grads_params also
// keeps 1/d of their weights plus the gathered units: the running one and those prefetched up
// to 5e8 elements (four of Llama 2 7B's 202M-parameter layers).
TEST(StateMemory, MegatronFsdpShardsGradientsThenWeights) {
  const ModelSpec m = resolve_model("llama2-7b");
  const ClusterSpec c = h100s(8);
  const CostModel cost(m, c, resolve_profile("h100-sxm"));
  const ParallelPlan dopt = llama7b_on_8(FsdpSharding::kOptim);
  const ParallelPlan og = llama7b_on_8(FsdpSharding::kOptimGrads);
  const ParallelPlan ogp = llama7b_on_8(FsdpSharding::kOptimGradsParams);
  for (const ParallelPlan& p : {dopt, og, ogp}) p.validate(m);
  const double params = cost.parameters_on_stage(og, 0);
  const double outside = cost.non_layer_parameters_on_stage(og, 0);
  // The embedding and the untied output layer, and the final norm.
  EXPECT_DOUBLE_EQ(outside, 2.0 * 32000 * 4096 + 4096);
  const double unit = (params - outside) / 32;
  EXPECT_NEAR(unit, 202383360, 1);  // 4 h^2 + 3 h ffn + two norms
  const MemoryBreakdown a = cost.memory(dopt), b = cost.memory(og), g = cost.memory(ogp);
  EXPECT_DOUBLE_EQ(a.weights, 2 * params);
  EXPECT_DOUBLE_EQ(a.gradients, 4 * params);
  EXPECT_DOUBLE_EQ(b.weights, a.weights);
  // Every gradient sharded; whole: two units' (more than the output layer's, 131M, with one
  // unit's beside it while its reduction is in flight).
  EXPECT_DOUBLE_EQ(b.gradients, 4 * (params / 8 + 2 * unit));
  // Llama 3 8B's output layer (128256 x 4096, 525M, with the final norm) is larger than two of
  // its 218M layers: its window and the last layer's.
  {
    const ModelSpec l3 = resolve_model("llama3-8b");
    const CostModel c3(l3, c, resolve_profile("h100-sxm"));
    ParallelPlan og3 = og;
    og3.validate(l3);
    const double p3 = c3.parameters_on_stage(og3, 0),
                 out3 = c3.non_layer_parameters_on_stage(og3, 0);
    const double unit3 = (p3 - out3) / 32, output3 = 128256.0 * 4096 + 4096;  // + final norm
    ASSERT_GT(output3, 2 * unit3);
    EXPECT_DOUBLE_EQ(c3.memory(og3).gradients, 4 * (p3 / 8 + output3 + unit3));
  }
  EXPECT_DOUBLE_EQ(g.gradients, b.gradients);
  EXPECT_DOUBLE_EQ(g.weights, 2 * ((params - outside) / 8 + outside + 4 * unit));
  for (const MemoryBreakdown& x : {b, g}) EXPECT_DOUBLE_EQ(x.optimizer, a.optimizer);
  EXPECT_DOUBLE_EQ(g.activations, a.activations);
  EXPECT_GT(a.peak, b.peak);
  EXPECT_GT(b.peak, g.peak);
  // no_shard keeps everything whole, as DDP.
  ParallelPlan none = llama7b_on_8(FsdpSharding::kNoShard);
  ParallelPlan ddp = none;
  ddp.fsdp = FsdpSharding::kOff;
  EXPECT_DOUBLE_EQ(cost.memory(none).peak, cost.memory(ddp).peak);
  // An MoE model's experts shard over the expert-data-parallel ranks: Mixtral 8x7B at ep 8 on
  // 16 GPUs keeps half of its experts' weights and gradients.
  const ModelSpec moe = resolve_model("mixtral-8x7b");
  const CostModel moe_cost(moe, h100s(16), resolve_profile("h100-sxm"));
  ParallelPlan e = llama7b_on_8(FsdpSharding::kOptimGradsParams);
  e.data_parallel = 16;
  e.expert_parallel = 8;
  e.validate(moe);
  ASSERT_EQ(e.expert_data_parallel(), 2);
  const double experts = moe_cost.expert_parameters_on_stage(e, 0);
  const MemoryBreakdown x = moe_cost.memory(e);
  EXPECT_DOUBLE_EQ(x.expert_weights, 2 * experts / 2);
  EXPECT_DOUBLE_EQ(x.expert_gradients, 4 * experts / 2);
  e.fsdp = FsdpSharding::kOptim;
  EXPECT_DOUBLE_EQ(moe_cost.memory(e).expert_optimizer, x.expert_optimizer);
  EXPECT_DOUBLE_EQ(moe_cost.memory(e).expert_gradients, 4 * experts);
}

// Megatron-FSDP's collectives per microbatch: optim_grads reduce-scatters every gradient in each
// backward pass and gathers the updated weights once an iteration; optim_grads_params also
// gathers the layers' weights before each forward and each backward pass, and only what is
// outside the units once an iteration. A pass exposes its first unit's gather or last unit's
// reduction (1/L of its collectives), and what the rest take beyond the rest of its kernels:
// checked against the collectives priced on their own, on the DGX H100's network and on one
// 50 times slower, where they outlast the passes.
TEST(CostModel, MegatronFsdpCollectivesRunInEveryMicrobatch) {
  const ModelSpec m = resolve_model("llama2-7b");
  for (const double slower : {1.0, 50.0}) {
    ClusterSpec c = resolve_cluster("dgx-h100");
    c.resize(16);  // two nodes: the data-parallel group crosses the network
    c.nic_bandwidth_gbps /= slower;
    const CostModel cost(m, c, resolve_profile("h100-sxm"));
    for (FsdpSharding s : {FsdpSharding::kOptimGrads, FsdpSharding::kOptimGradsParams}) {
      ParallelPlan p = llama7b_on_8(s);
      p.data_parallel = 16;
      p.global_batch_size = 128;
      p.validate(m);
      const std::string label = to_string(s) + " nic /" + std::to_string(static_cast<int>(slower));
      ParallelPlan plain = p;
      plain.fsdp = FsdpSharding::kOptim;
      const ChunkTime t = cost.chunk_time(p, 0, 0), u = cost.chunk_time(plain, 0, 0);
      EXPECT_EQ(u.forward.dp_comm + u.backward.dp_comm, 0) << label;
      EXPECT_DOUBLE_EQ(t.forward.compute, u.forward.compute) << label;
      // The collectives on their own: the 32 layers' bf16 weights gathered, every fp32
      // gradient reduce-scattered, over the 16 data-parallel ranks.
      const double params = cost.parameters_on_stage(p, 0);
      const double units = params - cost.non_layer_parameters_on_stage(p, 0);
      const GroupSpan dp = data_group_span(c, p);
      const double gather =
          p.shards_weights()
              ? cost.comm().collective_time(Collective::kAllGather, 2 * units, dp, DType::kBF16)
              : 0.0;
      const double reduce =
          cost.comm().collective_time(Collective::kReduceScatter, 4 * params, dp, DType::kF32);
      auto exposed = [](double comm, double kernels) {
        return comm / 32 + std::max(0.0, (comm - kernels) * 31 / 32);
      };
      const double forward = u.forward.compute + u.forward.tp_comm;
      const double backward =
          u.backward.compute + u.backward.tp_comm + u.recompute.compute + u.recompute.tp_comm;
      EXPECT_NEAR(t.forward.dp_comm, exposed(gather, forward), 1e-12) << label;
      EXPECT_NEAR(t.backward.dp_comm, exposed(gather + reduce, backward), 1e-12) << label;
      if (slower > 1)  // the slow network's reduce-scatter outlasts the backward pass
        EXPECT_GT(t.backward.dp_comm, reduce / 32 + 1e-3) << label;
      else
        EXPECT_NEAR(t.backward.dp_comm, (gather + reduce) / 32, 1e-12) << label;
      // m times a microbatch's, and the weights' all-gather once: of all of them with sharded
      // gradients only, of the embedding and output layer with sharded weights too.
      const Prediction r = cost.predict(p);
      const double m_b = static_cast<double>(p.num_microbatches());
      const double left = cost.comm().collective_time(
          Collective::kAllGather, 2 * (p.shards_weights() ? params - units : params), dp,
          DType::kBF16);
      EXPECT_NEAR(r.breakdown.dp_comm, m_b * (t.forward.dp_comm + t.backward.dp_comm) + left, 1e-12)
          << label;
      std::printf("%-26s forward %6.2f ms, backward %6.2f ms exposed a microbatch; %.2f ms left\n",
                  label.c_str(), 1e3 * t.forward.dp_comm, 1e3 * t.backward.dp_comm, 1e3 * left);
    }
  }
}

TEST(StateMemory, LargerModelsStopFitting) {
  const ModelSpec m = resolve_model("gpt-1t");
  CostModel cost(m, a100(8), resolve_profile("a100-80gb"));
  ParallelPlan p;
  p.tensor_parallel = 8;
  p.global_batch_size = 8;
  EXPECT_FALSE(cost.memory(p).fits);
}

// Megatron-Core's distributed optimizer in K instances (--num-distributed-optimizer-instances):
// Llama 2 7B at d = 32 on four DGX H100s. The optimizer states shard over an instance's 32 / K
// ranks, so they grow K-fold; the weights, gradients and activations do not change. The
// synchronisation is a reduce-scatter of the fp32 gradients within the instance, an
// all-reduce of each rank's 1/(32 / K) shard across the K instances, and an all-gather of the
// bf16 weights within the instance, each priced over the span of its own group: with K = 4 an
// instance is the 8 GPUs of a node (NVLink), and the all-reduce crosses the 4 nodes, 8 rings
// side by side on each node's NICs.
// a2a+p2p (8 x 2 on two 8-GPU nodes, Llama 3 8B at 16k tokens): each level is priced over its
// own ranks: the all-to-alls over the 8 ranks of a node (NVLink), the ring's send/recv between
// the two nodes, behind the attention of one of the ring's 2 blocks. Its exposed context time
// is below both the flat ring's (15 steps, 8 of them crossing nodes behind 1/16-sized blocks)
// and Ulysses' (all-to-alls across the nodes); it buys the ring nothing at one node (8 x 1 is
// Ulysses').
// The cost model caches each layer shape's times: every recompute mode and module set is a
// shape of its own. One model priced in turn with each (an MoE model with shared experts, where
// every module applies) gives what a fresh model gives for each (before session 32 the key
// packed the set into 4 bits, so selective core_attn + shared_experts and full recomputation
// shared one entry).
TEST(CostModel, EveryRecomputeSettingIsPricedAsItself) {
  const ModelSpec m = resolve_model("qwen2-57b-a14b");
  const ClusterSpec c = h100s(64);
  const HardwareProfile h = resolve_profile("h100-sxm");
  ParallelPlan p;
  p.tensor_parallel = 2;
  p.sequence_parallel = true;
  p.pipeline_parallel = 4;
  p.expert_parallel = 8;
  p.data_parallel = 8;
  p.global_batch_size = 256;
  std::vector<ParallelPlan> plans;
  for (const Recompute r : {Recompute::kNone, Recompute::kFull}) {
    p.recompute = r;
    p.recompute_modules = kRecomputeCoreAttn;
    plans.push_back(p);
  }
  p.recompute = Recompute::kSelective;
  for (unsigned modules = 1; modules <= kAllRecomputeModules; ++modules) {
    p.recompute_modules = modules;
    if (first_violated_rule(m, p) == PlanRule::kNone) plans.push_back(p);
  }
  ASSERT_EQ(plans.size(), 2u + 63u);  // every set is allowed for this model
  const CostModel shared(m, c, h);
  std::set<double> times;
  for (const ParallelPlan& q : plans) {
    const double cached = shared.predict(q).iteration_time_s;
    EXPECT_DOUBLE_EQ(cached, CostModel(m, c, h).predict(q).iteration_time_s)
        << to_string(q.recompute) << " " << recompute_modules_string(q.recompute_modules);
    times.insert(cached);
  }
  EXPECT_GT(times.size(), 10u);
}

TEST(CostModel, HierarchicalContextParallelPricesEachLevelOverItsRanks) {
  ModelSpec m = resolve_model("llama3-8b");
  m.seq_length = 16384;
  const ClusterSpec c = h100s(16);
  HardwareProfile h = resolve_profile("h100-sxm");
  h.arrival_skew = 0;
  const CostModel cost(m, c, h);
  ParallelPlan p;
  p.context_parallel = 16;
  p.global_batch_size = 8;
  p.cp_comm = CpComm::kA2AP2P;
  p.hierarchical_cp = 8;
  p.validate(m);
  const GroupSpan inner = context_group_span(c, p, Collective::kAllToAll);
  const GroupSpan outer = context_group_span(c, p, Collective::kSendRecv);
  EXPECT_EQ(inner.size, 8);
  EXPECT_EQ(inner.nodes, 1);
  EXPECT_EQ(outer.size, 2);
  EXPECT_EQ(outer.nodes, 2);
  const PassOps ops = transformer_layer_ops(m, layer_shape(p));
  const std::vector<double> time = cost.exposed_times(ops.forward, p);
  const CommModel& comm = cost.comm();
  int a2a = 0, steps = 0;
  for (size_t i = 0; i < ops.forward.size(); ++i) {
    const Op& op = ops.forward[i];
    if (op.kind != OpKind::kCollective || op.group != CommGroup::kContext) continue;
    if (op.collective == Collective::kAllToAll) {
      EXPECT_NEAR(time[i], comm.collective_time(op.collective, op.bytes, inner, op.dtype), 1e-15);
      ++a2a;
    } else {
      const double raw =
          comm.collective_time(op.collective, op.bytes, ring_neighbour_span(outer, c), op.dtype);
      EXPECT_LE(time[i], raw);  // under the attention of a block
      ++steps;
    }
  }
  EXPECT_EQ(a2a, 2);
  EXPECT_EQ(steps, 1);
  const double hier = cost.predict(p).breakdown.cp_comm;
  ParallelPlan ring = p, ulysses = p;
  ring.cp_comm = CpComm::kP2P;
  ring.hierarchical_cp = 0;
  ulysses.cp_comm = CpComm::kA2A;
  ulysses.hierarchical_cp = 0;
  EXPECT_LT(hier, cost.predict(ring).breakdown.cp_comm);
  EXPECT_LT(hier, cost.predict(ulysses).breakdown.cp_comm);
  // One node: 8 x 1 is Ulysses' all-to-alls over the same 8 ranks.
  const CostModel one_node(m, h100s(8), h);
  ParallelPlan q = p;
  q.context_parallel = 8;
  ulysses.context_parallel = 8;
  EXPECT_NEAR(one_node.predict(q).iteration_time_s, one_node.predict(ulysses).iteration_time_s,
              1e-12);
}

TEST(CostModel, DistributedOptimizerInstancesShardWithinAndReduceAcross) {
  const ModelSpec m = resolve_model("llama2-7b");
  const ClusterSpec c = h100s(32);
  const CostModel cost(m, c, resolve_profile("h100-sxm"));
  ParallelPlan one;
  one.data_parallel = 32;
  one.global_batch_size = 128;
  one.recompute = Recompute::kFull;
  one.distributed_optimizer = true;
  one.validate(m);
  const double params = cost.parameters_on_stage(one, 0);
  const MemoryBreakdown base = cost.memory(one);
  for (const int64_t k : {2, 4, 16, 32}) {
    ParallelPlan p = one;
    p.optimizer_instances = k;
    p.validate(m);
    ASSERT_EQ(p.optimizer_shards(), 32 / k);
    const MemoryBreakdown mb = cost.memory(p);
    EXPECT_NEAR(mb.optimizer, base.optimizer * static_cast<double>(k), 1e-6 * mb.optimizer) << k;
    EXPECT_DOUBLE_EQ(mb.weights, base.weights) << k;
    EXPECT_DOUBLE_EQ(mb.gradients, base.gradients) << k;
    EXPECT_DOUBLE_EQ(mb.activations, base.activations) << k;
    const GroupSpan instance = optimizer_instance_span(c, p), across = optimizer_replica_span(c, p);
    EXPECT_EQ(instance.size, 32 / k) << k;
    EXPECT_EQ(across.size, k) << k;
    const CommModel& comm = cost.comm();
    const double want =
        comm.collective_time(Collective::kReduceScatter, 4 * params, instance, DType::kF32) +
        comm.collective_time(Collective::kAllReduce, 4 * params / static_cast<double>(32 / k),
                             across, DType::kF32) +
        comm.collective_time(Collective::kAllGather, 2 * params, instance, DType::kBF16);
    EXPECT_NEAR(cost.gradient_sync_time(p, params), want, 1e-12) << k;
    if (k == 4) {
      EXPECT_EQ(instance.nodes, 1);  // a node's 8 GPUs
      EXPECT_EQ(across.nodes, 4);
      EXPECT_EQ(across.concurrent_per_node, 8);
    }
    if (k == 32) {  // one rank an instance: whole states, and the gradients all-reduced
      EXPECT_NEAR(cost.gradient_sync_time(p, params),
                  comm.collective_time(Collective::kAllReduce, 4 * params, data_group_span(c, p),
                                       DType::kF32),
                  1e-12);
      ParallelPlan ddp = one;
      ddp.distributed_optimizer = false;
      EXPECT_DOUBLE_EQ(mb.optimizer, cost.memory(ddp).optimizer);
    }
  }
  // One instance is the ordinary distributed optimizer: the whole group's reduce-scatter and
  // all-gather.
  const GroupSpan dp = data_group_span(c, one);
  EXPECT_NEAR(cost.gradient_sync_time(one, params),
              cost.comm().collective_time(Collective::kReduceScatter, 4 * params, dp, DType::kF32) +
                  cost.comm().collective_time(Collective::kAllGather, 2 * params, dp, DType::kBF16),
              1e-12);
  // An MoE model's experts shard over their expert-data-parallel ranks' instances: Mixtral
  // 8x7B at ep 8 on 32 GPUs has edp = 4, so two instances keep twice the experts' states.
  const ModelSpec moe = resolve_model("mixtral-8x7b");
  const CostModel moe_cost(moe, c, resolve_profile("h100-sxm"));
  ParallelPlan e = one;
  e.expert_parallel = 8;
  e.validate(moe);
  ParallelPlan e2 = e;
  e2.optimizer_instances = 2;
  e2.validate(moe);
  EXPECT_EQ(e2.expert_optimizer_shards(), 2);
  EXPECT_NEAR(moe_cost.memory(e2).expert_optimizer, 2 * moe_cost.memory(e).expert_optimizer,
              1e-6 * moe_cost.memory(e2).expert_optimizer);
}

// Megatron-FSDP in K instances (HSDP; --outer-dp-sharding-strategy): Llama 2 7B with
// optim_grads_params at d = 32 on four DGX H100s, K = 4 (an instance is a node). The gradients
// and weights shard over an instance's 8 ranks, each pass's gathers and reduce-scatters stay on
// the node's NVLink; once an iteration each rank's gradient shard is all-reduced across the 4
// instances (no_shard), or reduce-scattered across them and its updated weights all-gathered
// (optim, HFSDP, whose optimizer states shard over all 32 ranks).
TEST(CostModel, MegatronFsdpInstancesShardWithinANodeAndSyncAcrossOnceAnIteration) {
  const ModelSpec m = resolve_model("llama2-7b");
  const ClusterSpec c = h100s(32);
  const CostModel cost(m, c, resolve_profile("h100-sxm"));
  ParallelPlan flat = llama7b_on_8(FsdpSharding::kOptimGradsParams);
  flat.data_parallel = 32;
  flat.global_batch_size = 128;
  flat.validate(m);
  ParallelPlan hsdp = flat, hfsdp = flat;
  hsdp.optimizer_instances = hfsdp.optimizer_instances = 4;
  hfsdp.fsdp_outer = FsdpSharding::kOptim;
  hsdp.validate(m);
  hfsdp.validate(m);
  const double params = cost.parameters_on_stage(flat, 0);
  const double outside = cost.non_layer_parameters_on_stage(flat, 0);
  const double unit = (params - outside) / 32;
  const MemoryBreakdown a = cost.memory(flat), b = cost.memory(hsdp), o = cost.memory(hfsdp);
  // Gradients: 1/8 of them plus two units whole (1/32 flat); weights: the units' 1/8 plus the
  // outer modules and the gathered units.
  EXPECT_DOUBLE_EQ(b.gradients, 4 * (params / 8 + 2 * unit));
  EXPECT_DOUBLE_EQ(a.gradients, 4 * (params / 32 + 2 * unit));
  EXPECT_DOUBLE_EQ(b.weights, 2 * ((params - outside) / 8 + outside + 4 * unit));
  EXPECT_DOUBLE_EQ(o.gradients, b.gradients);
  EXPECT_DOUBLE_EQ(o.weights, b.weights);
  EXPECT_NEAR(b.optimizer, 4 * a.optimizer, 1e-6 * b.optimizer);  // states over 8 ranks
  EXPECT_DOUBLE_EQ(o.optimizer, a.optimizer);                     // over all 32
  // Each pass's collectives over the node: cheaper than over the four nodes.
  const ChunkTime tf = cost.chunk_time(flat, 0, 0), th = cost.chunk_time(hsdp, 0, 0);
  EXPECT_GT(tf.forward.dp_comm + tf.backward.dp_comm, 0);
  EXPECT_LT(th.forward.dp_comm + th.backward.dp_comm, tf.forward.dp_comm + tf.backward.dp_comm);
  EXPECT_DOUBLE_EQ(cost.chunk_time(hfsdp, 0, 0).backward.dp_comm, th.backward.dp_comm);
  // Once an iteration: the weights outside the units gathered within the instance, and across
  // the instances the shard's all-reduce, or its reduce-scatter and the weights' all-gather.
  const GroupSpan node = optimizer_instance_span(c, hsdp), across = optimizer_replica_span(c, hsdp);
  ASSERT_EQ(node.nodes, 1);
  ASSERT_EQ(across.size, 4);
  const CommModel& comm = cost.comm();
  const double within =
      comm.collective_time(Collective::kAllGather, 2 * outside, node, DType::kBF16);
  EXPECT_NEAR(
      cost.gradient_sync_time(hsdp, params),
      within + comm.collective_time(Collective::kAllReduce, 4 * params / 8, across, DType::kF32),
      1e-12);
  EXPECT_NEAR(
      cost.gradient_sync_time(hfsdp, params),
      within +
          comm.collective_time(Collective::kReduceScatter, 4 * params / 8, across, DType::kF32) +
          comm.collective_time(Collective::kAllGather, 2 * params / 8, across, DType::kBF16),
      1e-12);
  EXPECT_NEAR(cost.gradient_sync_time(flat, params),
              comm.collective_time(Collective::kAllGather, 2 * outside, data_group_span(c, flat),
                                   DType::kBF16),
              1e-12);
}

}  // namespace
}  // namespace ptdp
