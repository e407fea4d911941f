// AdamW kernel (kernels/cuda/adamw.h): elementwise, fp32 arithmetic, grid-stride loop.
#include <cmath>
#include <stdexcept>

#include "kernels/cuda/adamw.h"
#include "kernels/cuda/common.cuh"

namespace ptdp::kernels::cuda {
namespace {

struct AdamWConsts {
  float lr, beta1, beta2, eps, weight_decay, bias1, bias2, grad_scale;
};

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, bf16* param_bf16,
                             int64_t n, AdamWConsts c) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = grad[i] * c.grad_scale;
    const float mi = c.beta1 * m[i] + (1.0f - c.beta1) * g;
    const float vi = c.beta2 * v[i] + (1.0f - c.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float mhat = mi / c.bias1, vhat = vi / c.bias2;
    const float p = param[i] - c.lr * (mhat / (sqrtf(vhat) + c.eps) + c.weight_decay * param[i]);
    param[i] = p;
    if (param_bf16) param_bf16[i] = to_bf16(p);
  }
}

}  // namespace

void adamw_step(float* param, const float* grad, float* m, float* v, bf16* param_bf16, int64_t n,
                const AdamW& o, int64_t step, double grad_scale, cudaStream_t stream) {
  if (step < 1) throw std::invalid_argument("adamw_step: step counts from 1");
  if (n <= 0) return;
  const AdamWConsts c{static_cast<float>(o.lr),
                      static_cast<float>(o.beta1),
                      static_cast<float>(o.beta2),
                      static_cast<float>(o.eps),
                      static_cast<float>(o.weight_decay),
                      static_cast<float>(1.0 - std::pow(o.beta1, static_cast<double>(step))),
                      static_cast<float>(1.0 - std::pow(o.beta2, static_cast<double>(step))),
                      static_cast<float>(grad_scale)};
  const int64_t blocks = (n + 255) / 256;
  PTDP_KERNEL_LAUNCH(adamw_kernel, static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0,
                     stream)
  (param, grad, m, v, param_bf16, n, c);
  check_launch("adamw_kernel");
}

}  // namespace ptdp::kernels::cuda
