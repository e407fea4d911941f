// kernels/cuda/adamw.h and grad_norm.h against adamw_step (kernels/cpu/kernels.h) and
// sum_squares (kernels/cpu/elementwise.h).
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/grad_norm.h"
#include "tests/cuda/cuda_test_util.h"

#ifdef PTDP_CUDA_EMULATION
namespace emu {
void fail_next_allocations(int n);  // tests/cuda/emulated_cuda_runtime.cc
}
#endif

namespace ptdp::cuda_test {
namespace {

#ifdef PTDP_CUDA_EMULATION
// A kernel's temporary that finds the device full (kernels::cuda::allocate_async, here the
// gradient norm's partials): the out-of-memory handler (the CUDA backend's: its kept blocks back
// to the device) runs once and the allocation is tried again; with no handler, or a second
// failure, the error names cudaMallocAsync.
TEST(CudaAllocateAsync, OutOfMemoryRunsTheHandlerThenRetriesOnce) {
  const std::vector<float> g(1000, 0.5f);
  DeviceBuffer<float> d(g);
  static int handled = 0;
  handled = 0;
  kernels::cuda::set_out_of_memory_handler([](void*) { ++handled; }, nullptr);
  emu::fail_next_allocations(1);
  EXPECT_DOUBLE_EQ(kernels::cuda::global_norm({{d.get(), 1000}}, nullptr), std::sqrt(250.0));
  EXPECT_EQ(handled, 1);
  emu::fail_next_allocations(2);
  try {
    kernels::cuda::global_norm({{d.get(), 1000}}, nullptr);
    ADD_FAILURE() << "a second failure must throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cudaMallocAsync"), std::string::npos) << e.what();
  }
  EXPECT_EQ(handled, 2);
  kernels::cuda::set_out_of_memory_handler(nullptr, nullptr);
  emu::fail_next_allocations(1);
  EXPECT_THROW(kernels::cuda::global_norm({{d.get(), 1000}}, nullptr), std::runtime_error);
  EXPECT_EQ(handled, 2);
  emu::fail_next_allocations(0);
}
#endif

TEST(CudaAdamW, ThreeStepsMatchCpuAndWriteTheBf16Copy) {
  PTDP_REQUIRE_GPU();
  const int64_t n = 10007;
  auto param = random_f32(n, 1, 1);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  DeviceBuffer<float> d_param(param), d_m(m), d_v(v);
  DeviceBuffer<bf16> d_bf16(n);
  kernels::AdamW o;
  o.lr = 1e-2;
  const double grad_scale = 0.25;
  for (int64_t step = 1; step <= 3; ++step) {
    const auto grad = random_f32(n, 1, 10 + static_cast<uint32_t>(step));
    DeviceBuffer<float> d_grad(grad);
    kernels::cuda::adamw_step(d_param.get(), d_grad.get(), d_m.get(), d_v.get(), d_bf16.get(), n, o,
                              step, grad_scale, nullptr);
    auto scaled = grad;
    kernels::scale(scaled.data(), n, grad_scale);
    kernels::adamw_step(param.data(), scaled.data(), m.data(), v.data(), n, o, step);
  }
  const auto got = d_param.download();
  expect_close(got, param, 1e-6, 1e-5, "master weights");
  expect_close(d_m.download(), m, 1e-7, 1e-5, "first moment");
  expect_close(d_v.download(), v, 1e-9, 1e-5, "second moment");
  std::vector<float> rounded(n);
  for (int64_t i = 0; i < n; ++i) rounded[i] = round_bf16(got[i]);
  expect_close(bf16_values(d_bf16), rounded, 0, 0, "bf16 copy of the device weights");
}

TEST(CudaAdamW, RejectsStepZero) {
  kernels::AdamW o;
  EXPECT_THROW(
      kernels::cuda::adamw_step(nullptr, nullptr, nullptr, nullptr, nullptr, 1, o, 0, 1.0, nullptr),
      std::invalid_argument);
}

TEST(CudaGradNorm, MatchesCpuAndIsBitwiseReproducible) {
  PTDP_REQUIRE_GPU();
  // Sizes for one block (17), some blocks (65536, 1000003: a block each 4096 elements) and the
  // most blocks (1024), each thread looping (5000001).
  const auto a = random_f32(1000003, 1, 1), b = random_f32(17, 3, 2),
             c = random_f32(65536, 0.1f, 3), e = random_f32(5000001, 0.5f, 4);
  DeviceBuffer<float> da(a), db(b), dc(c), de(e);
  const std::vector<std::pair<const float*, int64_t>> tensors = {
      {da.get(), static_cast<int64_t>(a.size())},
      {db.get(), static_cast<int64_t>(b.size())},
      {dc.get(), static_cast<int64_t>(c.size())},
      {da.get() + 1, 6},  // off the 16-byte boundary: a head of 3 elements and a tail
      {dc.get() + 3, 2},
      {de.get(), static_cast<int64_t>(e.size())}};
  const double got = kernels::cuda::global_norm(tensors, nullptr);
  double want = kernels::sum_squares(e.data(), static_cast<int64_t>(e.size()));
  want = kernels::sum_squares(a.data(), static_cast<int64_t>(a.size()), want);
  want = kernels::sum_squares(b.data(), static_cast<int64_t>(b.size()), want);
  want = kernels::sum_squares(c.data(), static_cast<int64_t>(c.size()), want);
  want = kernels::sum_squares(a.data() + 1, 6, want);
  want = kernels::sum_squares(c.data() + 3, 2, want);
  EXPECT_NEAR(got, std::sqrt(want), 1e-9 * std::sqrt(want));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(kernels::cuda::global_norm(tensors, nullptr), got);
}

}  // namespace
}  // namespace ptdp::cuda_test
