// CPU kernels for the memory-bound glue of the sharded GPT model and its optimizer: residual and
// bias adds, scaling, column splits, the sequence-parallel reordering around collectives, the
// vocabulary-parallel embedding and cross-entropy pieces, and the squared norm. Every loop the
// runtime runs over tensor elements lives here (or in kernels/cpu/kernels.h), so a device
// backend replaces exactly this list. All arrays are dense row-major fp32.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ptdp::kernels {

// y[i] += x[i].
void add(float* y, const float* x, int64_t n);
// y[r, c] += bias[c] for rows x width; db[c] += sum_r dy[r, c].
void add_bias(float* y, const float* bias, int64_t rows, int64_t width);
void bias_grad(const float* dy, float* db, int64_t rows, int64_t width);
// x[i] = x[i] * f, the product rounded once to fp32.
void scale(float* x, int64_t n, double f);
// acc + the sum of squares, accumulated in double in index order.
double sum_squares(const float* x, int64_t n, double acc = 0);

// These four move elements of `element` bytes (fp32 by default; bf16's 2 as they are, with no
// widening: a bf16 run's glue).
// Rows of x [n, a + b + c] split into y0 [n, a], y1 [n, b], y2 [n, c], and back.
void split_columns3(const void* x, void* y0, void* y1, void* y2, int64_t n, int64_t a, int64_t b,
                    int64_t c, size_t element = sizeof(float));
void concat_columns3(const void* x0, const void* x1, const void* x2, void* y, int64_t n, int64_t a,
                     int64_t b, int64_t c, size_t element = sizeof(float));

// Sequence parallelism. `shards` is t blocks, rank-major, each [b, s/t, width] (what an
// all-gather returns and a reduce-scatter takes); `full` is [b, s, width].
void sequence_unshard(const void* shards, void* full, int64_t t, int64_t b, int64_t s,
                      int64_t width, size_t element = sizeof(float));
void sequence_shard(const void* full, void* shards, int64_t t, int64_t b, int64_t s, int64_t width,
                    size_t element = sizeof(float));

// Vocabulary-parallel embedding: this rank holds rows [v0, v0 + vl) of the table. Rows of y for
// tokens outside the shard are zero; the gradient adds only rows inside it.
void vocab_embedding_lookup(const int32_t* tokens, const float* table, float* y, int64_t n,
                            int64_t h, int64_t v0, int64_t vl);
void vocab_embedding_grad(const int32_t* tokens, const float* dy, float* dtable, int64_t n,
                          int64_t h, int64_t v0, int64_t vl);
// x [b, sl, h] += pos[first + j] for position j of each sequence; and its gradient.
void add_positions(float* x, const float* pos, int64_t b, int64_t sl, int64_t h, int64_t first);
void position_grad(const float* dx, float* dpos, int64_t b, int64_t sl, int64_t h, int64_t first);

// Vocabulary-parallel cross-entropy over logits [n, vl] of which the first `valid` columns are
// real (the rest pad the vocabulary to a multiple of t).
//   stats:    per row (max, sum of exp(x - max), target logit or 0 when the target is elsewhere)
//   finish:   from every rank's stats ([ranks, n, 3]) the log-sum-exp per row, the logits
//             turned into probabilities in place (0 in padding); returns the summed loss
//   backward: probs become d(scale * mean loss)/dlogits in place
void cross_entropy_stats(const float* logits, const int32_t* targets, float* stats, int64_t n,
                         int64_t vl, int64_t valid, int64_t v0);
double cross_entropy_finish(const float* stats, int64_t ranks, float* logits, float* lse, int64_t n,
                            int64_t vl, int64_t valid);
void cross_entropy_backward(float* probs, const int32_t* targets, int64_t n, int64_t vl, int64_t v0,
                            double scale);

// Sequences of s + 1 tokens ([b, s + 1]) to the s tokens starting at `shift` of each
// ([b, s]): shift 0 the inputs, shift 1 the targets.
void token_window(const int32_t* sequences, int32_t* out, int64_t b, int64_t s, int64_t shift);

}  // namespace ptdp::kernels
