// The first stage's vocabulary-parallel embedding and the last stage's final norm, LM head
// and vocabulary-parallel cross-entropy, executed op by op from embedding_ops and lm_head_ops
// (core/layer_ops.h). Each tensor-parallel rank holds a contiguous 1/t of the (padded)
// vocabulary; the loss is finished from every rank's per-token (max, sum-exp, target) stats.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/layer_ops.h"
#include "runtime/shard_context.h"
#include "runtime/transformer_layer.h"

namespace ptdp {

// Parameters of one model chunk outside its layers (offsets, -1 when absent).
struct ChunkParams {
  int64_t word = -1, pos = -1, lnf_g = -1, lnf_b = -1, head = -1;
};

struct ChunkActs {
  std::vector<int32_t> inputs, targets;  // [b, s]
  Buffer emb;                            // word embedding before the position add
  std::vector<LayerActs> layers;
  // probs: the logits, then their probabilities and gradient (the run's precision).
  Buffer lnf_in, lnf, lnf_full, probs;
  Buffer lnf_mean{DType::kF32}, lnf_rstd{DType::kF32}, stats{DType::kF32}, lse{DType::kF32};
  // A loss over some rows only: a multi-token prediction module's, whose last positions of each
  // sequence have no target (Megatron-Core masks them). Runs [first, first + count) of the rows;
  // the loss is their sum over loss_tokens, and its gradient is weighted loss_weight. Unmasked:
  // every row, their mean, weight 1.
  // `masked` says the runs apply (a rank may hold none of a module's targets: no loss, then).
  bool masked = false;
  std::vector<std::pair<int64_t, int64_t>> loss_rows;
  double loss_tokens = 0, loss_weight = 1;
};

bool is_embedding_op(OpId id);
bool is_head_forward_op(OpId id);
bool is_head_backward_op(OpId id);

// x: the embedding output (forward); dx: the gradient reaching the embedding (backward).
void embedding_op(ShardContext& c, OpId op, const ChunkParams& W, ChunkActs& A, Buffer& x,
                  Buffer* dx);
// Returns the mean loss over the microbatch's tokens once the loss is finished (else 0).
double head_forward_op(ShardContext& c, OpId op, const ChunkParams& W, ChunkActs& A);
// D.d_out receives the gradient of the final norm's input.
void head_backward_op(ShardContext& c, OpId op, const ChunkParams& W, ChunkActs& A, LayerGrads& D,
                      double loss_scale);

}  // namespace ptdp
