// The global gradient norm on the GPU: sums of squares of fp32 gradients, accumulated in fp64
// in a fixed order (a fixed grid of per-block partial sums, then one block that adds them up in
// index order), so the result depends on the data and n only, never on scheduling. CPU twin:
// sum_squares in kernels/cpu/elementwise.h.
#pragma once

#include <utility>
#include <vector>

#include "kernels/cuda/common.h"

namespace ptdp::kernels::cuda {

// *acc (device memory) += sum of x[i]^2.
void sum_squares(const float* x, int64_t n, double* acc, cudaStream_t stream);
// sqrt of the sum of squares over every (pointer, length) tensor in order; synchronizes the
// stream to return the value.
double global_norm(const std::vector<std::pair<const float*, int64_t>>& tensors,
                   cudaStream_t stream);

}  // namespace ptdp::kernels::cuda
