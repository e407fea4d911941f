// The one validity rule for a PTD-P plan on a model: every condition a ParallelPlan must meet
// for Megatron-LM's sharding of the model, stated once.
//
// Callers, all of which must agree:
//   - ParallelPlan::validate (core/parallel_plan.cc) throws the first violation (check_plan);
//   - the search (planner/search.cc) rejects a candidate whose first_violated_rule is not
//     kNone, and tallies it under rule_reason;
//   - the runtime's validate_shard_layout (runtime/gpt_model.cc) turns its ShardLayout into a
//     plan and applies the same check, so `ptdp run` refuses exactly what `ptdp plan` rejects.
//
// Each rule has one error message, a single line starting with the Megatron-LM flag it is
// about (thrown as InputError, core/error.h).
//
// Not plan rules, and so not here: what `ptdp run` does not execute whatever the plan, i.e.
// the zb-h1 schedule for MoE models (checked by the trainer). The search proposes zb-h1 only when
// asked (--pipeline-schedule), and `ptdp plan` refuses that for MoE models, so every plan it ranks
// is one `ptdp run` accepts. Whether
// the world has t * p * d ranks is a property of the launch, checked where the world is known.
#pragma once

#include <cstdint>
#include <vector>

#include "core/cluster_spec.h"
#include "core/model_spec.h"
#include "core/parallel_plan.h"

namespace ptdp {

// The largest micro-batch, global batch and virtual stage count a plan may have, so that the
// products later drawn from them (d * b, tokens per batch) stay far from overflowing.
inline constexpr int64_t kMaxBatch = int64_t{1} << 24;

enum class PlanRule {
  kNone,                                  // the plan is valid
  kPositiveSizes,                         // t, p, d, b, B, v, cp and ep are positive
  kSizesInRange,                          // t * cp * p * d <= kMaxGpus; b, B, v <= kMaxBatch
  kTensorDividesHeads,                    // t | num_attention_heads
  kTensorDividesQueryGroups,              // t | num_query_groups
  kTensorDividesFfn,                      // t | ffn_hidden_size
  kTensorDividesMtpHidden,                // MTP: t | hidden_size (eh_proj's output columns)
  kContextDividesSequence,                // 2 cp | seq_length
  kHierarchicalContext,                   // --hierarchical-context-parallel-sizes A B exactly
                                          // with a2a+p2p at cp > 1: A, B >= 1, A B = cp
  kContextDividesHeads,                   // a2a: cp | heads / t and cp | query groups / t;
                                          // a2a+p2p: A | both
  kExpertNeedsMoe,                        // ep > 1 or etp given only for an MoE model
  kExpertDividesExperts,                  // ep | num_experts
  kExpertTensorDividesFfn,                // etp | moe_ffn_hidden_size, t | shared experts' FFN
  kExpertGroupsFit,                       // etp * ep | t * cp * d
  kPipelineWithinLayers,                  // p <= num_layers
  kPipelineDividesLayers,                 // p | num_layers (no layers_per_stage given)
  kLayersPerStage,                        // layers_per_stage: p entries, each >= 1, summing to L
  kLayersPerChunk,                        // layers_per_chunk: p v entries, each >= 0, summing to L
  kBatchDivisible,                        // d * b | B
  kVirtualNeedsInterleaved,               // v > 1 only with the interleaved schedule
  kInterleavedNeedsVirtual,               // the interleaved schedule only with v > 1
  kVirtualNeedsPipeline,                  // v > 1 only with p >= 2
  kVirtualDividesStage,                   // v | layers of every pipeline rank
  kVirtualMicrobatches,                   // v > 1: at least p microbatches
  kMicrobatchGroup,                       // v > 1: valid_microbatch_group(N, m, p)
  kSequenceParallelNeedsTensor,           // sequence parallelism only with t > 1
  kSequenceParallelDividesSequence,       // sequence parallelism: t * cp | seq_length
  kMoeNeedsSequenceParallel,              // an MoE model with t > 1 needs SP
  kTpCommOverlapNeedsSequenceParallel,    // --tp-comm-overlap with t > 1 needs SP
  kParamGatherNeedsDistributedOptimizer,  // --overlap-param-gather with d > 1 needs it
  kOptimizerInstances,  // --num-distributed-optimizer-instances K: K >= 1; K > 1 needs the
                        // distributed optimizer (with Megatron-FSDP, HSDP: optim_grads or
                        // optim_grads_params), K | d * cp and K | edp
  kMegatronFsdp,        // --use-megatron-fsdp: p = 1, not zb-h1; the optimizer states sharded (the
                        // distributed optimizer) exactly when the strategy shards them; the
                        // outer strategy no_shard, or optim with optim_grads_params and K > 1
  kExpertOverlap,       // --overlap-moe-expert-parallel-comm: ep > 1, no full recompute, 1F1B at
                        // p = 1 or interleaved
  kRecomputeLayers,     // recompute_layers >= 0, and > 0 only with full
  kRecomputeModules,    // --recompute-modules: core_attn, mlp, moe_act, layernorm, shared_experts
                        // (with shared experts), moe (MoE models, not with the combined 1F1B);
                        // other than core_attn alone only with selective
};

// The first rule the plan breaks, in the order listed above (kNone when it breaks none).
// Cheap: builds no message.
PlanRule first_violated_rule(const ModelSpec& m, const ParallelPlan& p);
// A short reason for tallies, e.g. "t does not divide the FFN hidden size".
const char* rule_reason(PlanRule r);
// Throws InputError for the first rule the plan breaks, naming the Megatron flag, e.g.
//   "--tensor-model-parallel-size: 3 does not divide ffn_hidden_size (256)".
void check_plan(const ModelSpec& m, const ParallelPlan& p);

// Whether Megatron-Core's interleaved schedule runs m microbatches on p pipeline ranks in
// groups of n (--microbatch-group-size-per-virtual-pipeline-stage): p <= n <= m, and the last
// group, m mod n, is empty or holds at least p (a smaller one would stall the pipeline).
bool valid_microbatch_group(int64_t n, int64_t m, int64_t p);
// The smallest such n (the fewest activations in flight; p when p | m), 0 when m < p.
int64_t smallest_microbatch_group(int64_t m, int64_t p);

// Layers of each model chunk in global-stage order (chunk c of pipeline rank r is global stage
// c * p + r; size p * v): the plan's layout (layers_per_chunk), else pipeline rank r's layers
// (layers_on_stage) split evenly over its v chunks. The plan must be valid.
std::vector<int64_t> layers_per_model_chunk(const ModelSpec& m, const ParallelPlan& p);

}  // namespace ptdp
