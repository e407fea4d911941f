// Vocabulary-parallel softmax cross-entropy fused with the LM-head gradient, on the GPU. The
// logits [n, vl] (bf16) of this rank's vocabulary slice [v0, v0 + vl), of which the first
// `valid` columns are real, are reduced to per-row statistics; the tensor-parallel ranks
// exchange those (an all-gather of [n, 3] floats), and the backward pass turns the logits into
// their gradient in place, so no probability matrix is ever stored. CPU twins:
// cross_entropy_stats / cross_entropy_finish / cross_entropy_backward in kernels/cpu/elementwise.h.
#pragma once

#include "kernels/cuda/common.h"

namespace ptdp::kernels::cuda {

// stats [n, 3]: per row (max, sum of exp(x - max), the target's logit or 0 when the target is
// on another rank).
void cross_entropy_stats(const bf16* logits, const int32_t* targets, float* stats, int64_t n,
                         int64_t vl, int64_t valid, int64_t v0, cudaStream_t stream);
// From every rank's stats ([ranks, n, 3], rank-major): lse [n], the log-sum-exp of each row over
// the whole vocabulary, and loss [n] = lse - target logit.
void cross_entropy_finish(const float* stats, int64_t ranks, float* lse, float* loss, int64_t n,
                          cudaStream_t stream);
// logits become d(scale * mean loss)/dlogits = scale / n * (softmax - onehot(target)) in place;
// padding columns become 0.
void cross_entropy_backward(bf16* logits, const int32_t* targets, const float* lse, int64_t n,
                            int64_t vl, int64_t valid, int64_t v0, double scale,
                            cudaStream_t stream);

}  // namespace ptdp::kernels::cuda
