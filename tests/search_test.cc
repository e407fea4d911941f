#include "planner/search.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <tuple>

#include "core/plan_rules.h"
#include "core/presets.h"
#include "planner/comm_model.h"
#include "runtime/gpt_model.h"

namespace ptdp {
namespace {

struct Job {
  ModelSpec m = resolve_model("gpt3-175b");
  ClusterSpec c = resolve_cluster("dgx-a100-80gb");
  HardwareProfile h = resolve_profile("a100-80gb");
  Job(int64_t gpus) { c.resize(gpus); }
  // A preset model on `gpus` H100s (dgx-h100, the estimated h100-sxm profile).
  Job(const std::string& model, int64_t gpus)
      : m(resolve_model(model)), c(resolve_cluster("dgx-h100")), h(resolve_profile("h100-sxm")) {
    c.resize(gpus);
  }
};

// An a2a+p2p plan as the search ranked it is no slower than with any other all-to-all size the
// search tries (that fits).
void expect_fastest_hierarchical_cp(const Job& j, const CostModel& cost, const RankedPlan& r) {
  for (const int64_t a : hierarchical_cp_sizes(j.m, r.plan, j.c.gpus_per_node)) {
    ParallelPlan other = r.plan;
    other.hierarchical_cp = a;
    if (!cost.memory(other).fits) continue;
    EXPECT_GE(cost.predict(other).iteration_time_s, r.prediction.iteration_time_s * (1 - 1e-12))
        << plan_summary(r.plan) << " with all-to-alls over " << a;
  }
}

TEST(Search, SameResultForAnyThreadCount) {
  Job j(256);
  SearchOptions o;
  o.global_batch_size = 512;
  o.top_k = 20;
  o.threads = 1;
  const SearchResult one = search_plans(j.m, j.c, j.h, o);
  o.threads = 2;
  const SearchResult two = search_plans(j.m, j.c, j.h, o);
  o.threads = 7;
  const SearchResult seven = search_plans(j.m, j.c, j.h, o);
  ASSERT_EQ(one.top.size(), 20u);
  for (const SearchResult* r : {&two, &seven}) {
    ASSERT_EQ(r->top.size(), one.top.size());
    for (size_t i = 0; i < one.top.size(); ++i) {
      EXPECT_EQ(plan_summary(r->top[i].plan), plan_summary(one.top[i].plan)) << i;
      EXPECT_EQ(r->top[i].prediction.iteration_time_s, one.top[i].prediction.iteration_time_s);
    }
    EXPECT_EQ(r->considered, one.considered);
    EXPECT_EQ(r->evaluated, one.evaluated);
    EXPECT_EQ(r->rejected, one.rejected);
  }
}

TEST(Search, RankedValidFittingAndExplained) {
  Job j(512);
  SearchOptions o;
  o.global_batch_size = 1024;
  o.top_k = 10;
  const SearchResult r = search_plans(j.m, j.c, j.h, o);
  ASSERT_EQ(r.top.size(), 10u);
  for (size_t i = 0; i < r.top.size(); ++i) {
    EXPECT_NO_THROW(r.top[i].plan.validate(j.m));
    EXPECT_TRUE(r.top[i].prediction.memory.fits);
    EXPECT_EQ(r.top[i].plan.num_gpus(), 512);
    if (i > 0) {
      EXPECT_GE(r.top[i].prediction.iteration_time_s, r.top[i - 1].prediction.iteration_time_s);
      EXPECT_NE(loses_because(r.top[0].prediction, r.top[i].prediction), "");
    }
  }
  // 175B does not fit without model parallelism: memory must have rejected something.
  EXPECT_GT(r.rejected.at("does not fit in GPU memory"), 0);
  EXPECT_GT(r.considered, r.evaluated);
}

TEST(Search, ExplanationNamesTheComponentThatGrew) {
  Prediction a, b;
  a.breakdown.compute = b.breakdown.compute = 1.0;
  a.breakdown.bubble = 0.1;
  b.breakdown.bubble = 0.5;
  b.breakdown.tp_comm = 0.05;
  EXPECT_EQ(loses_because(a, b).rfind("pipeline bubble", 0), 0u);
}

TEST(Search, PlanDifferenceListsChangedFields) {
  ParallelPlan a, b;
  a.pipeline_parallel = 16;
  b.pipeline_parallel = 8;
  b.recompute = Recompute::kSelective;
  EXPECT_EQ(plan_difference(a, b), "p 16->8, recompute none->selective");
  EXPECT_EQ(plan_difference(a, a), "same configuration");
}

// The search applies the rules ParallelPlan::validate and the runtime apply
// (core/plan_rules.h): for a model whose FFN width (100) t = 8 does not divide and whose
// sequence (30) t = 4 does not, with d forced to 1, no ranked plan breaks them, and the
// rejections are tallied under the rules' reasons.
TEST(Search, RanksOnlyPlansEveryValidatorAccepts) {
  Job j(16);
  j.m = ModelSpec{};
  j.m.num_layers = 8;
  j.m.hidden_size = 64;
  j.m.num_attention_heads = 8;
  j.m.ffn_hidden_size = 100;
  j.m.seq_length = 30;
  j.m.vocab_size = 128;
  SearchOptions o;
  o.global_batch_size = 1;
  o.top_k = 1000;
  const SearchResult r = search_plans(j.m, j.c, j.h, o);
  ASSERT_FALSE(r.top.empty());
  for (const RankedPlan& rp : r.top) {
    EXPECT_EQ(first_violated_rule(j.m, rp.plan), PlanRule::kNone) << plan_summary(rp.plan);
    EXPECT_NO_THROW(rp.plan.validate(j.m)) << plan_summary(rp.plan);
    for (int64_t pp = 0; pp < rp.plan.pipeline_parallel; ++pp) {
      ShardLayout l;
      l.t = rp.plan.tensor_parallel;
      l.p = rp.plan.pipeline_parallel;
      l.pp = pp;
      l.v = rp.plan.virtual_stages;
      l.micro_batch = rp.plan.micro_batch_size;
      l.sequence_parallel = rp.plan.sequence_parallel;
      l.layers_per_stage = layers_per_model_chunk(j.m, rp.plan);
      EXPECT_NO_THROW(validate_shard_layout(j.m, l)) << plan_summary(rp.plan);
    }
  }
  EXPECT_GT(r.rejected.at(rule_reason(PlanRule::kTensorDividesFfn)), 0);
  EXPECT_GT(r.rejected.at(rule_reason(PlanRule::kSequenceParallelDividesSequence)), 0);
}

// Megatron-FSDP's strategies enter the search only when asked, and then only where Megatron-Core
// runs them (p = 1) and there is something to shard (d cp > 1); the search with them is a
// superset, so its best plan is no slower, and every FSDP plan it ranks passes the rules.
TEST(Search, MegatronFsdpStrategiesOnlyWhenAskedAndAtOneStage) {
  Job j("llama2-7b", 16);
  SearchOptions o;
  o.global_batch_size = 64;
  o.top_k = 400;
  const SearchResult plain = search_plans(j.m, j.c, j.h, o);
  ASSERT_FALSE(plain.top.empty());
  for (const RankedPlan& rp : plain.top) EXPECT_EQ(rp.plan.fsdp, FsdpSharding::kOff);
  o.fsdp_strategies = {FsdpSharding::kOptimGrads, FsdpSharding::kOptimGradsParams};
  const SearchResult fsdp = search_plans(j.m, j.c, j.h, o);
  EXPECT_GT(fsdp.considered, plain.considered);
  EXPECT_LE(fsdp.top[0].prediction.iteration_time_s, plain.top[0].prediction.iteration_time_s);
  std::set<FsdpSharding> seen;
  for (const RankedPlan& rp : fsdp.top) {
    if (rp.plan.fsdp == FsdpSharding::kOff) continue;
    seen.insert(rp.plan.fsdp);
    EXPECT_EQ(rp.plan.pipeline_parallel, 1) << plan_summary(rp.plan);
    EXPECT_GT(rp.plan.data_parallel * rp.plan.context_parallel, 1) << plan_summary(rp.plan);
    EXPECT_TRUE(rp.plan.distributed_optimizer) << plan_summary(rp.plan);
    EXPECT_EQ(first_violated_rule(j.m, rp.plan), PlanRule::kNone) << plan_summary(rp.plan);
    EXPECT_NE(plan_summary(rp.plan).find(" fsdp-og"), std::string::npos);
  }
  EXPECT_EQ(seen.size(), 2u);
}

// The distributed optimizer's instances are tried only when asked for, beside one instance, on
// the candidates whose data-parallel ranks they divide into instances of two ranks or more;
// auto asks for one instance per node's part of the data-parallel group.
// --recompute-modules: the selective candidates recompute the modules asked for, and fewer
// configurations are refused for memory when the MLP is among them, since each such plan keeps
// less. By default (the attention core) a candidate that does not fit so is tried again with
// more modules (memory_saving_modules: the MLP in a dense model; in MoE models Megatron-Core's
// cheap memory savers, the pre-MLP layernorm, the experts' activation and the shared experts):
// each plan that recomputes them does not fit without them, and more plans fit.
TEST(Search, SelectivePlansRecomputeTheModulesAsked) {
  Job j("llama3-8b", 8);
  SearchOptions o;
  o.global_batch_size = 64;
  o.top_k = 5000;
  o.recompute_modes = {Recompute::kSelective};
  o.try_memory_saving_modules = false;  // as --recompute-modules pins the set
  const SearchResult core = search_plans(j.m, j.c, j.h, o);
  o.selective_modules = {kRecomputeCoreAttn | kRecomputeMlp};
  const SearchResult both = search_plans(j.m, j.c, j.h, o);
  ASSERT_FALSE(core.top.empty());
  ASSERT_FALSE(both.top.empty());
  for (const RankedPlan& rp : core.top) EXPECT_EQ(rp.plan.recompute_modules, kRecomputeCoreAttn);
  for (const RankedPlan& rp : both.top) {
    EXPECT_EQ(rp.plan.recompute_modules, kRecomputeCoreAttn | kRecomputeMlp);
    EXPECT_NE(plan_summary(rp.plan).find("selective+mlp"), std::string::npos);
  }
  EXPECT_EQ(both.considered, core.considered);
  EXPECT_GT(both.top.size(), core.top.size());  // more of them fit

  EXPECT_EQ(memory_saving_modules(j.m), kRecomputeCoreAttn | kRecomputeMlp);
  EXPECT_EQ(memory_saving_modules(resolve_model("mixtral-8x7b")),
            kRecomputeCoreAttn | kRecomputeLayernorm | kRecomputeMoeAct);
  EXPECT_EQ(memory_saving_modules(resolve_model("qwen2-57b-a14b")),
            kRecomputeCoreAttn | kRecomputeLayernorm | kRecomputeMoeAct | kRecomputeSharedExperts);
  o.selective_modules = {kRecomputeCoreAttn};
  o.try_memory_saving_modules = true;
  const SearchResult saving = search_plans(j.m, j.c, j.h, o);
  const CostModel cost(j.m, j.c, j.h);
  int savers = 0;
  for (const RankedPlan& rp : saving.top) {
    if (rp.plan.recompute_modules == kRecomputeCoreAttn) continue;
    ++savers;
    EXPECT_EQ(rp.plan.recompute_modules, memory_saving_modules(j.m));
    ParallelPlan alone = rp.plan;
    alone.recompute_modules = kRecomputeCoreAttn;
    EXPECT_FALSE(cost.memory(alone).fits) << plan_summary(rp.plan);
  }
  EXPECT_GT(savers, 0);
  EXPECT_EQ(saving.considered, core.considered);
  EXPECT_EQ(saving.top.size(), core.top.size() + static_cast<size_t>(savers));
}

TEST(Search, OptimizerInstancesOnlyWhenAskedAndWhereTheyDivide) {
  Job j("llama2-7b", 64);
  SearchOptions o;
  o.global_batch_size = 256;
  o.top_k = 3000;
  const SearchResult plain = search_plans(j.m, j.c, j.h, o);
  for (const RankedPlan& rp : plain.top) EXPECT_EQ(rp.plan.optimizer_instances, 1);
  for (const int64_t asked : {int64_t{4}, int64_t{0}}) {
    o.optimizer_instances = asked;
    const SearchResult r = search_plans(j.m, j.c, j.h, o);
    EXPECT_GT(r.considered, plain.considered) << asked;
    EXPECT_LE(r.top[0].prediction.iteration_time_s, plain.top[0].prediction.iteration_time_s)
        << asked;
    std::set<int64_t> seen;
    for (const RankedPlan& rp : r.top) {
      const ParallelPlan& p = rp.plan;
      if (p.optimizer_instances == 1) continue;
      seen.insert(p.optimizer_instances);
      const int64_t dp = p.data_parallel * p.context_parallel;
      EXPECT_TRUE(p.distributed_optimizer) << plan_summary(p);
      EXPECT_EQ(dp % p.optimizer_instances, 0) << plan_summary(p);
      EXPECT_GE(dp / p.optimizer_instances, 2) << plan_summary(p);
      EXPECT_EQ(first_violated_rule(j.m, p), PlanRule::kNone) << plan_summary(p);
      EXPECT_NE(plan_summary(p).find("dopt-x" + std::to_string(p.optimizer_instances)),
                std::string::npos);
      if (asked == 4) {
        EXPECT_EQ(p.optimizer_instances, 4) << plan_summary(p);
      }
      // auto: the instance is a node's part of the group (t * d * cp / K = 8 GPUs of a node).
      const GroupSpan span = data_group_span(j.c, p);
      if (asked == 0) {
        EXPECT_EQ(p.optimizer_instances, span.nodes) << plan_summary(p);
        EXPECT_EQ(optimizer_instance_span(j.c, p).nodes, 1) << plan_summary(p);
      }
    }
    EXPECT_FALSE(seen.empty()) << asked;
  }
  // With Megatron-FSDP's strategies too: HSDP plans at p = 1, across the instances no_shard, and
  // optim only over optim_grads_params.
  o.optimizer_instances = 0;
  o.fsdp_strategies = {FsdpSharding::kOptimGrads, FsdpSharding::kOptimGradsParams};
  const SearchResult hsdp = search_plans(j.m, j.c, j.h, o);
  std::set<std::pair<FsdpSharding, FsdpSharding>> kinds;
  for (const RankedPlan& rp : hsdp.top) {
    const ParallelPlan& p = rp.plan;
    if (p.fsdp == FsdpSharding::kOff || p.optimizer_instances == 1) continue;
    kinds.insert({p.fsdp, p.fsdp_outer});
    EXPECT_EQ(p.pipeline_parallel, 1) << plan_summary(p);
    EXPECT_EQ(first_violated_rule(j.m, p), PlanRule::kNone) << plan_summary(p);
    EXPECT_NE(plan_summary(p).find("-x" + std::to_string(p.optimizer_instances)),
              std::string::npos);
  }
  EXPECT_EQ(kinds, (std::set<std::pair<FsdpSharding, FsdpSharding>>{
                       {FsdpSharding::kOptimGrads, FsdpSharding::kNoShard},
                       {FsdpSharding::kOptimGradsParams, FsdpSharding::kNoShard},
                       {FsdpSharding::kOptimGradsParams, FsdpSharding::kOptim}}));
}

// Megatron's uneven splits: the ends lighter than (or as full as) the equal middle stages, the
// sum always the model's layers, the even split first when there is one.
// The overlap settings hide communication and nothing else: searching with them considers the
// same configurations, applies each overlap only where it has something to overlap (sequence
// parallelism, the distributed optimizer), and finds a best plan no slower. (They once ruled
// out every t > 1 or d > 1 cell: the cell check saw the overlap without SP or the optimizer.)
TEST(Search, OverlapSettingsApplyWhereTheyCanAndNeverShrinkTheSearch) {
  Job j(256);
  SearchOptions o;
  o.global_batch_size = 512;
  o.top_k = 50;
  const SearchResult plain = search_plans(j.m, j.c, j.h, o);
  o.defaults.tp_comm_overlap = true;
  o.defaults.overlap_param_gather = true;
  const SearchResult overlapped = search_plans(j.m, j.c, j.h, o);
  EXPECT_EQ(overlapped.considered, plain.considered);
  EXPECT_EQ(overlapped.evaluated, plain.evaluated);
  ASSERT_FALSE(overlapped.top.empty());
  EXPECT_LT(overlapped.top.front().prediction.iteration_time_s,
            plain.top.front().prediction.iteration_time_s);
  bool tp_overlapped = false, gather_overlapped = false;
  for (const RankedPlan& r : overlapped.top) {
    EXPECT_EQ(r.plan.tp_comm_overlap, r.plan.sequence_parallel) << plan_summary(r.plan);
    EXPECT_EQ(r.plan.overlap_param_gather, r.plan.distributed_optimizer) << plan_summary(r.plan);
    tp_overlapped = tp_overlapped || (r.plan.tp_comm_overlap && r.plan.tensor_parallel > 1);
    gather_overlapped =
        gather_overlapped || (r.plan.overlap_param_gather && r.plan.data_parallel > 1);
  }
  EXPECT_TRUE(tp_overlapped);
  EXPECT_TRUE(gather_overlapped);
}

// Megatron's block recompute: where no recomputation does not fit but full recomputation does,
// the search adds the plan recomputing the fewest layers per chunk that fit. It is faster than
// full recomputation (recompute time in proportion to the layers recomputed), it fits, and one
// layer fewer would not.
TEST(Search, BlockRecomputeTakesTheFewestLayersThatFit) {
  Job j(64);
  j.m.seq_length = 8192;
  SearchOptions o;
  o.global_batch_size = 512;
  o.top_k = 30;
  const SearchResult r = search_plans(j.m, j.c, j.h, o);
  const CostModel cost(j.m, j.c, j.h);
  int blocks = 0;
  for (const RankedPlan& rp : r.top) {
    const ParallelPlan& p = rp.plan;
    if (p.recompute_layers == 0) continue;
    ++blocks;
    ASSERT_EQ(p.recompute, Recompute::kFull) << plan_summary(p);
    EXPECT_TRUE(cost.memory(p).fits) << plan_summary(p);
    ParallelPlan fewer = p, full = p, none = p;
    fewer.recompute_layers -= 1;
    if (fewer.recompute_layers > 0) {
      EXPECT_FALSE(cost.memory(fewer).fits) << plan_summary(p);
    }
    full.recompute_layers = 0;
    none.recompute = Recompute::kNone;
    none.recompute_layers = 0;
    EXPECT_FALSE(cost.memory(none).fits) << plan_summary(p);
    const Prediction a = cost.predict(p), b = cost.predict(full);
    EXPECT_LT(a.iteration_time_s, b.iteration_time_s) << plan_summary(p);
    EXPECT_GT(a.memory.peak, b.memory.peak) << plan_summary(p);
    // An even split without interleaving: each stage recomputes N of its layers.
    if (p.layers_per_stage.empty() && p.virtual_stages == 1) {
      const double share = static_cast<double>(p.recompute_layers) /
                           static_cast<double>(j.m.num_layers / p.pipeline_parallel);
      EXPECT_NEAR(a.breakdown.recompute, share * b.breakdown.recompute,
                  1e-9 * b.breakdown.recompute)
          << plan_summary(p);
    }
  }
  EXPECT_GT(blocks, 0) << "no block-recompute plan among the top " << r.top.size();
  EXPECT_GT(r.top.front().plan.recompute_layers, 0) << plan_summary(r.top.front().plan);
}

TEST(StageSplits, MegatronStyleFirstAndLastStages) {
  for (const auto& [layers, p] : std::vector<std::pair<int64_t, int64_t>>{
           {126, 16}, {96, 8}, {80, 6}, {32, 3}, {30, 4}, {61, 2}, {7, 7}}) {
    const auto splits = stage_splits(layers, p, true);
    EXPECT_EQ(splits.empty() || !splits.front().empty(), layers % p != 0) << layers << "/" << p;
    for (const std::vector<int64_t>& s : splits) {
      if (s.empty()) continue;
      ASSERT_EQ(static_cast<int64_t>(s.size()), p);
      EXPECT_EQ(std::accumulate(s.begin(), s.end(), int64_t{0}), layers);
      const int64_t mid = p > 2 ? s[1] : std::max(s.front(), s.back());
      for (size_t i = 1; i + 1 < s.size(); ++i) EXPECT_EQ(s[i], mid);
      EXPECT_GE(s.front(), 1);
      EXPECT_GE(s.back(), 1);
      EXPECT_LE(s.front(), mid);
      EXPECT_LE(s.back(), mid);
      EXPECT_EQ(s, megatron_stage_split(layers, p, s.front(), s.back()));
    }
    EXPECT_EQ(stage_splits(layers, p, false).size(), layers % p == 0 ? 1u : 0u);
  }
  // Llama 3 405B's split at p = 16 (Llama 3 paper, section 3.3.2: one fewer layer on the
  // first and the last stage).
  std::vector<int64_t> llama(16, 8);
  llama.front() = llama.back() = 7;
  const auto splits = stage_splits(126, 16, true);
  EXPECT_NE(std::find(splits.begin(), splits.end(), llama), splits.end());
  EXPECT_TRUE(stage_splits(7, 7, true).size() == 1 && stage_splits(7, 7, true)[0].empty());
}

// The interleaved layouts of Megatron-Core's accounting flags: every chunk (L + counted) / (p v)
// layers, the ends lighter by what they hold; Megatron-Bridge's recipe layouts are among them
// (Qwen3 235B: 94 layers at p8 v4 with the embedding and the loss counted; DeepSeek-V3: 61
// layers and its MTP module at p8 v4, "Et|(tt|)*30mL").
TEST(StageSplits, AccountedInterleavedLayouts) {
  auto has = [](const std::vector<std::vector<int64_t>>& all, const std::vector<int64_t>& l) {
    return std::find(all.begin(), all.end(), l) != all.end();
  };
  std::vector<int64_t> qwen(32, 3);
  qwen.front() = qwen.back() = 2;
  EXPECT_TRUE(has(accounted_chunk_layouts(94, 8), qwen));
  std::vector<int64_t> deepseek(32, 2);
  deepseek.front() = 1;
  deepseek.back() = 0;
  EXPECT_TRUE(has(accounted_chunk_layouts(61, 8, 1), deepseek));
  EXPECT_FALSE(has(accounted_chunk_layouts(61, 8), deepseek));  // without MTP: 63 slots
  for (const auto& [layers, p, mtp] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {94, 8, 0}, {61, 8, 1}, {126, 8, 0}, {34, 2, 0}, {47, 4, 2}, {7, 7, 0}}) {
    for (const std::vector<int64_t>& l : accounted_chunk_layouts(layers, p, mtp)) {
      ASSERT_EQ(static_cast<int64_t>(l.size()) % p, 0);
      EXPECT_GE(static_cast<int64_t>(l.size()) / p, 2);
      EXPECT_EQ(std::accumulate(l.begin(), l.end(), int64_t{0}), layers);
      for (size_t i = 1; i + 1 < l.size(); ++i) EXPECT_EQ(l[i], l[1]);
      EXPECT_GE(l.front(), 1);
      EXPECT_GE(l.back(), 0);
      EXPECT_LE(l.front(), l[1]);
      EXPECT_LE(l.back(), l[1]);
    }
  }
  EXPECT_TRUE(accounted_chunk_layouts(94, 1).empty());
}

// Tensor-parallel groups that do not tile a node (t = 3 on 8-GPU nodes) leave one group across
// two nodes, and that group sets the pace; on a 72-GPU NVLink domain t = 3 stays inside.
TEST(CommModel, TensorGroupsThatDoNotTileANodeCrossIt) {
  ClusterSpec dgx = resolve_cluster("dgx-a100-80gb");
  dgx.resize(96);
  const HardwareProfile h = resolve_profile("a100-80gb");
  ParallelPlan p;
  auto span = [&](const ClusterSpec& c, int64_t t) {
    p.tensor_parallel = t;
    return tensor_group_span(c, p);
  };
  EXPECT_EQ(span(dgx, 4).nodes, 1);
  EXPECT_EQ(span(dgx, 8).nodes, 1);
  EXPECT_EQ(span(dgx, 3).nodes, 2);
  EXPECT_EQ(span(dgx, 6).nodes, 2);
  EXPECT_EQ(span(dgx, 16).nodes, 2);
  EXPECT_EQ(span(dgx, 16).ranks_per_node, 8);
  const CommModel comm(dgx, h);
  const double bytes = 64e6;
  EXPECT_GT(comm.collective_time(Collective::kAllReduce, bytes, span(dgx, 3), DType::kBF16),
            2 * comm.collective_time(Collective::kAllReduce, bytes, span(dgx, 4), DType::kBF16));
  ClusterSpec nvl72 = resolve_cluster("gb200-nvl72");
  nvl72.resize(144);
  EXPECT_EQ(span(nvl72, 3).nodes, 1);
  EXPECT_EQ(span(nvl72, 8).nodes, 1);
  EXPECT_EQ(span(nvl72, 16).nodes, 2);  // 16 does not tile 72
}

// SC'21's scatter/gather of pipeline transfers across nodes: each tensor-parallel rank sends 1/t
// and the receivers all-gather. With sequence parallelism the message is already 1/t (each rank's
// slice of the sequence): it is sent as it is, not split again.
TEST(CommModel, ScatterGatherSplitsOnlyWhatSequenceParallelismHasNotSplit) {
  ClusterSpec dgx = resolve_cluster("dgx-a100-80gb");
  dgx.resize(64);
  const HardwareProfile h = resolve_profile("a100-80gb");  // CommModel keeps a reference
  const CommModel comm(dgx, h);
  ParallelPlan p;
  p.tensor_parallel = 8;
  p.pipeline_parallel = 8;
  const double bytes = 48e6;
  ASSERT_TRUE(pipeline_crosses_nodes(dgx, p));
  const P2PSplit split = comm.p2p_split(bytes, p);
  EXPECT_DOUBLE_EQ(split.bytes, bytes / 8);
  EXPECT_GT(split.gather_s, 0.0);
  p.sequence_parallel = true;
  const P2PSplit sp = comm.p2p_split(bytes, p);
  EXPECT_DOUBLE_EQ(sp.bytes, bytes);
  EXPECT_EQ(sp.gather_s, 0.0);
  p.sequence_parallel = false;
  p.scatter_gather_p2p = false;
  EXPECT_DOUBLE_EQ(comm.p2p_split(bytes, p).bytes, bytes);
}

TEST(Search, UnevenStagesLetPNotDividingTheLayersRun) {
  Job j("llama3-405b", 1024);  // 126 layers
  j.m.seq_length = 4096;
  SearchOptions o;
  o.global_batch_size = 512;
  o.top_k = 50;
  o.try_uneven_stages = false;
  const SearchResult even = search_plans(j.m, j.c, j.h, o);
  o.try_uneven_stages = true;
  const SearchResult uneven = search_plans(j.m, j.c, j.h, o);
  EXPECT_GT(uneven.considered, even.considered);
  ASSERT_FALSE(uneven.top.empty());
  // Without uneven splits p must divide 126; with them p = 16 and the like are priced too.
  bool any_uneven = false;
  for (const RankedPlan& r : uneven.top) {
    EXPECT_NO_THROW(r.plan.validate(j.m));
    any_uneven = any_uneven || !r.plan.layers_per_stage.empty();
  }
  for (const RankedPlan& r : even.top) EXPECT_EQ(126 % r.plan.pipeline_parallel, 0);
  EXPECT_TRUE(any_uneven);
  // Here p | 126 leaves p <= 2 for 1024 GPUs, too few stages to hold 405B parameters.
  EXPECT_TRUE(even.top.empty());
}

// Llama 3 405B at a 128K context on 16384 H100s: nothing without context parallelism fits, so
// the search ranks cp plans first; every one of them is valid and fits.
TEST(Search, LongContextNeedsContextParallelism) {
  Job j("llama3-405b", 16384);
  j.m.seq_length = 131072;
  SearchOptions o;
  o.global_batch_size = 2048;
  o.threads = 1;
  o.try_context_parallel = false;
  const SearchResult without = search_plans(j.m, j.c, j.h, o);
  EXPECT_EQ(without.evaluated, 0);
  EXPECT_GT(without.rejected.at("does not fit in GPU memory"), 0);
  o.try_context_parallel = true;
  const SearchResult with = search_plans(j.m, j.c, j.h, o);
  ASSERT_FALSE(with.top.empty());
  for (const RankedPlan& r : with.top) {
    EXPECT_GT(r.plan.context_parallel, 1);
    EXPECT_NO_THROW(r.plan.validate(j.m));
    EXPECT_TRUE(r.prediction.memory.fits);
    EXPECT_EQ(r.plan.num_gpus(), 16384);
  }
}

// Each cp > 1 plan carries the fastest --cp-comm-type that fits it: re-priced with each type
// the plan allows, none is faster. A 16k-token MHA model on 128 H100s cannot hide the ring's
// steps behind the small attention blocks of a wide cp group, so the search beats the ring-only
// search there.
TEST(Search, ContextParallelPlansCarryTheFastestCpCommType) {
  Job j("llama2-7b", 128);
  j.m.seq_length = 16384;
  j.h.activation_dtype = DType::kBF16;
  SearchOptions o;
  o.global_batch_size = 64;
  o.threads = 1;
  o.top_k = 20;
  o.min_context_tokens = 512;
  const SearchResult all = search_plans(j.m, j.c, j.h, o);
  const CostModel cost(j.m, j.c, j.h);
  ASSERT_FALSE(all.top.empty());
  int context = 0;
  std::set<CpComm> kinds;
  for (const RankedPlan& r : all.top) {
    if (r.plan.context_parallel == 1) continue;
    ++context;
    kinds.insert(r.plan.cp_comm);
    for (CpComm c : kCpComms) {
      ParallelPlan other = r.plan;
      other.hierarchical_cp = 0;
      other = with_cp_comm(other, c, j.m, j.c.gpus_per_node);
      if (first_violated_rule(j.m, other) != PlanRule::kNone || !cost.memory(other).fits) continue;
      EXPECT_GE(cost.predict(other).iteration_time_s, r.prediction.iteration_time_s * (1 - 1e-12))
          << plan_summary(r.plan) << " as " << to_string(c);
    }
  }
  EXPECT_GT(context, 0);
  EXPECT_GT(kinds.size(), 1u);
  // a2a+p2p plans carry the fastest all-to-all size: re-priced with each other one that divides
  // the heads and keeps the all-to-alls in a node, none is faster.
  for (const RankedPlan& r : all.top)
    if (r.plan.context_parallel > 1 && r.plan.cp_comm == CpComm::kA2AP2P) {
      const std::vector<int64_t> sizes = hierarchical_cp_sizes(j.m, r.plan, j.c.gpus_per_node);
      EXPECT_NE(std::find(sizes.begin(), sizes.end(), r.plan.hierarchical_cp), sizes.end());
      expect_fastest_hierarchical_cp(j, cost, r);
    }
  o.cp_comms = {CpComm::kP2P};  // --cp-comm-type p2p
  const SearchResult ring = search_plans(j.m, j.c, j.h, o);
  for (const RankedPlan& r : ring.top) EXPECT_EQ(r.plan.cp_comm, CpComm::kP2P);
  ASSERT_FALSE(ring.top.empty());
  EXPECT_LE(all.top[0].prediction.iteration_time_s, ring.top[0].prediction.iteration_time_s);
}

// a2a+p2p's all-to-all size is searched, not fixed at the largest group inside a node: Llama 3
// 8B at 64k tokens on 128 H100s, pinned to a2a+p2p, ranks first a plan whose all-to-all size is
// the fastest of every in-node size its cp allows, and not the largest. hierarchical_cp_sizes
// lists each A with 1 < A < cp dividing the heads and groups.
TEST(Search, HierarchicalContextParallelTriesEveryAllToAllSize) {
  Job j("llama3-8b", 128);
  j.m.seq_length = 65536;
  j.h.activation_dtype = DType::kBF16;
  ParallelPlan p;
  p.context_parallel = 16;
  p.tensor_parallel = 1;
  EXPECT_EQ(hierarchical_cp_sizes(j.m, p, 8), (std::vector<int64_t>{2, 4, 8}));
  EXPECT_EQ(natural_hierarchical_cp(j.m, p, 8), 8);
  p.tensor_parallel = 2;  // 4 query groups a rank: A must divide them
  EXPECT_EQ(hierarchical_cp_sizes(j.m, p, 8), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(natural_hierarchical_cp(j.m, p, 8), 4);
  p.tensor_parallel = 8;  // one group a rank
  EXPECT_TRUE(hierarchical_cp_sizes(j.m, p, 8).empty());
  EXPECT_EQ(natural_hierarchical_cp(j.m, p, 8), 0);
  SearchOptions o;
  o.global_batch_size = 64;
  o.threads = 1;
  o.top_k = 10;
  o.cp_comms = {CpComm::kA2AP2P};
  const SearchResult r = search_plans(j.m, j.c, j.h, o);
  const CostModel cost(j.m, j.c, j.h);
  ASSERT_FALSE(r.top.empty());
  std::set<int64_t> chosen;
  for (const RankedPlan& ranked : r.top) {
    if (ranked.plan.context_parallel == 1) continue;
    ASSERT_EQ(ranked.plan.cp_comm, CpComm::kA2AP2P);
    chosen.insert(ranked.plan.hierarchical_cp);
    expect_fastest_hierarchical_cp(j, cost, ranked);
  }
  ASSERT_FALSE(chosen.empty());
  const RankedPlan& best = r.top.front();
  EXPECT_NE(best.plan.hierarchical_cp, natural_hierarchical_cp(j.m, best.plan, 8))
      << plan_summary(best.plan);
}

// An MoE model plans with expert and context parallelism among the candidates, each a valid
// plan whose expert groups tile the stage's t * cp * d ranks (ptdp run executes MoE with cp
// since 2026-11-27; the search left cp out for MoE models before).
TEST(Search, MoeModelsPlanWithExpertParallelism) {
  Job j("mixtral-8x7b", 64);
  j.m.seq_length = 4096;
  SearchOptions o;
  o.global_batch_size = 256;
  o.top_k = 200;
  const SearchResult r = search_plans(j.m, j.c, j.h, o);
  ASSERT_FALSE(r.top.empty());
  bool any_ep = false, any_cp = false, both = false;
  for (const RankedPlan& x : r.top) {
    EXPECT_NO_THROW(x.plan.validate(j.m));
    const ParallelPlan& p = x.plan;
    any_ep = any_ep || p.expert_parallel > 1;
    any_cp = any_cp || p.context_parallel > 1;
    both = both || (p.expert_parallel > 1 && p.context_parallel > 1);
    EXPECT_EQ(p.tensor_parallel * p.context_parallel * p.data_parallel %
                  (p.expert_tp() * p.expert_parallel),
              0);
    // A runner-up that loses on its all-to-alls says so, not "tensor-parallel" at t = 1.
    const std::string why = loses_because(r.top[0].prediction, x.prediction);
    if (p.tensor_parallel == 1) {
      EXPECT_EQ(why.find("tensor-parallel"), std::string::npos) << why;
    }
  }
  EXPECT_TRUE(any_ep);
  EXPECT_TRUE(any_cp);
  EXPECT_TRUE(both);
  // Expert parallelism lowers the expert memory of a rank: the best ep > 1 plan holds less
  // expert state than the same plan with ep = 1.
  for (const RankedPlan& x : r.top) {
    if (x.plan.expert_parallel == 1) continue;
    ParallelPlan one = x.plan;
    one.expert_parallel = 1;
    CostModel cost(j.m, j.c, j.h);
    EXPECT_LT(x.prediction.memory.expert_weights, cost.memory(one).expert_weights);
    break;
  }
}

}  // namespace
}  // namespace ptdp
