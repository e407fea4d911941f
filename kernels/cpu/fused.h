// CPU twins of the fused CUDA kernels (kernels/cuda/) that have no single counterpart in
// kernels/cpu/kernels.h: the residual add fused with LayerNorm / RMSNorm, bias + GELU, and causal
// attention computed the flash-attention way (per query row, saving only the log-sum-exp and
// recomputing the probabilities in the backward pass). fp32, dense row-major.
#pragma once

#include <cstdint>

namespace ptdp::kernels {

// r = x + residual (residual may be null: r = x), written to r_out when non-null; then
// y = LayerNorm(r) * g + b with mean and rstd ([n]) saved.
void add_layernorm_forward(const float* x, const float* residual, float* r_out, const float* g,
                           const float* b, float* y, float* mean, float* rstd, int64_t n, int64_t h,
                           float eps);
// r: the normalized input; dresid (may be null): the gradient reaching the residual stream from
// above, added to dx. dx is overwritten; dg and db accumulate.
void add_layernorm_backward(const float* r, const float* g, const float* mean, const float* rstd,
                            const float* dy, const float* dresid, float* dx, float* dg, float* db,
                            int64_t n, int64_t h);
void add_rmsnorm_forward(const float* x, const float* residual, float* r_out, const float* g,
                         float* y, float* rstd, int64_t n, int64_t h, float eps);
void add_rmsnorm_backward(const float* r, const float* g, const float* rstd, const float* dy,
                          const float* dresid, float* dx, float* dg, int64_t n, int64_t h);

// y[r, c] = gelu(x[r, c] + bias[c]) (bias may be null), GELU's tanh approximation.
void bias_gelu_forward(const float* x, const float* bias, float* y, int64_t rows, int64_t cols);
// dx = dy * gelu'(x + bias) (overwritten); dbias (may be null) += column sums of dx.
void bias_gelu_backward(const float* x, const float* bias, const float* dy, float* dx, float* dbias,
                        int64_t rows, int64_t cols);

// Causal attention with grouped-query heads: q, out [b, sq, hq, d], k, v [b, sk, hk, d]
// (sq <= sk), query head j reading key/value head j / (hq / hk); lse [b, hq, sq] is the natural
// log of each row's softmax denominator over the scaled scores (scale 1 / sqrt(d)). The causal
// mask is aligned to the last key: query i sees keys j <= i + sk - sq, so sq == sk is plain
// causal self-attention and sq < sk the last sq queries of a sequence of sk (what a
// context-parallel rank computes for a chunk of its queries against the keys before them).
void causal_attention_forward(const float* q, const float* k, const float* v, float* out,
                              float* lse, int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk,
                              int64_t d);
// Recomputes the probabilities from lse; dq, dk, dv are overwritten. out and lse may be a longer
// attention's (the queries' whole softmax, when the keys are one block of it): delta = rowsum(dout
// out) and p = exp(score - lse) then give this block's part of the gradients.
void causal_attention_backward(const float* q, const float* k, const float* v, const float* out,
                               const float* lse, const float* dout, float* dq, float* dk, float* dv,
                               int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk,
                               int64_t d);

}  // namespace ptdp::kernels
