// kernels/cuda/norm.h against add_layernorm_* / add_rmsnorm_* (kernels/cpu/fused.h).
#include "kernels/cuda/norm.h"

#include "kernels/cpu/fused.h"
#include "tests/cuda/cuda_test_util.h"

namespace ptdp::cuda_test {
namespace {

constexpr int64_t kRows = 37;
// Row widths, one per kernel and edge: 300 (not a multiple of 8) and 8200 (above the 8192 columns
// a block holds in registers) re-read the row; 768 and 1000 go a warp per row (whole and partial
// last vectors), 1032 and 4096 a block per row in registers.
constexpr int64_t kWidths[] = {300, 768, 1000, 1032, 4096, 8200};

struct NormCase {
  NormCase(int64_t width, int64_t rows) : kN(rows), kH(width) {}
  int64_t kN, kH;
  std::vector<float> x = random_bf16(kN * kH, 1, 1), res = random_bf16(kN * kH, 1, 2);
  std::vector<float> g = random_bf16(kH, 1, 3), b = random_bf16(kH, 1, 4);
  std::vector<float> dy = random_bf16(kN * kH, 1, 5), dresid = random_bf16(kN * kH, 1, 6);
  std::vector<float> dg0 = random_f32(kH, 1, 7), db0 = random_f32(kH, 1, 8);
};

void check_layernorm(int64_t width, int64_t kN = kRows) {
  SCOPED_TRACE("h = " + std::to_string(width) + ", rows = " + std::to_string(kN));
  NormCase c(width, kN);
  const int64_t kH = width;
  auto dx_ = to_device_bf16(c.x), dres = to_device_bf16(c.res), dg_ = to_device_bf16(c.g),
       db_ = to_device_bf16(c.b);
  DeviceBuffer<bf16> r(kN * kH), y(kN * kH);
  DeviceBuffer<float> mean(kN), rstd(kN);
  kernels::cuda::add_layernorm_forward(dx_.get(), dres.get(), r.get(), dg_.get(), db_.get(),
                                       y.get(), mean.get(), rstd.get(), kN, kH, 1e-5f, nullptr);
  std::vector<float> r_want(kN * kH), y_want(kN * kH), mean_want(kN), rstd_want(kN);
  kernels::add_layernorm_forward(c.x.data(), c.res.data(), r_want.data(), c.g.data(), c.b.data(),
                                 y_want.data(), mean_want.data(), rstd_want.data(), kN, kH, 1e-5f);
  for (auto& v : r_want) v = round_bf16(v);
  expect_close(bf16_values(r), r_want, 0, 0, "residual sum");
  expect_close(mean.download(), mean_want, 1e-2, 0, "mean");  // GPU normalizes the bf16 sum
  expect_close(rstd.download(), rstd_want, 0, 1e-2, "rstd");
  expect_close(bf16_values(y), y_want, 3e-2, 2e-2, "layernorm output");

  // Backward from the device's own r, mean and rstd so only the arithmetic differs.
  const auto r_dev = bf16_values(r), mean_dev = mean.download(), rstd_dev = rstd.download();
  auto ddy = to_device_bf16(c.dy), ddres = to_device_bf16(c.dresid);
  DeviceBuffer<bf16> dx(kN * kH);
  DeviceBuffer<float> dg(c.dg0), db(c.db0);
  kernels::cuda::add_layernorm_backward(r.get(), dg_.get(), mean.get(), rstd.get(), ddy.get(),
                                        ddres.get(), dx.get(), dg.get(), db.get(), kN, kH, nullptr);
  std::vector<float> dx_want(kN * kH);
  auto dg_want = c.dg0, db_want = c.db0;
  kernels::add_layernorm_backward(r_dev.data(), c.g.data(), mean_dev.data(), rstd_dev.data(),
                                  c.dy.data(), c.dresid.data(), dx_want.data(), dg_want.data(),
                                  db_want.data(), kN, kH);
  expect_close(bf16_values(dx), dx_want, 2e-2, 1e-2, "layernorm dx");
  expect_close(dg.download(), dg_want, 1e-3, 1e-4, "layernorm dgamma");
  expect_close(db.download(), db_want, 1e-3, 1e-4, "layernorm dbeta");
}

TEST(CudaNorm, ResidualLayerNormMatchesCpu) {
  PTDP_REQUIRE_GPU();
  for (int64_t h : kWidths) check_layernorm(h);
}

void check_rmsnorm(int64_t width, int64_t kN = kRows) {
  SCOPED_TRACE("h = " + std::to_string(width) + ", rows = " + std::to_string(kN));
  NormCase c(width, kN);
  const int64_t kH = width;
  auto dx_ = to_device_bf16(c.x), dg_ = to_device_bf16(c.g);
  DeviceBuffer<bf16> y(kN * kH);
  DeviceBuffer<float> rstd(kN);
  // No residual: r is x itself, and x is the backward's input.
  kernels::cuda::add_rmsnorm_forward(dx_.get(), nullptr, nullptr, dg_.get(), y.get(), rstd.get(),
                                     kN, kH, 1e-5f, nullptr);
  std::vector<float> y_want(kN * kH), rstd_want(kN);
  kernels::add_rmsnorm_forward(c.x.data(), nullptr, nullptr, c.g.data(), y_want.data(),
                               rstd_want.data(), kN, kH, 1e-5f);
  expect_close(rstd.download(), rstd_want, 0, 1e-4, "rmsnorm rstd");
  expect_close(bf16_values(y), y_want, 1e-2, 1e-2, "rmsnorm output");

  auto ddy = to_device_bf16(c.dy);
  DeviceBuffer<bf16> dx(kN * kH);
  DeviceBuffer<float> dg(c.dg0);
  kernels::cuda::add_rmsnorm_backward(dx_.get(), dg_.get(), rstd.get(), ddy.get(), nullptr,
                                      dx.get(), dg.get(), kN, kH, nullptr);
  std::vector<float> dx_want(kN * kH);
  auto dg_want = c.dg0;
  const auto rstd_dev = rstd.download();
  kernels::add_rmsnorm_backward(c.x.data(), c.g.data(), rstd_dev.data(), c.dy.data(), nullptr,
                                dx_want.data(), dg_want.data(), kN, kH);
  expect_close(bf16_values(dx), dx_want, 2e-2, 1e-2, "rmsnorm dx");
  expect_close(dg.download(), dg_want, 1e-3, 1e-4, "rmsnorm dgamma");
}

TEST(CudaNorm, ResidualRmsNormMatchesCpuAndPlainNormSkipsTheResidual) {
  PTDP_REQUIRE_GPU();
  for (int64_t h : kWidths) check_rmsnorm(h);
}

// The backward pass of a row in registers sums the weight gradients per chunk of rows (at most
// 256 chunks): 2100 rows give chunks of 9, so a warp of the warp-per-row kernel takes two rows of
// a chunk and a block of the block-per-row kernel nine: with the next row loaded ahead (300
// columns a warp, 1032 and 4096 a block) and without (768 a warp).
TEST(CudaNorm, ChunksOfSeveralRowsMatchCpu) {
  PTDP_REQUIRE_GPU();
  for (int64_t h : {300, 768, 1032, 4096}) check_layernorm(h, 2100);
  check_rmsnorm(1000, 2100);
}

TEST(CudaNorm, GammaGradientIsBitwiseReproducible) {
  PTDP_REQUIRE_GPU();
  const int64_t kH = 768, kN = kRows;
  NormCase c(kH, kN);
  auto r = to_device_bf16(c.x), g = to_device_bf16(c.g), dy = to_device_bf16(c.dy);
  DeviceBuffer<float> mean(std::vector<float>(kN, 0.1f)), rstd(std::vector<float>(kN, 0.9f));
  std::vector<std::vector<float>> runs;
  for (int i = 0; i < 2; ++i) {
    DeviceBuffer<bf16> dx(kN * kH);
    const std::vector<float> zeros(kH);
    DeviceBuffer<float> dg(zeros), db(zeros);  // added to
    kernels::cuda::add_layernorm_backward(r.get(), g.get(), mean.get(), rstd.get(), dy.get(),
                                          nullptr, dx.get(), dg.get(), db.get(), kN, kH, nullptr);
    runs.push_back(dg.download());
  }
  EXPECT_EQ(runs[0], runs[1]);
}

}  // namespace
}  // namespace ptdp::cuda_test
