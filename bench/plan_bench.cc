// Exhaustive `ptdp plan` over the full search space (t, cp, p, d, b, v, ep, etp, uneven
// splits, recompute, SP, distributed optimizer): the 1T-parameter model of SC'21 Table 1 (128
// layers, hidden 25600, 160 heads) on 3072 A100s at global batch 3072; the same on H100s at
// sequence 32768 (where context parallelism is tried); and a 64-expert MoE (Qwen2-57B-A14B,
// top-8, shared experts) on 1024 H100s, which adds expert parallelism; Llama 3 70B on 1024 H100s
// without and with Megatron-FSDP's strategies.
//   build/bench/plan_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "core/presets.h"
#include "planner/search.h"

namespace {

void run_search(benchmark::State& state, const ptdp::ModelSpec& m, const std::string& cluster,
                int64_t gpus, int64_t batch, const std::vector<ptdp::FsdpSharding>& fsdp = {},
                int64_t optimizer_instances = 1) {
  ptdp::ClusterSpec c = ptdp::resolve_cluster(cluster);
  c.resize(gpus);
  const ptdp::HardwareProfile h = ptdp::default_profile_for(c);
  ptdp::SearchOptions o;
  o.global_batch_size = batch;
  o.threads = static_cast<int>(state.range(0));
  o.fsdp_strategies = fsdp;
  o.optimizer_instances = optimizer_instances;
  int64_t considered = 0, evaluated = 0;
  for (auto _ : state) {
    const ptdp::SearchResult r = ptdp::search_plans(m, c, h, o);
    considered = r.considered;
    evaluated = r.evaluated;
    benchmark::DoNotOptimize(r.top.data());
  }
  state.counters["configs"] = static_cast<double>(considered);
  state.counters["priced"] = static_cast<double>(evaluated);
  state.counters["configs_per_s"] = benchmark::Counter(
      static_cast<double>(considered), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Plan1T(benchmark::State& state) {
  run_search(state, ptdp::resolve_model("gpt-1t"), "dgx-a100-80gb", 3072, 3072);
}
BENCHMARK(BM_Plan1T)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Plan1TLongContextH100(benchmark::State& state) {
  ptdp::ModelSpec m = ptdp::resolve_model("gpt-1t");
  m.seq_length = 32768;
  run_search(state, m, "dgx-h100", 3072, 384);
}
BENCHMARK(BM_Plan1TLongContextH100)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_PlanMoe64Experts(benchmark::State& state) {
  run_search(state, ptdp::resolve_model("qwen2-57b-a14b"), "dgx-h100", 1024, 1024);
}
BENCHMARK(BM_PlanMoe64Experts)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// DeepSeek-V3 (61 layers, an MTP module, 256 experts) on 1024 H100s at global batch 8192: its
// interleaved layouts (the embedding, loss and MTP module counted as layers) at thousands of
// microbatches, whose memory walks each rank's order.
void BM_PlanDeepSeekV3(benchmark::State& state) {
  run_search(state, ptdp::resolve_model("deepseek-v3"), "dgx-h100", 1024, 8192);
}
BENCHMARK(BM_PlanDeepSeekV3)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// Llama 3 70B on 1024 H100s at global batch 1024, as ptdp plan searches it, and with
// --use-megatron-fsdp (optim_grads and optim_grads_params at p = 1 besides).
void BM_PlanLlama70B(benchmark::State& state) {
  run_search(state, ptdp::resolve_model("llama3-70b"), "dgx-h100", 1024, 1024);
}
BENCHMARK(BM_PlanLlama70B)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_PlanLlama70BMegatronFsdp(benchmark::State& state) {
  run_search(state, ptdp::resolve_model("llama3-70b"), "dgx-h100", 1024, 1024,
             {ptdp::FsdpSharding::kOptimGrads, ptdp::FsdpSharding::kOptimGradsParams});
}
BENCHMARK(BM_PlanLlama70BMegatronFsdp)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// The distributed optimizer also in instances (auto: one per node's part of the group).
void BM_PlanLlama70BOptimizerInstances(benchmark::State& state) {
  run_search(state, ptdp::resolve_model("llama3-70b"), "dgx-h100", 1024, 1024, {}, 0);
}
BENCHMARK(BM_PlanLlama70BOptimizerInstances)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Predict175B(benchmark::State& state) {
  const ptdp::ModelSpec m = ptdp::resolve_model("gpt3-175b");
  ptdp::ClusterSpec c = ptdp::resolve_cluster("dgx-a100-80gb");
  c.resize(1024);
  const ptdp::HardwareProfile h = ptdp::default_profile_for(c);
  ptdp::ParallelPlan p;
  p.tensor_parallel = 8;
  p.pipeline_parallel = 16;
  p.data_parallel = 8;
  p.global_batch_size = 1536;
  for (auto _ : state) {
    ptdp::CostModel cost(m, c, h);  // fresh: no memoised op prices
    benchmark::DoNotOptimize(cost.predict(p).iteration_time_s);
  }
}
BENCHMARK(BM_Predict175B)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
