// Without a GPU, the launchers report the failure as an exception that names the kernel or the
// call, instead of crashing or silently doing nothing. Runs only where no GPU is visible (CI).
#include <stdexcept>
#include <string>

#include "kernels/cuda/embedding.h"
#include "kernels/cuda/grad_norm.h"
#include "kernels/cuda/norm.h"
#include "tests/cuda/cuda_test_util.h"

namespace ptdp::cuda_test {
namespace {

template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST(CudaErrors, LaunchesWithoutADeviceThrowNamingTheKernelOrCall) {
  if (kernels::cuda::device_count() > 0) GTEST_SKIP() << "a GPU is visible; this tests its absence";
  EXPECT_NE(error_of([] {
              kernels::cuda::embedding_forward(nullptr, nullptr, nullptr, nullptr, 1, 4, 8, 0, 10,
                                               0, nullptr);
            }).find("embedding_forward_kernel"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              kernels::cuda::add_layernorm_backward(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                    nullptr, nullptr, nullptr, nullptr, 2, 8,
                                                    nullptr);
            }).find("norm_backward_kernel"),
            std::string::npos);
  EXPECT_NE(error_of([] { kernels::cuda::global_norm({}, nullptr); }).find("cudaMallocAsync"),
            std::string::npos);
  // Empty shapes queue nothing and so cannot fail.
  EXPECT_EQ(error_of([] {
              kernels::cuda::embedding_forward(nullptr, nullptr, nullptr, nullptr, 0, 4, 8, 0, 10,
                                               0, nullptr);
            }),
            "");
}

}  // namespace
}  // namespace ptdp::cuda_test
