// LayerNorm / RMSNorm fused with the residual add (kernels/cuda/norm.h). One block per row; the
// row is read from global memory (L1/L2-resident) once per pass rather than held in registers,
// which keeps the kernel independent of h.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/norm.h"

namespace ptdp::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// r = x + residual, rounded to bf16 exactly as stored in r_out.
__device__ __forceinline__ float residual_at(const bf16* x, const bf16* residual, int64_t i) {
  return residual ? to_float(to_bf16(to_float(x[i]) + to_float(residual[i]))) : to_float(x[i]);
}

template <bool kRms>
__global__ void __launch_bounds__(kThreads)
    norm_forward_kernel(const bf16* x, const bf16* residual, bf16* r_out, const bf16* g,
                        const bf16* b, bf16* y, float* mean_out, float* rstd_out, int64_t h,
                        float eps) {
  __shared__ float scratch[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * h;
  float mean = 0;
  if (!kRms) {
    float s = 0;
    for (int64_t e = threadIdx.x; e < h; e += blockDim.x) s += residual_at(x, residual, base + e);
    mean = block_sum(s, scratch) / static_cast<float>(h);
  }
  float ss = 0;  // sum of (r - mean)^2, or of r^2 for RMSNorm
  for (int64_t e = threadIdx.x; e < h; e += blockDim.x) {
    const float r = residual_at(x, residual, base + e);
    if (r_out) r_out[base + e] = to_bf16(r);
    ss += (r - mean) * (r - mean);
  }
  const float rstd = rsqrtf(block_sum(ss, scratch) / static_cast<float>(h) + eps);
  for (int64_t e = threadIdx.x; e < h; e += blockDim.x) {
    const float r = residual_at(x, residual, base + e);
    float out = (r - mean) * rstd * to_float(g[e]);
    if (!kRms) out += to_float(b[e]);
    y[base + e] = to_bf16(out);
  }
  if (threadIdx.x == 0) {
    if (!kRms) mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
}

// LayerNorm: dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * g.
// RMSNorm:   dx = rstd * dxhat - r * rstd^3 * mean(dxhat * r).
template <bool kRms>
__global__ void __launch_bounds__(kThreads)
    norm_backward_kernel(const bf16* r, const bf16* g, const float* mean_in, const float* rstd_in,
                         const bf16* dy, const bf16* dresid, bf16* dx, int64_t h) {
  __shared__ float scratch[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * h;
  const float mean = kRms ? 0.0f : mean_in[blockIdx.x], rstd = rstd_in[blockIdx.x];
  float a = 0, c = 0;  // sum dxhat, sum dxhat * xhat (LayerNorm) or dxhat * r (RMSNorm)
  for (int64_t e = threadIdx.x; e < h; e += blockDim.x) {
    const float dxhat = to_float(dy[base + e]) * to_float(g[e]);
    const float v = to_float(r[base + e]);
    a += dxhat;
    c += dxhat * (kRms ? v : (v - mean) * rstd);
  }
  const float inv_h = 1.0f / static_cast<float>(h);
  const float sum_a = kRms ? 0.0f : block_sum(a, scratch) * inv_h;
  const float sum_c = block_sum(c, scratch) * inv_h;
  for (int64_t e = threadIdx.x; e < h; e += blockDim.x) {
    const float dxhat = to_float(dy[base + e]) * to_float(g[e]);
    const float v = to_float(r[base + e]);
    float d = kRms ? dxhat * rstd - v * rstd * rstd * rstd * sum_c
                   : rstd * (dxhat - sum_a - (v - mean) * rstd * sum_c);
    if (dresid) d += to_float(dresid[base + e]);
    dx[base + e] = to_bf16(d);
  }
}

// dg: dy * xhat (LayerNorm) or dy * r * rstd (RMSNorm); db: dy.
struct GammaGrad {
  const bf16 *r, *dy;
  const float *mean, *rstd;
  int64_t h;
  __device__ float operator()(int64_t row, int64_t c) const {
    const float m = mean ? mean[row] : 0.0f;
    return to_float(dy[row * h + c]) * (to_float(r[row * h + c]) - m) * rstd[row];
  }
};
struct BetaGrad {
  const bf16* dy;
  int64_t h;
  __device__ float operator()(int64_t row, int64_t c) const { return to_float(dy[row * h + c]); }
};

template <bool kRms>
void forward(const bf16* x, const bf16* residual, bf16* r_out, const bf16* g, const bf16* b,
             bf16* y, float* mean, float* rstd, int64_t n, int64_t h, float eps,
             cudaStream_t stream) {
  if (n <= 0 || h <= 0) return;
  PTDP_KERNEL_LAUNCH(norm_forward_kernel<kRms>, static_cast<unsigned>(n), kThreads, 0, stream)
  (x, residual, r_out, g, b, y, mean, rstd, h, eps);
  check_launch("norm_forward_kernel");
}

template <bool kRms>
void backward(const bf16* r, const bf16* g, const float* mean, const float* rstd, const bf16* dy,
              const bf16* dresid, bf16* dx, float* dg, float* db, int64_t n, int64_t h,
              cudaStream_t stream) {
  if (n <= 0 || h <= 0) return;
  PTDP_KERNEL_LAUNCH(norm_backward_kernel<kRms>, static_cast<unsigned>(n), kThreads, 0, stream)
  (r, g, mean, rstd, dy, dresid, dx, h);
  check_launch("norm_backward_kernel");
  if (dg) column_sum(GammaGrad{r, dy, mean, rstd, h}, dg, n, h, stream);
  if (db) column_sum(BetaGrad{dy, h}, db, n, h, stream);
}

}  // namespace

void add_layernorm_forward(const bf16* x, const bf16* residual, bf16* r_out, const bf16* g,
                           const bf16* b, bf16* y, float* mean, float* rstd, int64_t n, int64_t h,
                           float eps, cudaStream_t stream) {
  forward<false>(x, residual, r_out, g, b, y, mean, rstd, n, h, eps, stream);
}

void add_layernorm_backward(const bf16* r, const bf16* g, const float* mean, const float* rstd,
                            const bf16* dy, const bf16* dresid, bf16* dx, float* dg, float* db,
                            int64_t n, int64_t h, cudaStream_t stream) {
  backward<false>(r, g, mean, rstd, dy, dresid, dx, dg, db, n, h, stream);
}

void add_rmsnorm_forward(const bf16* x, const bf16* residual, bf16* r_out, const bf16* g, bf16* y,
                         float* rstd, int64_t n, int64_t h, float eps, cudaStream_t stream) {
  forward<true>(x, residual, r_out, g, nullptr, y, nullptr, rstd, n, h, eps, stream);
}

void add_rmsnorm_backward(const bf16* r, const bf16* g, const float* rstd, const bf16* dy,
                          const bf16* dresid, bf16* dx, float* dg, int64_t n, int64_t h,
                          cudaStream_t stream) {
  backward<true>(r, g, nullptr, rstd, dy, dresid, dx, dg, nullptr, n, h, stream);
}

}  // namespace ptdp::kernels::cuda
