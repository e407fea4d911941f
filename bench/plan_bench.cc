// Exhaustive `ptdp plan` of the 1T-parameter model of SC'21 Table 1 (128 layers, hidden 25600,
// 160 heads) on 3072 A100s at global batch 3072, over the full search space, on one thread.
//   build/bench/plan_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include "core/presets.h"
#include "planner/search.h"

namespace {

void BM_Plan1T(benchmark::State& state) {
  const ptdp::ModelSpec m = ptdp::resolve_model("gpt-1t");
  ptdp::ClusterSpec c = ptdp::resolve_cluster("dgx-a100-80gb");
  c.resize(3072);
  const ptdp::HardwareProfile h = ptdp::default_profile_for(c);
  ptdp::SearchOptions o;
  o.global_batch_size = 3072;
  o.threads = static_cast<int>(state.range(0));
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
BENCHMARK(BM_Plan1T)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

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
