// kernels/cuda/attention.h against causal_attention_* (kernels/cpu/fused.h): both
// implementations, the tensor-core one (FlashKernel::kTensorCore) and the CUDA-core one.
#include "kernels/cuda/attention.h"

#include <algorithm>
#include <stdexcept>

#include "kernels/cpu/fused.h"
#include "tests/cuda/cuda_test_util.h"

namespace ptdp::cuda_test {
namespace {

// s queries; sk keys (0: s), the queries being the last s of sk positions.
struct Shape {
  int64_t b, s, hq, hk, d, sk = 0;
};

void check_one(const Shape& sh, kernels::cuda::FlashKernel kernel) {
  SCOPED_TRACE(kernel == kernels::cuda::FlashKernel::kSimt ? "CUDA cores" : "tensor cores");
  const auto [b, s, hq, hk, d, keys] = sh;
  const int64_t sk = keys > 0 ? keys : s;
  const auto q = random_bf16(b * s * hq * d, 1, 1), k = random_bf16(b * sk * hk * d, 1, 2),
             v = random_bf16(b * sk * hk * d, 1, 3), dout = random_bf16(b * s * hq * d, 1, 4);
  auto dq_ = to_device_bf16(q), dk_ = to_device_bf16(k), dv_ = to_device_bf16(v),
       ddo = to_device_bf16(dout);
  DeviceBuffer<bf16> out(q.size());
  DeviceBuffer<float> lse(b * hq * s);
  kernels::cuda::flash_attention_forward(dq_.get(), dk_.get(), dv_.get(), out.get(), lse.get(), b,
                                         s, sk, hq, hk, d, nullptr, kernel);
  std::vector<float> out_want(q.size()), lse_want(b * hq * s);
  kernels::causal_attention_forward(q.data(), k.data(), v.data(), out_want.data(), lse_want.data(),
                                    b, s, sk, hq, hk, d);
  expect_close(bf16_values(out), out_want, 1e-2, 1e-2, "attention output");
  expect_close(lse.download(), lse_want, 1e-3, 1e-4, "log-sum-exp");

  // Backward from the device's own output and lse.
  const auto out_dev = bf16_values(out), lse_dev = lse.download();
  DeviceBuffer<bf16> dq(q.size()), dk(k.size()), dv(v.size());
  kernels::cuda::flash_attention_backward(dq_.get(), dk_.get(), dv_.get(), out.get(), lse.get(),
                                          ddo.get(), dq.get(), dk.get(), dv.get(), b, s, sk, hq, hk,
                                          d, nullptr, kernel);
  std::vector<float> dq_want(q.size()), dk_want(k.size()), dv_want(v.size());
  kernels::causal_attention_backward(q.data(), k.data(), v.data(), out_dev.data(), lse_dev.data(),
                                     dout.data(), dq_want.data(), dk_want.data(), dv_want.data(), b,
                                     s, sk, hq, hk, d);
  expect_close(bf16_values(dq), dq_want, 2e-2 * max_abs(dq_want), 1e-2, "dq");
  expect_close(bf16_values(dk), dk_want, 2e-2 * max_abs(dk_want), 1e-2, "dk");
  expect_close(bf16_values(dv), dv_want, 2e-2 * max_abs(dv_want), 1e-2, "dv");

  // No atomics: a second backward pass gives the same bits.
  DeviceBuffer<bf16> dq2(q.size()), dk2(k.size()), dv2(v.size());
  kernels::cuda::flash_attention_backward(dq_.get(), dk_.get(), dv_.get(), out.get(), lse.get(),
                                          ddo.get(), dq2.get(), dk2.get(), dv2.get(), b, s, sk, hq,
                                          hk, d, nullptr, kernel);
  EXPECT_EQ(dq2.download<uint16_t>(), dq.download<uint16_t>());
  EXPECT_EQ(dk2.download<uint16_t>(), dk.download<uint16_t>());
  EXPECT_EQ(dv2.download<uint16_t>(), dv.download<uint16_t>());
}

void check_attention(const Shape& sh) {
  check_one(sh, kernels::cuda::FlashKernel::kTensorCore);
  check_one(sh, kernels::cuda::FlashKernel::kSimt);
}

TEST(CudaFlashAttention, GroupedQueriesHeadDim64MatchCpu) {
  PTDP_REQUIRE_GPU();
  check_attention({2, 70, 4, 2, 64});  // three query tiles, the last one partial
}

TEST(CudaFlashAttention, MultiHeadHeadDim128MatchCpu) {
  PTDP_REQUIRE_GPU();
  check_attention({1, 96, 2, 2, 128});
}

TEST(CudaFlashAttention, MultiQueryShortSequenceMatchCpu) {
  PTDP_REQUIRE_GPU();
  check_attention({3, 5, 4, 1, 64});  // shorter than one tile
}

TEST(CudaFlashAttention, SequenceOfSeveralTensorCoreTilesMatchCpu) {
  PTDP_REQUIRE_GPU();
  check_attention({1, 200, 2, 1, 128});  // four 64-row tiles, the last partial; multi-query
}

// Queries that are the last s of sk positions (a context-parallel rank's chunk against the keys
// before it): the diagonal shifted by sk - s, by a whole number of tiles or not, with the
// queries shorter than a tile or spanning several, and keys that end inside a tile.
TEST(CudaFlashAttention, QueriesAfterLongerKeysMatchCpu) {
  PTDP_REQUIRE_GPU();
  check_attention({2, 40, 4, 2, 64, 120});   // shift 80: one tile and a part
  check_attention({1, 70, 2, 1, 128, 198});  // shift 128: two whole tiles; queries in two tiles
  check_attention({1, 9, 2, 2, 64, 200});    // nine queries over four key tiles
  check_attention({2, 64, 2, 2, 64, 128});   // shift of exactly one tile
}

TEST(CudaFlashAttention, LongSequenceKeepsNoScoreMatrix) {
  PTDP_REQUIRE_GPU();
#ifdef PTDP_CUDA_EMULATION
  GTEST_SKIP() << "16384 positions take too long in the host emulation; runs on a GPU";
#endif
  // s = 16384: a [hq, s, s] fp32 score matrix would need 2 GiB; the kernel's own extra memory is
  // the lse and delta rows only, so the free memory barely moves.
  const int64_t b = 1, s = 16384, hq = 2, hk = 2, d = 64;
  const std::vector<uint16_t> zeros_q(b * s * hq * d), zeros_kv(b * s * hk * d);
  DeviceBuffer<bf16> q(zeros_q), k(zeros_kv), v(zeros_kv), out(b * s * hq * d);
  DeviceBuffer<float> lse(b * hq * s);
  size_t free_before = 0, free_after = 0, total = 0;
  PTDP_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  kernels::cuda::flash_attention_forward(q.get(), k.get(), v.get(), out.get(), lse.get(), b, s, s,
                                         hq, hk, d, nullptr);
  PTDP_CUDA_CHECK(cudaDeviceSynchronize());
  PTDP_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  EXPECT_LT(free_before - std::min(free_before, free_after), size_t{64} << 20);
  const auto lse_host = lse.download();
  // All-zero inputs: uniform attention, lse of row i is log(i + 1).
  EXPECT_NEAR(lse_host[s - 1], std::log(static_cast<double>(s)), 1e-3);
  EXPECT_NEAR(lse_host[0], 0.0, 1e-6);
}

TEST(CudaFlashAttention, RejectsUnsupportedShapesBeforeTouchingTheDevice) {
  // No GPU needed: the shape checks come first.
  EXPECT_THROW(kernels::cuda::flash_attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                      1, 8, 8, 2, 2, 32, nullptr),
               std::invalid_argument);
  EXPECT_THROW(kernels::cuda::flash_attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                       nullptr, nullptr, nullptr, nullptr, 1, 8, 8,
                                                       3, 2, 64, nullptr),
               std::invalid_argument);
  // More queries than keys.
  EXPECT_THROW(kernels::cuda::flash_attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                      1, 9, 8, 2, 2, 64, nullptr),
               std::invalid_argument);
  // More sequences than the grid's z takes (the launch would fail on a GPU, not in the emulation).
  EXPECT_THROW(kernels::cuda::flash_attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                      65536, 8, 8, 2, 2, 64, nullptr),
               std::invalid_argument);
}

}  // namespace
}  // namespace ptdp::cuda_test
