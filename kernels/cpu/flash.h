// Flash attention on the CPU backend (--use-flash-attn, and context parallelism): the same
// contract as causal_attention_* (kernels/cpu/fused.h), computed in fp32 over 64 x 64 tiles of
// queries and keys with Eigen GEMMs: scores of a tile, the online softmax (running max and sum
// per query row), and the tile's probabilities times V. Tiles past the causal diagonal are
// skipped, so the work is the causal half; memory beyond the outputs is two tiles. The backward
// pass recomputes each tile's probabilities from lse and accumulates dq, dk and dv tile by tile
// (single-threaded and in a fixed order: the same bits on every run). causal_attention_* in
// double precision stay the twin the tests hold these and the CUDA kernels to.
#pragma once

#include <cstdint>

namespace ptdp::kernels {

// q, out [b, sq, hq, d]; k, v [b, sk, hk, d] (sq <= sk, query i seeing keys j <= i + sk - sq);
// lse [b, hq, sq].
void flash_attention_forward(const float* q, const float* k, const float* v, float* out, float* lse,
                             int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk, int64_t d);
// dq, dk, dv overwritten; out and lse may be a longer attention's (as causal_attention_backward).
void flash_attention_backward(const float* q, const float* k, const float* v, const float* out,
                              const float* lse, const float* dout, float* dq, float* dk, float* dv,
                              int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk, int64_t d);

}  // namespace ptdp::kernels
