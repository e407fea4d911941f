// AdamW on the GPU over fp32 master weights, writing the bf16 copy of the parameters that the
// forward and backward passes read. CPU twin: adamw_step in kernels/cpu/kernels.h (on the
// gradient scaled by grad_scale, then rounded to bf16).
#pragma once

#include "kernels/cpu/kernels.h"
#include "kernels/cuda/common.h"

namespace ptdp::kernels::cuda {

// One decoupled-weight-decay Adam step (step counts from 1) on param [n] with gradient
// grad * grad_scale (grad_scale: e.g. the clipping factor from the global gradient norm); m and v
// are updated; param_bf16 (may be null) receives the new parameters rounded to bf16.
void adamw_step(float* param, const float* grad, float* m, float* v, bf16* param_bf16, int64_t n,
                const AdamW& o, int64_t step, double grad_scale, cudaStream_t stream);

}  // namespace ptdp::kernels::cuda
