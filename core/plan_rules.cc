// The plan rules of core/plan_rules.h: one evaluator, asked either for the rule alone (the
// search) or for the rule with its message (check_plan).
#include "core/plan_rules.h"

#include <string>

#include "core/error.h"

namespace ptdp {
namespace {

std::string num(int64_t v) {
  return std::to_string(v);
}

// Where a violation is described; null when only the rule is wanted.
struct Report {
  std::string flag, message;
};

// Records the violation (building the message only when asked) and returns its rule.
template <class Message>
PlanRule broken(PlanRule rule, Report* report, const char* flag, Message message) {
  if (report) {
    report->flag = flag;
    report->message = message();
  }
  return rule;
}

PlanRule evaluate(const ModelSpec& m, const ParallelPlan& plan, Report* report) {
  const int64_t t = plan.tensor_parallel, p = plan.pipeline_parallel, d = plan.data_parallel;
  const int64_t b = plan.micro_batch_size, B = plan.global_batch_size, v = plan.virtual_stages;
  const int64_t cp = plan.context_parallel, ep = plan.expert_parallel;
  const std::pair<const char*, int64_t> sizes[] = {{"--tensor-model-parallel-size", t},
                                                   {"--pipeline-model-parallel-size", p},
                                                   {"data_parallel", d},
                                                   {"--micro-batch-size", b},
                                                   {"--global-batch-size", B},
                                                   {"--num-layers-per-virtual-pipeline-stage", v},
                                                   {"--context-parallel-size", cp},
                                                   {"--expert-model-parallel-size", ep}};
  for (const auto& size : sizes) {
    const int64_t value = size.second;  // a copy: clang 14 cannot capture structured bindings
    if (value <= 0)
      return broken(PlanRule::kPositiveSizes, report, size.first,
                    [&] { return "must be positive, got " + num(value); });
  }

  const char* group_flag = "--microbatch-group-size-per-virtual-pipeline-stage";
  if (plan.microbatch_group < 0)
    return broken(PlanRule::kPositiveSizes, report, group_flag,
                  [&] { return "must be positive, got " + num(plan.microbatch_group); });
  // Bounded before anything multiplies them (plan files may hold any integer).
  if (plan.expert_tensor_parallel < 0)
    return broken(PlanRule::kPositiveSizes, report, "--expert-tensor-parallel-size",
                  [&] { return "must be positive, got " + num(plan.expert_tensor_parallel); });
  if (t > kMaxGpus || p > kMaxGpus || d > kMaxGpus || cp > kMaxGpus || ep > kMaxGpus ||
      plan.expert_tensor_parallel > kMaxGpus || t * p * d > kMaxGpus || t * p * d * cp > kMaxGpus)
    return broken(PlanRule::kSizesInRange, report, "data_parallel", [&] {
      return "t * cp * p * d = " + num(t) + " * " + num(cp) + " * " + num(p) + " * " + num(d) +
             " exceeds the " + num(kMaxGpus) + " GPUs ptdp handles";
    });
  for (const auto& size : {sizes[3], sizes[4], sizes[5]}) {
    const int64_t value = size.second;
    if (value > kMaxBatch)
      return broken(PlanRule::kSizesInRange, report, size.first,
                    [&] { return num(value) + " exceeds " + num(kMaxBatch); });
  }
  if (plan.microbatch_group > kMaxBatch)
    return broken(PlanRule::kSizesInRange, report, group_flag,
                  [&] { return num(plan.microbatch_group) + " exceeds " + num(kMaxBatch); });

  const char* tp = "--tensor-model-parallel-size";
  if (m.num_attention_heads % t != 0)
    return broken(PlanRule::kTensorDividesHeads, report, tp, [&] {
      return num(t) + " does not divide num_attention_heads (" + num(m.num_attention_heads) + ")";
    });
  if (m.query_groups() % t != 0)
    return broken(PlanRule::kTensorDividesQueryGroups, report, tp, [&] {
      return num(t) + " does not divide num_query_groups (" + num(m.query_groups()) + ")";
    });
  if (m.ffn_hidden() % t != 0)
    return broken(PlanRule::kTensorDividesFfn, report, tp, [&] {
      return num(t) + " does not divide ffn_hidden_size (" + num(m.ffn_hidden()) + ")";
    });
  if (m.mtp_num_layers > 0 && m.hidden_size % t != 0)
    return broken(PlanRule::kTensorDividesMtpHidden, report, tp, [&] {
      return num(t) + " does not divide hidden_size (" + num(m.hidden_size) +
             "), whose eh_proj outputs multi-token prediction splits over the tensor-parallel "
             "ranks";
    });

  // Context parallelism splits the sequence in 2 * cp chunks, two per rank (causal balance).
  if (cp > 1 && m.seq_length % (2 * cp) != 0)
    return broken(PlanRule::kContextDividesSequence, report, "--context-parallel-size", [&] {
      return "2 * " + num(cp) + " does not divide seq_length (" + num(m.seq_length) + ")";
    });
  // Hierarchical (a2a+p2p): the all-to-all groups' size A, with B = cp / A groups round the ring.
  const bool hierarchical = cp > 1 && plan.cp_comm == CpComm::kA2AP2P;
  const char* hcp = "--hierarchical-context-parallel-sizes";
  if (hierarchical && plan.hierarchical_cp < 1)
    return broken(PlanRule::kHierarchicalContext, report, hcp, [] {
      return std::string(
          "must be given (the all-to-all's and the ring's sizes) with "
          "--cp-comm-type a2a+p2p");
    });
  if (hierarchical && cp % plan.hierarchical_cp != 0)
    return broken(PlanRule::kHierarchicalContext, report, hcp, [&] {
      return num(plan.hierarchical_cp) + " does not divide context-parallel-size (" + num(cp) + ")";
    });
  if (!hierarchical && plan.hierarchical_cp != 0)
    return broken(PlanRule::kHierarchicalContext, report, hcp, [] {
      return std::string("needs --cp-comm-type a2a+p2p and --context-parallel-size above 1");
    });
  // Ulysses trades the sequence for heads: each rank keeps 1/cp of its heads (1/A with a2a+p2p),
  // query and K/V (Transformer Engine's a2a asserts both).
  const int64_t a2a = plan.cp_a2a_size();
  if (a2a > 1 && ((m.num_attention_heads / t) % a2a != 0 || (m.query_groups() / t) % a2a != 0))
    return broken(PlanRule::kContextDividesHeads, report, hierarchical ? hcp : "--cp-comm-type",
                  [&] {
                    return (hierarchical ? "a2a+p2p needs the all-to-all size ("
                                         : "a2a needs context-parallel-size (") +
                           num(a2a) + ") to divide each tensor-parallel rank's attention heads (" +
                           num(m.num_attention_heads / t) + ") and query groups (" +
                           num(m.query_groups() / t) + ")";
                  });

  const char* epf = "--expert-model-parallel-size";
  if (!m.is_moe() && (ep > 1 || plan.expert_tensor_parallel > 0))
    return broken(PlanRule::kExpertNeedsMoe, report, ep > 1 ? epf : "--expert-tensor-parallel-size",
                  [] { return std::string("needs an MoE model (num_experts > 0)"); });
  if (m.is_moe()) {
    if (m.num_experts % ep != 0)
      return broken(PlanRule::kExpertDividesExperts, report, epf, [&] {
        return num(ep) + " does not divide num_experts (" + num(m.num_experts) + ")";
      });
    const int64_t etp = plan.expert_tp();
    if (m.moe_ffn_hidden() % etp != 0 ||
        (m.moe_shared_expert_ffn_size > 0 && m.moe_shared_expert_ffn_size % t != 0))
      return broken(PlanRule::kExpertTensorDividesFfn, report,
                    plan.expert_tensor_parallel > 0 ? "--expert-tensor-parallel-size"
                                                    : "--tensor-model-parallel-size",
                    [&] {
                      return num(etp) + " does not divide the expert FFN width (" +
                             num(m.moe_ffn_hidden()) + ") or t the shared experts' (" +
                             num(m.moe_shared_expert_ffn_size) + ")";
                    });
    if ((t * cp * d) % (etp * ep) != 0)
      return broken(PlanRule::kExpertGroupsFit, report, epf, [&] {
        return "expert-tensor-parallel-size * expert-model-parallel-size (" + num(etp) + " * " +
               num(ep) + ") does not divide the t * cp * d = " + num(t * cp * d) +
               " ranks of a pipeline stage";
      });
  }

  const char* pp = "--pipeline-model-parallel-size";
  if (p > m.num_layers)
    return broken(PlanRule::kPipelineWithinLayers, report, pp,
                  [&] { return num(p) + " exceeds num_layers (" + num(m.num_layers) + ")"; });
  const std::vector<int64_t>& split = plan.layers_per_stage;
  const std::vector<int64_t>& chunks = plan.layers_per_chunk;
  const char* layout = "--pipeline-model-parallel-layout";
  if (!chunks.empty()) {
    if (!split.empty())
      return broken(PlanRule::kLayersPerChunk, report, layout, [] {
        return std::string("conflicts with layers_per_stage (give one way to split the layers)");
      });
    if (static_cast<int64_t>(chunks.size()) != p * v)
      return broken(PlanRule::kLayersPerChunk, report, layout, [&] {
        return "has " + num(static_cast<int64_t>(chunks.size())) +
               " stages, expected pipeline-model-parallel-size * virtual stages (" + num(p) +
               " * " + num(v) + ")";
      });
    int64_t sum = 0;
    for (int64_t n : chunks) {
      if (n < 0)
        return broken(PlanRule::kLayersPerChunk, report, layout,
                      [&] { return "has a stage of " + num(n) + " layers"; });
      sum = n > m.num_layers - sum ? m.num_layers + 1 : sum + n;
    }
    if (sum != m.num_layers)
      return broken(PlanRule::kLayersPerChunk, report, layout, [&] {
        if (sum > m.num_layers) return "places more than num_layers (" + num(m.num_layers) + ")";
        return "places " + num(sum) + " transformer layers, expected num_layers (" +
               num(m.num_layers) + ")";
      });
  } else if (split.empty()) {
    if (m.num_layers % p != 0)
      return broken(PlanRule::kPipelineDividesLayers, report, pp, [&] {
        return num(p) + " does not divide num_layers (" + num(m.num_layers) +
               "); give --decoder-first-pipeline-num-layers and/or "
               "--decoder-last-pipeline-num-layers (layers_per_stage in a plan file) for an "
               "uneven split";
      });
  } else {
    if (static_cast<int64_t>(split.size()) != p)
      return broken(PlanRule::kLayersPerStage, report, "layers_per_stage", [&] {
        return "has " + num(static_cast<int64_t>(split.size())) +
               " entries, expected pipeline-model-parallel-size (" + num(p) + ")";
      });
    int64_t sum = 0;
    for (int64_t n : split) {
      if (n < 1)
        return broken(PlanRule::kLayersPerStage, report, "layers_per_stage",
                      [&] { return "every stage needs a layer, got " + num(n); });
      // Summed without overflow: past num_layers the sum is wrong whatever follows.
      sum = n > m.num_layers - sum ? m.num_layers + 1 : sum + n;
    }
    if (sum != m.num_layers)
      return broken(PlanRule::kLayersPerStage, report, "layers_per_stage", [&] {
        if (sum > m.num_layers) return "sums to more than num_layers (" + num(m.num_layers) + ")";
        return "sums to " + num(sum) + ", expected num_layers (" + num(m.num_layers) + ")";
      });
  }

  if (B % (d * b) != 0)
    return broken(PlanRule::kBatchDivisible, report, "--global-batch-size", [&] {
      return num(B) + " is not divisible by data-parallel size * micro-batch size (" + num(d) +
             " * " + num(b) + ")";
    });

  // Megatron states v per rank when the stages are uneven, and layers per chunk otherwise.
  const char* vp = !chunks.empty() ? layout
                   : split.empty() ? "--num-layers-per-virtual-pipeline-stage"
                                   : "--num-virtual-stages-per-pipeline-rank";
  if (v == 1 && plan.schedule == Schedule::kInterleaved1F1B)
    return broken(PlanRule::kInterleavedNeedsVirtual, report, "--pipeline-schedule", [&] {
      return std::string("interleaved needs more than one model chunk per pipeline rank (") + vp +
             "); with one it is 1f1b";
    });
  if (v > 1) {
    if (plan.schedule != Schedule::kInterleaved1F1B)
      return broken(PlanRule::kVirtualNeedsInterleaved, report, vp, [&] {
        return num(v) + " virtual stages need the interleaved schedule, not " +
               to_string(plan.schedule);
      });
    if (p < 2)
      return broken(PlanRule::kVirtualNeedsPipeline, report, vp, [] {
        return std::string("interleaving needs pipeline-model-parallel-size >= 2");
      });
    // Even stages all hold L / p layers: one check (the search asks this of every candidate).
    // A layout states each chunk's layers.
    for (int64_t r = 0; r < (!chunks.empty() ? 0 : split.empty() ? 1 : p); ++r) {
      const int64_t layers = plan.layers_on_stage(m, r);
      if (layers % v != 0)
        return broken(PlanRule::kVirtualDividesStage, report, vp, [&] {
          return num(v) + " virtual stages do not divide the " + num(layers) +
                 " layers of pipeline rank " + num(r);
        });
    }
    const int64_t mb = plan.num_microbatches(), n = plan.microbatch_group_size();
    if (mb < p)
      return broken(PlanRule::kVirtualMicrobatches, report, vp, [&] {
        return "interleaving needs at least pipeline-model-parallel-size (" + num(p) +
               ") microbatches, got " + num(mb);
      });
    if (!valid_microbatch_group(n, mb, p))
      return broken(
          PlanRule::kMicrobatchGroup, report, plan.microbatch_group > 0 ? group_flag : vp, [&] {
            const std::string why = n < p || n > mb ? " is not in [" + num(p) + ", " + num(mb) + "]"
                                                    : " leaves a last group of " + num(mb % n) +
                                                          " < " + num(p) + " microbatches";
            return "the interleaved schedule's microbatch group " + num(n) +
                   (plan.microbatch_group > 0 ? "" : " (p, the default)") + why + " (" + num(mb) +
                   " microbatches): " + group_flag + " " + num(smallest_microbatch_group(mb, p)) +
                   " runs them";
          });
  }

  if (plan.sequence_parallel) {
    if (t == 1)
      return broken(PlanRule::kSequenceParallelNeedsTensor, report, "--sequence-parallel",
                    [] { return std::string("needs tensor-model-parallel-size > 1"); });
    // Layernorms and dropout-adds run on s/(cp t) of the sequence (runtime/gpt_model.h).
    if (m.seq_length % (t * cp) != 0)
      return broken(PlanRule::kSequenceParallelDividesSequence, report, "--sequence-parallel", [&] {
        if (cp == 1)
          return "seq_length (" + num(m.seq_length) +
                 ") is not a multiple of tensor-model-parallel-size (" + num(t) + ")";
        return "seq_length (" + num(m.seq_length) +
               ") is not a multiple of tensor-model-parallel-size * context-parallel-size (" +
               num(t) + " * " + num(cp) + ")";
      });
  }
  // Megatron-Core: MoE layers with tensor parallelism run on sequence-parallel tokens.
  if (m.is_moe() && t > 1 && !plan.sequence_parallel)
    return broken(PlanRule::kMoeNeedsSequenceParallel, report, "--sequence-parallel", [] {
      return std::string("is required for an MoE model with tensor-model-parallel-size > 1");
    });
  // Settings that apply only where there is something to overlap: no-ops at t = 1 or d = 1.
  if (plan.tp_comm_overlap && t > 1 && !plan.sequence_parallel)
    return broken(PlanRule::kTpCommOverlapNeedsSequenceParallel, report, "--tp-comm-overlap",
                  [] { return std::string("needs --sequence-parallel"); });
  if (plan.overlap_param_gather && d > 1 && !plan.distributed_optimizer)
    return broken(PlanRule::kParamGatherNeedsDistributedOptimizer, report, "--overlap-param-gather",
                  [] { return std::string("needs --use-distributed-optimizer"); });
  // Megatron-Core's partial distributed optimizer: K instances of d * cp / K consecutive
  // data-parallel ranks (and of edp / K expert-data-parallel ranks).
  if (plan.optimizer_instances != 1) {
    const char* flag = "--num-distributed-optimizer-instances";
    const int64_t k = plan.optimizer_instances;
    if (k < 1 || k > kMaxGpus)
      return broken(PlanRule::kOptimizerInstances, report, flag,
                    [&] { return "must be between 1 and " + num(kMaxGpus) + ", got " + num(k); });
    if (!plan.distributed_optimizer)
      return broken(PlanRule::kOptimizerInstances, report, flag,
                    [] { return std::string("needs --use-distributed-optimizer"); });
    // Megatron-FSDP's HSDP: the instances are the groups its strategy shards over.
    if (plan.fsdp != FsdpSharding::kOff && plan.fsdp < FsdpSharding::kOptimGrads)
      return broken(PlanRule::kOptimizerInstances, report, flag, [&] {
        return "with --use-megatron-fsdp (HSDP) needs --data-parallel-sharding-strategy "
               "optim_grads or optim_grads_params, got " +
               to_string(plan.fsdp);
      });
    if ((d * cp) % k != 0)
      return broken(PlanRule::kOptimizerInstances, report, flag, [&] {
        return num(k) + " does not divide the data-parallel size d * cp (" + num(d) + " * " +
               num(cp) + ")";
      });
    if (m.is_moe() && plan.expert_data_parallel() % k != 0)
      return broken(PlanRule::kOptimizerInstances, report, flag, [&] {
        return num(k) +
               " does not divide the experts' data-parallel size t * cp * d / (etp * ep) (" +
               num(plan.expert_data_parallel()) + ")";
      });
  }
  // Megatron-FSDP's outer strategy across the instances (HSDP): no_shard, or optim (HFSDP), which
  // Megatron-FSDP allows only over optim_grads_params and with more than one instance.
  if (plan.fsdp_outer != FsdpSharding::kNoShard) {
    const char* flag = "--outer-dp-sharding-strategy";
    if (plan.fsdp_outer != FsdpSharding::kOptim)
      return broken(PlanRule::kMegatronFsdp, report, flag,
                    [&] { return "must be no_shard or optim, got " + to_string(plan.fsdp_outer); });
    if (plan.fsdp != FsdpSharding::kOptimGradsParams)
      return broken(PlanRule::kMegatronFsdp, report, flag, [] {
        return std::string(
            "optim needs --use-megatron-fsdp --data-parallel-sharding-strategy "
            "optim_grads_params (Megatron-FSDP's rule: the outer sharding builds on the inner)");
      });
    if (plan.optimizer_instances < 2)
      return broken(PlanRule::kMegatronFsdp, report, flag, [] {
        return std::string("optim needs --num-distributed-optimizer-instances > 1");
      });
  }
  // Megatron-FSDP: Megatron-Core shards a whole replica and runs it without pipeline
  // parallelism (its tests and recipes are all p = 1; Torch-FSDP2 refuses p > 1 outright), and it
  // turns the distributed optimizer on for the strategies that shard the optimizer states.
  if (plan.fsdp != FsdpSharding::kOff) {
    const char* flag = "--use-megatron-fsdp";
    if (p > 1)
      return broken(PlanRule::kMegatronFsdp, report, flag, [&] {
        return "runs with pipeline-model-parallel-size 1 (Megatron-FSDP shards each data-parallel "
               "replica's layers), got " +
               num(p);
      });
    if (plan.schedule == Schedule::kZeroBubbleH1)
      return broken(PlanRule::kMegatronFsdp, report, flag, [] {
        return std::string(
            "runs Megatron-Core's 1f1b schedule, not zb-h1 (whose deferred weight-gradient passes "
            "would hold each layer's gradients back from its reduce-scatter)");
      });
    const bool sharded = plan.fsdp >= FsdpSharding::kOptim;
    if (plan.distributed_optimizer != sharded)
      return broken(PlanRule::kMegatronFsdp, report, flag, [&] {
        return "--data-parallel-sharding-strategy " + to_string(plan.fsdp) +
               (sharded ? " shards the optimizer states: the plan needs the distributed optimizer"
                        : " keeps the optimizer states whole: the plan cannot use the distributed "
                          "optimizer");
      });
  }
  // Megatron-Core's conditions for its combined 1F1B (TransformerConfig's checks).
  if (plan.overlap_moe_ep_comm) {
    const char* flag = "--overlap-moe-expert-parallel-comm";
    if (ep == 1)
      return broken(PlanRule::kExpertOverlap, report, flag,
                    [] { return std::string("needs expert-model-parallel-size > 1"); });
    if (plan.recompute == Recompute::kFull)
      return broken(PlanRule::kExpertOverlap, report, flag,
                    [] { return std::string("does not run with full recomputation"); });
    const bool schedule_ok =
        p == 1 ? plan.schedule == Schedule::k1F1B : plan.schedule == Schedule::kInterleaved1F1B;
    if (!schedule_ok)
      return broken(PlanRule::kExpertOverlap, report, flag, [&] {
        return std::string(p == 1 ? "runs the 1f1b schedule at p = 1, not "
                                  : "needs the interleaved schedule (virtual stages) with p > 1, "
                                    "not ") +
               to_string(plan.schedule);
      });
  }
  if (plan.recompute_layers < 0 || plan.recompute_layers > kMaxModelSize ||
      (plan.recompute_layers > 0 && plan.recompute != Recompute::kFull))
    return broken(PlanRule::kRecomputeLayers, report, "--recompute-num-layers", [&] {
      return plan.recompute_layers > 0 && plan.recompute != Recompute::kFull
                 ? std::string("with --recompute-method block needs --recompute-granularity full")
                 : "must be positive, got " + std::to_string(plan.recompute_layers);
    });
  const bool shared_without_experts = (plan.recompute_modules & kRecomputeSharedExperts) != 0 &&
                                      !(m.is_moe() && m.moe_shared_expert_ffn_size > 0);
  const bool moe_without_experts = (plan.recompute_modules & kRecomputeMoe) != 0 && !m.is_moe();
  const bool mla_up_without_mla =
      (plan.recompute_modules & kRecomputeMlaUpProj) != 0 && !m.multi_latent_attention;
  // (The combined 1F1B overlaps the all-to-alls of one microbatch's forward pass with another's
  // backward; Megatron-Core does not run it with the MoE layer recomputed.)
  const bool moe_with_overlap =
      (plan.recompute_modules & kRecomputeMoe) != 0 && plan.overlap_moe_ep_comm;
  if (plan.recompute_modules == 0 || (plan.recompute_modules & ~kAllRecomputeModules) != 0 ||
      (plan.recompute_modules != kRecomputeCoreAttn && plan.recompute != Recompute::kSelective) ||
      shared_without_experts || moe_without_experts || moe_with_overlap || mla_up_without_mla)
    return broken(PlanRule::kRecomputeModules, report, "--recompute-modules", [&] {
      if (plan.recompute != Recompute::kSelective)
        return std::string("needs --recompute-granularity selective");
      if (shared_without_experts)
        return std::string(
            "shared_experts needs an MoE model with shared experts "
            "(--moe-shared-expert-intermediate-size)");
      if (moe_without_experts) return std::string("moe needs an MoE model (--num-experts)");
      if (mla_up_without_mla)
        return std::string("mla_up_proj needs multi-latent attention (--multi-latent-attention)");
      if (moe_with_overlap)
        return std::string("moe does not run with --overlap-moe-expert-parallel-comm");
      return std::string(
          "must name core_attn, mlp, moe_act, layernorm, shared_experts, moe and/or mla_up_proj");
    });
  return PlanRule::kNone;
}

}  // namespace

PlanRule first_violated_rule(const ModelSpec& m, const ParallelPlan& p) {
  return evaluate(m, p, nullptr);
}

const char* rule_reason(PlanRule r) {
  switch (r) {
    case PlanRule::kNone:
      return "valid";
    case PlanRule::kPositiveSizes:
      return "a parallel or batch size is not positive";
    case PlanRule::kSizesInRange:
      return "a parallel or batch size is too large";
    case PlanRule::kTensorDividesHeads:
      return "t does not divide the attention heads";
    case PlanRule::kTensorDividesQueryGroups:
      return "t does not divide the query groups";
    case PlanRule::kTensorDividesFfn:
      return "t does not divide the FFN hidden size";
    case PlanRule::kTensorDividesMtpHidden:
      return "MTP: t does not divide the hidden size";
    case PlanRule::kContextDividesSequence:
      return "2 * cp does not divide the sequence";
    case PlanRule::kHierarchicalContext:
      return "a2a+p2p: the hierarchical sizes do not match cp";
    case PlanRule::kContextDividesHeads:
      return "a2a: cp (a2a+p2p: A) does not divide a rank's heads";
    case PlanRule::kExpertNeedsMoe:
      return "expert parallelism needs an MoE model";
    case PlanRule::kExpertDividesExperts:
      return "ep does not divide the experts";
    case PlanRule::kExpertTensorDividesFfn:
      return "etp does not divide the expert FFN size";
    case PlanRule::kExpertGroupsFit:
      return "etp * ep does not divide t * cp * d";
    case PlanRule::kPipelineWithinLayers:
      return "p exceeds the layers";
    case PlanRule::kPipelineDividesLayers:
      return "p does not divide the layers";
    case PlanRule::kLayersPerStage:
      return "layers_per_stage does not fit p and the layers";
    case PlanRule::kLayersPerChunk:
      return "the pipeline layout does not fit p, v and the layers";
    case PlanRule::kBatchDivisible:
      return "global batch not divisible by d * b";
    case PlanRule::kVirtualNeedsInterleaved:
      return "virtual stages need the interleaved schedule";
    case PlanRule::kInterleavedNeedsVirtual:
      return "the interleaved schedule needs v > 1";
    case PlanRule::kVirtualNeedsPipeline:
      return "virtual stages need p >= 2";
    case PlanRule::kVirtualDividesStage:
      return "v does not divide a stage's layers";
    case PlanRule::kVirtualMicrobatches:
      return "interleaving needs at least p microbatches";
    case PlanRule::kMicrobatchGroup:
      return "the microbatch group does not fit the microbatches";
    case PlanRule::kSequenceParallelNeedsTensor:
      return "sequence parallelism needs t > 1";
    case PlanRule::kSequenceParallelDividesSequence:
      return "sequence parallelism needs t to divide the sequence";
    case PlanRule::kMegatronFsdp:
      return "Megatron-FSDP needs p = 1, the 1f1b schedule and its outer strategy's conditions";
    case PlanRule::kMoeNeedsSequenceParallel:
      return "MoE with t > 1 needs sequence parallelism";
    case PlanRule::kTpCommOverlapNeedsSequenceParallel:
      return "tp-comm-overlap needs sequence parallelism";
    case PlanRule::kParamGatherNeedsDistributedOptimizer:
      return "overlap-param-gather needs the distributed optimizer";
    case PlanRule::kOptimizerInstances:
      return "the optimizer instances do not divide the data-parallel ranks";
    case PlanRule::kExpertOverlap:
      return "the expert all-to-all overlap does not fit the plan";
    case PlanRule::kRecomputeLayers:
      return "block recompute needs full recompute";
    case PlanRule::kRecomputeModules:
      return "recompute modules need selective recompute";
  }
  return "?";
}

bool valid_microbatch_group(int64_t n, int64_t m, int64_t p) {
  return n >= p && n <= m && (m % n == 0 || m % n >= p);
}

int64_t smallest_microbatch_group(int64_t m, int64_t p) {
  for (int64_t n = p; n <= m; ++n)  // n = m always qualifies
    if (valid_microbatch_group(n, m, p)) return n;
  return 0;
}

void check_plan(const ModelSpec& m, const ParallelPlan& p) {
  Report report;
  if (evaluate(m, p, &report) != PlanRule::kNone) throw InputError(report.flag, report.message);
}

std::vector<int64_t> layers_per_model_chunk(const ModelSpec& m, const ParallelPlan& p) {
  const int64_t stages = p.pipeline_parallel * p.virtual_stages;
  std::vector<int64_t> out(static_cast<size_t>(stages));
  for (int64_t g = 0; g < stages; ++g)
    out[static_cast<size_t>(g)] =
        p.layers_in_chunk(m, g % p.pipeline_parallel, g / p.pipeline_parallel);
  return out;
}

}  // namespace ptdp
