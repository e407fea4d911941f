// The global gradient norm on the GPU: sums of squares of fp32 gradients, accumulated in fp64
// in a fixed order (per-block partial sums over a grid that depends on n alone, then one block
// that adds them up in a fixed order), so the result depends on the data, n and the data's
// 16-byte alignment only, never on scheduling. CPU twin:
// sum_squares in kernels/cpu/elementwise.h.
#pragma once

#include <utility>
#include <vector>

#include "kernels/cuda/common.h"

namespace ptdp::kernels::cuda {

// *acc (device memory) += sum of x[i]^2.
void sum_squares(const float* x, int64_t n, double* acc, cudaStream_t stream);
// The most per-block partial sums the two calls take.
constexpr int kSumSquaresMaxBlocks = 1024;
// *out (device memory) = sum of x[i]^2, in the same order as sum_squares, through `partials`
// (kSumSquaresMaxBlocks doubles of device memory): no allocation (the runtime's gradient norm).
void sum_squares_to(const float* x, int64_t n, double* partials, double* out, cudaStream_t stream);
// sqrt of the sum of squares over every (pointer, length) tensor in order; synchronizes the
// stream to return the value.
double global_norm(const std::vector<std::pair<const float*, int64_t>>& tensors,
                   cudaStream_t stream);

}  // namespace ptdp::kernels::cuda
