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
