// Token and position embedding on the GPU, vocabulary-parallel as in kernels/cpu/elementwise.h:
// this rank holds rows [v0, v0 + vl) of the token table. CPU twins: vocab_embedding_lookup +
// add_positions (forward), vocab_embedding_grad + position_grad (backward).
#pragma once

#include "kernels/cuda/common.h"

namespace ptdp::kernels::cuda {

// tokens [b, sl]; y [b * sl, h] = table[token - v0] (zero for tokens outside the shard)
// + pos[first + j] for position j of each sequence (pos may be null). Sums in fp32, stored bf16.
void embedding_forward(const int32_t* tokens, const bf16* table, const bf16* pos, bf16* y,
                       int64_t b, int64_t sl, int64_t h, int64_t v0, int64_t vl, int64_t first,
                       cudaStream_t stream);
// dtable [vl, h] += the rows of dy whose token is in the shard; dpos [*, h] rows first.. += the
// sum over sequences (either may be null). fp32 gradients, deterministic (no atomics: each
// output element is owned by one thread that adds in token order).
void embedding_backward(const int32_t* tokens, const bf16* dy, float* dtable, float* dpos,
                        int64_t b, int64_t sl, int64_t h, int64_t v0, int64_t vl, int64_t first,
                        cudaStream_t stream);

}  // namespace ptdp::kernels::cuda
