// The CPU backend's flash attention (kernels/cpu/flash.h: fp32 tiles of 64 x 64 with Eigen GEMMs)
// against the double-precision twin it replaced on that backend (causal_attention_* in
// kernels/cpu/fused.h), forward and backward, for self-attention (sq = sk = 512) and for a
// context-parallel chunk (128 queries, the last of 512 keys). One sequence, 8 heads of 64.
// Counter: GFLOP/s of the causal half (4 sq keys d per head forward, 10 backward; keys the
// average seen).
//   build/bench/cpu_kernels_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/flash.h"
#include "kernels/cpu/fused.h"
#include "kernels/cpu/kernels.h"

namespace {

constexpr int64_t kHeads = 8, kDim = 64;

std::vector<float> random(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = d(g);
  return x;
}

// range(0): 0 the twin, 1 the tiled kernel; range(1): queries (keys 512).
void attention(benchmark::State& state, bool backward) {
  const bool tiled = state.range(0) == 1;
  const int64_t sk = 512, sq = state.range(1);
  const size_t nq = static_cast<size_t>(sq * kHeads * kDim),
               nk = static_cast<size_t>(sk * kHeads * kDim);
  const auto q = random(nq, 1), k = random(nk, 2), v = random(nk, 3), dout = random(nq, 4);
  std::vector<float> out(nq), lse(static_cast<size_t>(kHeads * sq)), dq(nq), dk(nk), dv(nk);
  namespace kn = ptdp::kernels;
  auto forward = [&] {
    (tiled ? kn::flash_attention_forward : kn::causal_attention_forward)(
        q.data(), k.data(), v.data(), out.data(), lse.data(), 1, sq, sk, kHeads, kHeads, kDim);
  };
  forward();
  for (auto _ : state) {
    if (backward)
      (tiled ? kn::flash_attention_backward : kn::causal_attention_backward)(
          q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), dq.data(), dk.data(),
          dv.data(), 1, sq, sk, kHeads, kHeads, kDim);
    else
      forward();
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(dk.data());
  }
  const double keys = static_cast<double>(sk - sq) + (static_cast<double>(sq) + 1) / 2;
  const double flops = (backward ? 10.0 : 4.0) * kHeads * static_cast<double>(sq) * keys * kDim;
  state.counters["GFLOP_per_s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_CpuFlashAttentionForward(benchmark::State& state) {
  attention(state, false);
}
void BM_CpuFlashAttentionBackward(benchmark::State& state) {
  attention(state, true);
}

// GELU (tanh approximation) over 1M floats: range(0) 0 with libm's tanhf a call per element,
// 1 the kernel (kernels/cpu/fast_math.h's inline tanh, vectorised). Counter: ns per element.
void gelu(benchmark::State& state, bool backward) {
  constexpr int64_t n = 1 << 20;
  const auto x = random(n, 5), dy = random(n, 6);
  std::vector<float> y(n);
  const bool kernel = state.range(0) == 1;
  constexpr float c = 0.7978845608028654f;
  for (auto _ : state) {
    if (kernel && backward) {
      ptdp::kernels::gelu_backward(x.data(), dy.data(), y.data(), n);
    } else if (kernel) {
      ptdp::kernels::gelu_forward(x.data(), y.data(), n);
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const float xi = x[i], th = std::tanh(c * (xi + 0.044715f * xi * xi * xi));
        y[i] = backward ? dy[i] * (0.5f * (1 + th) +
                                   0.5f * xi * (1 - th * th) * c * (1 + 3 * 0.044715f * xi * xi))
                        : 0.5f * xi * (1 + th);
      }
    }
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["ns_per_element"] = benchmark::Counter(
      static_cast<double>(n) * 1e-9,
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void BM_CpuGeluForward(benchmark::State& state) {
  gelu(state, false);
}
void BM_CpuGeluBackward(benchmark::State& state) {
  gelu(state, true);
}

}  // namespace

BENCHMARK(BM_CpuGeluForward)->ArgNames({"kernel"})->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CpuGeluBackward)->ArgNames({"kernel"})->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CpuFlashAttentionForward)
    ->ArgNames({"tiled", "sq"})
    ->ArgsProduct({{0, 1}, {512, 128}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CpuFlashAttentionBackward)
    ->ArgNames({"tiled", "sq"})
    ->ArgsProduct({{0, 1}, {512, 128}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
