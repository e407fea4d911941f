#include "planner/cost_model.h"

#include <algorithm>
#include <cmath>

#include "core/units.h"

namespace ptdp {
namespace {

constexpr double kWeightBytes = 2.0;      // 16-bit model weights
constexpr double kOptimizerBytes = 12.0;  // fp32 master weights, Adam m and v
constexpr double kUsableMemory = 0.95;    // CUDA context and allocator fragmentation keep the rest

void add(PassTime& a, const PassTime& b, double times) {
  a.compute += b.compute * times;
  a.tp_comm += b.tp_comm * times;
}

}  // namespace

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

ActivationMemory::ActivationMemory(const ModelSpec& m, const ParallelPlan& p, DType element)
    : m_(m), p_(p), element_(static_cast<double>(dtype_bytes(element))) {
  LayerShape shape{p.tensor_parallel, p.micro_batch_size, p.sequence_parallel, p.recompute};
  shape.activation_dtype = element;
  per_layer_ = layer_activation_bytes(m, shape);
  // The layer being recomputed (or the last one run) holds its full activations once.
  LayerShape full = shape;
  full.recompute = Recompute::kNone;
  working_layer_ = p.recompute == Recompute::kNone ? 0.0 : layer_activation_bytes(m, full);
  // One activation crossing a stage boundary ([b, s, h], 1/t of it with sequence parallelism).
  boundary_ = static_cast<double>(p.micro_batch_size * m.seq_length) *
              static_cast<double>(m.hidden_size) * element_ /
              (p.sequence_parallel ? static_cast<double>(p.tensor_parallel) : 1.0);
}

double ActivationMemory::on_stage(int64_t r) const {
  const int64_t layers = p_.layers_on_stage(m_, r);
  const double inflight = inflight_layer_activations(p_, r, layers);
  double bytes = inflight * per_layer_ + working_layer_;
  if (r == 0 && layers > 0)
    bytes +=
        inflight / static_cast<double>(layers) * static_cast<double>(p_.virtual_stages) * boundary_;
  return bytes;
}

double ActivationMemory::p2p_buffers() const {
  return p_.pipeline_parallel > 1 ? 4.0 * boundary_ : 0.0;
}

double inflight_layer_activations(const ParallelPlan& p, int64_t r, int64_t layers_on_stage) {
  const double m = static_cast<double>(p.num_microbatches());
  const double layers = static_cast<double>(layers_on_stage);
  switch (p.schedule) {
    case Schedule::kGPipe:
      return m * layers;
    case Schedule::kInterleaved1F1B: {
      const double v = static_cast<double>(p.virtual_stages);
      const double pp = static_cast<double>(p.pipeline_parallel);
      // Megatron runs every forward first when m == p.
      if (m == pp) return m * layers;
      const double warmup = 2.0 * (pp - static_cast<double>(r) - 1.0) + (v - 1.0) * pp;
      return std::min(warmup + 1.0, m * v) * layers / v;
    }
    case Schedule::kZeroBubbleH1:
      // Every rank holds p microbatches until their weight-gradient passes (counted whole).
      return std::min(static_cast<double>(p.pipeline_parallel), m) * layers;
    case Schedule::k1F1B:
      break;
  }
  return std::min(static_cast<double>(p.pipeline_parallel - r), m) * layers;
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
  return op.bytes / (cluster_.gpu.hbm_bandwidth_gbps * kGB * eff) +
         profile_.kernel_gap_us * kMicrosecond;
}

LayerShape CostModel::priced_layer_shape(const ParallelPlan& p) const {
  LayerShape s = layer_shape(p);
  s.activation_dtype = profile_.activation_dtype;
  return s;
}

double CostModel::op_time(const Op& op, const ParallelPlan& p) const {
  switch (op.kind) {
    case OpKind::kGemm:
      return gemm_time(op);
    case OpKind::kMemory:
      return memory_time(op);
    case OpKind::kCollective: {
      GroupSpan span;
      if (op.group == CommGroup::kTensor)
        span = tensor_group_span(cluster_, p);
      else if (op.group == CommGroup::kData)
        span = data_group_span(cluster_, p);
      return comm_.collective_time(op.collective, op.bytes, span);
    }
  }
  return 0.0;
}

std::vector<double> CostModel::exposed_times(const std::vector<Op>& ops,
                                             const ParallelPlan& p) const {
  std::vector<double> time(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) time[i] = op_time(ops[i], p);
  const int64_t t = p.tensor_parallel;
  if (t == 1) return time;
  // Arrival skew (measured by ptdp calibrate): each tensor-parallel collective also waits for
  // its last rank, a fraction of the compute since the previous one.
  if (profile_.arrival_skew > 0) {
    double since = 0;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind != OpKind::kCollective) {
        since += time[i];
      } else if (ops[i].group == CommGroup::kTensor) {
        time[i] += profile_.arrival_skew * since;
        since = 0;
      }
    }
  }
  if (!p.tp_comm_overlap || !p.sequence_parallel) return time;
  // --tp-comm-overlap (Transformer Engine's userbuffers): a sequence-parallel all-gather is
  // pipelined with the GEMM that consumes it, a reduce-scatter with the GEMM that produces it,
  // each cut into t chunks along the tokens. What it hides: the smaller of the two, but for
  // the one chunk that cannot overlap. What it costs: t - 1 more kernel launches and gaps.
  // Assumed: the chunks run on several streams (as Transformer Engine launches them), so their
  // tiles fill the GPU as the whole GEMM's do.
  std::vector<bool> paired(ops.size(), false);
  auto is_partner = [&](size_t j) {
    return ops[j].kind == OpKind::kGemm && ops[j].role != OpRole::kWeightGrad && !paired[j] &&
           ops[j].batch == 1;
  };
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& c = ops[i];
    if (c.kind != OpKind::kCollective || c.group != CommGroup::kTensor) continue;
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

PassTime CostModel::price(const std::vector<Op>& ops, const ParallelPlan& p, double* flops,
                          PassTime* weight_grad) const {
  PassTime t;
  const std::vector<double> times = exposed_times(ops, p);
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    const double time = times[i];
    PassTime& w = weight_grad && op.role == OpRole::kWeightGrad ? *weight_grad : t;
    if (op.kind == OpKind::kCollective)
      w.tp_comm += time;
    else
      w.compute += time;
    *flops += op.flops();
  }
  if (weight_grad) add(t, *weight_grad, 1);
  return t;
}

const CostModel::ShapeTimes& CostModel::shape_times(const ParallelPlan& p) const {
  const auto key = std::make_tuple(
      p.tensor_parallel, p.micro_batch_size, p.sequence_parallel, static_cast<int>(p.recompute),
      int64_t{p.tp_comm_overlap} * 4 + int64_t{p.gradient_accumulation_fusion} * 2 +
          p.fp32_grad_reduce);
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  const LayerShape shape = priced_layer_shape(p);
  ShapeTimes st;
  const PassOps layer = transformer_layer_ops(model_, shape);
  const PassOps embed = embedding_ops(model_, shape);
  const PassOps head = lm_head_ops(model_, shape);
  double fwd_flops = 0, bwd_flops = 0;
  st.layer_f = price(layer.forward, p, &fwd_flops);
  st.layer_b = price(layer.backward, p, &bwd_flops, &st.layer_w);
  st.layer_r = price(layer.recompute, p, &st.layer_recompute_flops);
  st.layer_flops = fwd_flops + bwd_flops;
  double ef = 0, hf = 0;
  st.embed_f = price(embed.forward, p, &ef);
  st.embed_b = price(embed.backward, p, &ef, &st.embed_w);
  st.head_f = price(head.forward, p, &hf);
  st.head_b = price(head.backward, p, &hf, &st.head_w);
  st.embed_flops = ef;
  st.head_flops = hf;
  return cache_.emplace(key, st).first->second;
}

ChunkTime CostModel::layer_span_time(const ShapeTimes& st, int64_t layers, bool embedding,
                                     bool head) {
  ChunkTime c;
  c.layers = layers;
  const double l = static_cast<double>(layers);
  add(c.forward, st.layer_f, l);
  add(c.backward, st.layer_b, l);
  add(c.recompute, st.layer_r, l);
  add(c.weight_grad, st.layer_w, l);
  if (embedding) {
    add(c.forward, st.embed_f, 1);
    add(c.backward, st.embed_b, 1);
    add(c.weight_grad, st.embed_w, 1);
  }
  if (head) {
    add(c.forward, st.head_f, 1);
    add(c.backward, st.head_b, 1);
    add(c.weight_grad, st.head_w, 1);
  }
  return c;
}

std::vector<StageTime> CostModel::stage_times(const ParallelPlan& p, const ShapeTimes& st) const {
  std::vector<StageTime> stages;
  for (int64_t r = 0; r < p.pipeline_parallel; ++r) {
    stages.push_back(
        {layer_span_time(st, p.layers_on_stage(model_, r), r == 0, r == p.pipeline_parallel - 1)});
  }
  return stages;
}

double CostModel::activation_message_bytes(const ParallelPlan& p) const {
  const double element = static_cast<double>(dtype_bytes(profile_.activation_dtype));
  return static_cast<double>(p.micro_batch_size * model_.seq_length) *
         static_cast<double>(model_.hidden_size) * element /
         (p.sequence_parallel ? static_cast<double>(p.tensor_parallel) : 1.0);
}

double CostModel::gradient_sync_time(const ParallelPlan& p, double params) const {
  const GroupSpan dp = data_group_span(cluster_, p);
  const double gbytes = params * gradient_bytes_per_parameter(p);
  if (p.distributed_optimizer)
    return comm_.collective_time(Collective::kReduceScatter, gbytes, dp) +
           comm_.collective_time(Collective::kAllGather, params * kWeightBytes, dp);
  return comm_.collective_time(Collective::kAllReduce, gbytes, dp);
}

double CostModel::hidden_param_gather(const ParallelPlan& p, double params, int64_t layers,
                                      double forward_s) const {
  if (!p.overlap_param_gather || !p.distributed_optimizer || p.data_parallel == 1) return 0.0;
  const double gather = comm_.collective_time(Collective::kAllGather, params * kWeightBytes,
                                              data_group_span(cluster_, p));
  return std::min(gather - last_gradient_bucket_time(gather, layers), forward_s);
}

double CostModel::embedding_sync_time(const ParallelPlan& p) const {
  if (p.pipeline_parallel == 1 || model_.untie_embeddings_and_output_weights) return 0.0;
  GroupSpan pair;
  pair.size = 2;
  pair.nodes = pipeline_crosses_nodes(cluster_, p) ? 2 : 1;
  pair.concurrent_per_node = cluster_.gpus_per_node;
  const double emb = static_cast<double>(model_.vocab_size * model_.hidden_size) /
                     static_cast<double>(p.tensor_parallel) * gradient_bytes_per_parameter(p);
  return comm_.collective_time(Collective::kAllReduce, emb, pair);
}

double CostModel::optimizer_time(const ParallelPlan& p, double params) const {
  const double local =
      params / (p.distributed_optimizer ? static_cast<double>(p.data_parallel) : 1.0);
  const double eff = profile_.memory_efficiency_of("optimizer");
  return local * profile_.optimizer_bytes_per_param /
             (cluster_.gpu.hbm_bandwidth_gbps * kGB * eff) +
         profile_.kernel_gap_us * kMicrosecond;
}

ChunkTime CostModel::chunk_time(const ParallelPlan& p, int64_t rank, int64_t chunk) const {
  return layer_span_time(shape_times(p), p.layers_on_stage(model_, rank) / p.virtual_stages,
                         rank == 0 && chunk == 0,
                         rank == p.pipeline_parallel - 1 && chunk == p.virtual_stages - 1);
}

double CostModel::parameters_on_stage(const ParallelPlan& p, int64_t r) const {
  const double t = static_cast<double>(p.tensor_parallel);
  double params =
      static_cast<double>(p.layers_on_stage(model_, r)) * model_.parameters_per_layer() / t;
  const bool first = r == 0, last = r == p.pipeline_parallel - 1;
  if (first) params += model_.embedding_parameters() / t;
  if (last) {
    params += 2.0 * static_cast<double>(model_.hidden_size);  // final layernorm
    if (model_.untie_embeddings_and_output_weights) {
      params += model_.output_parameters() / t;
    } else if (!first) {
      // Tied embeddings: the last stage keeps its own copy of the word embeddings.
      params += static_cast<double>(model_.vocab_size * model_.hidden_size) / t;
    }
  }
  return params;
}

MemoryBreakdown CostModel::memory(const ParallelPlan& p) const {
  const ActivationMemory activations(model_, p, DType::kBF16);
  const double tokens = static_cast<double>(p.micro_batch_size * model_.seq_length);
  const double t = static_cast<double>(p.tensor_parallel);
  const double d = static_cast<double>(p.data_parallel);

  const double grad_bytes = gradient_bytes_per_parameter(p);
  MemoryBreakdown best;
  for (int64_t r = 0; r < p.pipeline_parallel; ++r) {
    MemoryBreakdown mb;
    const double params = parameters_on_stage(p, r);
    mb.weights = params * kWeightBytes;
    mb.gradients = params * grad_bytes;
    mb.optimizer = params * kOptimizerBytes / (p.distributed_optimizer ? d : 1.0);
    mb.activations = activations.on_stage(r);
    if (r == p.pipeline_parallel - 1) {
      // fp16 logits and their fp32 softmax for the vocabulary shard, one microbatch.
      const double vocab_local = std::ceil(static_cast<double>(model_.vocab_size) / t);
      mb.buffers += tokens * vocab_local * (2.0 + 4.0);
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
  size_t slowest = 0;
  double sum_stage = 0;
  for (size_t r = 0; r < out.stages.size(); ++r) {
    sum_stage += fill_of(out.stages[r]);
    if (out.stages[r].per_microbatch() > out.stages[slowest].per_microbatch()) slowest = r;
  }
  const StageTime& s = out.stages[slowest];
  TimeBreakdown& b = out.breakdown;
  b.compute = m * (s.forward.compute + s.backward.compute);
  b.recompute = m * s.recompute.compute;
  b.tp_comm = m * (s.forward.tp_comm + s.backward.tp_comm + s.recompute.tp_comm);
  const double fill = (sum_stage - fill_of(s)) / v;
  b.bubble = fill;  // GPipe and 1F1B share (p-1)/m; interleaving divides it by v

  // Pipeline transfers: blocking send/receive pairs on the critical path, one per chunk
  // boundary and direction for every microbatch, plus the fill and drain of the pipeline.
  if (p.pipeline_parallel > 1) {
    out.p2p_time_s = comm_.p2p_time(activation_message_bytes(p), p);
    b.pp_comm = (2.0 * m * v + 2.0 * (pp - 1.0)) * out.p2p_time_s;
  }

  // Data-parallel gradient reduction of the most loaded stage, and the tied-embedding
  // all-reduce between the first and last stage.
  double params_max = 0;
  for (int64_t r = 0; r < p.pipeline_parallel; ++r)
    params_max = std::max(params_max, parameters_on_stage(p, r));
  out.dp_time_s = gradient_sync_time(p, params_max);
  double dp_exposed =
      out.dp_time_s - hidden_param_gather(p, params_max, s.layers, s.forward.total());
  if (p.overlap_grad_reduce && p.data_parallel > 1) {
    // Buckets are reduced while the last microbatch's backward pass runs, all but the last.
    const double hidden = s.backward.total() + s.recompute.total();
    dp_exposed = std::max(last_gradient_bucket_time(dp_exposed, s.layers), dp_exposed - hidden);
  }
  b.dp_comm = dp_exposed + embedding_sync_time(p);

  b.optimizer = optimizer_time(p, params_max);

  out.iteration_time_s =
      b.compute + b.recompute + b.tp_comm + b.pp_comm + b.dp_comm + b.bubble + b.optimizer;

  // FLOPs: the op lists count per-GPU shards, so multiply by t; all microbatches, all replicas.
  const double per_mb_model =
      static_cast<double>(model_.num_layers) * st.layer_flops + st.embed_flops + st.head_flops;
  const double per_mb_recompute = static_cast<double>(model_.num_layers) * st.layer_recompute_flops;
  const double replicas =
      static_cast<double>(p.tensor_parallel) * m * static_cast<double>(p.data_parallel);
  out.model_flops = per_mb_model * replicas;
  out.hardware_flops = (per_mb_model + per_mb_recompute) * replicas;
  out.model_tflops_per_gpu = tflops_per_gpu(out.model_flops, out.iteration_time_s, p.num_gpus());
  out.hardware_tflops_per_gpu =
      tflops_per_gpu(out.hardware_flops, out.iteration_time_s, p.num_gpus());
  out.mfu = out.model_tflops_per_gpu / cluster_.gpu.peak_tflops_16bit;
  out.tokens_per_s = tokens_per_second(model_, p, out.iteration_time_s);
  out.memory = memory(p);
  return out;
}

}  // namespace ptdp
