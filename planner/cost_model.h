// CostModel: the analytic (closed-form) prediction of one PTD-P configuration.
//
// Every op of the layer op list (core/layer_ops.h) is priced with the hardware profile; stage
// times are sums of op times; the pipeline schedule, point-to-point transfers, the
// data-parallel gradient reduction and the optimizer step are added in closed form.
// Not thread-safe (it memoises op-list prices): give each thread its own CostModel.
#pragma once

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "core/cluster_spec.h"
#include "core/hardware_profile.h"
#include "core/layer_ops.h"
#include "core/model_spec.h"
#include "core/parallel_plan.h"
#include "planner/comm_model.h"

namespace ptdp {

struct ScheduleSpec;  // core/schedule.h

// Bytes on the most loaded GPU.
struct MemoryBreakdown {
  double weights = 0;
  double gradients = 0;
  double optimizer = 0;
  // The routed experts' part of weights, gradients and optimizer state (MoE models); the rest
  // is dense (attention, router, shared experts, embeddings).
  double expert_weights = 0;
  double expert_gradients = 0;
  double expert_optimizer = 0;
  double activations = 0;
  double buffers = 0;  // logits, communication buffers
  double peak = 0;
  double capacity = 0;
  bool fits = false;
};

// Seconds of one iteration; the parts add up to the iteration time.
struct TimeBreakdown {
  double compute = 0;    // forward and backward math on the slowest stage
  double recompute = 0;  // forward math redone for activation recomputation
  double tp_comm = 0;    // exposed tensor-/sequence-parallel collectives
  double cp_comm = 0;    // exposed context-parallel exchanges (what attention does not hide)
  double ep_comm = 0;    // MoE all-to-alls and expert-tensor-parallel gathers/scatters
  double pp_comm = 0;    // exposed pipeline point-to-point transfers
  double dp_comm = 0;    // exposed data-parallel gradient (and parameter) collectives
  double bubble = 0;     // pipeline fill and drain
  double optimizer = 0;  // optimizer step
};

// Time of one microbatch's pass on one stage, split by what it waits on.
struct PassTime {
  double compute = 0;  // GEMMs and memory-bound kernels
  double tp_comm = 0;  // tensor-parallel collectives (not overlapped)
  double cp_comm = 0;  // context-parallel exchanges: what attention does not hide of the ring's
  double ep_comm = 0;  // expert all-to-alls and the expert-tensor-parallel gathers/scatters
  // Bytes on the wire behind cp_comm and ep_comm, for the simulator's flows: what each rank
  // sends of its context-parallel exchanges (all its ring steps, hidden or not, or its share of
  // an all-gather or all-to-all), and each rank's expert all-to-all buffers (1/ep of each
  // stays, the rest goes to the other members).
  double cp_bytes = 0, ep_bytes = 0;
  // Megatron-FSDP's collectives of the pass (sharded gradients or weights): what its compute
  // does not hide of the layers' weight all-gathers and gradient reduce-scatters
  // (CostModel::add_fsdp_pass_comm).
  double dp_comm = 0;
  double comm() const { return tp_comm + cp_comm + ep_comm + dp_comm; }
  double total() const { return compute + comm(); }
};

// One microbatch on one model chunk (a pipeline rank holds v chunks). `weight_grad` is the
// part of `backward` that zero-bubble schedules defer: the layers' weight-gradient GEMMs (not the
// embedding's, the head's or the MTP modules', which ptdp run keeps in the input pass).
struct ChunkTime {
  int64_t layers = 0;
  PassTime forward, backward, recompute, weight_grad;
  // Megatron-FSDP's exposed collectives of one microbatch through the span (PassTime::dp_comm).
  double dp_comm() const { return forward.dp_comm + backward.dp_comm + recompute.dp_comm; }
};

// One microbatch on one pipeline stage: all its chunks' layers, priced as one chunk holding
// them (CostModel::layer_span_time prices both).
struct StageTime : ChunkTime {
  double per_microbatch() const { return forward.total() + backward.total() + recompute.total(); }
};

struct Prediction {
  double iteration_time_s = 0;
  double tokens_per_s = 0;
  double model_tflops_per_gpu = 0;  // without recomputation, attention pairs causally
  // The same counting every attention pair (SC'21's equation 3): the convention of published
  // TFLOP/s that do not halve the attention for its causal mask (docs/validation.md).
  double model_tflops_per_gpu_all_pairs = 0;
  double hardware_tflops_per_gpu = 0;  // with recomputation
  double mfu = 0;
  double model_flops = 0;            // per iteration, all GPUs
  double model_flops_all_pairs = 0;  // per iteration, all GPUs
  double hardware_flops = 0;         // per iteration, all GPUs
  double p2p_time_s = 0;             // one activation transfer between stages
  double dp_time_s = 0;              // one full data-parallel gradient reduction (before overlap)
  DType precision = DType::kBF16;    // of weights and activations (the profile's)
  MemoryBreakdown memory;
  TimeBreakdown breakdown;
  std::vector<StageTime> stages;  // per pipeline rank, per microbatch (all its chunks)
};

class CostModel {
 public:
  CostModel(const ModelSpec& m, const ClusterSpec& c, const HardwareProfile& h);

  // The plan must be valid for the model (ParallelPlan::validate).
  Prediction predict(const ParallelPlan& p) const;
  MemoryBreakdown memory(const ParallelPlan& p) const;

  double op_time(const Op& op, const ParallelPlan& p) const;
  // The fraction of its operands an op finds in the last-level cache under plan p, from the
  // profile's cache model (HardwareProfile::cache_hit) and what a rank of the largest stage
  // touches between two uses of them: its weights, gradients, stored activations and transfer
  // buffers (not the optimizer state, which only the step touches). 1 without a cache model.
  double cache_hit(const ParallelPlan& p) const;
  // Each op's time on the critical path of its pass: op_time, except that a list the host
  // issues slower than the device runs it takes the host's time (stretch_to_host), and with
  // --tp-comm-overlap a sequence-parallel collective shows only what its GEMM cannot hide and
  // that GEMM runs in t chunks.
  std::vector<double> exposed_times(const std::vector<Op>& ops, const ParallelPlan& p) const;
  double gemm_time(const Op& op) const;
  double memory_time(double bytes) const;
  // A memory-bound op of the list: its kernel family's efficiency where the profile measured it
  // (HardwareProfile::memory_efficiency), else hbm_efficiency.
  double memory_time(const Op& op) const;
  // The op list's shape for a plan on this profile's device (its activation element type).
  LayerShape priced_layer_shape(const ParallelPlan& p) const;
  ChunkTime chunk_time(const ParallelPlan& p, int64_t rank, int64_t chunk) const;
  // Bytes of one activation (or its gradient) sent between pipeline stages.
  double activation_message_bytes(const ParallelPlan& p) const;
  // Data-parallel reduction of `params` dense parameters' gradients over the d * cp ranks
  // (reduce-scatter + all-gather of the weights with the distributed optimizer, in K instances
  // with sharded_gradient_sync_time), not overlapped.
  // With Megatron-FSDP's sharded gradients, which are reduced in every microbatch's backward
  // pass (add_fsdp_pass_comm), what is left is the all-gather of the updated weights: all of
  // them, or with sharded weights those outside the layer units (non_layer_parameters_on_stage),
  // within the instance, and with HSDP the collectives across the instances.
  double gradient_sync_time(const ParallelPlan& p, double params) const;
  // The same for `params` expert parameters, over the expert-data-parallel group.
  double expert_gradient_sync_time(const ParallelPlan& p, double params) const;
  // The distributed optimizer's synchronisation of `params` parameters: reduce-scatter within
  // an optimizer instance, all-reduce of each shard across the instances (K > 1), all-gather of
  // the updated weights within the instance.
  double sharded_gradient_sync_time(const ParallelPlan& p, double params, const GroupSpan& instance,
                                    const GroupSpan& replicas) const;
  // Megatron-FSDP's HSDP, once an iteration across the K instances: the all-reduce of each
  // rank's gradient shard (outer no_shard), or its reduce-scatter and the all-gather of the
  // updated weights' shard (outer optim). 0 with one instance.
  double fsdp_outer_sync_time(const ParallelPlan& p, double params, const GroupSpan& instance,
                              const GroupSpan& replicas) const;
  // What --overlap-param-gather hides of gradient_sync_time: the distributed optimizer's
  // parameter all-gather, bucket by bucket ahead of the next iteration's first forward pass
  // (`forward_s`, one microbatch through the stage), all but the first of `layers` buckets.
  double hidden_param_gather(const ParallelPlan& p, double params, int64_t layers,
                             double forward_s) const;
  // What a stage holding `params` parameters (`expert_params` of them routed experts) exposes of
  // its data-parallel gradient synchronisation: the whole of it less what --overlap-param-gather
  // and --overlap-grad-reduce hide under the stage's passes (`s`, one microbatch through it).
  // The embedding sync is not included.
  double exposed_gradient_sync_time(const ParallelPlan& p, double params, double expert_params,
                                    const StageTime& s) const;
  // Megatron-FSDP with sharded gradients (p = 1): the exposed part of each microbatch's
  // collectives, set into t's forward and backward passes (dp_comm). Each transformer layer is a
  // unit: with sharded weights its weights are all-gathered before its forward pass and again
  // before its backward pass (one gather serves the recompute and the backward), and every
  // gradient is reduce-scattered as its layer's backward pass ends; the next units' gathers are
  // prefetched. A pass exposes its first unit's gather and its last unit's reduction, and what
  // the rest of its collectives take beyond the rest of its compute. A no-op for other plans.
  void add_fsdp_pass_comm(const ParallelPlan& p, int64_t r, ChunkTime& t) const;
  // Megatron-FSDP's parameters outside the layer units on stage r: the embedding, the final norm
  // and the output layer, whose weights stay whole (gathered once an iteration) and whose
  // gradients are sharded and reduce-scattered with the units'.
  double non_layer_parameters_on_stage(const ParallelPlan& p, int64_t r) const;
  // All-reduce of the tied word-embedding gradients between first and last stage (0 if none).
  double embedding_sync_time(const ParallelPlan& p) const;
  // With sequence parallelism, the gradients of the parameters every tensor-parallel rank holds
  // whole (norms, row-parallel biases, routers, learned positions) are partial sums over the
  // rank's slice of the sequence: one all-reduce over the tensor-parallel group on stage r
  // before the step (Megatron's allreduce of the layernorm gradients; runtime/grad_sync.cc).
  double sequence_parallel_grad_sync_time(const ParallelPlan& p, int64_t r) const;
  // Optimizer step over `params` dense and `expert_params` expert parameters (1/(d cp) and
  // 1/edp shards with the distributed optimizer).
  double optimizer_time(const ParallelPlan& p, double params, double expert_params = 0) const;
  // Parameters held by one rank of pipeline stage r: all of them, and the routed experts' part.
  double parameters_on_stage(const ParallelPlan& p, int64_t r) const;
  // Of those, chunk c's: its layers', and the embedding's (first chunk) or the output side's
  // (last chunk: the final norm, output layer, MTP modules).
  double parameters_in_chunk(const ParallelPlan& p, int64_t r, int64_t c) const;
  double expert_parameters_on_stage(const ParallelPlan& p, int64_t r) const;
  // MoE layers among the layers of pipeline rank r's model chunk c (0 for a dense model).
  int64_t moe_layers_in_chunk(const ParallelPlan& p, int64_t r, int64_t c) const;
  int64_t moe_layers_on_stage(const ParallelPlan& p, int64_t r) const;

  const ModelSpec& model() const { return model_; }
  const ClusterSpec& cluster() const { return cluster_; }
  const HardwareProfile& profile() const { return profile_; }
  const CommModel& comm() const { return comm_; }
  // The elements the data-parallel collectives carry: weights (the distributed optimizer's
  // all-gather) and gradients (fp32 main gradients, or 16-bit ones without --fp32-grad-reduce).
  DType weight_dtype() const;
  DType gradient_dtype(const ParallelPlan& p) const;

 private:
  struct ShapeTimes {  // per microbatch, one layer / the embedding / the LM head
    PassTime layer_f, layer_b, layer_r, embed_f, embed_b, head_f, head_b;
    PassTime layer_w;                     // the weight-gradient part of a layer's backward pass
    PassTime moe_f, moe_b, moe_r, moe_w;  // one MoE layer
    // One multi-token prediction module besides its transformer layer: its embedding lookup,
    // norms and projection, and its final norm, output layer and loss (and their FLOPs).
    PassTime mtp_f, mtp_b;
    double mtp_flops = 0;
    double layer_flops = 0, layer_recompute_flops = 0, embed_flops = 0, head_flops = 0;
    double moe_flops = 0, moe_recompute_flops = 0;  // at balanced routing
    // Of the recompute FLOPs, the recompute lists' (what block recompute runs on some layers
    // only); the rest is the backward lists' own (flash attention's scores).
    double layer_list_recompute_flops = 0, moe_list_recompute_flops = 0;
    // Model FLOPs, whatever kernel runs the attention: with its GEMMs over (query, key) pairs
    // at the causal half (Megatron-LM's convention), and at all s x s pairs (SC'21's equation
    // 3's).
    double layer_model_flops = 0, moe_model_flops = 0;
    double layer_model_flops_all_pairs = 0, moe_model_flops_all_pairs = 0;
  };
  const ShapeTimes& shape_times(const ParallelPlan& p) const;
  // One microbatch through `layers` transformer layers (`moe` of them MoE layers), plus the
  // embedding and/or the LM head: a model chunk (chunk_time) or a whole stage (stage_times).
  // `recomputed` of the span's layers (`recomputed_moe` of them MoE layers) run the recompute
  // list (all of them but with block recompute, RecomputedLayers).
  static ChunkTime layer_span_time(const ShapeTimes& st, int64_t layers, int64_t moe,
                                   int64_t recomputed, int64_t recomputed_moe, bool embedding,
                                   bool head);
  // The multi-token prediction modules (ModelSpec::mtp_num_layers) on the last model chunk: their
  // layers (the decoder's last layer's kind) and the rest of each (ShapeTimes::mtp_*), added to
  // the chunk's passes; Megatron-Core recomputes them with full uniform recomputation (not
  // block) and selective recomputation recomputes their layers as any.
  void add_mtp(ChunkTime& c, const ShapeTimes& st, const ParallelPlan& p) const;
  // op_time and exposed_times at a given cache_hit(p); warm_op_time: as the profile measured
  // (or estimated) the op, its operands in cache.
  double op_time(const Op& op, const ParallelPlan& p, double hit) const;
  double warm_op_time(const Op& op, const ParallelPlan& p) const;
  // A fused kernel's op as the profile measured it (HardwareProfile::fused_ops); negative when
  // the op is not fused or was not measured.
  double fused_op_time(const Op& op) const;
  // fp32 training (a profile whose activations are fp32: ptdp run's precision, as calibrate
  // measures it): fp32 weights that are their own master copy, fp32 activations and logits.
  bool fp32_training() const { return profile_.activation_dtype == DType::kF32; }
  // The parameters outside the layers on stage r: the embedding (first stage), and the final
  // norm with the output layer or the tied word embedding's copy (last stage).
  struct OuterModules {
    double embedding = 0, output = 0;
  };
  OuterModules outer_modules(const ParallelPlan& p, int64_t r) const;
  // Of a stage's `params` dense parameters, those whose weights the distributed optimizer
  // all-gathers once an iteration: all, or with Megatron-FSDP's sharded weights (p = 1) the
  // ones outside the layer units.
  double iteration_gathered_parameters(const ParallelPlan& p, double params) const;
  double weight_bytes() const;           // per parameter: 2 (bf16), or 4
  double optimizer_state_bytes() const;  // per parameter: 12 (master, m, v), or 8 (m, v)
  std::vector<double> exposed_times(const std::vector<Op>& ops, const ParallelPlan& p,
                                    double hit) const;
  // With measured host issue times (HardwareProfile::host_op_us): where the host takes longer
  // to issue the list's ops than the device to run them, each op's device time stretched by
  // that ratio (the device waits for the host in proportion).
  void stretch_to_host(const std::vector<Op>& ops, std::vector<double>& time) const;
  // Prices a pass; FLOPs of kRecompute ops go to `recompute_flops` when given.
  PassTime price(const std::vector<Op>& ops, const ParallelPlan& p, double hit, double* flops,
                 PassTime* weight_grad = nullptr, double* recompute_flops = nullptr) const;
  std::vector<StageTime> stage_times(const ParallelPlan& p, const ShapeTimes& st) const;

  ModelSpec model_;
  ClusterSpec cluster_;
  HardwareProfile profile_;
  CommModel comm_;
  mutable std::map<std::tuple<int64_t, int64_t, bool, int, int64_t, int64_t, int64_t, double>,
                   ShapeTimes>
      cache_;
  // MoE layers per model chunk of the last (p, v, split, layout) asked about.
  const std::vector<int64_t>& moe_chunks(const ParallelPlan& p) const;
  mutable int64_t moe_key_p_ = 0, moe_key_v_ = 0;
  mutable std::vector<int64_t> moe_key_split_, moe_key_chunks_, moe_chunks_;
  // A layer's parameters on one rank (dense, MoE without its experts, one MoE layer's experts)
  // at the last (t, ep, etp) asked about: memory() asks for each stage of every plan priced.
  struct LayerParameters {
    int64_t t = 0, ep = 0, etp = 0;
    double dense = 0, moe = 0, experts = 0;
  };
  const LayerParameters& layer_parameters(const ParallelPlan& p) const;
  mutable LayerParameters layer_parameters_;
};

// Bytes per parameter of the gradients kept and reduced: 4 with fp32 gradient reduction, 2
// with 16-bit (the main-gradient width of core/layer_ops.cc's layer_shape, so the op list and
// the cost model agree).
double gradient_bytes_per_parameter(const ParallelPlan& p);

// With --overlap-grad-reduce the gradient buckets are reduced while the last microbatch's
// backward pass runs; the final bucket (about one layer's gradients of the stage's `layers`)
// cannot be hidden. `sync_time_s` is the whole reduction (CostModel::gradient_sync_time).
double last_gradient_bucket_time(double sync_time_s, int64_t layers);

// TFLOP/s per GPU of `flops` (per iteration, all GPUs) done in `iteration_s` on `gpus` GPUs.
double tflops_per_gpu(double flops, double iteration_s, int64_t gpus);

// Tokens per second of an iteration of `iteration_s` (global batch x sequence length).
double tokens_per_second(const ModelSpec& m, const ParallelPlan& p, double iteration_s);

// The token load of the busiest expert-parallel rank, as a multiple of its fair share, that
// MoE layers are priced at: dropless routing with Megatron-Core's load balancing is assumed to
// leave the busiest rank 10% over the mean (kDroplessExpertLoad); a capacity factor caps it.
// Without expert parallelism (ep = 1) a rank holds every expert and computes every routed
// token, whichever experts they chose: its load is the mean, 1 (less a capacity factor's drops).
// ModelSpec::moe_expert_load (--moe-expert-load, what `ptdp reconcile` measured) replaces the
// assumption, at most ep.
inline constexpr double kDroplessExpertLoad = 1.1;
double expert_load(const ModelSpec& m, int64_t expert_parallel);

// Whether the last pipeline stage runs each microbatch's backward pass right after its forward
// pass (1F1B and ZB-H1 without interleaving or combined passes), so that a microbatch's logits,
// freed by the LM head's backward pass, never meet another microbatch's layer backward pass.
// Otherwise (GPipe, interleaving, --overlap-moe-expert-parallel-comm) they can.
bool logits_freed_before_layer_backward(const ParallelPlan& p);

// In-flight microbatch-chunks whose activations pipeline rank r holds at its peak, and the
// number of layers in each (Megatron's warm-up counts; docs/cost_model.md).
double inflight_layer_activations(const ParallelPlan& p, int64_t r, int64_t layers_on_stage);

// With --overlap-moe-expert-parallel-comm, the combined steps (a forward and a backward of
// another microbatch run as one) of pipeline rank r: its microbatch-chunks after the warm-up.
double combined_steps(const ParallelPlan& p, int64_t r);

// The layers of a model chunk (or of a pipeline rank's chunks together) whose recompute list
// runs before their backward pass, and how many of those are MoE layers: every layer, but with
// block recompute (ParallelPlan::recompute_layers) the first N of each chunk.
struct RecomputedLayers {
  int64_t layers = 0, moe = 0;
};
RecomputedLayers recomputed_in_chunk(const ModelSpec& m, const ParallelPlan& p, int64_t r,
                                     int64_t c);
RecomputedLayers recomputed_on_stage(const ModelSpec& m, const ParallelPlan& p, int64_t r);

// MoE layers in each model chunk, in global-stage order (chunk c of rank r is global stage
// c p + r; chunks hold consecutive layers in that order). Empty for a dense model.
std::vector<int64_t> moe_layers_per_chunk(const ModelSpec& m, const ParallelPlan& p);

// Activation memory of a plan's pipeline stages, for activations of one element type (16-bit
// on GPUs as the memory model prices them, fp32 in ptdp run on CPU ranks). It keeps references:
// the model, the plan and `moe_chunks` (moe_layers_per_chunk's, as CostModel::moe_chunks keeps
// them: the search builds this for every plan it prices) must outlive it.
class ActivationMemory {
 public:
  ActivationMemory(const ModelSpec& m, const ParallelPlan& p, DType element,
                   const std::vector<int64_t>& moe_chunks);
  // What pipeline rank r holds at its peak: the in-flight microbatches' layer activations
  // (Korthikanti et al. 2022), the layer being recomputed, a layer's backward working set
  // (its activations' gradients), and on the first stage the embedding's outputs.
  double on_stage(int64_t r) const;
  // Its transient part: what one layer's backward pass holds for a while beside what the
  // in-flight microbatches keep (the layer being recomputed and layer_backward_working_bytes).
  double transient_on_stage(int64_t r) const;
  // What `logits` bytes on stage r (the last one's, freed by the LM head's backward pass) add to
  // on_stage(r): what exceeds the transient part where they never meet it
  // (logits_freed_before_layer_backward), else all of them.
  double logits_beyond_transient(int64_t r, double logits) const;
  // Send and receive buffers of the pipeline transfers (0 without pipelining).
  double p2p_buffers() const;

 private:
  // The other part: what the in-flight microbatches keep, and the first stage's embedding
  // outputs.
  double kept_on_stage(int64_t r) const;
  // kept_on_stage for a pipeline layout under the interleaved schedule.
  double kept_in_chunks(int64_t r, const ScheduleSpec& spec) const;

  const ModelSpec& m_;
  const ParallelPlan& p_;
  double element_, per_layer_, per_moe_layer_, working_layer_, boundary_;
  // What one multi-token prediction module keeps per microbatch (its layer and the inputs of its
  // norms, projection and head), 0 without them.
  double mtp_module_ = 0;
  // Block recompute: a layer that is not recomputed keeps its whole activations.
  double kept_layer_ = 0, kept_moe_layer_ = 0;
  double backward_workspace_ = 0;           // layer_backward_working_bytes, held during a backward
  const std::vector<int64_t>& moe_chunks_;  // MoE layers per model chunk (empty: dense)
};

}  // namespace ptdp
