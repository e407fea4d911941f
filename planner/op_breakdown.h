// Op families and the predicted time of each, per pipeline stage: what `ptdp reconcile` sets
// against a measured run (cli/reconcile.h).
//
// A family groups the ops of core/layer_ops.h by what they do (attention GEMMs, MLP GEMMs, the
// attention core, norms, element-wise glue, tensor-parallel collectives, embedding / LM head /
// loss) and adds the schedule-level work the cost model prices in closed form (pipeline p2p,
// the data-parallel gradient sync, the optimizer step). The predicted breakdown of a stage is
// priced with the same CostModel::op_time that CostModel::predict sums, so its compute families
// add up to the stage's StageTime.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/layer_ops.h"
#include "core/parallel_plan.h"
#include "planner/cost_model.h"

namespace ptdp {

enum class OpFamily : uint8_t {
  kAttentionGemm,  // qkv (or MLA's projections), attn_proj and their gradients
  kMlpGemm,        // fc1, fc2 and their gradients
  kAttentionCore,  // scores, softmax, dropout, context, rotary embedding
  kNorm,           // layernorms / RMSNorms
  kElementwise,    // bias-dropout-add, GELU, SwiGLU, gradient accumulation
  kTensorComm,     // tensor-/sequence-parallel collectives
  kContextComm,    // context-parallel ring exchanges of K and V (and their gradients)
  kMoeRouting,     // router GEMM, top-k, permute and unpermute of routed tokens
  kExpertGemm,     // the experts' FC1 and FC2 and their gradients
  kExpertComm,     // token dispatch and combine (all-to-all, expert-tensor gathers)
  kEmbeddingHead,  // embedding lookup, LM head, cross-entropy
  kPipelineP2p,    // activations and gradients between stages
  kDataParallel,   // data-parallel gradient reduction and the tied-embedding all-reduce
  kOptimizer,      // gradient norm, clipping, AdamW
};
inline constexpr int kNumOpFamilies = static_cast<int>(OpFamily::kOptimizer) + 1;

// The family of an op of the layer op list (every OpId has one).
OpFamily op_family(OpId id);
// "attention_gemm", "mlp_gemm", ...: the names traces, tables and JSON use.
std::string_view family_name(OpFamily f);
std::optional<OpFamily> parse_family(std::string_view name);

// Seconds per family and op role (forward, input grad, weight grad, recompute). Schedule-level
// families (p2p, data-parallel, optimizer) are filed under the forward role.
struct FamilyTimes {
  std::array<std::array<double, 4>, kNumOpFamilies> s{};
  double& at(OpFamily f, OpRole r) { return s[static_cast<size_t>(f)][static_cast<size_t>(r)]; }
  double at(OpFamily f, OpRole r) const {
    return s[static_cast<size_t>(f)][static_cast<size_t>(r)];
  }
  double family(OpFamily f) const;  // all roles
  double total() const;
};

// One pipeline stage's predicted iteration: every family per iteration (all microbatches of
// every chunk on the stage), the batched p2p calls the stage's action list makes, and the
// idle time left to the predicted iteration (the bubble).
struct StagePrediction {
  int64_t stage = 0;
  FamilyTimes families;
  int64_t p2p_calls = 0;  // batched point-to-point calls per iteration
  double bubble = 0;      // iteration - families.total()
};

struct PredictedBreakdown {
  double iteration = 0;  // CostModel::predict
  double peak_memory_bytes = 0;
  std::vector<StagePrediction> stages;
};

// Prices every op of each stage's op lists per microbatch, times the number of microbatches;
// the p2p family as the stage's batched calls times one activation transfer; the data-parallel
// and optimizer families as CostModel prices them for the stage's parameters (not overlapped).
PredictedBreakdown predict_breakdown(const CostModel& cost, const ParallelPlan& p);

}  // namespace ptdp
