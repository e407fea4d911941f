// The MoE layer's routing loops (runtime/moe_layer.cc): top-k over router logits with a softmax
// over the k chosen (Megatron-Core's default order), capacity dropping, the permutation of tokens
// into expert order and its inverse, and the block reorders around the all-to-alls. Plain loops on
// host arrays; an expert index of -1 marks a dropped (token, slot) assignment.
#pragma once

#include <cstdint>

namespace ptdp::kernels {

// For each of n tokens: the k largest of its E logits (ties: the lower expert index first), in
// descending order, into expert[n * k], and the softmax over those k logits into prob[n * k].
void topk_softmax(const float* logits, int64_t n, int64_t experts, int64_t k, int32_t* expert,
                  float* prob);
// dlogits[n * E] (overwritten): the gradient through topk_softmax given dprob[n * k], with
// chosen[n * k] its experts; zero for the experts not chosen. A dropped slot has dprob 0 and
// still shapes the softmax.
void topk_softmax_backward(const float* prob, const float* dprob, const int32_t* chosen, int64_t n,
                           int64_t experts, int64_t k, float* dlogits);
// Each expert keeps at most `capacity` of its assignments, those of the highest probability
// (ties: the earlier token), or with `by_position` those of the earliest positions in the
// sequence (Megatron's --moe-token-drop-policy position): the n tokens are `sequences` sequences
// of n / sequences, and position j of every sequence comes before position j + 1 of any, as in
// Megatron's [s, b] token order. The others' expert becomes -1. Returns the number dropped.
int64_t drop_over_capacity(int32_t* expert, const float* prob, int64_t n, int64_t k,
                           int64_t experts, int64_t capacity, bool by_position = false,
                           int64_t sequences = 1);
// The permuted order: rows grouped by expert (ascending), tokens ascending within an expert.
// slot_of_row[r] = token * k + slot of row r; counts[e] = rows of expert e. Returns the rows.
int64_t permutation(const int32_t* expert, int64_t n, int64_t k, int64_t experts,
                    int64_t* slot_of_row, int64_t* counts);
// y[r] = x[slot_of_row[r] / k] for each row r (width h).
void permute_rows(const float* x, const int64_t* slot_of_row, int64_t rows, int64_t k, int64_t h,
                  float* y);
// dx[slot_of_row[r] / k] += dy[r] (dx is not cleared).
void permute_rows_backward(const float* dy, const int64_t* slot_of_row, int64_t rows, int64_t k,
                           int64_t h, float* dx);
// out[token] += prob[slot] * y[r] for each row r of (token, slot) (out is not cleared).
void unpermute(const float* y, const float* prob, const int64_t* slot_of_row, int64_t rows,
               int64_t k, int64_t h, float* out);
// dy[r] = prob[slot] * dout[token]; dprob[slot] = <dout[token], y[r]> (dprob of slots without
// a row is left as it was: zero it first).
void unpermute_backward(const float* dout, const float* y, const float* prob,
                        const int64_t* slot_of_row, int64_t rows, int64_t k, int64_t h, float* dy,
                        float* dprob);
// Rows held as blocks (a, b) in a-major order, rows[a * B + b] rows each, rewritten in b-major
// order (the chunk sort around an all-to-all). Its inverse is the same call with the counts
// transposed.
void transpose_blocks(const float* in, const int64_t* rows, int64_t A, int64_t B, int64_t h,
                      float* out);

}  // namespace ptdp::kernels
