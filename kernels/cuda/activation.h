// Activation kernels on the GPU: bias + GELU (tanh approximation, Megatron's bias_gelu) and
// SwiGLU, forward and backward. bf16 in and out, fp32 arithmetic. CPU twins: bias_gelu_* in
// kernels/cpu/fused.h, swiglu_* in kernels/cpu/kernels.h.
#pragma once

#include "kernels/cuda/common.h"

namespace ptdp::kernels::cuda {

// y[r, c] = gelu(x[r, c] + bias[c]); bias may be null. y may alias x.
void bias_gelu_forward(const bf16* x, const bf16* bias, bf16* y, int64_t rows, int64_t cols,
                       cudaStream_t stream);
// dx = dy * gelu'(x + bias) (dx may alias dy); dbias (fp32, may be null) += column sums of dx,
// taken before dx is rounded to bf16, in a fixed order.
void bias_gelu_backward(const bf16* x, const bf16* bias, const bf16* dy, bf16* dx, float* dbias,
                        int64_t rows, int64_t cols, cudaStream_t stream);

// x [n, 2f] = [gate | up]; y [n, f] = silu(gate) * up.
void swiglu_forward(const bf16* x, bf16* y, int64_t n, int64_t f, cudaStream_t stream);
// dx [n, 2f] overwritten.
void swiglu_backward(const bf16* x, const bf16* dy, bf16* dx, int64_t n, int64_t f,
                     cudaStream_t stream);

}  // namespace ptdp::kernels::cuda
