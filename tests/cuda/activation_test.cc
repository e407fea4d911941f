// kernels/cuda/activation.h against bias_gelu_* (kernels/cpu/fused.h) and swiglu_*.
#include "kernels/cuda/activation.h"

#include "kernels/cpu/fused.h"
#include "kernels/cpu/kernels.h"
#include "tests/cuda/cuda_test_util.h"

namespace ptdp::cuda_test {
namespace {

// Widths of 257 and 130 take the element-wise kernels, 264 and 136 (multiples of 8) the
// 16-byte-vector ones.
void check_bias_gelu(int64_t cols) {
  SCOPED_TRACE("cols = " + std::to_string(cols));
  const int64_t rows = 33;
  const auto x = random_bf16(rows * cols, 2, 1), bias = random_bf16(cols, 1, 2),
             dy = random_bf16(rows * cols, 1, 3);
  const auto dbias0 = random_f32(cols, 1, 4);
  auto d_x = to_device_bf16(x), d_bias = to_device_bf16(bias), d_dy = to_device_bf16(dy);
  DeviceBuffer<bf16> y(rows * cols), dx(rows * cols);
  DeviceBuffer<float> dbias(dbias0);
  kernels::cuda::bias_gelu_forward(d_x.get(), d_bias.get(), y.get(), rows, cols, nullptr);
  kernels::cuda::bias_gelu_backward(d_x.get(), d_bias.get(), d_dy.get(), dx.get(), dbias.get(),
                                    rows, cols, nullptr);
  std::vector<float> y_want(rows * cols), dx_want(rows * cols);
  auto dbias_want = dbias0;
  kernels::bias_gelu_forward(x.data(), bias.data(), y_want.data(), rows, cols);
  kernels::bias_gelu_backward(x.data(), bias.data(), dy.data(), dx_want.data(), dbias_want.data(),
                              rows, cols);
  expect_close(bf16_values(y), y_want, 1e-3, 8e-3, "bias gelu forward");
  expect_close(bf16_values(dx), dx_want, 1e-3, 8e-3, "bias gelu dx");
  expect_close(dbias.download(), dbias_want, 1e-4, 1e-4, "bias gradient");

  // In place (dx aliasing dy) with the bias gradient: the one-pass kernel where the columns
  // allow vectors reads each dy before it writes dx there.
  {
    auto d_dy2 = to_device_bf16(dy);
    DeviceBuffer<float> dbias2(dbias0);
    kernels::cuda::bias_gelu_backward(d_x.get(), d_bias.get(), d_dy2.get(), d_dy2.get(),
                                      dbias2.get(), rows, cols, nullptr);
    expect_close(bf16_values(d_dy2), dx_want, 1e-3, 8e-3, "bias gelu dx in place");
    expect_close(dbias2.download(), dbias_want, 1e-4, 1e-4, "bias gradient in place");
  }

  // Without a bias, and in place (dx aliasing dy).
  kernels::cuda::bias_gelu_backward(d_x.get(), nullptr, d_dy.get(), d_dy.get(), nullptr, rows, cols,
                                    nullptr);
  kernels::bias_gelu_backward(x.data(), nullptr, dy.data(), dx_want.data(), nullptr, rows, cols);
  expect_close(bf16_values(d_dy), dx_want, 1e-3, 8e-3, "gelu dx in place");
}

TEST(CudaActivation, BiasGeluForwardAndBackwardMatchCpu) {
  PTDP_REQUIRE_GPU();
  for (int64_t cols : {257, 264}) check_bias_gelu(cols);
}

// GELU without a bias over one long row, as the runtime calls it on a whole activation: the
// kernels take it as rows of 8192 down to 1024 where n divides so (here 6 rows of 8192 and 15
// of 1024), else as the one row (40000: 16-byte vectors; 10001: element by element).
TEST(CudaActivation, GeluOverOneLongRowMatchesCpu) {
  PTDP_REQUIRE_GPU();
  for (const int64_t n : {49152, 15360, 40000, 10001}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const auto x = random_bf16(n, 2, 7), dy = random_bf16(n, 1, 8);
    auto d_x = to_device_bf16(x), d_dy = to_device_bf16(dy);
    DeviceBuffer<bf16> y(n);
    kernels::cuda::bias_gelu_forward(d_x.get(), nullptr, y.get(), 1, n, nullptr);
    kernels::cuda::bias_gelu_backward(d_x.get(), nullptr, d_dy.get(), d_dy.get(), nullptr, 1, n,
                                      nullptr);
    std::vector<float> y_want(n), dx_want(n);
    kernels::bias_gelu_forward(x.data(), nullptr, y_want.data(), 1, n);
    kernels::bias_gelu_backward(x.data(), nullptr, dy.data(), dx_want.data(), nullptr, 1, n);
    expect_close(bf16_values(y), y_want, 1e-3, 8e-3, "gelu forward");
    expect_close(bf16_values(d_dy), dx_want, 1e-3, 8e-3, "gelu dx in place");
  }
}

void check_swiglu(int64_t f) {
  SCOPED_TRACE("f = " + std::to_string(f));
  const int64_t n = 19;
  const auto x = random_bf16(n * 2 * f, 2, 5), dy = random_bf16(n * f, 1, 6);
  auto d_x = to_device_bf16(x), d_dy = to_device_bf16(dy);
  DeviceBuffer<bf16> y(n * f), dx(n * 2 * f);
  kernels::cuda::swiglu_forward(d_x.get(), y.get(), n, f, nullptr);
  kernels::cuda::swiglu_backward(d_x.get(), d_dy.get(), dx.get(), n, f, nullptr);
  std::vector<float> y_want(n * f), dx_want(n * 2 * f);
  kernels::swiglu_forward(x.data(), y_want.data(), n, f);
  kernels::swiglu_backward(x.data(), dy.data(), dx_want.data(), n, f);
  expect_close(bf16_values(y), y_want, 1e-3, 8e-3, "swiglu forward");
  expect_close(bf16_values(dx), dx_want, 1e-3, 8e-3, "swiglu backward");
}

TEST(CudaActivation, SwigluForwardAndBackwardMatchCpu) {
  PTDP_REQUIRE_GPU();
  for (int64_t f : {130, 136}) check_swiglu(f);
}

}  // namespace
}  // namespace ptdp::cuda_test
