// One training step of `ptdp run` on one CPU rank (the Eigen kernels, the op-list interpreter
// and AdamW), for a small GPT (GPT-2-small shape cut to 4 layers: hidden 768, 12 heads,
// sequence 128, vocabulary 8192, b = 2), by recompute mode and in bf16 mixed precision (--bf16:
// every kernel widened to fp32 on the CPU), and for the 4-layer test model.
// Counters: tokens/s, and model FLOP/s (6 * parameters * tokens + attention, no recompute).
//   build/bench/run_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include "runtime/communicator.h"
#include "runtime/trainer.h"

namespace {

ptdp::TrainOptions options(int64_t layers, int64_t hidden, int64_t heads, int64_t seq,
                           int64_t vocab, int64_t b, ptdp::Recompute r) {
  ptdp::TrainOptions o;
  o.model.num_layers = layers;
  o.model.hidden_size = hidden;
  o.model.num_attention_heads = heads;
  o.model.seq_length = seq;
  o.model.vocab_size = vocab;
  o.plan.micro_batch_size = b;
  o.plan.global_batch_size = b;
  o.plan.recompute = r;
  return o;
}

// Each iteration trains 3 steps from scratch (model set-up included in the iteration time);
// the counters average steps 2 and 3 of every iteration, the first being a warm-up.
void step(benchmark::State& state, ptdp::TrainOptions o) {
  auto self = ptdp::make_self_communicator();
  o.steps = 3;
  int64_t timed = 0;
  double seconds = 0;
  const auto per_step = [&](const ptdp::StepStats& s) {
    if (s.step == 0) return;
    seconds += s.seconds;
    ++timed;
  };
  for (auto _ : state) ptdp::train(o, *self, per_step);
  const double tokens = static_cast<double>(o.plan.global_batch_size * o.model.seq_length);
  const double s = static_cast<double>(o.model.seq_length);
  const double h = static_cast<double>(o.model.hidden_size);
  // Model FLOPs per token: 6 per parameter, plus the attention scores and context (causal
  // attention counted in full, as Megatron's formula does).
  const double flops_per_token =
      6.0 * o.model.parameters() + 12.0 * static_cast<double>(o.model.num_layers) * s * h;
  const double n = static_cast<double>(timed);
  state.counters["step_ms"] = seconds / n * 1e3;
  state.counters["tokens_per_s"] = tokens * n / seconds;
  state.counters["GFLOP_per_s"] = flops_per_token * tokens * n / seconds / 1e9;
}

void BM_StepTinyTestModel(benchmark::State& state) {
  step(state, options(4, 64, 4, 32, 128, 8, ptdp::Recompute::kNone));
}
void BM_StepSmallGpt(benchmark::State& state) {
  step(state, options(4, 768, 12, 128, 8192, 2, static_cast<ptdp::Recompute>(state.range(0))));
}
void BM_StepSmallGptBf16(benchmark::State& state) {
  ptdp::TrainOptions o = options(4, 768, 12, 128, 8192, 2, ptdp::Recompute::kNone);
  o.precision = ptdp::DType::kBF16;
  step(state, o);
}

}  // namespace

BENCHMARK(BM_StepTinyTestModel)->Iterations(10)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_StepSmallGpt)
    ->ArgName("recompute")
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Iterations(2)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_StepSmallGptBf16)->Iterations(2)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
