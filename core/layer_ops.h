// The layer op list: one transformer layer (and the embedding, LM head and optimizer step)
// as the operations one GPU executes, derived from (model, t, b, sequence parallel, recompute).
//
// The same list is priced by the cost model, benchmarked by the calibrator and executed by the
// runtime, so all three name the same ops. Shapes are per GPU (already divided by t).
// Activations and weights are 16-bit; `bytes` counts every byte a memory-bound op reads and
// writes; for a collective `bytes` is the full (unsharded-by-the-collective) buffer, as
// nccl-tests counts it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/model_spec.h"
#include "core/parallel_plan.h"

namespace ptdp {

enum class OpKind { kGemm, kMemory, kCollective };
enum class Collective { kAllReduce, kAllGather, kReduceScatter, kSendRecv };
enum class CommGroup { kTensor, kPipeline, kData, kEmbedding };

std::string to_string(Collective c);

struct Op {
  std::string name;
  OpKind kind = OpKind::kMemory;
  // GEMM: `batch` independent products C[m x n] = A[m x k] * B[k x n].
  int64_t m = 0, n = 0, k = 0, batch = 1;
  double bytes = 0;  // memory op: bytes moved; collective: buffer bytes
  Collective collective = Collective::kAllReduce;
  CommGroup group = CommGroup::kTensor;

  double flops() const { return kind == OpKind::kGemm ? 2.0 * m * n * k * batch : 0.0; }
};

// Whether an op of a backward pass computes (or accumulates) weight gradients, the part a
// zero-bubble schedule defers (W); the rest computes input gradients (B).
bool is_weight_gradient(const Op& op);

// Ops of one pass, in execution order.
struct PassOps {
  std::vector<Op> forward;
  std::vector<Op> backward;   // input and weight gradients
  std::vector<Op> recompute;  // forward work redone before the backward pass (may be empty)
};

struct LayerShape {
  int64_t tensor_parallel = 1;
  int64_t micro_batch = 1;
  bool sequence_parallel = false;
  Recompute recompute = Recompute::kNone;
  // Without fused gradient accumulation each weight gradient is added to the main gradient
  // buffer (of main_grad_bytes per element) by a separate memory-bound pass.
  bool fused_grad_accumulation = true;
  double main_grad_bytes = 4;
};

LayerShape layer_shape(const ParallelPlan& p);

PassOps transformer_layer_ops(const ModelSpec& m, const LayerShape& s);
PassOps embedding_ops(const ModelSpec& m, const LayerShape& s);  // first pipeline stage
PassOps lm_head_ops(const ModelSpec& m, const LayerShape& s);    // last stage, loss included

// Activation bytes one layer keeps for its backward pass, per microbatch (Korthikanti et al.
// 2022, Table 2, generalised to GQA and gated MLPs; equals s b h (34 + 5 a s / h) for GPT).
double layer_activation_bytes(const ModelSpec& m, const LayerShape& s);

}  // namespace ptdp
