// The MoE layer's routing loops (runtime/moe_layer.cc): top-k over router logits with a softmax
// over the k chosen (Megatron-Core's default order), capacity dropping, the permutation of tokens
// into expert order and its inverse, and the block reorders around the all-to-alls. The routing
// decisions are host loops on host arrays (an expert index of -1 marks a dropped (token, slot)
// assignment); the row moves are index-driven gathers, the CPU backend's form of
// Backend::gather_rows, gather_add_rows and row_dots.
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
// The row moves of the layer, driven by index arrays the host computes from the routing (so that
// a device backend runs them as plain gathers: Backend::gather_rows and friends). Rows have
// width h and are stored as T: float, or uint16_t holding bf16 bit patterns (a bf16 model's
// routed rows), loaded as fp32 and stored rounded to nearest even; an index of -1 is skipped.
//
// y[r] = x[index[r]], times weight[r] when weight is not null.
template <class T>
void gather_rows(const T* x, const int64_t* index, const float* weight, int64_t rows, int64_t h,
                 T* y);
// out[i] += weight[i * k + j] * y[index[i * k + j]] (weight 1 when null) for j = 0 .. k - 1 in
// that order, skipping index -1 (out is not cleared), in fp32: out rounded once.
template <class T>
void gather_add_rows(const T* y, const int64_t* index, const float* weight, int64_t n, int64_t k,
                     int64_t h, T* out);
// dot[r] = <a[index[r]], b[r]>, summed in double in column order.
template <class T>
void row_dots(const T* a, const int64_t* index, const T* b, int64_t rows, int64_t h, float* dot);

// Index arrays for those calls, from the permutation (slot_of_row, rows of it).
// The token of each row: token_of_row[r] = slot_of_row[r] / k (permute: gather_rows of x).
void token_of_rows(const int64_t* slot_of_row, int64_t rows, int64_t k, int64_t* token_of_row);
// For each of n tokens its k entries: the rows holding its slots in ascending row order, then
// -1 (dropped slots), and in `row_prob` the probability (prob[n * k]) of each entry's slot (0 for
// -1). gather_add_rows over these sums a token's rows in row order.
void rows_of_tokens(const int64_t* slot_of_row, int64_t rows, int64_t n, int64_t k,
                    const float* prob, int64_t* row_of, float* row_prob);
// Rows held as blocks (a, b) in a-major order, rows[a * B + b] rows each, rewritten in b-major
// order (the chunk sort around an all-to-all): out row i is in row index[i]. Its inverse is the
// same call with the counts transposed.
void transpose_blocks_index(const int64_t* rows, int64_t A, int64_t B, int64_t* index);

}  // namespace ptdp::kernels
