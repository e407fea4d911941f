// Context parallelism in `ptdp run` (Megatron-Core's context-parallel attention): the
// sequence of every microbatch is cut into 2 * cp chunks of c = s / (2 cp) tokens and
// context-parallel rank r holds chunks r and 2 cp - 1 - r (causal load balancing: every rank gets
// an early and a late chunk). Everything outside attention works on these s / cp local tokens;
// positions (learned or rotary) are the tokens' global ones.
//
// Attention is fused (flash attention, whatever --use-flash-attn says, as Megatron-Core runs
// context parallelism only with fused attention). Once K and V are final (after QKV, or after the
// rotary embedding) each rank's block goes round a ring of the cp ranks (cp - 1 send/recv steps,
// each a batch of one send and one receive on the context-parallel communicator, bounded as every
// wait is), recorded as kCpKvExchange ops (bytes: one block's K and V). The rank's first chunk
// (positions r c ..) then attends to the keys of positions [0, (r + 1) c) and its second chunk
// (positions (2 cp - 1 - r) c ..) to [0, (2 cp - r) c): two calls of the flash kernel with the
// queries the last c of those positions, exactly the causal attention of the local queries, at
// the arithmetic of the causal half (2 cp + 1 chunk pairs per rank, the same on every rank).
// Only the local K and V are kept for the backward pass, with the output and one log-sum-exp per
// query row and head. The backward pass sends the blocks round the ring again and returns each
// block's dK and dV to its owner round the same ring (a ring reduce-scatter): 2 (cp - 1)
// kCpKvExchangeBackward steps of one block each, the bytes of the op list's cp - 1 steps of K, V
// and their gradients.
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
void context_rope(ShardContext& c, Buffer& x, int64_t heads, int64_t d, bool inverse);

// Forward ring: A.k and A.v (local, [b, s / cp, hl, d]) become the whole sequence's K and V
// ([b, s, hl, d], global order). Recorded as kCpKvExchange steps of pass `pass`.
void context_exchange_kv(ShardContext& c, LayerActs& A, PassKind pass);
// The attention of the local queries A.q over the whole sequence's keys, run by op kAttnScores
// (a selective recomputation's starts with local K and V: they go round the ring first, then
// the op's record goes on): A.ctx [b, s / cp, hl d] and A.lse ([b][2][hl][c]: each chunk's rows
// apart). A.k and A.v become local again.
void context_attention_forward(ShardContext& c, LayerActs& A);
// Its backward pass from D.d_ctx (local), run by op kAttnScoresRecompute: gathers K and V again
// (kCpKvExchangeBackward steps, then the op's record goes on) unless they are whole, and gives D.dq
// (local) and D.dk, D.dv of the whole sequence (this rank's queries' part), which
// context_return_dkv sums into their owners. A.k and A.v become local.
void context_attention_backward(ShardContext& c, LayerActs& A, LayerGrads& D);
// a2a+p2p (1 < ShardDims::cp_a2a_size = A < cp, --hierarchical-context-parallel-sizes A B): the
// same all-to-alls within this rank's group of A adjacent ranks (ShardContext::cp_heads) give
// it the group's s / B tokens (ordered as a rank of a ring of B holds them: the group's chunks
// form two chunks of 2 B) of hl / A heads; K and V then go round the ring of the B groups
// (ShardContext::cp_ring) as above, the queries attend as a ring rank's do, and the output, the
// gradients and dK, dV (after the ring's reduce-scatter) come back by the all-to-alls.
// Ulysses (cp_a2a_size = cp, --cp-comm-type a2a): context_attention_forward moves Q, K and V by
// all-to-alls (kCpKvExchange) from this rank's s / cp tokens of every local head to all s tokens
// of hl / cp heads (block cpr), runs the causal attention of the whole sequence for them, and
// leaves the output in A.ctx in that heads layout, which context_output_to_local (run by op
// kAttnContext) returns to the local tokens of every head (kCpOutAllToAll). Only the local Q, K,
// V and output are kept; context_attention_backward moves them in again (kCpKvExchangeBackward)
// with the output's gradient (kCpOutAllToAllBackward) and leaves D.dq, D.dk, D.dv in the heads
// layout, which context_return_dkv returns (kCpKvExchangeBackward). Transformer Engine keeps the
// moved tensors instead and moves only gradients in the backward pass.
void context_output_to_local(ShardContext& c, LayerActs& A);
// Backward ring: D.dk and D.dv of the whole sequence (this rank's queries' part) are summed over
// the ring into each block's owner and become local. Recorded as kCpKvExchangeBackward steps.
void context_return_dkv(ShardContext& c, LayerGrads& D);

}  // namespace ptdp
