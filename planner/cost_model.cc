#include "planner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "core/schedule.h"
#include "core/units.h"
#include "planner/op_breakdown.h"

namespace ptdp {
namespace {

constexpr double kWeightBytes = 2.0;      // 16-bit model weights
constexpr double kOptimizerBytes = 12.0;  // fp32 master weights, Adam m and v
// fp32 training (ptdp run's precision, on a device whose calibrated profile says fp32
// activations): the weights are their own master copy, so Adam keeps m and v only.
constexpr double kFp32WeightBytes = 4.0;
constexpr double kFp32OptimizerBytes = 8.0;
constexpr double kUsableMemory = 0.95;  // CUDA context and allocator fragmentation keep the rest
// Megatron-FSDP's prefetch and gradient units in flight: kFsdpPrefetchElements and
// kFsdpGradientUnitsInFlight (core/parallel_plan.h).

// The GEMMs Transformer Engine runs in FP8 (--fp8-format): the layers' linear GEMMs and the
// experts'; the attention core, the router and the LM head stay in 16 bits.
bool is_fp8_gemm(OpId id) {
  const OpFamily f = op_family(id);
  return f == OpFamily::kAttentionGemm || f == OpFamily::kMlpGemm || f == OpFamily::kExpertGemm;
}

// The attention core's ops (op_family's kAttentionCore, whose rotary embedding is not part of
// a ring block's work).
bool is_attention_core(OpId id) {
  return op_family(id) == OpFamily::kAttentionCore && id != OpId::kRotaryEmbedding &&
         id != OpId::kRotaryEmbeddingBackward;
}

// Context parallelism's ring (of cp ranks, or a2a+p2p's B groups): the cp - 1 block transfers
// of a pass overlap the attention of the blocks already there (cp blocks of attention, each
// 1/cp of the core's time), so a step shows only what its transfer takes beyond one block's
// attention. (a2a+p2p's all-to-alls are not hidden.)
void hide_ring_exchanges(const std::vector<Op>& ops, int64_t cp, std::vector<double>& time) {
  double core = 0;
  for (size_t i = 0; i < ops.size(); ++i)
    if (is_attention_core(ops[i].id)) core += time[i];
  const double per_block = core / static_cast<double>(cp);
  for (size_t i = 0; i < ops.size(); ++i)
    if ((ops[i].id == OpId::kCpKvExchange || ops[i].id == OpId::kCpKvExchangeBackward) &&
        ops[i].collective == Collective::kSendRecv)
      time[i] = std::max(0.0, time[i] - per_block);
}

void add(PassTime& a, const PassTime& b, double times) {
  a.compute += b.compute * times;
  a.tp_comm += b.tp_comm * times;
  a.cp_comm += b.cp_comm * times;
  a.ep_comm += b.ep_comm * times;
  a.dp_comm += b.dp_comm * times;
  a.cp_bytes += b.cp_bytes * times;
  a.ep_bytes += b.ep_bytes * times;
}

int64_t moe_layers_of_stage(const std::vector<int64_t>& chunks, const ParallelPlan& p, int64_t r) {
  int64_t n = 0;
  if (chunks.empty()) return 0;
  for (int64_t c = 0; c < p.virtual_stages; ++c)
    n += chunks[static_cast<size_t>(c * p.pipeline_parallel + r)];
  return n;
}

// Gradient and optimizer shards of the dense parameters (over d * cp ranks) and the experts'
// (over the expert-data-parallel ranks) with the distributed optimizer.
// (With K optimizer instances, over the d * cp / K and edp / K ranks of an instance.)
double dense_shards(const ParallelPlan& p) {
  return static_cast<double>(p.optimizer_shards());
}
double expert_shards(const ParallelPlan& p) {
  return static_cast<double>(p.expert_optimizer_shards());
}

}  // namespace

std::vector<int64_t> moe_layers_per_chunk(const ModelSpec& m, const ParallelPlan& p) {
  std::vector<int64_t> out;
  if (!m.is_moe()) return out;
  const int64_t v = p.virtual_stages, pp = p.pipeline_parallel;
  out.resize(static_cast<size_t>(pp * v));
  int64_t first = 0;
  for (int64_t g = 0; g < pp * v; ++g) {
    const int64_t count = p.layers_in_chunk(m, g % pp, g / pp);
    out[static_cast<size_t>(g)] = m.moe_layers_in(first, count);
    first += count;
  }
  return out;
}

RecomputedLayers recomputed_in_chunk(const ModelSpec& m, const ParallelPlan& p, int64_t r,
                                     int64_t c) {
  const int64_t layers = p.layers_in_chunk(m, r, c);
  const int64_t n = p.recompute == Recompute::kFull ? p.recomputed_layers(layers) : layers;
  if (!m.is_moe()) return {n, 0};
  return {n, m.moe_layers_in(p.first_layer_of_chunk(m, r, c), n)};
}

RecomputedLayers recomputed_on_stage(const ModelSpec& m, const ParallelPlan& p, int64_t r) {
  RecomputedLayers total;
  for (int64_t c = 0; c < p.virtual_stages; ++c) {
    const RecomputedLayers one = recomputed_in_chunk(m, p, r, c);
    total.layers += one.layers;
    total.moe += one.moe;
  }
  return total;
}

double expert_load(const ModelSpec& m, int64_t expert_parallel) {
  if (!m.is_moe()) return 1.0;
  // One rank computes every kept token: all of them, or each expert's capacity at most. With
  // several, the load the model states (measured by a run), else the assumed one; the busiest
  // of ep ranks takes ep times the mean at most.
  const double stated = m.moe_expert_load > 0 ? m.moe_expert_load : kDroplessExpertLoad;
  const double busiest =
      expert_parallel > 1 ? std::min(stated, static_cast<double>(expert_parallel)) : 1.0;
  if (m.moe_capacity_factor > 0) return std::min(m.moe_capacity_factor, busiest);
  return busiest;
}

double gradient_bytes_per_parameter(const ParallelPlan& p) {
  return layer_shape(p).main_grad_bytes;
}

double last_gradient_bucket_time(double sync_time_s, int64_t layers) {
  return sync_time_s / std::max<double>(1.0, static_cast<double>(layers));
}

double tflops_per_gpu(double flops, double iteration_s, int64_t gpus) {
  return flops / (iteration_s * static_cast<double>(gpus)) / kTFLOP;
}

double tokens_per_second(const ModelSpec& m, const ParallelPlan& p, double iteration_s) {
  return static_cast<double>(p.global_batch_size * m.seq_length) / iteration_s;
}

ActivationMemory::ActivationMemory(const ModelSpec& m, const ParallelPlan& p, DType element,
                                   const std::vector<int64_t>& moe_chunks)
    : m_(m), p_(p), element_(static_cast<double>(dtype_bytes(element))), moe_chunks_(moe_chunks) {
  LayerShape shape = layer_shape(p);
  shape.activation_dtype = element;
  shape.expert_load = expert_load(m, p.expert_parallel);
  per_layer_ = layer_activation_bytes(m, shape);
  per_moe_layer_ = m.is_moe() ? moe_layer_activation_bytes(m, shape) : per_layer_;
  // The layer being recomputed holds what its recomputation rebuilds once: with full
  // recomputation its whole activations (its kept input counted again); with selective, what
  // the layer does not keep (its kept part is among the stage's layers already), so selective
  // recomputation never holds more than none.
  LayerShape full = shape;
  full.recompute = Recompute::kNone;
  const double dense_full = layer_activation_bytes(m, full);
  const double moe_full = m.is_moe() ? moe_layer_activation_bytes(m, full) : 0.0;
  if (p.recompute == Recompute::kFull)
    working_layer_ = m.is_moe() ? moe_full : dense_full;
  else if (p.recompute == Recompute::kSelective)
    working_layer_ =
        std::max(dense_full - per_layer_, m.is_moe() ? moe_full - per_moe_layer_ : 0.0);
  else
    working_layer_ = 0.0;
  if (p.recompute == Recompute::kFull && p.recompute_layers > 0) {
    kept_layer_ = layer_activation_bytes(m, full);
    kept_moe_layer_ = m.is_moe() ? moe_layer_activation_bytes(m, full) : kept_layer_;
  }
  // While a layer's backward pass runs, its activations' gradients (the larger of a dense and
  // an MoE layer's).
  backward_workspace_ = layer_backward_working_bytes(m, shape, false);
  if (m.is_moe())
    backward_workspace_ =
        std::max(backward_workspace_, layer_backward_working_bytes(m, shape, true));
  // One activation crossing a stage boundary ([b, s/cp, h], 1/t of it with sequence
  // parallelism).
  boundary_ = static_cast<double>(p.micro_batch_size * (m.seq_length / p.context_parallel)) *
              static_cast<double>(m.hidden_size) * element_ /
              (p.sequence_parallel ? static_cast<double>(p.tensor_parallel) : 1.0);
  if (m.mtp_num_layers > 0) {
    // Its layer (not recomputed with block recomputation, as Megatron-Core skips it there), and
    // the inputs of its embedding's and hidden state's norms, of eh_proj (both, 2h), of its final
    // norm and of the output layer: 6 h a token.
    const bool moe = m.mtp_layer_is_moe();
    const bool block = p.recompute == Recompute::kFull && p.recompute_layers > 0;
    const double layer =
        block ? (moe ? kept_moe_layer_ : kept_layer_) : (moe ? per_moe_layer_ : per_layer_);
    mtp_module_ = layer + 6.0 * boundary_;
  }
}

bool logits_freed_before_layer_backward(const ParallelPlan& p) {
  return (p.schedule == Schedule::k1F1B || p.schedule == Schedule::kZeroBubbleH1) &&
         p.virtual_stages == 1 && !p.overlap_moe_ep_comm;
}

double ActivationMemory::on_stage(int64_t r) const {
  return kept_on_stage(r) + transient_on_stage(r);
}

double ActivationMemory::logits_beyond_transient(int64_t r, double logits) const {
  return logits_freed_before_layer_backward(p_) ? std::max(0.0, logits - transient_on_stage(r))
                                                : logits;
}

double ActivationMemory::transient_on_stage(int64_t r) const {
  const int64_t layers = p_.layers_on_stage(m_, r);
  // (A stage of no decoder layers still runs the MTP modules' layers, if it is the last.)
  if (layers == 0 && !(r == p_.pipeline_parallel - 1 && m_.mtp_num_layers > 0)) return 0;
  double working = working_layer_;
  // Block recompute: a chunk recomputes its first layers after the backward pass has freed its
  // kept ones, so the layer being recomputed adds to the peak only where a chunk keeps none.
  if (p_.recompute == Recompute::kFull && p_.recompute_layers > 0 &&
      recomputed_on_stage(m_, p_, r).layers < layers)
    working = 0;
  return working + backward_workspace_;
}

double ActivationMemory::kept_on_stage(int64_t r) const {
  const int64_t layers = p_.layers_on_stage(m_, r);
  const ScheduleSpec spec = schedule_spec(p_, false);
  if (!p_.layers_per_chunk.empty() && spec.kind == Schedule::kInterleaved1F1B)
    return kept_in_chunks(r, spec);
  const double inflight = inflight_layer_activations(p_, r, layers);
  // Per layer: the stage's mix of dense and MoE layers.
  const double moe = static_cast<double>(moe_layers_of_stage(moe_chunks_, p_, r));
  double per_layer =
      layers > 0 ? ((static_cast<double>(layers) - moe) * per_layer_ + moe * per_moe_layer_) /
                       static_cast<double>(layers)
                 : per_layer_;
  if (p_.recompute == Recompute::kFull && p_.recompute_layers > 0 && layers > 0) {
    // Block recompute: each chunk's first N layers keep their inputs, the rest everything.
    const RecomputedLayers rec = recomputed_on_stage(m_, p_, r);
    const double rd = static_cast<double>(rec.layers - rec.moe), rm = static_cast<double>(rec.moe);
    const double kd = static_cast<double>(layers) - moe - rd, km = moe - rm;
    per_layer = (rd * per_layer_ + rm * per_moe_layer_ + kd * kept_layer_ + km * kept_moe_layer_) /
                static_cast<double>(layers);
  }
  double bytes = inflight * per_layer;
  if (r == p_.pipeline_parallel - 1 && m_.mtp_num_layers > 0) {
    // The multi-token prediction modules run in the last chunk: as many microbatches of them in
    // flight as of that chunk.
    std::vector<double> last(static_cast<size_t>(p_.virtual_stages), 0.0);
    last.back() = 1.0;
    const double held = spec.kind == Schedule::kInterleaved1F1B
                            ? interleaved_peak_in_flight(spec, r, last)
                            : inflight_layer_activations(p_, r, 1);
    bytes += held * static_cast<double>(m_.mtp_num_layers) * mtp_module_;
  }
  if (r == 0 && layers > 0)  // one boundary per microbatch-chunk in flight
    bytes +=
        inflight / static_cast<double>(layers) * static_cast<double>(p_.virtual_stages) * boundary_;
  return bytes;
}

double ActivationMemory::kept_in_chunks(int64_t r, const ScheduleSpec& spec) const {
  // A layout's chunks differ in layers, in their mix of dense and MoE layers and in what else
  // they hold (rank 0's boundaries, the last chunk's MTP modules): each chunk's bytes a
  // microbatch, and the most held at once along the rank's order.
  const bool block = p_.recompute == Recompute::kFull && p_.recompute_layers > 0;
  const bool boundaries = r == 0 && p_.layers_on_stage(m_, r) > 0;
  std::vector<double> bytes;
  for (int64_t c = 0; c < p_.virtual_stages; ++c) {
    const int64_t g = c * p_.pipeline_parallel + r;
    const double layers = static_cast<double>(p_.layers_in_chunk(m_, r, c));
    const double moe =
        moe_chunks_.empty() ? 0.0 : static_cast<double>(moe_chunks_[static_cast<size_t>(g)]);
    double b = (layers - moe) * per_layer_ + moe * per_moe_layer_;
    if (block && layers > 0) {  // the chunk's first N layers keep their inputs, the rest all
      const RecomputedLayers rec = recomputed_in_chunk(m_, p_, r, c);
      const double rd = static_cast<double>(rec.layers - rec.moe),
                   rm = static_cast<double>(rec.moe);
      b = rd * per_layer_ + rm * per_moe_layer_ + (layers - moe - rd) * kept_layer_ +
          (moe - rm) * kept_moe_layer_;
    }
    if (boundaries) b += boundary_;
    if (r == p_.pipeline_parallel - 1 && c == p_.virtual_stages - 1)
      b += static_cast<double>(m_.mtp_num_layers) * mtp_module_;
    bytes.push_back(b);
  }
  return interleaved_peak_in_flight(spec, r, bytes);
}

double ActivationMemory::p2p_buffers() const {
  return p_.pipeline_parallel > 1 ? 4.0 * boundary_ : 0.0;
}

double inflight_layer_activations(const ParallelPlan& p, int64_t r, int64_t layers_on_stage) {
  const double layers = static_cast<double>(layers_on_stage);
  ScheduleSpec s = schedule_spec(p, false);
  if (s.kind != Schedule::kInterleaved1F1B) s.virtual_stages = 1;  // one chunk of the stage
  if (p.schedule == Schedule::kZeroBubbleH1)
    // Every rank holds p microbatches until their weight-gradient passes (counted whole).
    return static_cast<double>(std::min(p.pipeline_parallel, s.microbatches)) * layers;
  if (s.kind == Schedule::kInterleaved1F1B && !p.layers_per_chunk.empty()) {
    // A layout's chunks differ: the most layers held at once along the rank's order.
    std::vector<double> weight;
    for (int64_t c = 0; c < s.virtual_stages; ++c)
      weight.push_back(static_cast<double>(
          p.layers_per_chunk.at(static_cast<size_t>(c * p.pipeline_parallel + r))));
    return interleaved_peak_in_flight(s, r, weight);
  }
  // The warm-up's forwards and the first steady-state one (Megatron's warm-up counts,
  // core/schedule.h), in model chunks of layers / v; GPipe holds all m.
  const int64_t chunks = std::min(warmup_forwards(s, r) + 1, s.microbatches * s.virtual_stages);
  return static_cast<double>(chunks) * layers / static_cast<double>(s.virtual_stages);
}

double combined_steps(const ParallelPlan& p, int64_t r) {
  if (!p.overlap_moe_ep_comm) return 0;
  const ScheduleSpec s = schedule_spec(p, false);
  return static_cast<double>(s.microbatches * s.virtual_stages - warmup_forwards(s, r));
}

CostModel::CostModel(const ModelSpec& m, const ClusterSpec& c, const HardwareProfile& h)
    : model_(m), cluster_(c), profile_(h), comm_(cluster_, profile_) {}

double CostModel::gemm_time(const Op& op) const {
  const double eff =
      profile_.gemm_efficiency(static_cast<double>(op.m), static_cast<double>(op.n),
                               static_cast<double>(op.k), static_cast<double>(op.batch));
  return op.flops() / (cluster_.gpu.peak_tflops_16bit * kTFLOP * eff) +
         profile_.kernel_gap_us * kMicrosecond;
}

double CostModel::memory_time(double bytes) const {
  return bytes / (cluster_.gpu.hbm_bandwidth_gbps * kGB * profile_.hbm_efficiency) +
         profile_.kernel_gap_us * kMicrosecond;
}

double CostModel::memory_time(const Op& op) const {
  const double eff = profile_.memory_efficiency_of(memory_family(op.id));
  auto fitted = [&](double bytes) {
    return bytes / (cluster_.gpu.hbm_bandwidth_gbps * kGB * eff) +
           profile_.kernel_gap_us * kMicrosecond;
  };
  const double t = fitted(op.bytes);
  if (profile_.memory_ops.empty()) return t;
  return t * profile_.memory_op_ratio(op.name(), op.bytes, fitted);
}

LayerShape CostModel::priced_layer_shape(const ParallelPlan& p) const {
  LayerShape s = layer_shape(p);
  s.activation_dtype = profile_.activation_dtype;
  s.expert_load = expert_load(model_, p.expert_parallel);
  return s;
}

double CostModel::cache_hit(const ParallelPlan& p) const {
  if (!(profile_.cache.bytes_per_rank > 0) && profile_.cache.hit_curve.empty()) return 1.0;
  // The largest stage's working set, with weights and activations at the profile's element
  // width (fp32 on CPU ranks, where cache models are measured) and the gradients as kept.
  const double element = static_cast<double>(dtype_bytes(profile_.activation_dtype));
  const ActivationMemory activations(model_, p, profile_.activation_dtype, moe_chunks(p));
  double working_set = 0;
  for (int64_t r = 0; r < p.pipeline_parallel; ++r)
    working_set = std::max(working_set,
                           parameters_on_stage(p, r) * (element + gradient_bytes_per_parameter(p)) +
                               activations.on_stage(r) + activations.p2p_buffers());
  const double hit = profile_.cache_hit(working_set);
  return std::round(hit * 4096) / 4096;  // a few values, so that memoised prices are reused
}

double CostModel::op_time(const Op& op, const ParallelPlan& p) const {
  return op_time(op, p, cache_hit(p));
}

namespace {

// A warm-measured time's scale when a fraction `hit` of the operands is in cache and the rest
// costs `cold` times as much.
double cache_scale(double hit, double cold) {
  return hit + (1.0 - hit) * cold;
}

}  // namespace

double CostModel::op_time(const Op& op, const ParallelPlan& p, double hit) const {
  const double warm = warm_op_time(op, p);
  if (!(hit < 1) || fused_op_time(op) >= 0) return warm;  // fused kernels: as measured
  switch (op.kind) {
    case OpKind::kGemm:
      return cache_scale(hit, profile_.gemm_cold_factor(
                                  static_cast<double>(op.m), static_cast<double>(op.n),
                                  static_cast<double>(op.k), static_cast<double>(op.batch))) *
             warm;
    case OpKind::kMemory:
      return cache_scale(hit, profile_.memory_cold_factor_of(memory_family(op.id))) * warm;
    case OpKind::kCollective:
      break;
  }
  return warm;
}

double CostModel::fused_op_time(const Op& op) const {
  if (!op.fused || profile_.fused_ops.empty() || op.kind == OpKind::kCollective) return -1;
  return profile_.fused_op_seconds(op.name(), op.kind == OpKind::kGemm ? op.flops() : op.bytes,
                                   static_cast<double>(op.m));
}

double CostModel::warm_op_time(const Op& op, const ParallelPlan& p) const {
  if (const double fused = fused_op_time(op); fused >= 0) return fused;
  switch (op.kind) {
    case OpKind::kGemm:
      if (p.fp8 && is_fp8_gemm(op.id)) {
        // FP8: the tensor cores' FP8 rate at the GEMM's efficiency, plus casting the
        // activation operand to FP8 (read 16 bits, write 8: 3 bytes per element of A; the
        // weights' casts are amortised over the microbatches).
        if (cluster_.gpu.peak_tflops_fp8 <= 0)
          throw InputError("--fp8-format", cluster_.gpu.name + " has no FP8 tensor cores");
        const double eff =
            profile_.gemm_efficiency(static_cast<double>(op.m), static_cast<double>(op.n),
                                     static_cast<double>(op.k), static_cast<double>(op.batch));
        const double cast = static_cast<double>(op.m * op.k * op.batch) * 3.0;
        return op.flops() / (cluster_.gpu.peak_tflops_fp8 * kTFLOP * eff) + memory_time(cast) +
               profile_.kernel_gap_us * kMicrosecond;
      }
      return gemm_time(op);
    case OpKind::kMemory:
      return memory_time(op);
    case OpKind::kCollective: {
      GroupSpan span;
      switch (op.group) {
        case CommGroup::kTensor:
          span = tensor_group_span(cluster_, p);
          break;
        case CommGroup::kData:
          span = data_group_span(cluster_, p);
          break;
        case CommGroup::kContext:
          span = context_group_span(cluster_, p, op.collective);
          break;
        case CommGroup::kExpert:
          span = expert_group_span(cluster_, p);
          break;
        case CommGroup::kExpertTensor:
          span = expert_tensor_group_span(cluster_, p);
          break;
        case CommGroup::kPipeline:
        case CommGroup::kEmbedding:
          break;
      }
      if (op.collective == Collective::kSendRecv) span = ring_neighbour_span(span, cluster_);
      return comm_.collective_time(op.collective, op.bytes, span, op.dtype);
    }
  }
  return 0.0;
}

std::vector<double> CostModel::exposed_times(const std::vector<Op>& ops,
                                             const ParallelPlan& p) const {
  return exposed_times(ops, p, cache_hit(p));
}

std::vector<double> CostModel::exposed_times(const std::vector<Op>& ops, const ParallelPlan& p,
                                             double hit) const {
  std::vector<double> time(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) time[i] = op_time(ops[i], p, hit);
  stretch_to_host(ops, time);
  if (p.cp_ring_size() > 1) hide_ring_exchanges(ops, p.cp_ring_size(), time);
  const int64_t t = p.tensor_parallel;
  // Arrival skew (measured by ptdp calibrate): each collective inside a layer, over the
  // tensor-parallel group or an MoE layer's expert groups, also waits for its last rank, a
  // fraction of the compute since the previous one. (An all-to-all waits as an all-reduce
  // does: it cannot finish before every rank has sent.)
  if (profile_.arrival_skew > 0 && (t > 1 || p.expert_parallel > 1 || p.expert_tp() > 1)) {
    double since = 0;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (is_input_regather(ops[i].id)) continue;  // asynchronous: waits for no rank's arrival
      if (ops[i].kind != OpKind::kCollective) {
        since += time[i];
      } else if (ops[i].group == CommGroup::kTensor || ops[i].group == CommGroup::kExpert ||
                 ops[i].group == CommGroup::kExpertTensor) {
        time[i] += profile_.arrival_skew * since;
        since = 0;
      }
    }
  }
  // Context parallelism synchronises its ranks the same way, once per layer pass: the pass's
  // first ring step (or its all-gather or first all-to-all) waits for the group's last rank, the
  // measured fraction of the compute since the previous wait, which is the whole pass (the
  // previous layer's same pass); the pass's other exchanges follow it at once.
  if (profile_.arrival_skew > 0 && p.context_parallel > 1) {
    double pass = 0;
    for (size_t i = 0; i < ops.size(); ++i)
      if (ops[i].kind != OpKind::kCollective) pass += time[i];
    for (size_t i = 0; i < ops.size(); ++i)
      if (ops[i].kind == OpKind::kCollective && ops[i].group == CommGroup::kContext) {
        time[i] += profile_.arrival_skew * pass;
        break;
      }
  }
  // Sequence parallelism's input all-gathered again for a weight gradient runs behind the
  // input-gradient GEMM that follows it (Megatron starts it first and waits after the GEMM);
  // zb-h1 defers it to the W pass, where nothing runs beside it. That GEMM is then taken:
  // --tp-comm-overlap hides the input gradient's reduce-scatter behind the weight-gradient GEMM
  // instead (Transformer Engine's bulk overlaps).
  std::vector<bool> hides_regather(ops.size(), false);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!is_input_regather(ops[i].id)) continue;
    for (size_t j = i + 1; j < ops.size(); ++j)
      if (ops[j].kind == OpKind::kGemm) {
        hides_regather[j] = true;
        if (p.schedule != Schedule::kZeroBubbleH1) time[i] = std::max(0.0, time[i] - time[j]);
        break;
      }
  }
  if (t == 1 || !p.tp_comm_overlap || !p.sequence_parallel) return time;
  // --tp-comm-overlap (Transformer Engine's userbuffers): a sequence-parallel all-gather is
  // pipelined with the GEMM that consumes it, a reduce-scatter with the GEMM that produces it,
  // each cut into t chunks along the tokens. What it hides: the smaller of the two, but for
  // the one chunk that cannot overlap. What it costs: t - 1 more kernel launches and gaps.
  // Assumed: the chunks run on several streams (as Transformer Engine launches them), so their
  // tiles fill the GPU as the whole GEMM's do.
  // The input-gradient GEMMs that hide a regather are taken; the weight-gradient GEMM after
  // each may hide the reduce-scatter that follows it.
  std::vector<bool> paired = hides_regather, wgrad_partner(ops.size(), false);
  for (size_t j = 0; j < ops.size(); ++j)
    if (hides_regather[j])
      for (size_t k = j + 1; k < ops.size(); ++k)
        if (ops[k].kind == OpKind::kGemm) {
          wgrad_partner[k] = ops[k].role == OpRole::kWeightGrad;
          break;
        }
  auto is_partner = [&](size_t j) {
    return ops[j].kind == OpKind::kGemm &&
           (ops[j].role != OpRole::kWeightGrad || wgrad_partner[j]) && !paired[j] &&
           ops[j].batch == 1;
  };
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& c = ops[i];
    if (c.kind != OpKind::kCollective || c.group != CommGroup::kTensor) continue;
    if (is_input_regather(c.id)) continue;  // hidden above
    const bool gather = c.collective == Collective::kAllGather;
    if (!gather && c.collective != Collective::kReduceScatter) continue;
    size_t j = i;
    if (gather) {
      for (j = i + 1; j < ops.size() && !is_partner(j); ++j) {
      }
    } else {
      for (j = i; j > 0 && !is_partner(j - 1); --j) {
      }
      j = j > 0 ? j - 1 : ops.size();
    }
    if (j >= ops.size()) continue;
    paired[j] = true;
    const double chunks = static_cast<double>(t);
    const double comm = time[i], gemm = time[j];
    time[j] = gemm + (chunks - 1.0) * profile_.kernel_gap_us * kMicrosecond;
    time[i] = std::max(0.0, comm - gemm) + std::min(comm, gemm) / chunks;
  }
  return time;
}

void CostModel::stretch_to_host(const std::vector<Op>& ops, std::vector<double>& time) const {
  if (profile_.host_op_us.empty()) return;
  double device = 0, issue = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].kind == OpKind::kCollective) continue;
    device += time[i];
    issue += profile_.host_issue_us(ops[i].name()) * kMicrosecond;
  }
  // The list repeats (layer after layer, microbatch after microbatch) and the device queue
  // carries over between repeats: where the device is the slower, the host gets ahead and the
  // queue hides its gaps; where the host is, every op waits for it, in proportion.
  if (!(issue > device) || !(device > 0)) return;
  const double stretch = issue / device;
  for (size_t i = 0; i < ops.size(); ++i)
    if (ops[i].kind != OpKind::kCollective) time[i] *= stretch;
}

PassTime CostModel::price(const std::vector<Op>& ops, const ParallelPlan& p, double hit,
                          double* flops, PassTime* weight_grad, double* recompute_flops) const {
  PassTime t;
  const std::vector<double> times = exposed_times(ops, p, hit);
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    const double time = times[i];
    PassTime& w = weight_grad && op.role == OpRole::kWeightGrad ? *weight_grad : t;
    if (op.kind != OpKind::kCollective) {
      w.compute += time;
    } else if (op.group == CommGroup::kContext) {
      // What each rank sends: a ring step's block, or its share of a collective's buffer. With
      // a2a+p2p only the ring's (the simulator's flows between the groups); its all-to-alls
      // within a group count in the time alone.
      w.cp_comm += time;
      if (op.collective == Collective::kSendRecv)
        w.cp_bytes += op.bytes;
      else if (p.cp_comm != CpComm::kA2AP2P)
        w.cp_bytes += collective_algorithm_factor(op.collective, p.context_parallel) * op.bytes;
    } else if (op.group == CommGroup::kExpert || op.group == CommGroup::kExpertTensor) {
      w.ep_comm += time;
      if (op.collective == Collective::kAllToAll) w.ep_bytes += op.bytes;
    } else {
      w.tp_comm += time;
    }
    *(recompute_flops && op.role == OpRole::kRecompute ? recompute_flops : flops) += op.flops();
  }
  if (weight_grad) add(t, *weight_grad, 1);
  return t;
}

const CostModel::ShapeTimes& CostModel::shape_times(const ParallelPlan& p) const {
  const double hit = cache_hit(p);
  const auto key = std::make_tuple(
      p.tensor_parallel, p.micro_batch_size, p.sequence_parallel,
      // (the module set below bit 16: RecomputeModule has 6 bits)
      (static_cast<int>(p.recompute) << 16) + static_cast<int>(p.recompute_modules),
      int64_t{p.fp8} * 8 + int64_t{p.tp_comm_overlap} * 4 +
          int64_t{p.gradient_accumulation_fusion} * 2 + p.fp32_grad_reduce,
      (p.context_parallel * 4 + static_cast<int>(p.cp_comm)) * (int64_t{1} << 20) + p.cp_a2a_size(),
      p.expert_parallel * (int64_t{1} << 24) + p.expert_tp(), hit);
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  const LayerShape shape = priced_layer_shape(p);
  ShapeTimes st;
  const PassOps layer = transformer_layer_ops(model_, shape);
  const PassOps embed = embedding_ops(model_, shape);
  const PassOps head = lm_head_ops(model_, shape);
  double fwd_flops = 0, bwd_flops = 0;
  st.layer_f = price(layer.forward, p, hit, &fwd_flops);
  st.layer_b = price(layer.backward, p, hit, &bwd_flops, &st.layer_w, &st.layer_recompute_flops);
  st.layer_r = price(layer.recompute, p, hit, &st.layer_list_recompute_flops);
  st.layer_flops = fwd_flops + bwd_flops;
  // Model FLOPs are counted on the unfused attention's list, so that MFU does not depend on the
  // kernel that runs it, with the attention core's GEMMs at half their pairs: a causal mask
  // leaves half of them, as Megatron-LM's num_floating_point_operations counts them (and its
  // logged TFLOP/s/GPU), and as flash attention and context parallelism's ring run them.
  // Counting every pair (SC'21's equation 3, which docs/validation.md still uses for Table 1)
  // puts MFU over 100% at long sequences.
  LayerShape all_pairs = shape;
  all_pairs.fused_attention = false;
  // Returns the causal count and the all-pairs count.
  auto model_flops = [](const PassOps& ops) {
    double causal = 0, all = 0;
    for (const auto* list : {&ops.forward, &ops.backward})
      for (const Op& op : *list) {
        if (op.role == OpRole::kRecompute) continue;
        causal += is_attention_pair_gemm(op.id) ? 0.5 * op.flops() : op.flops();
        all += op.flops();
      }
    return std::pair{causal, all};
  };
  std::tie(st.layer_model_flops, st.layer_model_flops_all_pairs) =
      model_flops(transformer_layer_ops(model_, all_pairs));
  double ef = 0, hf = 0;
  st.embed_f = price(embed.forward, p, hit, &ef);
  st.embed_b = price(embed.backward, p, hit, &ef);
  st.head_f = price(head.forward, p, hit, &hf);
  st.head_b = price(head.backward, p, hit, &hf);
  st.embed_flops = ef;
  st.head_flops = hf;
  if (model_.mtp_num_layers > 0) {
    const PassOps proj = mtp_projection_ops(model_, shape);
    double mf = 0;
    for (const PassTime* part : {&st.embed_f, &st.head_f}) add(st.mtp_f, *part, 1);
    add(st.mtp_f, price(proj.forward, p, hit, &mf), 1);
    for (const PassTime* part : {&st.embed_b, &st.head_b}) add(st.mtp_b, *part, 1);
    add(st.mtp_b, price(proj.backward, p, hit, &mf), 1);
    st.mtp_flops = ef + hf + mf;
  }
  if (model_.is_moe()) {
    const PassOps moe = moe_layer_ops(model_, shape);
    double unused = 0;
    st.moe_f = price(moe.forward, p, hit, &unused);
    st.moe_b = price(moe.backward, p, hit, &unused, &st.moe_w);
    st.moe_r = price(moe.recompute, p, hit, &unused);
    // Model FLOPs count the experts' work at balanced routing (the load only costs time).
    LayerShape balanced = shape;
    balanced.expert_load = 1.0;
    const PassOps even = moe_layer_ops(model_, balanced);
    for (const auto* list : {&even.forward, &even.backward})
      for (const Op& op : *list)
        (op.role == OpRole::kRecompute ? st.moe_recompute_flops : st.moe_flops) += op.flops();
    for (const Op& op : even.recompute) st.moe_list_recompute_flops += op.flops();
    balanced.fused_attention = false;
    std::tie(st.moe_model_flops, st.moe_model_flops_all_pairs) =
        model_flops(moe_layer_ops(model_, balanced));
  }
  return cache_.emplace(key, st).first->second;
}

ChunkTime CostModel::layer_span_time(const ShapeTimes& st, int64_t layers, int64_t moe,
                                     int64_t recomputed, int64_t recomputed_moe, bool embedding,
                                     bool head) {
  ChunkTime c;
  c.layers = layers;
  const double l = static_cast<double>(layers - moe), e = static_cast<double>(moe);
  add(c.forward, st.layer_f, l);
  add(c.backward, st.layer_b, l);
  add(c.recompute, st.layer_r, static_cast<double>(recomputed - recomputed_moe));
  add(c.weight_grad, st.layer_w, l);
  if (moe > 0) {
    add(c.forward, st.moe_f, e);
    add(c.backward, st.moe_b, e);
    add(c.recompute, st.moe_r, static_cast<double>(recomputed_moe));
    add(c.weight_grad, st.moe_w, e);
  }
  // The embedding's and the head's weight gradients are not deferred by zero-bubble schedules:
  // they stay in the input pass (`backward`), as ptdp run keeps them there (deferring the
  // head's would keep the logits' gradient until the W pass).
  if (embedding) {
    add(c.forward, st.embed_f, 1);
    add(c.backward, st.embed_b, 1);
  }
  if (head) {
    add(c.forward, st.head_f, 1);
    add(c.backward, st.head_b, 1);
  }
  return c;
}

void CostModel::add_mtp(ChunkTime& c, const ShapeTimes& st, const ParallelPlan& p) const {
  if (model_.mtp_num_layers == 0) return;
  const double n = static_cast<double>(model_.mtp_num_layers);
  const bool moe = model_.mtp_layer_is_moe();
  add(c.forward, st.mtp_f, n);
  add(c.forward, moe ? st.moe_f : st.layer_f, n);
  // Their weight gradients (the layer's too) stay in the input pass, as the head's do.
  add(c.backward, st.mtp_b, n);
  add(c.backward, moe ? st.moe_b : st.layer_b, n);
  if (!(p.recompute == Recompute::kFull && p.recompute_layers > 0))
    add(c.recompute, moe ? st.moe_r : st.layer_r, n);
}

std::vector<StageTime> CostModel::stage_times(const ParallelPlan& p, const ShapeTimes& st) const {
  std::vector<StageTime> stages;
  for (int64_t r = 0; r < p.pipeline_parallel; ++r) {
    const int64_t layers = p.layers_on_stage(model_, r), moe = moe_layers_on_stage(p, r);
    const RecomputedLayers rec =
        p.recompute_layers > 0 ? recomputed_on_stage(model_, p, r) : RecomputedLayers{layers, moe};
    stages.push_back({layer_span_time(st, layers, moe, rec.layers, rec.moe, r == 0,
                                      r == p.pipeline_parallel - 1)});
    if (r == p.pipeline_parallel - 1) add_mtp(stages.back(), st, p);
    add_fsdp_pass_comm(p, r, stages.back());
  }
  return stages;
}

double CostModel::activation_message_bytes(const ParallelPlan& p) const {
  const double element = static_cast<double>(dtype_bytes(profile_.activation_dtype));
  return static_cast<double>(p.micro_batch_size * (model_.seq_length / p.context_parallel)) *
         static_cast<double>(model_.hidden_size) * element /
         (p.sequence_parallel ? static_cast<double>(p.tensor_parallel) : 1.0);
}

double CostModel::gradient_sync_time(const ParallelPlan& p, double params) const {
  const GroupSpan dp = data_group_span(cluster_, p);
  const double gbytes = params * gradient_bytes_per_parameter(p);
  if (p.shards_gradients()) {
    const GroupSpan instance = optimizer_instance_span(cluster_, p);
    return comm_.collective_time(Collective::kAllGather,
                                 iteration_gathered_parameters(p, params) * weight_bytes(),
                                 instance, weight_dtype()) +
           fsdp_outer_sync_time(p, params, instance, optimizer_replica_span(cluster_, p));
  }
  if (p.distributed_optimizer)
    return sharded_gradient_sync_time(p, params, optimizer_instance_span(cluster_, p),
                                      optimizer_replica_span(cluster_, p));
  return comm_.collective_time(Collective::kAllReduce, gbytes, dp, gradient_dtype(p));
}

double CostModel::fsdp_outer_sync_time(const ParallelPlan& p, double params,
                                       const GroupSpan& instance, const GroupSpan& replicas) const {
  if (replicas.size <= 1 || params <= 0) return 0.0;
  // Each rank's shard of its instance: 1 / (the instance's ranks) of the gradients and weights.
  const double share = params / static_cast<double>(instance.size);
  const double gbytes = share * gradient_bytes_per_parameter(p);
  if (p.fsdp_outer == FsdpSharding::kOptim)  // HFSDP: the states sharded across, too
    return comm_.collective_time(Collective::kReduceScatter, gbytes, replicas, gradient_dtype(p)) +
           comm_.collective_time(Collective::kAllGather, share * weight_bytes(), replicas,
                                 weight_dtype());
  return comm_.collective_time(Collective::kAllReduce, gbytes, replicas, gradient_dtype(p));
}

double CostModel::sharded_gradient_sync_time(const ParallelPlan& p, double params,
                                             const GroupSpan& instance,
                                             const GroupSpan& replicas) const {
  // Reduce-scattered within the instance; with K > 1 instances each rank's shard (1 / its
  // instance's ranks of the gradients) is all-reduced across the instances (Megatron-Core's
  // second reduction, on its own stream after the first); the updated weights are all-gathered
  // within the instance.
  const double gbytes = params * gradient_bytes_per_parameter(p);
  const double across = replicas.size > 1
                            ? comm_.collective_time(Collective::kAllReduce,
                                                    gbytes / static_cast<double>(instance.size),
                                                    replicas, gradient_dtype(p))
                            : 0.0;
  return comm_.collective_time(Collective::kReduceScatter, gbytes, instance, gradient_dtype(p)) +
         across +
         comm_.collective_time(Collective::kAllGather, params * weight_bytes(), instance,
                               weight_dtype());
}

double CostModel::expert_gradient_sync_time(const ParallelPlan& p, double params) const {
  if (params <= 0 || p.expert_data_parallel() <= 1) return 0.0;
  const GroupSpan edp = expert_data_group_span(cluster_, p);
  const double gbytes = params * gradient_bytes_per_parameter(p);
  if (p.shards_gradients()) {
    const GroupSpan instance = expert_optimizer_instance_span(cluster_, p);
    const double outer =
        fsdp_outer_sync_time(p, params, instance, expert_optimizer_replica_span(cluster_, p));
    if (p.shards_weights()) return outer;  // experts live in the layer units
    return comm_.collective_time(Collective::kAllGather, params * weight_bytes(), instance,
                                 weight_dtype()) +
           outer;
  }
  if (p.distributed_optimizer)
    return sharded_gradient_sync_time(p, params, expert_optimizer_instance_span(cluster_, p),
                                      expert_optimizer_replica_span(cluster_, p));
  return comm_.collective_time(Collective::kAllReduce, gbytes, edp, gradient_dtype(p));
}

double CostModel::hidden_param_gather(const ParallelPlan& p, double params, int64_t layers,
                                      double forward_s) const {
  if (!p.overlap_param_gather || !p.distributed_optimizer ||
      p.data_parallel * p.context_parallel == 1)
    return 0.0;
  const double gather = comm_.collective_time(
      Collective::kAllGather, iteration_gathered_parameters(p, params) * weight_bytes(),
      optimizer_instance_span(cluster_, p), weight_dtype());
  return std::min(gather - last_gradient_bucket_time(gather, layers), forward_s);
}

double CostModel::exposed_gradient_sync_time(const ParallelPlan& p, double params,
                                             double expert_params, const StageTime& s) const {
  const double dense = params - expert_params;
  const double whole = gradient_sync_time(p, dense) + expert_gradient_sync_time(p, expert_params);
  double exposed = whole - hidden_param_gather(p, dense, s.layers, s.forward.total());
  // (Megatron-FSDP's sharded gradients were reduced during each backward pass already.)
  if (p.overlap_grad_reduce && whole > 0 && !p.shards_gradients()) {
    // Each model chunk's buckets are reduced while its last backward pass runs, all but the
    // last bucket, which goes once that pass is over; the chunks' reductions queue on the
    // data-parallel links. With interleaving, chunk c's last backward pass comes c g chunk
    // passes before the end of the cool-down (Megatron's order: chunks v-1 ... 0 for the last
    // microbatch group, g = m mod N of them, or N, the group: p by default), so the earlier
    // chunks hide behind the later ones' passes; ZB-H1 defers the weight-gradient passes to
    // the drain, so a chunk's gradients are complete only after its last W pass. Times are
    // relative to the end of the stage's last backward pass.
    const double v = static_cast<double>(p.virtual_stages);
    const int64_t group = p.microbatch_group_size(), m = p.num_microbatches();
    const double pp = static_cast<double>(m % group != 0 ? m % group : group);
    const double pass =
        (p.schedule == Schedule::kZeroBubbleH1 ? s.weight_grad.total()
                                               : s.backward.total() + s.recompute.total()) /
        v;
    const double share = exposed / v, last = last_gradient_bucket_time(exposed, s.layers);
    double free = -std::numeric_limits<double>::infinity(), finish = 0;
    for (int64_t c = p.virtual_stages - 1; c >= 0; --c) {
      const double begin = -(static_cast<double>(c) * pp + 1.0) * pass;
      finish = std::max(std::max(free, begin) + share, begin + pass + last);
      free = finish;
    }
    exposed = std::max(0.0, finish);
  }
  return exposed;
}

double CostModel::embedding_sync_time(const ParallelPlan& p) const {
  // Tied embeddings, or multi-token prediction's copy: the first and last stage's word
  // embedding gradients all-reduced.
  if (p.pipeline_parallel == 1 || !model_.last_stage_shares_word_embedding()) return 0.0;
  GroupSpan pair;
  pair.size = 2;
  pair.nodes = pipeline_crosses_nodes(cluster_, p) ? 2 : 1;
  pair.concurrent_per_node = cluster_.gpus_per_node;
  const double emb = static_cast<double>(model_.vocab_size * model_.hidden_size) /
                     static_cast<double>(p.tensor_parallel) * gradient_bytes_per_parameter(p);
  return comm_.collective_time(Collective::kAllReduce, emb, pair, gradient_dtype(p));
}

double CostModel::sequence_parallel_grad_sync_time(const ParallelPlan& p, int64_t r) const {
  if (!p.sequence_parallel || p.tensor_parallel == 1) return 0.0;
  const int64_t moe = moe_layers_on_stage(p, r);
  double whole = static_cast<double>(p.layers_on_stage(model_, r) - moe) *
                     model_.replicated_parameters_per_layer() +
                 static_cast<double>(moe) * model_.replicated_parameters_per_layer(true);
  if (r == 0) whole += model_.position_embedding_parameters();
  if (r == p.pipeline_parallel - 1) {
    whole += model_.norm_parameters();
    // Multi-token prediction's norms and its layer's replicated parameters.
    whole += static_cast<double>(model_.mtp_num_layers) *
             (3 * model_.norm_parameters() +
              model_.replicated_parameters_per_layer(model_.mtp_layer_is_moe()));
  }
  return comm_.collective_time(Collective::kAllReduce, whole * gradient_bytes_per_parameter(p),
                               tensor_group_span(cluster_, p), gradient_dtype(p));
}

double CostModel::optimizer_time(const ParallelPlan& p, double params, double expert_params) const {
  const double local = params / dense_shards(p) + expert_params / expert_shards(p);
  const double eff = profile_.memory_efficiency_of("optimizer");
  return local * profile_.optimizer_bytes_per_param /
             (cluster_.gpu.hbm_bandwidth_gbps * kGB * eff) +
         profile_.kernel_gap_us * kMicrosecond;
}

void CostModel::add_fsdp_pass_comm(const ParallelPlan& p, int64_t r, ChunkTime& t) const {
  const int64_t layers = p.layers_on_stage(model_, r);
  if (!p.shards_gradients() || layers == 0) return;
  // Over the ranks of an optimizer instance (all d * cp of them, or the experts' edp, without
  // HSDP).
  const GroupSpan dp = optimizer_instance_span(cluster_, p),
                  edp = expert_optimizer_instance_span(cluster_, p);
  const double experts = expert_parameters_on_stage(p, r);
  const double dense = parameters_on_stage(p, r) - experts;
  const double dense_units = dense - non_layer_parameters_on_stage(p, r);
  auto gather = [&](double params, const GroupSpan& g, int64_t size) {
    if (params <= 0 || size <= 1) return 0.0;
    return comm_.collective_time(Collective::kAllGather, params * weight_bytes(), g,
                                 weight_dtype());
  };
  auto reduce = [&](double params, const GroupSpan& g, int64_t size) {
    if (params <= 0 || size <= 1) return 0.0;
    return comm_.collective_time(Collective::kReduceScatter,
                                 params * gradient_bytes_per_parameter(p), g, gradient_dtype(p));
  };
  const int64_t d = p.instance_ranks(), ed = p.expert_instance_ranks();
  // One microbatch's collectives: the units' weight gathers (each pass) and every gradient's
  // reduce-scatter (the backward pass).
  const double gathers =
      p.shards_weights() ? gather(dense_units, dp, d) + gather(experts, edp, ed) : 0.0;
  const double reductions = reduce(dense, dp, d) + reduce(experts, edp, ed);
  const double n = static_cast<double>(layers);
  auto exposed = [n](double comm, double compute) {
    return comm / n + std::max(0.0, (comm - compute) * (n - 1.0) / n);
  };
  // What can hide them: the passes' kernels and tensor-parallel collectives (the context and
  // expert exchanges use the same links).
  auto kernels = [](const PassTime& x) { return x.compute + x.tp_comm; };
  t.forward.dp_comm = exposed(gathers, kernels(t.forward));
  t.backward.dp_comm = exposed(gathers + reductions, kernels(t.backward) + kernels(t.recompute));
}

ChunkTime CostModel::chunk_time(const ParallelPlan& p, int64_t rank, int64_t chunk) const {
  const int64_t layers = p.layers_in_chunk(model_, rank, chunk);
  const int64_t moe = moe_layers_in_chunk(p, rank, chunk);
  const RecomputedLayers rec = p.recompute_layers > 0 ? recomputed_in_chunk(model_, p, rank, chunk)
                                                      : RecomputedLayers{layers, moe};
  const bool head = rank == p.pipeline_parallel - 1 && chunk == p.virtual_stages - 1;
  const ShapeTimes& st = shape_times(p);
  ChunkTime t =
      layer_span_time(st, layers, moe, rec.layers, rec.moe, rank == 0 && chunk == 0, head);
  if (head) add_mtp(t, st, p);
  if (p.virtual_stages == 1) add_fsdp_pass_comm(p, rank, t);  // Megatron-FSDP: p = v = 1
  return t;
}

const std::vector<int64_t>& CostModel::moe_chunks(const ParallelPlan& p) const {
  // The last plan's counts: the search and predict ask for the same plan many times in a row.
  if (!model_.is_moe()) {
    static const std::vector<int64_t> none;
    return none;
  }
  if (p.pipeline_parallel != moe_key_p_ || p.virtual_stages != moe_key_v_ ||
      p.layers_per_stage != moe_key_split_ || p.layers_per_chunk != moe_key_chunks_) {
    moe_key_p_ = p.pipeline_parallel;
    moe_key_v_ = p.virtual_stages;
    moe_key_split_ = p.layers_per_stage;
    moe_key_chunks_ = p.layers_per_chunk;
    moe_chunks_ = moe_layers_per_chunk(model_, p);
  }
  return moe_chunks_;
}

int64_t CostModel::moe_layers_in_chunk(const ParallelPlan& p, int64_t r, int64_t c) const {
  const std::vector<int64_t>& chunks = moe_chunks(p);
  return chunks.empty() ? 0 : chunks[static_cast<size_t>(c * p.pipeline_parallel + r)];
}

int64_t CostModel::moe_layers_on_stage(const ParallelPlan& p, int64_t r) const {
  return moe_layers_of_stage(moe_chunks(p), p, r);
}

const CostModel::LayerParameters& CostModel::layer_parameters(const ParallelPlan& p) const {
  LayerParameters& l = layer_parameters_;
  const int64_t etp = model_.is_moe() ? p.expert_tp() : 1;
  if (l.t == p.tensor_parallel && l.ep == p.expert_parallel && l.etp == etp) return l;
  l = {p.tensor_parallel, p.expert_parallel, etp, 0, 0, 0};
  // Norms and the biases added after row-parallel reductions are whole on every tensor-parallel
  // rank; the rest of a layer is split t ways.
  l.dense = model_.layer_parameters_per_rank(p.tensor_parallel);
  if (model_.is_moe()) {
    l.moe = model_.layer_parameters_per_rank(p.tensor_parallel, true);
    l.experts = model_.expert_parameters_per_rank(p.expert_parallel, etp);
  }
  return l;
}

namespace {

// The last stage's multi-token prediction modules' layers, if MoE layers.
int64_t mtp_moe_layers_on_stage(const ModelSpec& m, const ParallelPlan& p, int64_t r) {
  return r == p.pipeline_parallel - 1 && m.mtp_layer_is_moe() ? m.mtp_num_layers : 0;
}

}  // namespace

double CostModel::expert_parameters_on_stage(const ParallelPlan& p, int64_t r) const {
  if (!model_.is_moe()) return 0.0;
  return static_cast<double>(moe_layers_on_stage(p, r) + mtp_moe_layers_on_stage(model_, p, r)) *
         layer_parameters(p).experts;
}

double CostModel::parameters_in_chunk(const ParallelPlan& p, int64_t r, int64_t c) const {
  const int64_t moe = moe_layers_in_chunk(p, r, c);
  const LayerParameters& l = layer_parameters(p);
  double params = static_cast<double>(p.layers_in_chunk(model_, r, c) - moe) * l.dense +
                  static_cast<double>(moe) * (l.moe + l.experts);
  const OuterModules o = outer_modules(p, r);
  if (c == 0) params += o.embedding;
  if (c == p.virtual_stages - 1) {
    params += o.output;
    params += static_cast<double>(mtp_moe_layers_on_stage(model_, p, r)) * l.experts;
  }
  return params;
}

double CostModel::parameters_on_stage(const ParallelPlan& p, int64_t r) const {
  const int64_t moe = moe_layers_on_stage(p, r);
  const double dense_layers = static_cast<double>(p.layers_on_stage(model_, r) - moe);
  const LayerParameters& l = layer_parameters(p);
  double params = dense_layers * l.dense;
  if (moe > 0) params += static_cast<double>(moe) * (l.moe + l.experts);
  params += static_cast<double>(mtp_moe_layers_on_stage(model_, p, r)) * l.experts;
  return params + non_layer_parameters_on_stage(p, r);
}

CostModel::OuterModules CostModel::outer_modules(const ParallelPlan& p, int64_t r) const {
  const double t = static_cast<double>(p.tensor_parallel);
  OuterModules out;
  const bool first = r == 0, last = r == p.pipeline_parallel - 1;
  // The word embedding is vocabulary-parallel; learned position embeddings are whole.
  if (first)
    out.embedding = (model_.embedding_parameters() - model_.position_embedding_parameters()) / t +
                    model_.position_embedding_parameters();
  if (last) {
    out.output = model_.norm_parameters();  // the final norm
    if (model_.untie_embeddings_and_output_weights) out.output += model_.output_parameters() / t;
    // On a stage of its own, its copy of the word embedding: the tied output layer's, or
    // multi-token prediction's inputs' (Megatron-Core's embedding on the MTP stage).
    if (!first && model_.last_stage_shares_word_embedding())
      out.output += static_cast<double>(model_.vocab_size * model_.hidden_size) / t;
    // Multi-token prediction's modules (their routed experts apart).
    out.output += static_cast<double>(model_.mtp_num_layers) *
                  model_.mtp_module_parameters_per_rank(p.tensor_parallel);
  }
  return out;
}

double CostModel::non_layer_parameters_on_stage(const ParallelPlan& p, int64_t r) const {
  const OuterModules o = outer_modules(p, r);
  return o.embedding + o.output;
}

double CostModel::iteration_gathered_parameters(const ParallelPlan& p, double params) const {
  return p.shards_weights() ? non_layer_parameters_on_stage(p, 0) : params;
}

double CostModel::weight_bytes() const {
  return fp32_training() ? kFp32WeightBytes : kWeightBytes;
}
DType CostModel::weight_dtype() const {
  return fp32_training() ? DType::kF32 : profile_.activation_dtype;
}
DType CostModel::gradient_dtype(const ParallelPlan& p) const {
  if (gradient_bytes_per_parameter(p) == 4) return DType::kF32;
  return fp32_training() ? DType::kBF16 : profile_.activation_dtype;
}
double CostModel::optimizer_state_bytes() const {
  return fp32_training() ? kFp32OptimizerBytes : kOptimizerBytes;
}

MemoryBreakdown CostModel::memory(const ParallelPlan& p) const {
  // Activations in the device's element type (16-bit but for fp32 training).
  const DType element_type = fp32_training() ? DType::kF32 : DType::kBF16;
  const double element = static_cast<double>(dtype_bytes(element_type));
  const ActivationMemory activations(model_, p, element_type, moe_chunks(p));
  const double tokens =
      static_cast<double>(p.micro_batch_size * (model_.seq_length / p.context_parallel));
  const double t = static_cast<double>(p.tensor_parallel);

  const double grad_bytes = fp32_training() ? std::max(4.0, gradient_bytes_per_parameter(p))
                                            : gradient_bytes_per_parameter(p);
  MemoryBreakdown best;
  for (int64_t r = 0; r < p.pipeline_parallel; ++r) {
    MemoryBreakdown mb;
    const double params = parameters_on_stage(p, r);
    const double experts = expert_parameters_on_stage(p, r);
    // With FP8, Transformer Engine also keeps FP8 copies of the linear layers' weights, a byte
    // an element each (GpuSpec::fp8_weight_copies: the weight and, on Hopper, its transpose);
    // the embedding and output layer run in 16 bits and keep none. Until 2026-11-29 one byte
    // was counted for every parameter: 3.7 GiB a GPU short for Llama 3 70B at t4 p4 on H100s.
    const double weight = weight_bytes();
    const double fp8_copy_bytes = p.fp8 ? static_cast<double>(cluster_.gpu.fp8_weight_copies) : 0.0;
    const double non_layer = non_layer_parameters_on_stage(p, r);
    mb.weights = params * weight + (params - non_layer) * fp8_copy_bytes;
    mb.gradients = params * grad_bytes;
    mb.expert_weights = experts * weight_bytes();
    mb.expert_gradients = experts * grad_bytes;
    if (p.shards_gradients()) {
      // Megatron-FSDP: every gradient in 1/(d cp) shards (the experts' in 1/edp), and with
      // sharded weights the layer units' weights; whole: the weights outside the units, the
      // gradients of the units being computed and reduced (or of the module outside the units
      // whose backward pass runs with the unit beside it, if larger; a tied word embedding's,
      // which both ends of the model add to, throughout), and the gathered units' weights (the
      // unit running and those prefetched).
      const double dense_units = params - experts - non_layer;
      const double layers = static_cast<double>(std::max<int64_t>(1, p.layers_on_stage(model_, r)));
      const double unit = (dense_units + experts) / layers;  // one layer's parameters
      const double ds = static_cast<double>(p.instance_ranks()),
                   es = static_cast<double>(p.expert_instance_ranks());
      mb.expert_gradients = experts / es * grad_bytes;
      const double units_alive = std::min(layers, kFsdpGradientUnitsInFlight) * unit;
      const OuterModules outer = outer_modules(p, r);
      // Untied, the output layer's window meets the last layer's (its reduction in flight while
      // that layer computes) and the embedding's the first layer's, as ptdp run's
      // (runtime/fsdp.h).
      const double alive =
          model_.untie_embeddings_and_output_weights
              ? std::max({units_alive, outer.embedding + unit, outer.output + unit})
              : units_alive + non_layer;
      mb.gradients = ((dense_units + non_layer) / ds + alive) * grad_bytes + mb.expert_gradients;
      if (p.shards_weights()) {
        const double gathered =
            unit > 0 ? std::min(layers, 1.0 + fsdp_units_ahead(unit)) * unit : 0.0;
        mb.expert_weights = experts / es * weight_bytes();
        const double layer_weights_held = dense_units / ds + gathered + experts / es;
        mb.weights =
            (layer_weights_held + non_layer) * weight + layer_weights_held * fp8_copy_bytes;
      }
    }
    mb.expert_optimizer = experts * optimizer_state_bytes() / expert_shards(p);
    mb.optimizer =
        (params - experts) * optimizer_state_bytes() / dense_shards(p) + mb.expert_optimizer;
    mb.activations = activations.on_stage(r);
    if (r == p.pipeline_parallel - 1) {
      // The vocabulary shard's logits (16-bit; fp32 in fp32 training), one microbatch, and
      // unless the loss is fused (computed in place on them), their fp32 softmax. They are
      // freed by the LM head's backward pass; where that runs right after their forward pass
      // (logits_freed_before_layer_backward) they never meet a layer's backward working set or
      // recomputed layer (the activations' transient part): what they add is what exceeds it.
      const double vocab_local = std::ceil(static_cast<double>(model_.vocab_size) / t);
      // Multi-token prediction computes and keeps as many logits again for each module.
      const double logits = static_cast<double>(1 + model_.mtp_num_layers) * tokens * vocab_local *
                            (element + (model_.cross_entropy_fusion ? 0.0 : 4.0));
      mb.buffers += activations.logits_beyond_transient(r, logits);
    }
    mb.buffers += activations.p2p_buffers();  // send/receive buffers
    mb.peak = mb.weights + mb.gradients + mb.optimizer + mb.activations + mb.buffers;
    if (mb.peak > best.peak) best = mb;
  }
  best.capacity = cluster_.gpu.memory_gib * kGiB;
  best.fits = best.peak <= best.capacity * kUsableMemory;
  return best;
}

Prediction CostModel::predict(const ParallelPlan& p) const {
  Prediction out;
  out.precision = profile_.activation_dtype;
  const ShapeTimes& st = shape_times(p);
  out.stages = stage_times(p, st);
  const double m = static_cast<double>(p.num_microbatches());
  const double v = static_cast<double>(p.virtual_stages);
  const double pp = static_cast<double>(p.pipeline_parallel);

  // The slowest stage sets the steady-state pace; the others' fill and drain is the bubble.
  // ZB-H1 (Qi et al. 2023) fills the drain with deferred weight-gradient passes: each other
  // stage leaves F + B - W idle instead of F + B + W, B being the input-gradient part.
  auto fill_of = [&](const StageTime& st) {
    if (p.schedule != Schedule::kZeroBubbleH1) return st.per_microbatch();
    return std::max(0.0, st.per_microbatch() - 2.0 * st.weight_grad.total());
  };
  // Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm): each steady-state
  // forward runs as one step with a backward of another microbatch, each one's all-to-alls on
  // their own stream behind the other's kernels: a step lasts its kernels or its all-to-alls,
  // whichever is longer. Counted over the pipeline ranks' combined steps on average (rank 0
  // warms up longest and so combines fewest; combined_steps). A stage's exposed all-to-all time
  // over the iteration, and so which stage is slowest, follows from it.
  double pairs = 0;
  if (p.overlap_moe_ep_comm) {
    for (int64_t r = 0; r < p.pipeline_parallel; ++r) pairs += combined_steps(p, r);
    pairs /= pp;
  }
  auto exposed_ep = [&](const StageTime& st) {
    const double all = st.forward.ep_comm + st.backward.ep_comm + st.recompute.ep_comm;
    if (!p.overlap_moe_ep_comm) return m * all;
    const double e = all / v;
    const double kernels = (st.forward.compute + st.forward.tp_comm + st.backward.compute +
                            st.backward.tp_comm + st.recompute.compute + st.recompute.tp_comm) /
                           v;
    return (m * v - pairs) * e + pairs * std::max(0.0, e - kernels);
  };
  auto paced = [&](const StageTime& st) {
    const double all = st.forward.ep_comm + st.backward.ep_comm + st.recompute.ep_comm;
    return m * (st.per_microbatch() - all) + exposed_ep(st);
  };
  size_t slowest = 0;
  double sum_stage = 0;
  for (size_t r = 0; r < out.stages.size(); ++r) {
    sum_stage += fill_of(out.stages[r]);
    if (paced(out.stages[r]) > paced(out.stages[slowest])) slowest = r;
  }
  const StageTime& s = out.stages[slowest];
  TimeBreakdown& b = out.breakdown;
  b.compute = m * (s.forward.compute + s.backward.compute);
  b.recompute = m * s.recompute.compute;
  // The collectives inside passes, by group (tensor, context, expert).
  b.tp_comm = m * (s.forward.tp_comm + s.backward.tp_comm + s.recompute.tp_comm);
  b.cp_comm = m * (s.forward.cp_comm + s.backward.cp_comm + s.recompute.cp_comm);
  b.ep_comm = exposed_ep(s);
  const double fill = (sum_stage - fill_of(s)) / v;
  b.bubble = fill;  // GPipe and 1F1B share (p-1)/m; interleaving divides it by v

  // Pipeline transfers: blocking send/receive pairs on the critical path, one per chunk
  // boundary and direction for every microbatch, plus the fill and drain of the pipeline.
  if (p.pipeline_parallel > 1) {
    out.p2p_time_s = comm_.p2p_time(activation_message_bytes(p), p);
    double steady = out.p2p_time_s, ring = 0;
    // Not in Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm), whose step
    // awaits both its inputs when it starts and posts its sends when it ends.
    if (p.overlap_p2p_comm && p.virtual_stages > 1 && !p.overlap_moe_ep_comm) {
      // Megatron-Core's interleaved schedule posts each steady-state transfer before the next
      // chunk's pass and waits after it: only what outlasts one chunk's forward pass shows.
      const double chunk_forward = s.forward.total() / v;
      steady = std::max(0.0, out.p2p_time_s - chunk_forward);
      // Except in the warm-up's first (v-1) N forwards and the cool-down's last (v-1) N
      // backwards (N: the microbatch group, p by default): a group goes round the p stages
      // chunk after chunk, each pass waiting for the one before it on the previous stage, so
      // no pass hides a transfer.
      ring = 2.0 * (v - 1.0) * static_cast<double>(p.microbatch_group_size());
    }
    b.pp_comm = (2.0 * m * v - ring) * steady + (ring + 2.0 * (pp - 1.0)) * out.p2p_time_s;
  }

  // Data-parallel gradient reduction of the most loaded stage, and the tied-embedding
  // all-reduce between the first and last stage.
  double params_max = 0, experts_max = 0;
  int64_t loaded = 0;
  for (int64_t r = 0; r < p.pipeline_parallel; ++r) {
    const double params = parameters_on_stage(p, r);
    if (params > params_max) {
      params_max = params;
      experts_max = expert_parameters_on_stage(p, r);
      loaded = r;
    }
  }
  const double dense_max = params_max - experts_max;
  out.dp_time_s = gradient_sync_time(p, dense_max) + expert_gradient_sync_time(p, experts_max);
  b.dp_comm = exposed_gradient_sync_time(p, params_max, experts_max, s) + embedding_sync_time(p) +
              sequence_parallel_grad_sync_time(p, loaded);
  // Megatron-FSDP's per-microbatch gathers and reductions (p = 1: the stage's passes).
  b.dp_comm += m * s.dp_comm();

  b.optimizer = optimizer_time(p, dense_max, experts_max);

  out.iteration_time_s = b.compute + b.recompute + b.tp_comm + b.cp_comm + b.ep_comm + b.pp_comm +
                         b.dp_comm + b.bubble + b.optimizer;

  // FLOPs: the op lists count per-GPU shards (1/t of the work, s/cp of the tokens), so multiply
  // by t cp; all microbatches, all replicas.
  const auto moe_layers = static_cast<double>(model_.num_moe_layers());
  const double dense_layers = static_cast<double>(model_.num_layers) - moe_layers;
  // Multi-token prediction modules: their layers (of the decoder's last layer's kind) and the
  // rest of each, as Megatron-LM's num_floating_point_operations counts them.
  const double mtp = static_cast<double>(model_.mtp_num_layers);
  const bool mtp_moe = model_.mtp_layer_is_moe();
  const double per_mb_model =
      dense_layers * st.layer_model_flops + moe_layers * st.moe_model_flops + st.embed_flops +
      st.head_flops + mtp * ((mtp_moe ? st.moe_model_flops : st.layer_model_flops) + st.mtp_flops);
  const double per_mb_model_all_pairs =
      dense_layers * st.layer_model_flops_all_pairs + moe_layers * st.moe_model_flops_all_pairs +
      st.embed_flops + st.head_flops +
      mtp * ((mtp_moe ? st.moe_model_flops_all_pairs : st.layer_model_flops_all_pairs) +
             st.mtp_flops);
  // What the kernels execute: a fused attention's causal half only, plus what is recomputed.
  const double per_mb_executed = dense_layers * st.layer_flops + moe_layers * st.moe_flops +
                                 st.embed_flops + st.head_flops +
                                 mtp * ((mtp_moe ? st.moe_flops : st.layer_flops) + st.mtp_flops);
  // The layers whose recompute list runs: all, but with block recompute each chunk's first N.
  double rec_moe = moe_layers, rec_dense = dense_layers;
  if (p.recompute_layers > 0) {
    int64_t layers = 0, moe = 0;
    for (int64_t r = 0; r < p.pipeline_parallel; ++r) {
      const RecomputedLayers rec = recomputed_on_stage(model_, p, r);
      layers += rec.layers;
      moe += rec.moe;
    }
    rec_moe = static_cast<double>(moe);
    rec_dense = static_cast<double>(layers - moe);
  }
  // (A multi-token prediction module's layer recomputes as any, except with block recompute.)
  const double mtp_rec = p.recompute == Recompute::kFull && p.recompute_layers > 0 ? 0.0 : mtp;
  const double per_mb_recompute =
      dense_layers * st.layer_recompute_flops + rec_dense * st.layer_list_recompute_flops +
      moe_layers * st.moe_recompute_flops + rec_moe * st.moe_list_recompute_flops +
      (mtp_moe ? mtp * st.moe_recompute_flops + mtp_rec * st.moe_list_recompute_flops
               : mtp * st.layer_recompute_flops + mtp_rec * st.layer_list_recompute_flops);
  const double replicas = static_cast<double>(p.tensor_parallel * p.context_parallel) * m *
                          static_cast<double>(p.data_parallel);
  out.model_flops = per_mb_model * replicas;
  out.hardware_flops = (per_mb_executed + per_mb_recompute) * replicas;
  out.model_flops_all_pairs = per_mb_model_all_pairs * replicas;
  out.model_tflops_per_gpu = tflops_per_gpu(out.model_flops, out.iteration_time_s, p.num_gpus());
  out.model_tflops_per_gpu_all_pairs =
      tflops_per_gpu(out.model_flops_all_pairs, out.iteration_time_s, p.num_gpus());
  out.hardware_tflops_per_gpu =
      tflops_per_gpu(out.hardware_flops, out.iteration_time_s, p.num_gpus());
  out.mfu = out.model_tflops_per_gpu / cluster_.gpu.peak_tflops_16bit;
  out.tokens_per_s = tokens_per_second(model_, p, out.iteration_time_s);
  out.memory = memory(p);
  return out;
}

}  // namespace ptdp
