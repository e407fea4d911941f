// Causal self-attention on the GPU the flash-attention way (Dao et al. 2022, "FlashAttention";
// Dao 2023, "FlashAttention-2"): K/V tiles staged in shared memory, a running max and sum per
// query row (online softmax), no s x s matrix in memory; the backward pass recomputes the
// probabilities from the saved log-sum-exp. Grouped-query attention: query head j reads key/value
// head j / (hq / hk). CPU twin: causal_attention_* in kernels/cpu/fused.h.
#pragma once

#include "kernels/cuda/common.h"

namespace ptdp::kernels::cuda {

// Which implementation runs. kTensorCore (attention_mma.cu): bf16 mma.sync tiles on the tensor
// cores, FlashAttention-2's work split, sm_80 and later, every pointer 16-byte aligned.
// kSimt (attention_forward.cu, attention_backward.cu): fp32 arithmetic on CUDA cores, the first
// and simplest kernel, kept as a cross-check. kDefault: PTDP_FLASH_KERNEL=mma|simt where set
// (another value: std::invalid_argument naming the variable), else the tensor cores where the
// device and the pointers allow them, else the CUDA cores.
enum class FlashKernel { kDefault, kTensorCore, kSimt };

// q, out [b, sq, hq, d]; k, v [b, sk, hk, d] (bf16, sq <= sk); lse [b, hq, sq] (fp32): the
// natural log of each row's softmax denominator over the scores q.k / sqrt(d). The queries are
// the last sq of sk positions: query i sees keys j <= i + sk - sq (sq == sk: self-attention).
// d is 64 or 128; hq a multiple of hk (else std::invalid_argument).
void flash_attention_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse,
                             int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk, int64_t d,
                             cudaStream_t stream, FlashKernel kernel = FlashKernel::kDefault);
// dq [b, sq, hq, d], dk and dv [b, sk, hk, d] are overwritten (summed over the query heads of a
// group). out and lse may be those of a longer attention (the queries' whole softmax when k and
// v are one block of its keys): this block's part of the gradients. Deterministic: no atomics
// (dq and dk/dv come from two kernels that each own their output rows).
void flash_attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                              const float* lse, const bf16* dout, bf16* dq, bf16* dk, bf16* dv,
                              int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk, int64_t d,
                              cudaStream_t stream, FlashKernel kernel = FlashKernel::kDefault);

}  // namespace ptdp::kernels::cuda
