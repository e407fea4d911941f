// ParallelPlan: one PTD-P configuration, in Megatron-LM's terms.
//
//   t  --tensor-model-parallel-size      p  --pipeline-model-parallel-size
//   cp --context-parallel-size           d  data-parallel size = num_gpus / (t * cp * p)
//   ep --expert-model-parallel-size      etp --expert-tensor-parallel-size (MoE layers' experts)
//   b  --micro-batch-size                B  --global-batch-size
//   v  virtual pipeline stages (model chunks per pipeline rank);
//      Megatron's --num-layers-per-virtual-pipeline-stage K gives v = num_layers / (p * K).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/model_spec.h"

namespace ptdp {

enum class Recompute { kNone, kSelective, kFull };
// What selective recomputation recomputes (Megatron-Core's --recompute-modules, a set): the
// attention core ("core_attn", its default and SC'21's selective recomputation), the dense
// MLP ("mlp": its layernorm, FC1, the activation and FC2 with their tensor-parallel
// communication, from the residual; not an MoE layer's experts), the routed experts' activation
// function ("moe_act": from FC1's output, so FC2's input is not kept), an MoE layer's
// pre-MLP layernorm ("layernorm": its output, the router's, the dispatch's and the shared
// experts' input, is not kept but rerun from the residual), an MoE layer's shared experts
// ("shared_experts": their MLP rerun from its input, as "mlp" reruns a dense layer's) and the
// whole MoE layer ("moe": router, dispatch, experts, combine and shared experts rerun from the
// layer's input, its all-to-alls included; nothing inside it kept).
//
// As Megatron-Core's default Transformer Engine layer spec builds a layer: the layernorm before
// the attention is fused into the QKV projection (TELayerNormColumnParallelLinear), and so is a
// dense layer's layernorm before its MLP into FC1, which leaves them no module of their own
// (IdentityOp) for "layernorm" to recompute (megatron/core/transformer/transformer_layer.py
// sets recompute_input_layernorm and recompute_pre_mlp_layernorm only for a norm that is not an
// IdentityOp; gpt_layer_specs.py gives the pre-MLP norm a module of its own in MoE layers only).
// A dense layer's checkpointed MLP starts at the residual, so "mlp" reruns its fused layernorm.
enum RecomputeModule : unsigned {
  kRecomputeCoreAttn = 1u,
  kRecomputeMlp = 2u,
  kRecomputeMoeAct = 4u,
  kRecomputeLayernorm = 8u,
  kRecomputeSharedExperts = 16u,
  kRecomputeMoe = 32u,
  // mla_up_proj: multi-head latent attention's up projections and rotary embedding rerun from
  // the kept latents (and, with sequence parallelism, their all-gather), so that Q, K and V are
  // not kept (Megatron-Core's CheckpointWithoutOutput around them).
  kRecomputeMlaUpProj = 64u
};
inline constexpr unsigned kAllRecomputeModules =
    kRecomputeCoreAttn | kRecomputeMlp | kRecomputeMoeAct | kRecomputeLayernorm |
    kRecomputeSharedExperts | kRecomputeMoe | kRecomputeMlaUpProj;
static_assert(kAllRecomputeModules < (1u << 16), "CostModel::shape_times keys the set in 16 bits");
// The modules as one layer runs them. The mlp bit is the layer's tensor-parallel MLP: a dense
// layer's MLP (mlp), or an MoE layer's shared experts (shared_experts, or moe). The layernorm
// bit is the pre-MLP layernorm's output rerun: in a dense layer with mlp (the layernorm given
// alone does nothing there), in an MoE layer with layernorm. moe_act and moe are for MoE layers
// only (moe reruns the experts' activation with the rest).
inline unsigned layer_recompute_modules(unsigned modules, bool moe_layer) {
  const unsigned core = modules & (kRecomputeCoreAttn | kRecomputeMlaUpProj);
  if (!moe_layer)
    return core | ((modules & kRecomputeMlp) ? unsigned{kRecomputeMlp | kRecomputeLayernorm} : 0u);
  const unsigned common = core | (modules & kRecomputeLayernorm);
  if (modules & kRecomputeMoe) return common | kRecomputeMoe | kRecomputeMlp;
  return common | (modules & kRecomputeMoeAct) |
         ((modules & kRecomputeSharedExperts) ? unsigned{kRecomputeMlp} : 0u);
}
// "core_attn mlp" (Megatron's spelling, space-separated); parsing names the flag or field and
// refuses Megatron's modules ptdp does not model.
std::string recompute_modules_string(unsigned modules);
std::vector<std::string> recompute_module_names(unsigned modules);
unsigned recompute_modules_from_strings(const std::vector<std::string>& names,
                                        const std::string& field);
enum class Schedule { kGPipe, k1F1B, kInterleaved1F1B, kZeroBubbleH1 };
// How a context-parallel attention meets the keys of the other cp ranks (Megatron-Core's
// --cp-comm-type, Transformer Engine's kernels): kP2P, a ring passing K and V blocks, each
// step's transfer under the previous block's attention; kAllGather, K and V all-gathered
// before the attention and their gradients reduce-scattered after it (Llama 3's choice for
// GQA); kA2A, Ulysses: all-to-alls trade sequence for heads, so each rank attends over the
// whole sequence with heads / cp of its heads, and back after; kA2AP2P, hierarchical ("a2a+p2p",
// --hierarchical-context-parallel-sizes A B): Ulysses' all-to-alls within groups of A adjacent
// context-parallel ranks (usually inside a node), then a ring of K and V blocks over the B groups
// (across nodes), each rank attending with heads / A of its heads to the keys of the whole
// sequence.
enum class CpComm { kP2P, kAllGather, kA2A, kA2AP2P };
inline constexpr std::array<CpComm, 4> kCpComms = {CpComm::kP2P, CpComm::kAllGather, CpComm::kA2A,
                                                   CpComm::kA2AP2P};
// Megatron-Core's Megatron-FSDP (--use-megatron-fsdp --data-parallel-sharding-strategy S): what
// each of the d * cp data-parallel ranks keeps of its replica (experts: of the
// expert-data-parallel ranks). kOff: Megatron's DDP (with --use-distributed-optimizer, ZeRO-1).
// kNoShard and kOptim keep whole gradients and reduce them once an iteration, as DDP and the
// distributed optimizer do. kOptimGrads (ZeRO-2) also shards the gradients: each transformer
// layer's gradients are reduce-scattered during every microbatch's backward pass and added to
// the rank's shard. kOptimGradsParams (ZeRO-3) also shards the weights: each layer's are
// all-gathered before its forward pass and again before its backward pass, and dropped after
// each (megatron/core/distributed/fsdp: layers are its units, the embedding and output layer
// stay whole).
enum class FsdpSharding { kOff, kNoShard, kOptim, kOptimGrads, kOptimGradsParams };

// Megatron-FSDP's defaults (megatron/core/distributed/fsdp, FSDP v1), which the memory model
// prices and ptdp run follows (runtime/fsdp.h): the all-gather pipeline prefetches units until
// about this many unsharded elements are in flight (half its communication size, max(1e9, 2 x
// the average unit)); a unit's whole gradient lives from its backward pass until its
// reduce-scatter is done: two units, the one computing and the one reducing, the steady state
// when the reductions keep pace with the backward pass.
inline constexpr double kFsdpPrefetchElements = 5e8;
inline constexpr double kFsdpGradientUnitsInFlight = 2.0;
// The units gathered ahead of the running one when a unit has `unit` elements (> 0).
inline double fsdp_units_ahead(double unit) {
  return std::ceil((kFsdpPrefetchElements > unit ? kFsdpPrefetchElements : unit) / unit);
}

std::string to_string(Recompute r);
std::string to_string(Schedule s);
// "p2p", "all_gather", "a2a", "a2a+p2p", as Megatron-Core's TransformerConfig and Transformer
// Engine spell them; reading also takes "allgather", the spelling of Megatron-LM's --help.
std::string to_string(CpComm c);
struct ParallelPlan;
// "none", "selective", "full", or "block N" for block recompute of N layers per chunk.
std::string recompute_label(const ParallelPlan& p);
Recompute recompute_from_string(const std::string& s);  // none|selective|full
Schedule schedule_from_string(const std::string& s);    // gpipe|1f1b|interleaved|zb-h1
CpComm cp_comm_from_string(const std::string& s);       // p2p|all_gather|a2a|a2a+p2p (|allgather)
// "off", or Megatron's --data-parallel-sharding-strategy names: "no_shard", "optim",
// "optim_grads", "optim_grads_params".
std::string to_string(FsdpSharding s);
FsdpSharding fsdp_sharding_from_string(const std::string& s);  // the names above but "off"

struct ParallelPlan {
  int64_t tensor_parallel = 1;
  int64_t pipeline_parallel = 1;
  int64_t data_parallel = 1;
  // Context parallelism: the sequence split over cp ranks, each rank holding two of 2 * cp
  // chunks for causal balance; attention meets the other ranks' keys as cp_comm says.
  int64_t context_parallel = 1;
  CpComm cp_comm = CpComm::kP2P;  // --cp-comm-type, used when cp > 1
  // With a2a+p2p: the size A of the all-to-all groups, the first of Megatron-Core's
  // --hierarchical-context-parallel-sizes A B (B = cp / A, the ring's); 0 otherwise.
  int64_t hierarchical_cp = 0;
  // Expert parallelism: an MoE layer's experts split over ep ranks, each expert's weights over
  // etp ranks (0: etp = t, Megatron-Core's default). The t * cp * d ranks of a pipeline stage
  // regroup as etp x ep x expert-data-parallel for the experts.
  int64_t expert_parallel = 1;
  int64_t expert_tensor_parallel = 0;
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 1;
  int64_t virtual_stages = 1;
  // Megatron-Core's --microbatch-group-size-per-virtual-pipeline-stage N: the interleaved
  // schedule runs each model chunk for N consecutive microbatches before the next chunk, and
  // rank r warms up with 2 (p - r - 1) + (v - 1) N forward passes. p <= N <= m, and the last
  // group (m mod N) is empty or holds at least p (core/plan_rules.h). 0: Megatron's default, p,
  // which needs m to be a multiple of p; a larger N runs other microbatch counts at the price of
  // (v - 1) (N - p) more chunks' activations in flight (microbatch_group_size()).
  int64_t microbatch_group = 0;
  Schedule schedule = Schedule::k1F1B;  // kInterleaved1F1B whenever virtual_stages > 1
  Recompute recompute = Recompute::kNone;
  // With full recompute: 0 recomputes every layer, each its own checkpoint (Megatron's
  // --recompute-method uniform --recompute-num-layers 1); N > 0 only the first N layers of each
  // model chunk, the others keeping their activations (--recompute-method block
  // --recompute-num-layers N), trading memory for less recomputation.
  int64_t recompute_layers = 0;
  // With selective recomputation, the modules it recomputes (RecomputeModule bits; Megatron's
  // default, the attention core alone, unless --recompute-modules says otherwise).
  unsigned recompute_modules = kRecomputeCoreAttn;
  bool sequence_parallel = false;
  bool distributed_optimizer = false;
  // Megatron-Core's partial distributed optimizer (--num-distributed-optimizer-instances K,
  // "HSDP" for the optimizer): the d * cp data-parallel ranks form K instances of d * cp / K
  // consecutive ranks each (the experts' edp ranks likewise, edp / K). Each instance shards the
  // optimizer states, master weights and gradient reduction over its own ranks; a gradient is
  // reduce-scattered within the instance, its shard all-reduced across the K instances (one
  // rank of each, at the same place), and the updated weights all-gathered within the
  // instance. K = 1: the ordinary distributed optimizer. Needs the distributed optimizer, K | d
  // cp (and K | edp); with Megatron-FSDP it is HSDP (fsdp_outer, core/plan_rules.h).
  int64_t optimizer_instances = 1;
  // Megatron-FSDP's sharding strategy (kOff: not used). Megatron-Core runs it with the
  // distributed optimizer on, at p = 1 (core/plan_rules.h); with sharded gradients it reduces
  // them in every microbatch's backward pass, and with sharded weights it gathers them in every
  // pass, both behind the passes' compute where they fit (planner/cost_model.h).
  FsdpSharding fsdp = FsdpSharding::kOff;
  // Megatron-FSDP with K > 1 optimizer instances (HSDP, --outer-dp-sharding-strategy): each
  // instance shards the gradients and weights over its d * cp / K ranks as `fsdp` says, and
  // across the instances kNoShard (HSDP) keeps K copies of those shards, all-reducing the
  // gradient shards across them once an iteration; kOptim (HFSDP, with optim_grads_params) also
  // shards the optimizer states across them (over all d * cp ranks), reduce-scattering the
  // gradient shards and all-gathering the updated weights across the instances at the
  // optimizer step. Every collective across the instances is once an iteration.
  FsdpSharding fsdp_outer = FsdpSharding::kNoShard;
  bool overlap_grad_reduce = false;  // --overlap-grad-reduce
  bool fp32_grad_reduce = true;      // grads kept and reduced in fp32 (Megatron's bf16 default)
  bool scatter_gather_p2p = true;    // SC'21 scatter/gather optimisation across nodes
  // Weight-gradient GEMMs accumulate straight into the main gradient buffer
  // (--gradient-accumulation-fusion, Megatron's default since 2022); off, each microbatch
  // adds its gradients to the buffer in a separate pass.
  bool gradient_accumulation_fusion = true;
  // Megatron-Core's overlaps that are settings (all off by default, as there):
  // --tp-comm-overlap hides the sequence-parallel all-gathers and reduce-scatters behind the
  // GEMMs they feed or drain (Transformer Engine's chunked GEMMs; needs sequence parallelism);
  // --overlap-param-gather hides the distributed optimizer's parameter all-gather behind the
  // next iteration's forward pass, all but its first bucket.
  bool tp_comm_overlap = false;
  bool overlap_param_gather = false;
  // --overlap-moe-expert-parallel-comm (Megatron-Core's "combined 1F1B", after DeepSeek-V3's
  // DualPipe): in the steady state the forward pass of one microbatch and the backward pass of
  // another run as one step, each one's expert all-to-alls behind the other's kernels. Needs
  // ep > 1, no full recompute, and with p > 1 the interleaved schedule; one more microbatch
  // warms up. Priced and scheduled; ptdp run executes the schedule without the overlap.
  bool overlap_moe_ep_comm = false;
  // Megatron-Core overlaps the interleaved schedule's steady-state send/receive with the next
  // chunk's compute (on by default there; --no-overlap-p2p-communication turns it off). Off in
  // a plan built by hand, as in SC'21's Megatron; the command line turns it on.
  bool overlap_p2p_comm = false;
  // FP8 GEMMs (--fp8-format hybrid, Transformer Engine): priced only; ptdp run accepts the plan
  // and runs its GEMMs in the run's precision, saying so.
  bool fp8 = false;
  // Optional uneven split: layers on each pipeline rank (size p, sums to num_layers).
  std::vector<int64_t> layers_per_stage;
  // Optional layout of every model chunk (Megatron-Core's --pipeline-model-parallel-layout):
  // the layers of each, in global-stage order (chunk c of rank r is entry c * p + r; size p * v;
  // a chunk may hold none, as one of only the embedding or only the loss). Given, it sets the
  // stages' layers and layers_per_stage stays empty.
  std::vector<int64_t> layers_per_chunk;

  bool shards_gradients() const { return fsdp >= FsdpSharding::kOptimGrads; }
  // The context-parallel ranks an all-to-all of heads spans (Ulysses: cp; a2a+p2p: A; else 1)
  // and those a ring of K and V blocks goes round (p2p: cp; a2a+p2p: cp / A; else 1).
  int64_t cp_a2a_size() const {
    if (context_parallel <= 1) return 1;
    if (cp_comm == CpComm::kA2A) return context_parallel;
    return cp_comm == CpComm::kA2AP2P && hierarchical_cp > 0 ? hierarchical_cp : 1;
  }
  int64_t cp_ring_size() const {
    if (cp_comm != CpComm::kP2P && cp_comm != CpComm::kA2AP2P) return 1;
    return context_parallel / cp_a2a_size();
  }
  // The ranks over which the distributed optimizer shards the dense parameters' states (d * cp
  // / K) and the routed experts' (edp / K); 1 without it.
  // (Megatron-FSDP's HFSDP shards them over all d * cp, or edp, ranks.)
  int64_t optimizer_shards() const {
    if (!distributed_optimizer) return 1;
    return fsdp_outer == FsdpSharding::kOptim ? data_parallel * context_parallel : instance_ranks();
  }
  int64_t expert_optimizer_shards() const {
    if (!distributed_optimizer) return 1;
    return fsdp_outer == FsdpSharding::kOptim ? expert_data_parallel() : expert_instance_ranks();
  }
  // The ranks of one optimizer instance: d * cp / K (the experts': edp / K); Megatron-FSDP's
  // gradient and weight shards are over these.
  // (K < 1, which the plan rules refuse, counts as one instance.)
  int64_t instances() const { return optimizer_instances > 0 ? optimizer_instances : 1; }
  int64_t instance_ranks() const { return data_parallel * context_parallel / instances(); }
  int64_t expert_instance_ranks() const { return expert_data_parallel() / instances(); }
  bool shards_weights() const { return fsdp == FsdpSharding::kOptimGradsParams; }

  int64_t num_gpus() const {
    return tensor_parallel * context_parallel * pipeline_parallel * data_parallel;
  }
  int64_t expert_tp() const {
    return expert_tensor_parallel > 0 ? expert_tensor_parallel : tensor_parallel;
  }
  // Data-parallel replicas of each expert: t * cp * d / (etp * ep).
  int64_t expert_data_parallel() const {
    return tensor_parallel * context_parallel * data_parallel / (expert_tp() * expert_parallel);
  }
  int64_t num_microbatches() const {
    return global_batch_size / (data_parallel * micro_batch_size);
  }
  // The interleaved schedule's microbatch group N (microbatch_group, or p when not given).
  int64_t microbatch_group_size() const {
    return microbatch_group > 0 ? microbatch_group : pipeline_parallel;
  }
  // Layers held by pipeline rank r (all its virtual chunks together).
  int64_t layers_on_stage(const ModelSpec& m, int64_t r) const;
  // Layers of chunk c of pipeline rank r: layers_per_chunk's, else the rank's split evenly.
  int64_t layers_in_chunk(const ModelSpec& m, int64_t r, int64_t c) const;
  // The most layers any model chunk holds.
  int64_t most_layers_in_a_chunk(const ModelSpec& m) const;
  // Of a model chunk of `chunk_layers` layers, how many are fully recomputed (the first ones).
  int64_t recomputed_layers(int64_t chunk_layers) const {
    if (recompute != Recompute::kFull) return 0;
    return recompute_layers > 0 && recompute_layers < chunk_layers ? recompute_layers
                                                                   : chunk_layers;
  }
  // The first layer (from 0) of chunk c of pipeline rank r (global stage c * p + r).
  int64_t first_layer_of_chunk(const ModelSpec& m, int64_t r, int64_t c) const;

  // Throws InputError naming the Megatron flag when the plan cannot run this model: the first
  // rule of core/plan_rules.h it breaks (check_plan).
  void validate(const ModelSpec& m) const;
  // The Megatron-LM launch flags for this plan (parallelism, batch, recompute, ...).
  // Megatron-LM's flags for this plan of `m`, trained in `precision` (--bf16 or --fp16; fp32,
  // Megatron's default, has no flag).
  std::string megatron_flags(const ModelSpec& m, DType precision = DType::kF32) const;
  // ptdp's own flags for what the Megatron-LM line cannot say (16-bit gradient reduction, no
  // scatter/gather of pipeline transfers, a schedule other than the one v implies), empty when
  // the plan has none; with the line, the job commands read back this very plan.
  std::string ptdp_flags() const;
};

// Megatron-Core refuses FP8's delayed scaling (its default --fp8-recipe) with moe_act or
// layernorm recomputation (TransformerConfig; Transformer Engine 2.6 or newer runs them with
// current scaling): such a plan's Megatron-LM line carries --fp8-recipe tensorwise.
bool fp8_needs_current_scaling(const ParallelPlan& p);

// Megatron-LM's uneven split: --decoder-first-pipeline-num-layers and
// --decoder-last-pipeline-num-layers (0: not given) set the first and last stages, and the
// other stages share the remaining layers evenly. Throws InputError naming the flag when the
// remainder does not divide, a stage would be empty, or p is too small for the flags given.
std::vector<int64_t> megatron_stage_split(int64_t num_layers, int64_t p, int64_t first,
                                          int64_t last);

// Megatron-Core's --pipeline-model-parallel-layout: the stages (p * v of them, split by '|')
// list their layers, 't' a transformer layer, 'E' the embedding (first) and 'L' the loss (last);
// "(...)*n" and "x*n" repeat, commas are only for reading. The layers of each stage in
// global-stage order, v = stages / p, and the multi-token prediction layers ('m'); throws
// InputError naming the flag when the string is malformed, has no whole number of stages per
// rank, places E or L elsewhere, or places an 'm' other than after the layers of the last stage
// (Megatron-Core also allows a standalone MTP chunk on an earlier rank; ptdp does not).
struct PipelineLayout {
  std::vector<int64_t> layers_per_chunk;
  int64_t virtual_stages = 1;
  int64_t mtp_layers = 0;
};
PipelineLayout parse_pipeline_layout(const std::string& layout, int64_t pipeline_parallel);
// The layout string of per-chunk layer counts, runs of equal stages written "(tt|)*n", with
// mtp_layers 'm's before the loss.
std::string pipeline_layout_string(const std::vector<int64_t>& layers_per_chunk,
                                   int64_t mtp_layers = 0);

// Megatron-LM's rank placement: tensor-parallel innermost, then context-parallel, then
// data-parallel, then pipeline-parallel (Megatron-Core's default order "tp-cp-ep-dp-pp"; the
// expert groups are carved from the same t * cp * d ranks of a stage).
inline int64_t megatron_global_rank(int64_t t, int64_t d, int64_t tp, int64_t dp, int64_t pp) {
  return tp + t * (dp + d * pp);
}
inline int64_t megatron_global_rank(int64_t t, int64_t cp, int64_t d, int64_t tp, int64_t cpr,
                                    int64_t dp, int64_t pp) {
  return tp + t * (cpr + cp * (dp + d * pp));
}

ParallelPlan plan_from_json(const nlohmann::json& j);
nlohmann::json to_json(const ParallelPlan& p);

}  // namespace ptdp
