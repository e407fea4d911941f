// The fp32 kernels of the CUDA backend (runtime/cuda/cuda_backend.cc): one launcher per
// element-wise or row-wise call of Backend (runtime/backend.h) that is not a GEMM, each the
// device twin of the CPU kernel of the same name in kernels/cpu/kernels.h or
// kernels/cpu/elementwise.h, with the same shapes and the same fp32 arithmetic (sums may be
// added in another order). Every launcher queues its work on `stream` and returns; pointers are
// device memory, token ids included. The GEMMs (linear layers, attention scores and context) go
// through cuBLAS in cuda_backend.cc.
//
// These run the runtime's fp32 training on a GPU so that it can be checked against the CPU
// backend step by step. The bf16 kernels of kernels/cuda/ (fused, flash attention, cuBLASLt)
// are the fast path; docs/gpu.md says how far the backend uses them.
//
// Mixed precision (--bf16): the glue, embedding, cross-entropy and attention-piece
// kernels also take bf16 activations (the overloads at the end), loaded as fp32 and stored
// rounded to nearest even, with the fp32 arithmetic inside: what widening to fp32, the fp32
// kernel and rounding back compute, without the fp32 round trip. Gradients of weights, biases,
// positions and tables, and the statistics, stay fp32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/common.h"

namespace ptdp::cuda_fp32 {

using bf16 = kernels::cuda::bf16;

void add(float* y, const float* x, int64_t n, cudaStream_t st);
// The MoE row moves (Backend::gather_rows, gather_add_rows, row_dots), index and weight arrays
// in device memory; the bf16 forms are below. gather_rows' y must not alias x (its blocks read
// rows that others write).
void gather_rows(const float* x, const int64_t* index, const float* weight, float* y, int64_t rows,
                 int64_t h, cudaStream_t st);
void gather_add_rows(const float* y, const int64_t* index, const float* weight, float* out,
                     int64_t n, int64_t slots, int64_t h, cudaStream_t st);
void row_dots(const float* a, const int64_t* index, const float* b, float* dot, int64_t rows,
              int64_t h, cudaStream_t st);
void add_bias(float* y, const float* bias, int64_t rows, int64_t width, cudaStream_t st);
// out [rows, width] = residual + partial, rounded, + bias (may be null) a row, rounded
// (Backend::residual_add). out may alias residual or partial.
void residual_add(float* out, const float* residual, const float* partial, const float* bias,
                  int64_t rows, int64_t width, cudaStream_t st);
void bias_grad(const float* dy, float* db, int64_t rows, int64_t width, cudaStream_t st);
void scale(float* x, int64_t n, double f, cudaStream_t st);
// Mixed precision (runtime/mixed_precision.cc): fp32 to bf16 (round to nearest even) and back;
// y and x are n bf16 elements.
void to_bf16(const float* x, void* y, int64_t n, cudaStream_t st);
void from_bf16(const void* x, float* y, int64_t n, cudaStream_t st);
void to_fp16(const float* x, void* y, int64_t n, cudaStream_t st);
void from_fp16(const void* x, float* y, int64_t n, cudaStream_t st);
void split_columns3(const float* x, float* y0, float* y1, float* y2, int64_t n, int64_t a,
                    int64_t b, int64_t c, cudaStream_t st);
void concat_columns3(const float* x0, const float* x1, const float* x2, float* y, int64_t n,
                     int64_t a, int64_t b, int64_t c, cudaStream_t st);
void sequence_unshard(const float* shards, float* full, int64_t t, int64_t b, int64_t s,
                      int64_t width, cudaStream_t st);
void sequence_shard(const float* full, float* shards, int64_t t, int64_t b, int64_t s,
                    int64_t width, cudaStream_t st);

void vocab_embedding_lookup(const int32_t* tokens, const float* table, float* y, int64_t n,
                            int64_t h, int64_t v0, int64_t vl, cudaStream_t st);
void add_positions(float* x, const float* pos, int64_t b, int64_t sl, int64_t h, int64_t first,
                   cudaStream_t st);
void position_grad(const float* dx, float* dpos, int64_t b, int64_t sl, int64_t h, int64_t first,
                   cudaStream_t st);

void cross_entropy_stats(const float* logits, const int32_t* targets, float* stats, int64_t n,
                         int64_t vl, int64_t valid, int64_t v0, cudaStream_t st);
// lse [n] and each row's loss (lse - target logit) into row_loss [n]; logits become
// probabilities in place (0 in the padding columns).
void cross_entropy_finish(const float* stats, int64_t ranks, float* logits, float* lse,
                          float* row_loss, int64_t n, int64_t vl, int64_t valid, cudaStream_t st);
void cross_entropy_backward(float* probs, const int32_t* targets, int64_t n, int64_t vl, int64_t v0,
                            double scale, cudaStream_t st);

void layernorm_forward(const float* x, const float* g, const float* b, float* y, float* mean,
                       float* rstd, int64_t n, int64_t h, cudaStream_t st);
void layernorm_backward(const float* x, const float* g, const float* mean, const float* rstd,
                        const float* dy, float* dx, float* dg, float* db, int64_t n, int64_t h,
                        cudaStream_t st);
void rmsnorm_forward(const float* x, const float* g, float* y, float* rstd, int64_t n, int64_t h,
                     cudaStream_t st);
void rmsnorm_backward(const float* x, const float* g, const float* rstd, const float* dy, float* dx,
                      float* dg, int64_t n, int64_t h, cudaStream_t st);

void gelu(const float* x, float* y, int64_t n, cudaStream_t st);
void gelu_backward(const float* x, const float* dy, float* dx, int64_t n, cudaStream_t st);
void swiglu(const float* x, float* y, int64_t n, int64_t f, cudaStream_t st);
void swiglu_backward(const float* x, const float* dy, float* dx, int64_t n, int64_t f,
                     cudaStream_t st);
void rope(float* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base, bool inverse,
          cudaStream_t st);

// Rows of length s, row i of each s x s matrix: softmax over columns 0..i (the rest untouched),
// and its backward (columns above the diagonal set to 0).
void causal_softmax(float* scores, int64_t rows, int64_t s, cudaStream_t st);
void causal_softmax_backward(const float* probs, const float* dprobs, float* dscores, int64_t rows,
                             int64_t s, cudaStream_t st);
// Zeroes the strictly upper triangle of `count` s x s matrices.
void zero_upper(float* m, int64_t count, int64_t s, cudaStream_t st);

// Causal attention fused the flash-attention way (runtime/cuda/fp32_attention.cu), the twin of
// causal_attention_* (kernels/cpu/fused.h): q, out [b, sq, hq, d], k, v [b, sk, hk, d] (sq <= sk,
// query i seeing keys j <= i + sk - sq), lse [b, hq, sq]. The backward pass overwrites dq, dk,
// dv and uses `delta` ([b, hq, sq] floats) as its workspace. Head dimensions
// 1..kMaxAttentionHeadDim; hq a multiple of hk (else std::invalid_argument, before anything is
// queued).
constexpr int kMaxAttentionHeadDim = 256;
void flash_attention_forward(const float* q, const float* k, const float* v, float* out, float* lse,
                             int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk, int64_t d,
                             cudaStream_t st);
void flash_attention_backward(const float* q, const float* k, const float* v, const float* out,
                              const float* lse, const float* dout, float* dq, float* dk, float* dv,
                              float* delta, int64_t b, int64_t sq, int64_t sk, int64_t hq,
                              int64_t hk, int64_t d, cudaStream_t st);

struct AdamWArgs {
  double lr, beta1, beta2, eps, weight_decay, c1, c2;  // c1, c2: bias corrections
};
void adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWArgs& a,
           cudaStream_t st);
// adamw on grad * grad_scale (rounded to fp32, as scale() leaves it; the gradient itself is not
// written), then the new weights stored into out (fp32 or rounded to bf16; null: none), in one
// pass: Backend::adamw_update's three calls fused.
// The same over spans [start, start + n) of the arrays, each with a.weight_decay or none
// (Backend::adamw_update_spans): one launch for every kAdamWSpans of them, the spans passed in
// the launch's arguments.
constexpr int kAdamWSpans = 64;
struct AdamWSpan {
  int64_t start = 0, n = 0;
  bool decay = false;
};
void adamw_update_spans(float* param, const float* grad, float* m, float* v, float* out,
                        const std::vector<AdamWSpan>& spans, const AdamWArgs& a, double grad_scale,
                        cudaStream_t st);
void adamw_update_spans(float* param, const float* grad, float* m, float* v, bf16* out,
                        const std::vector<AdamWSpan>& spans, const AdamWArgs& a, double grad_scale,
                        cudaStream_t st);
void adamw_update(float* param, const float* grad, float* m, float* v, float* out, int64_t n,
                  const AdamWArgs& a, double grad_scale, cudaStream_t st);
void adamw_update(float* param, const float* grad, float* m, float* v, bf16* out, int64_t n,
                  const AdamWArgs& a, double grad_scale, cudaStream_t st);

// ---- bf16 activations (mixed precision): the calls above of the same names and shapes ----
void add(bf16* y, const bf16* x, int64_t n, cudaStream_t st);
void gather_rows(const bf16* x, const int64_t* index, const float* weight, bf16* y, int64_t rows,
                 int64_t h, cudaStream_t st);
void gather_add_rows(const bf16* y, const int64_t* index, const float* weight, bf16* out, int64_t n,
                     int64_t slots, int64_t h, cudaStream_t st);
void row_dots(const bf16* a, const int64_t* index, const bf16* b, float* dot, int64_t rows,
              int64_t h, cudaStream_t st);
void add_bias(bf16* y, const bf16* bias, int64_t rows, int64_t width, cudaStream_t st);
void residual_add(bf16* out, const bf16* residual, const bf16* partial, const bf16* bias,
                  int64_t rows, int64_t width, cudaStream_t st);
void bias_grad(const bf16* dy, float* db, int64_t rows, int64_t width, cudaStream_t st);
// dout copied to d_residual and d_partial, and db (may be null) += its column sums (bias_grad's),
// in one pass; false (nothing queued) where that pass cannot take the rows: with db, bf16 rows of
// a multiple of 8 columns; without, any rows moving as 16-byte vectors (fp32 too).
bool residual_add_backward(const bf16* dout, bf16* d_residual, bf16* d_partial, float* db,
                           int64_t rows, int64_t width, cudaStream_t st);
bool residual_add_backward(const float* dout, float* d_residual, float* d_partial, float* db,
                           int64_t rows, int64_t width, cudaStream_t st);
void scale(bf16* x, int64_t n, double f, cudaStream_t st);
void split_columns3(const bf16* x, bf16* y0, bf16* y1, bf16* y2, int64_t n, int64_t a, int64_t b,
                    int64_t c, cudaStream_t st);
void concat_columns3(const bf16* x0, const bf16* x1, const bf16* x2, bf16* y, int64_t n, int64_t a,
                     int64_t b, int64_t c, cudaStream_t st);
void sequence_unshard(const bf16* shards, bf16* full, int64_t t, int64_t b, int64_t s,
                      int64_t width, cudaStream_t st);
void sequence_shard(const bf16* full, bf16* shards, int64_t t, int64_t b, int64_t s, int64_t width,
                    cudaStream_t st);
void vocab_embedding_lookup(const int32_t* tokens, const bf16* table, bf16* y, int64_t n, int64_t h,
                            int64_t v0, int64_t vl, cudaStream_t st);
void add_positions(bf16* x, const bf16* pos, int64_t b, int64_t sl, int64_t h, int64_t first,
                   cudaStream_t st);
void position_grad(const bf16* dx, float* dpos, int64_t b, int64_t sl, int64_t h, int64_t first,
                   cudaStream_t st);
void cross_entropy_stats(const bf16* logits, const int32_t* targets, float* stats, int64_t n,
                         int64_t vl, int64_t valid, int64_t v0, cudaStream_t st);
void cross_entropy_finish(const float* stats, int64_t ranks, bf16* logits, float* lse,
                          float* row_loss, int64_t n, int64_t vl, int64_t valid, cudaStream_t st);
void cross_entropy_backward(bf16* probs, const int32_t* targets, int64_t n, int64_t vl, int64_t v0,
                            double scale, cudaStream_t st);
// cross_entropy_finish without the probabilities (lse and each row's loss only), and then
// cross_entropy_finish's probabilities and cross_entropy_backward's gradient in one pass over
// the logits, from lse: the bits of the two calls, two passes over the logits fewer.
void cross_entropy_lse(const float* stats, int64_t ranks, float* lse, float* row_loss, int64_t n,
                       cudaStream_t st);
void cross_entropy_backward_from_lse(bf16* logits, const float* lse, const int32_t* targets,
                                     int64_t n, int64_t vl, int64_t valid, int64_t v0, double scale,
                                     cudaStream_t st);
void causal_softmax(bf16* scores, int64_t rows, int64_t s, cudaStream_t st);
void causal_softmax_backward(const bf16* probs, const bf16* dprobs, bf16* dscores, int64_t rows,
                             int64_t s, cudaStream_t st);
void zero_upper(bf16* m, int64_t count, int64_t s, cudaStream_t st);

}  // namespace ptdp::cuda_fp32
