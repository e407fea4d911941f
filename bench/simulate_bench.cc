// The discrete-event simulator on the 1T-parameter model of SC'21 Table 1 (128 layers, hidden
// 25600, 160 heads), t = 8, p = 64, b = 1, 1F1B:
//   BM_Simulate1TOnePipeline   3072 GPUs (d = 6), global batch 3072: m = 512, one pipeline
//   BM_Simulate1TFull16384     16384 GPUs (d = 32), global batch 3072: m = 96, every GPU
//   BM_Simulate1TLongBatch     one pipeline with m = 32768 microbatches (periodic steady
//                              state extrapolated from three short runs)
//   BM_Simulate1TInterleaved   as the first, interleaved with v = 2
// and Qwen2-57B-A14B (64 experts, top 8) on 64 H100s in bf16, t = 1, cp = 2, p = 2, v = 7,
// ep = 32, global batch 256 (m = 16): every MoE layer's pass starts 992 all-to-all flows
//   BM_SimulateQwenMoeEp32          one pipeline, 1F1B interleaved
//   BM_SimulateQwenMoeEp32Combined  the same, the all-to-alls under the other pass's kernels
//   build/bench/simulate_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include "core/presets.h"
#include "planner/simulation_input.h"

namespace {

struct Case {
  ptdp::ModelSpec model = ptdp::resolve_model("gpt-1t");
  ptdp::ClusterSpec cluster;
  ptdp::ParallelPlan plan;
  bool bf16 = false;
};

Case make(int64_t gpus, int64_t batch, int64_t v = 1) {
  Case k;
  k.cluster = ptdp::resolve_cluster("dgx-a100-80gb");
  k.cluster.resize(gpus);
  k.plan.tensor_parallel = 8;
  k.plan.pipeline_parallel = 64;
  k.plan.data_parallel = gpus / (8 * 64);
  k.plan.micro_batch_size = 1;
  k.plan.global_batch_size = batch;
  k.plan.virtual_stages = v;
  k.plan.schedule = v > 1 ? ptdp::Schedule::kInterleaved1F1B : ptdp::Schedule::k1F1B;
  k.plan.recompute = ptdp::Recompute::kFull;
  k.plan.validate(k.model);
  return k;
}

Case qwen(bool combined) {
  Case k;
  k.model = ptdp::resolve_model("qwen2-57b-a14b");
  k.cluster = ptdp::resolve_cluster("dgx-h100");
  k.cluster.resize(64);
  k.plan.tensor_parallel = 1;
  k.plan.context_parallel = 2;
  k.plan.pipeline_parallel = 2;
  k.plan.data_parallel = 16;
  k.plan.expert_parallel = 32;
  k.plan.micro_batch_size = 1;
  k.plan.global_batch_size = 256;
  k.plan.virtual_stages = 7;
  k.plan.schedule = ptdp::Schedule::kInterleaved1F1B;
  k.plan.overlap_p2p_comm = true;
  k.plan.overlap_moe_ep_comm = combined;
  k.bf16 = true;
  k.plan.validate(k.model);
  return k;
}

void run(benchmark::State& state, const Case& k, bool full) {
  ptdp::HardwareProfile profile = ptdp::default_profile_for(k.cluster);
  if (k.bf16) profile.activation_dtype = ptdp::DType::kBF16;
  const ptdp::CostModel cm(k.model, k.cluster, profile);
  const ptdp::SimulationInput in = [&] {
    ptdp::SimulationInput i = ptdp::simulation_input(cm, k.plan);
    i.full = full;
    return i;
  }();
  int64_t events = 0;
  double seconds = 0;
  for (auto _ : state) {
    const ptdp::SimulationResult r = ptdp::simulate(in, k.cluster, cm.profile());
    events = r.events;
    seconds = ptdp::to_seconds(r.iteration);
    benchmark::DoNotOptimize(r.iteration);
  }
  state.counters["microbatches"] = static_cast<double>(k.plan.num_microbatches());
  state.counters["events"] = static_cast<double>(events);
  state.counters["events_per_s"] = benchmark::Counter(
      static_cast<double>(events), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["iteration_s"] = seconds;
}

void BM_Simulate1TOnePipeline(benchmark::State& state) {
  run(state, make(3072, 3072), false);
}
BENCHMARK(BM_Simulate1TOnePipeline)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Simulate1TInterleaved(benchmark::State& state) {
  run(state, make(3072, 3072, 2), false);
}
BENCHMARK(BM_Simulate1TInterleaved)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Simulate1TFull16384(benchmark::State& state) {
  run(state, make(16384, 3072), true);
}
BENCHMARK(BM_Simulate1TFull16384)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);

void BM_Simulate1TLongBatch(benchmark::State& state) {
  run(state, make(3072, 32768 * 6), false);
}
BENCHMARK(BM_Simulate1TLongBatch)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_SimulateQwenMoeEp32(benchmark::State& state) {
  run(state, qwen(false), false);
}
BENCHMARK(BM_SimulateQwenMoeEp32)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_SimulateQwenMoeEp32Combined(benchmark::State& state) {
  run(state, qwen(true), false);
}
BENCHMARK(BM_SimulateQwenMoeEp32Combined)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
