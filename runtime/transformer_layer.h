// One transformer layer of a GptShard, executed op by op from the layer op list
// (core/layer_ops.h): column-parallel QKV and FC1, row-parallel projection and FC2, with the
// tensor-parallel all-reduces (or, with sequence parallelism, the all-gathers into and
// reduce-scatters out of each block) those ops name. Activations are [b, s, h] row-major,
// [b, s/t, h] outside the blocks with sequence parallelism.
#pragma once

#include <cstdint>

#include "core/layer_ops.h"
#include "core/parallel_plan.h"
#include "runtime/shard_context.h"

namespace ptdp {

struct LayerParams {  // offsets into the flat buffers; -1 when absent
  int64_t ln1_g = -1, ln1_b = -1, qkv_w = -1, qkv_b = -1, proj_w = -1, proj_b = -1;
  int64_t ln2_g = -1, ln2_b = -1, fc1_w = -1, fc1_b = -1, fc2_w = -1, fc2_b = -1;
  int64_t qn_g = -1, qn_b = -1, kn_g = -1, kn_b = -1;  // --qk-layernorm's query and key norms
  // Multi-head latent attention (qkv_w absent): the down projections (q_down_w absent without a
  // query latent) and the latents' norms, whole on every rank; the column-parallel up
  // projections (q_up_w: linear_q_proj without a query latent).
  int64_t q_down_w = -1, qlat_g = -1, q_up_w = -1, kv_down_w = -1, kvlat_g = -1, kv_up_w = -1;
};

struct LayerActs {
  // probs: the s x s attention probabilities; with flash attention lse (one log-sum-exp per
  // query row and head) instead. Activations take the run's precision (fp32 or bf16); the
  // statistics are fp32.
  Buffer x, ln1, ln1_full, q, k, v, probs, ctx, proj, h1;
  Buffer ln2, ln2_full, fc1, act, fc2, out;
  Buffer ln1_mean{DType::kF32}, ln1_rstd{DType::kF32}, ln2_mean{DType::kF32}, ln2_rstd{DType::kF32},
      lse{DType::kF32};
  // --qk-layernorm: the queries and keys before their norms, and the norms' statistics (one per
  // head and token).
  Buffer q_in, k_in;
  Buffer qn_mean{DType::kF32}, qn_rstd{DType::kF32}, kn_mean{DType::kF32}, kn_rstd{DType::kF32};
  // MLA, on the rank's tokens: the latents before and after their norms and the shared rotated
  // key; *_full: all tokens, gathered with sequence parallelism (the up projections' inputs);
  // k_nope: the keys' unrotated part between the up projection and the rotary embedding.
  Buffer q_lat_in, q_lat, q_lat_full, kv_lat_in, kv_lat, kv_lat_full, k_pe, k_pe_full, k_nope;
  Buffer qlat_mean{DType::kF32}, qlat_rstd{DType::kF32}, kvlat_mean{DType::kF32},
      kvlat_rstd{DType::kF32};
  // A heads all-to-all (Ulysses, a2a+p2p; runtime/context_parallel.cc): Q, K and V as the
  // attention took them (the group's tokens of this rank's heads block; K and V before the ring)
  // and its output before it went back to the tokens, kept for the backward pass as Transformer
  // Engine keeps them, so that only gradients move then. The rank's own Q, K and V are dropped
  // once moved, unless rerun_attention: a selective recomputation of the attention core reruns
  // the all-to-alls from them.
  Buffer q_heads, k_heads, v_heads, ctx_heads;
  bool rerun_attention = false;
};

// The backward pass's scratch. Each buffer is released after the op that reads it last, as
// autograd frees a gradient (the weight-gradient GEMMs' inputs after those GEMMs, which a
// zero-bubble input pass defers with them); d_out and d_x carry the gradient between layers.
// What one layer's backward pass holds at once is what layer_backward_working_bytes
// (core/layer_ops.h) prices; the gradients a zero-bubble input pass keeps for its deferred W
// pass are not priced.
struct LayerGrads {
  Buffer d_out, d_h1, d_fc2, d_act, d_pre, d_ln2_full, d_ln2, d_proj, d_ctx, d_probs, dq, dk, dv;
  Buffer d_qkv, d_ln1_full, d_ln1, d_x, tmp;
  // MLA: the up projections' output gradients (d_kvu: keys' unrotated part and values) and
  // input gradients (d_q_in: the query latent's, or the input norm's without one; d_kvc: the
  // key-value latent's with the rotated key's), the keys' parts, the latents' before the norms.
  Buffer d_kvu, d_q_in, d_kvc, dk_nope, dk_pe, d_q_lat_in;
};

// The ops of the layer's forward (and recomputation) and backward lists.
bool is_layer_forward_op(OpId id);
bool is_layer_backward_op(OpId id);

void layer_forward_op(ShardContext& c, OpId op, const LayerParams& W, LayerActs& A);
void layer_backward_op(ShardContext& c, OpId op, const LayerParams& W, LayerActs& A, LayerGrads& D);
// After a layer's forward pass, drops what the recompute mode (with selective, its modules:
// RecomputeModule bits) does not keep.
void drop_recomputed(LayerActs& A, Recompute r, unsigned modules);

}  // namespace ptdp
