// Rotary position embedding on the GPU (Su et al. 2021, "RoFormer"), in place on bf16
// x [b, s, heads, d] in the rotate-half layout: element i < d/2 of a head pairs with i + d/2 and
// the pair at position j turns by j * base^(-2i/d); inverse turns back (the backward pass).
// CPU twin: rope in kernels/cpu/kernels.h.
#pragma once

#include "kernels/cuda/common.h"

namespace ptdp::kernels::cuda {

// d must be even (else std::invalid_argument).
void rope(bf16* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base, bool inverse,
          cudaStream_t stream);

}  // namespace ptdp::kernels::cuda
