// kernels/cuda/cross_entropy.h against cross_entropy_stats / _finish / _backward
// (kernels/cpu/elementwise.h) and the unsharded cross_entropy (kernels/cpu/kernels.h).
#include "kernels/cuda/cross_entropy.h"

#include <string>

#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/kernels.h"
#include "tests/cuda/cuda_test_util.h"

namespace ptdp::cuda_test {
namespace {

// Vocabulary v over t = 2 ranks of vl columns each, the last rank's final ones padding.
void check_vocab_parallel(int64_t vl, int64_t v = 1001) {
  SCOPED_TRACE("vl = " + std::to_string(vl));
  const int64_t n = 13, t = 2;
  const auto full = random_bf16(n * v, 3, 1);
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = static_cast<int32_t>((i * 389 + 7) % v);
  targets[0] = static_cast<int32_t>(vl - 1);  // the last column of rank 0
  targets[1] = static_cast<int32_t>(vl);      // the first column of rank 1
  DeviceBuffer<int32_t> d_targets(targets);
  // f = scale / n = 64: gradients near 0.06 a logit, so that a padding column given exp(-lse) f
  // instead of 0 stands out from the bf16 rounding.
  const double scale = 64.0 * static_cast<double>(n);

  std::vector<std::vector<float>> shards(t);
  std::vector<float> all_stats;  // [t, n, 3]
  std::vector<DeviceBuffer<bf16>> d_logits;
  for (int64_t r = 0; r < t; ++r) {
    const int64_t v0 = r * vl, valid = std::min(vl, v - v0);
    shards[r].assign(n * vl, 0.0f);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < valid; ++j) shards[r][i * vl + j] = full[i * v + v0 + j];
    d_logits.push_back(to_device_bf16(shards[r]));
    DeviceBuffer<float> stats(n * 3);
    kernels::cuda::cross_entropy_stats(d_logits[r].get(), d_targets.get(), stats.get(), n, vl,
                                       valid, v0, nullptr);
    std::vector<float> want(n * 3);
    kernels::cross_entropy_stats(shards[r].data(), targets.data(), want.data(), n, vl, valid, v0);
    const auto got = stats.download();
    expect_close(got, want, 1e-5, 1e-4, "rank statistics");
    all_stats.insert(all_stats.end(), got.begin(), got.end());
  }

  DeviceBuffer<float> d_stats(all_stats), lse(n), loss(n);
  kernels::cuda::cross_entropy_finish(d_stats.get(), t, lse.get(), loss.get(), n, nullptr);
  const auto lse_got = lse.download(), loss_got = loss.download();
  double loss_sum = 0;
  for (float x : loss_got) loss_sum += x;
  // The unsharded loss of the same logits.
  const double mean_loss =
      kernels::cross_entropy(full.data(), targets.data(), static_cast<float*>(nullptr), n, v);
  EXPECT_NEAR(loss_sum / n, mean_loss, 1e-4);

  for (int64_t r = 0; r < t; ++r) {
    const int64_t v0 = r * vl, valid = std::min(vl, v - v0);
    kernels::cuda::cross_entropy_backward(d_logits[r].get(), d_targets.get(), lse.get(), n, vl,
                                          valid, v0, scale, nullptr);
    auto probs = shards[r];
    std::vector<float> lse_cpu(n);
    kernels::cross_entropy_finish(all_stats.data(), t, probs.data(), lse_cpu.data(), n, vl, valid);
    expect_close(lse_got, lse_cpu, 1e-4, 1e-5, "log-sum-exp");
    kernels::cross_entropy_backward(probs.data(), targets.data(), n, vl, v0, scale);
    expect_close(bf16_values(d_logits[r]), probs, 1e-6, 1e-2, "logit gradient");
  }
}

// 501 columns take the element-wise kernels; 504 (a multiple of 8) the 16-byte-vector ones,
// whose last rank has 497 valid columns, so one vector holds logits and padding. 10008 columns
// are 1251 vectors a row: several a thread in the statistics (two loads at a time) and in the
// gradient (4 at a time, over two blocks of the row).
TEST(CudaCrossEntropy, VocabParallelLossAndGradientMatchCpu) {
  PTDP_REQUIRE_GPU();
  check_vocab_parallel(501);
  check_vocab_parallel(504);
  check_vocab_parallel(10008, 20009);
}

}  // namespace
}  // namespace ptdp::cuda_test
