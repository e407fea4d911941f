// LayerNorm and RMSNorm on the GPU, fused with the residual add that precedes them in a
// transformer layer. bf16 activations and weights, fp32 statistics and weight gradients.
// CPU twins: add_layernorm_* and add_rmsnorm_* in kernels/cpu/fused.h.
#pragma once

#include "kernels/cuda/common.h"

namespace ptdp::kernels::cuda {

// Per row of h: r = x + residual (residual may be null: r = x), rounded to bf16 and written to
// r_out when non-null (the new residual stream, and the backward pass's input; r_out must not
// alias x or residual); then
// y = (r - mean) * rstd * g + b. mean and rstd ([n], fp32) are saved.
void add_layernorm_forward(const bf16* x, const bf16* residual, bf16* r_out, const bf16* g,
                           const bf16* b, bf16* y, float* mean, float* rstd, int64_t n, int64_t h,
                           float eps, cudaStream_t stream);
// r: the normalized input (r_out of the forward); dresid (may be null) is the gradient reaching
// the residual stream from above and is added to dx. dx is overwritten, and may be dy or dresid
// (each element of those is read, by the thread that writes dx there, before it is written); dg
// and db (fp32) accumulate, in a fixed order.
void add_layernorm_backward(const bf16* r, const bf16* g, const float* mean, const float* rstd,
                            const bf16* dy, const bf16* dresid, bf16* dx, float* dg, float* db,
                            int64_t n, int64_t h, cudaStream_t stream);

// RMSNorm (y = r * rstd * g, rstd = 1 / sqrt(mean(r^2) + eps)), same conventions.
void add_rmsnorm_forward(const bf16* x, const bf16* residual, bf16* r_out, const bf16* g, bf16* y,
                         float* rstd, int64_t n, int64_t h, float eps, cudaStream_t stream);
void add_rmsnorm_backward(const bf16* r, const bf16* g, const float* rstd, const bf16* dy,
                          const bf16* dresid, bf16* dx, float* dg, int64_t n, int64_t h,
                          cudaStream_t stream);

}  // namespace ptdp::kernels::cuda
