// Context parallelism in `ptdp run` (Megatron-Core's "p2p" context-parallel attention): the
// sequence of every microbatch is cut into 2 * cp chunks of s / (2 cp) tokens and context-parallel
// rank r holds chunks r and 2 cp - 1 - r (causal load balancing: every rank gets an early and a
// late chunk). Everything outside attention works on these s / cp local tokens; positions
// (learned or rotary) are the tokens' global ones. Attention passes each rank's K and V block
// around a ring of the cp ranks (cp - 1 send/recv steps, each a batch of one send and one receive
// on the context-parallel communicator, bounded as every wait is) and computes the local
// queries' attention over the gathered keys exactly, the causal mask on global positions. The
// backward pass returns each block's dK and dV to its owner around the same ring (a ring
// reduce-scatter, cp - 1 steps). The exchanges are recorded as kCpKvExchange and
// kCpKvExchangeBackward ops (send/recv over CommGroup::kContext, bytes: one block's K and V).
//
// What is exact and what is not the real algorithm: the attention is computed with the kernels
// of the plain causal attention on the full sequence length, the local queries placed at their
// global positions and the other rows zero (their outputs are dropped and their gradients are
// zero), so it does cp times the attention arithmetic a rank of Megatron-Core does and keeps
// [b, heads, s, s] scores; the result is exactly plain causal attention of the local queries.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/shard_context.h"
#include "runtime/transformer_layer.h"

namespace ptdp {

// A run of local tokens [local, local + len) whose global positions are [global, global + len).
struct PositionRun {
  int64_t local = 0, global = 0, len = 0;
};

// The runs covering local tokens [begin, begin + len) of context-parallel rank r, for a sequence
// of s tokens over cp ranks (2 * cp must divide s). At most two runs; one when cp == 1.
std::vector<PositionRun> context_runs(int64_t s, int64_t cp, int64_t r, int64_t begin, int64_t len);

// The s / cp tokens of rank r of each of b sequences of s + 1 tokens: window `shift` (0: the
// inputs, tokens 0..s-1; 1: the targets, tokens 1..s), in local order. out: b * s / cp tokens.
void context_token_window(const int32_t* sequences, int32_t* out, int64_t b, int64_t s, int64_t cp,
                          int64_t r, int64_t shift);

// Rows of [b, s / cp, width] (rank r's tokens) to and from [b, s, width] at their global places.
// to_global leaves the other rows of `full` as they are; from_global reads only rank r's rows.
void context_rows_to_global(Backend& be, CPtr local, Ptr full, int64_t b, int64_t s, int64_t cp,
                            int64_t r, int64_t width);
void context_rows_from_global(Backend& be, CPtr full, Ptr local, int64_t b, int64_t s, int64_t cp,
                              int64_t r, int64_t width);

// Adds (grad: accumulates the gradient of) the learned position table for local tokens
// [first, first + sl) of each sequence of x [b, sl, h] (the sequence-parallel slice).
void context_positions(ShardContext& c, Ptr x, int64_t table, int64_t sl, int64_t first, bool grad);

// Rotary embedding of x [b, s / cp, heads, d] at the local tokens' global positions.
void context_rope(ShardContext& c, Buffer& x, int64_t heads, bool inverse);

// Forward ring: A.k and A.v (local) become the whole sequence's K and V, A.q the local queries at
// their global rows of [b, s, hl, d] (other rows zero). Recorded as kCpKvExchange steps.
void context_exchange_kv(ShardContext& c, LayerActs& A);
// A.ctx computed on the whole sequence [b, s, hl d] back to the local rows.
void context_keep_local(ShardContext& c, Buffer& x, int64_t width);
// The local [b, s / cp, width] gradient placed at its global rows of a zero [b, s, width].
void context_pad_local(ShardContext& c, Buffer& x, int64_t width);
// Backward ring: D.dk and D.dv of the whole sequence (this rank's queries' part) are summed over
// the ring into each block's owner and become local; D.dq becomes local. Recorded as
// kCpKvExchangeBackward steps.
void context_return_dkv(ShardContext& c, LayerGrads& D);

}  // namespace ptdp
