// kernels/cuda/rope.h against rope (kernels/cpu/kernels.h).
#include "kernels/cuda/rope.h"

#include <stdexcept>
#include <string>

#include "kernels/cpu/kernels.h"
#include "tests/cuda/cuda_test_util.h"

namespace ptdp::cuda_test {
namespace {

// Both kernels: the 16-byte vector one (d = 64: halves of 32) and the scalar one (d = 36: halves
// of 18, not a multiple of 8). b x heads = 6 rows is not a multiple of the vector kernel's
// batches of 4 loads; 21 rows are two of its blocks of 16 rows, the second a batch of 4 and 1.
void check_rope(int64_t d, int64_t b = 2, int64_t heads = 3) {
  SCOPED_TRACE("d = " + std::to_string(d) + ", b x heads = " + std::to_string(b * heads));
  const int64_t s = 300;
  const double base = 10000;
  const auto x = random_bf16(b * s * heads * d, 1, 1);
  auto dx = to_device_bf16(x);
  kernels::cuda::rope(dx.get(), b, s, heads, d, base, false, nullptr);
  auto want = x;
  kernels::rope(want.data(), b, s, heads, d, base, false);
  expect_close(bf16_values(dx), want, 1e-2, 1e-2, "rope");

  const auto rotated = bf16_values(dx);
  kernels::cuda::rope(dx.get(), b, s, heads, d, base, true, nullptr);
  auto back = rotated;
  kernels::rope(back.data(), b, s, heads, d, base, true);
  expect_close(bf16_values(dx), back, 1e-2, 1e-2, "inverse rope");
  expect_close(bf16_values(dx), x, 3e-2, 3e-2, "rope then inverse");  // two bf16 roundings
}

TEST(CudaRope, ForwardAndInverseMatchCpu) {
  PTDP_REQUIRE_GPU();
  check_rope(64);
  check_rope(36);
  check_rope(64, 3, 7);
}

// Far along a sequence the angles j * base^(-2i/d) are large (up to 9000 rad here), where an
// fp32 angle is some 1e-3 rad off. The vector kernel reduces them in fp64 (rope.cu): its bf16
// results are the CPU twin's fp64 rotation rounded to bf16, but for the odd rounding tie.
TEST(CudaRope, FarPositionsKeepTheirAngles) {
  PTDP_REQUIRE_GPU();
  const int64_t b = 1, s = 9000, heads = 2, d = 64;
  const auto x = random_bf16(b * s * heads * d, 1, 7);
  auto dx = to_device_bf16(x);
  kernels::cuda::rope(dx.get(), b, s, heads, d, 10000, false, nullptr);
  auto want = x;
  kernels::rope(want.data(), b, s, heads, d, 10000, false);
  const auto got = bf16_values(dx);
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += got[i] != round_bf16(want[i]) ? 1 : 0;
  EXPECT_LT(differ, static_cast<int64_t>(got.size()) / 1000)
      << differ << " of " << got.size() << " elements are not the CPU's rotation rounded";
  expect_close(got, want, 1e-6, 8e-3, "rope far along the sequence");  // within a bf16 step
}

TEST(CudaRope, RejectsOddHeadDimension) {
  EXPECT_THROW(kernels::cuda::rope(nullptr, 1, 4, 1, 7, 10000, false, nullptr),
               std::invalid_argument);
}

}  // namespace
}  // namespace ptdp::cuda_test
