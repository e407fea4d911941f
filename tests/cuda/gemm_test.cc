// kernels/cuda/gemm.h against linear_forward / linear_backward / gelu_forward
// (kernels/cpu/kernels.h).
#include "kernels/cuda/gemm.h"

#include <stdexcept>

#include "kernels/cpu/kernels.h"
#include "tests/cuda/cuda_test_util.h"

namespace ptdp::cuda_test {
namespace {

using kernels::cuda::Epilogue;
using kernels::cuda::Gemm;
using kernels::cuda::GemmArgs;

// bf16 output of a k-term dot product: fp32 accumulation, one rounding to bf16.
void expect_gemm_close(const std::vector<float>& got, const std::vector<float>& want, int64_t k,
                       const std::string& what) {
  expect_close(got, want, 1e-5 * static_cast<double>(k) * max_abs(want) + 1e-3, 8e-3, what);
}

void check_linear(Gemm& gemm, int64_t n, int64_t in, int64_t out) {
  const auto x = random_bf16(n * in, 1, 1), w = random_bf16(out * in, 0.1f, 2),
             bias = random_bf16(out, 1, 3), dy = random_bf16(n * out, 1, 4);
  const auto dw0 = random_f32(out * in, 1, 5);
  auto d_x = to_device_bf16(x), d_w = to_device_bf16(w), d_bias = to_device_bf16(bias),
       d_dy = to_device_bf16(dy);
  DeviceBuffer<bf16> y(n * out), y_gelu(n * out), dx(n * in);
  DeviceBuffer<float> dw(dw0);

  GemmArgs fwd;
  fwd.m = n, fwd.n = out, fwd.k = in;
  fwd.a = d_x.get(), fwd.b = d_w.get(), fwd.trans_b = true;
  fwd.c = y.get(), fwd.epilogue = Epilogue::kBias, fwd.bias = d_bias.get();
  gemm.run(fwd, nullptr);
  fwd.c = y_gelu.get(), fwd.epilogue = Epilogue::kBiasGelu;
  gemm.run(fwd, nullptr);

  GemmArgs bx;  // dx = dy W
  bx.m = n, bx.n = in, bx.k = out, bx.a = d_dy.get(), bx.b = d_w.get(), bx.c = dx.get();
  gemm.run(bx, nullptr);
  GemmArgs bw;  // dW += dy^T x, into fp32
  bw.m = out, bw.n = in, bw.k = n, bw.a = d_dy.get(), bw.trans_a = true, bw.b = d_x.get();
  bw.c = dw.get(), bw.c_fp32 = true, bw.beta = 1.0f;
  gemm.run(bw, nullptr);

  std::vector<float> y_want(n * out), gelu_want(n * out), dx_want(n * in);
  auto dw_want = dw0;
  kernels::linear_forward(x.data(), w.data(), bias.data(), y_want.data(), n, in, out);
  kernels::gelu_forward(y_want.data(), gelu_want.data(), n * out);
  kernels::linear_backward(x.data(), w.data(), dy.data(), dx_want.data(), dw_want.data(),
                           static_cast<float*>(nullptr), n, in, out);
  expect_gemm_close(bf16_values(y), y_want, in, "x W^T + b");
  // cuBLASLt's GELU epilogue may use another approximation than the tanh one: bf16-level agreement.
  expect_close(bf16_values(y_gelu), gelu_want, 2e-2, 2e-2, "gelu(x W^T + b)");
  expect_gemm_close(bf16_values(dx), dx_want, out, "dy W");
  expect_close(dw.download(), dw_want, 1e-4 * static_cast<double>(n), 1e-4, "dW += dy^T x");
}

TEST(CudaGemm, LinearForwardBackwardAndEpiloguesMatchCpu) {
  PTDP_REQUIRE_GPU();
  Gemm gemm;
  check_linear(gemm, 64, 96, 128);
  EXPECT_EQ(gemm.cached_plans(), 4u);
  check_linear(gemm, 64, 96, 128);  // same shapes: planned once
  EXPECT_EQ(gemm.cached_plans(), 4u);
  check_linear(gemm, 40, 24, 56);  // another set of shapes
  EXPECT_EQ(gemm.cached_plans(), 8u);
}

TEST(CudaGemm, OddShapesMatchCpu) {
  PTDP_REQUIRE_GPU();
  Gemm gemm;
  check_linear(gemm, 33, 18, 7);  // leading dimensions that break 16-byte alignment
}

TEST(CudaGemm, RejectsBadArguments) {
  PTDP_REQUIRE_GPU();
  Gemm gemm;
  DeviceBuffer<bf16> a(64), b(64), c(64);
  GemmArgs g;
  g.m = 8, g.n = 8, g.k = 0, g.a = a.get(), g.b = b.get(), g.c = c.get();
  EXPECT_THROW(gemm.run(g, nullptr), std::invalid_argument);
  g.k = 8, g.epilogue = Epilogue::kBias;  // no bias pointer
  EXPECT_THROW(gemm.run(g, nullptr), std::invalid_argument);
  EXPECT_EQ(gemm.cached_plans(), 0u);
}

}  // namespace
}  // namespace ptdp::cuda_test
