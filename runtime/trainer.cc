#include "runtime/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/plan_rules.h"
#include "runtime/backend.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/data_plane.h"
#include "runtime/expert_groups.h"
#include "runtime/fsdp.h"
#include "runtime/gpt_model.h"
#include "runtime/grad_sync.h"
#include "runtime/lr_schedule.h"
#include "runtime/process_groups.h"
#include "runtime/shard_footprint.h"
#include "runtime/tensor.h"

namespace ptdp {
namespace {

using Clock = std::chrono::steady_clock;

// Runs f on every rank. If it throws on any rank, the lowest such rank rethrows its error and
// the others throw PeerFailed, so every rank stops before training and one says why.
template <class F>
void agree(ControlPlane& control, F f) {
  std::exception_ptr error;
  try {
    f();
  } catch (const std::exception&) {
    error = std::current_exception();
  }
  const int first = control.agree(error != nullptr);
  if (first < 0) return;
  if (first == control.rank()) std::rethrow_exception(error);
  throw PeerFailed();
}

// A timeline event on the control plane: fixed-size little records of plain values.
struct PackedEvent {
  int32_t pp, dp, kind, microbatch, chunk;
  double start, end;
};
struct PackedOp {
  int32_t pp, dp, chunk, microbatch, id, role;
  double start, end;
};
struct PackedSpan {  // a step-level collective's span (runtime/grad_sync.h)
  int32_t pp, dp;
  double start, end;
};

// Every rank's records as bytes, gathered on the control plane's rank 0.
template <class Packed, class T, class F>
std::vector<std::vector<uint8_t>> gather_packed(ControlPlane& control, const std::vector<T>& v,
                                                F pack) {
  std::vector<uint8_t> mine(v.size() * sizeof(Packed));
  for (size_t i = 0; i < v.size(); ++i) {
    const Packed p = pack(v[i]);
    std::memcpy(mine.data() + i * sizeof(Packed), &p, sizeof p);
  }
  return control.all_gather_bytes(mine);
}

// Calls f on each record of every rank's bytes, rank by rank.
template <class Packed, class F>
void for_each_packed(const std::vector<std::vector<uint8_t>>& all, F f) {
  for (const std::vector<uint8_t>& bytes : all) {
    for (size_t at = 0; at + sizeof(Packed) <= bytes.size(); at += sizeof(Packed)) {
      Packed p;
      std::memcpy(&p, bytes.data() + at, sizeof p);
      f(p);
    }
  }
}

int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == "VmHWM:") {
      int64_t kib = 0;
      in >> kib;
      return kib * 1024;
    }
    std::string rest;
    std::getline(in, rest);
  }
  return 0;
}

// The checkpoint layout: everything that must match for a shard to be loaded and the run to
// continue its loss curve.
nlohmann::json layout_fields(const TrainOptions& o, int64_t flat_size) {
  const ParallelPlan& p = o.plan;
  nlohmann::json j = {{"model", to_json(o.model)},
                      {"t", p.tensor_parallel},
                      {"p", p.pipeline_parallel},
                      {"d", p.data_parallel},
                      {"v", p.virtual_stages},
                      {"layers_per_stage", p.layers_per_stage},
                      {"distributed_optimizer", p.distributed_optimizer},
                      {"global_batch_size", p.global_batch_size},
                      {"micro_batch_size", p.micro_batch_size},
                      {"parameters_on_rank", flat_size}};
  // The instances the optimizer's states are sharded in (what the shards' sizes depend on).
  if (p.distributed_optimizer && p.optimizer_shards() < p.data_parallel * p.context_parallel)
    j["distributed_optimizer_instances"] =
        p.data_parallel * p.context_parallel / p.optimizer_shards();
  // A pipeline layout decides which layers a chunk holds (an even split and a layout can give
  // every rank the same size).
  if (!p.layers_per_chunk.empty()) j["layers_per_chunk"] = p.layers_per_chunk;
  // Megatron-FSDP's sharded weights: a shard holds only its block of the layers' weights (the
  // rest is zero in its file), which a run keeping whole weights must not load.
  if (runs_megatron_fsdp(o.model, p) && p.shards_weights()) j["layer_weights_sharded"] = true;
  if (o.model.is_moe()) {  // the expert grid decides which experts a shard holds
    j["ep"] = p.expert_parallel;
    j["etp"] = p.expert_tp();
  }
  return j;
}

nlohmann::json checkpoint_layout(const TrainOptions& o, int64_t flat_size) {
  nlohmann::json layout = layout_fields(o, flat_size);
  // Absent without context parallelism, as in the checkpoints written before it.
  if (o.plan.context_parallel > 1) layout["cp"] = o.plan.context_parallel;
  return layout;
}

int64_t total(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// Floats of one AdamW moment for parameter segments of these sizes: all of them, or with the
// distributed optimizer this rank's 1/d of each (1/edp of the routed experts' segment 2).
int64_t moment_floats(const std::vector<int64_t>& segments, bool distributed, int64_t d,
                      int64_t edp) {
  int64_t n = 0;
  for (size_t i = 0; i < segments.size(); ++i)
    n += distributed ? segments[i] / (i == 2 ? edp : d) : segments[i];
  return n;
}

void validate_options(const TrainOptions& o) {
  if (o.steps <= 0) throw InputError("--steps", "must be positive");
  if (o.precision == DType::kF16) o.loss_scale.validate();
  schedule_of(o).validate();
  if (!(o.clip_grad >= 0 && std::isfinite(o.clip_grad)))
    throw InputError("--clip-grad", "must be finite and not negative");
  if (!(o.weight_decay >= 0 && std::isfinite(o.weight_decay)))
    throw InputError("--weight-decay", "must be finite and not negative");
  if (!(o.beta1 >= 0 && o.beta1 < 1)) throw InputError("--adam-beta1", "must be in [0, 1)");
  if (!(o.beta2 >= 0 && o.beta2 < 1)) throw InputError("--adam-beta2", "must be in [0, 1)");
  if (!(o.eps > 0 && std::isfinite(o.eps))) throw InputError("--adam-eps", "must be positive");
  if (o.save_interval < 0) throw InputError("--save-interval", "must not be negative");
  if (o.save_interval > 0 && o.save_dir.empty())
    throw InputError("--save-interval", "needs --save DIR");
  if (o.keep_checkpoints < 0) throw InputError("--keep-checkpoints", "must be at least 1");
  if (o.keep_checkpoints > 0 && o.save_dir.empty())
    throw InputError("--keep-checkpoints", "needs --save DIR");
}

// PTDP_SCATTER_GATHER_P2P: "auto" (unset: scatter/gather where the job spans hosts), "always"
// (for tests on one host) or "never"; anything else is an InputError naming the variable.
std::string scatter_gather_p2p_mode() {
  const char* v = std::getenv("PTDP_SCATTER_GATHER_P2P");
  const std::string mode = v && *v ? v : "auto";
  if (mode != "auto" && mode != "always" && mode != "never")
    throw InputError("PTDP_SCATTER_GATHER_P2P",
                     "must be auto, always or never, not '" + mode + "'");
  return mode;
}

class Executor {
 public:
  Executor(const TrainOptions& o, Communicator& world, ControlPlane& control, bool dry = false)
      : o_(o), world_(world), control_(control), dry_(dry) {}

  TrainResult run(const std::function<void(const StepStats&)>& on_step);
  std::vector<RankFootprint> dry_run(const std::function<void(const RankFootprint&)>& check);

 private:
  void setup();
  void load_checkpoint();
  void save_checkpoint(int64_t completed);
  // Returns the step's mean loss; mtp_loss: the multi-token prediction modules' (StepStats).
  double step(int64_t step, double* grad_norm, double* mtp_loss);
  void tokens_of(int64_t step, int64_t mb, std::vector<int32_t>& out) const;
  void gather_timeline(TrainResult& r);
  // The ranks whose timeline a trace holds: one per (replica, stage), as the others of its
  // tensor- and context-parallel groups run the same passes.
  bool timeline_rank() const { return pos_.tp == 0 && cpr_ == 0; }

  const TrainOptions& o_;
  Communicator& world_;
  ControlPlane& control_;  // agreement, losses, counts, timelines (runtime/communicator.h)
  const bool dry_;         // check and size everything, allocate nothing
  // The plan's ranks: the world's, or, in a dry run by one process of a plan of several ranks,
  // every rank of the plan worked out here.
  int64_t ranks_ = 1;
  ShardLayout layout_;
  std::vector<int64_t> segment_sizes_;
  std::unique_ptr<ProcessGroups> pg_;
  // With a device backend (memory the host may not touch), the data plane stages its buffers
  // through host memory: world_ wrapped, and every group split from it.
  std::unique_ptr<Communicator> staged_world_;
  std::string data_plane_;  // a device backend's: "nccl" or "staged"
  Communicator* data_world_ = nullptr;
  std::unique_ptr<Communicator> tp_, dp_, pp_, model_, embedding_;
  std::unique_ptr<Communicator> ep_, etp_, edp_;  // MoE models (runtime/expert_groups.h)
  ExpertPosition expert_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<GptShard> shard_;
  std::unique_ptr<DataParallelOptimizer> optimizer_;
  std::unique_ptr<ScheduleExecutor> executor_;
  PipelineSchedule schedule_;
  std::optional<TokenSource> data_;
  int64_t t_ = 1, p_ = 1, d_ = 1, m_ = 1, first_step_ = 0;
  // Context parallelism: cp_ ranks per ring; the dp x cp ranks of a (tp, pp) reduce gradients
  // together (dcp_ of them), so ProcessGroups places ranks on a (t, p, dcp_) grid whose data
  // index is cpr + cp dp (runtime/context_parallel.h).
  int64_t cp_ = 1, dcp_ = 1, dp_index_ = 0, cpr_ = 0;
  std::unique_ptr<Communicator> cp_group_;
  std::unique_ptr<Communicator> cp_heads_, cp_ring_;  // a2a+p2p's all-to-all group and ring
  GridPosition pos_;
  bool dist_ = false;
  int64_t instances_ = 1;  // the distributed optimizer's instances (--num-distributed-...)
  // With K > 1 instances: the ranks of this rank's instance, and the K ranks (one per instance)
  // that all-reduce its shard; the experts' likewise.
  std::unique_ptr<Communicator> instance_, replicas_, expert_instance_, expert_replicas_;
  // Megatron-FSDP plans that run sharded (runtime/fsdp.h); after the groups its collectives use,
  // so that it is destroyed (waiting for what it has in flight) before them.
  std::unique_ptr<MegatronFsdp> fsdp_;
  // Updates applied so far (AdamW's and the learning rate's step): every step but the ones
  // skipped for an fp16 overflow. Checkpoints keep it with the loss scaler's state.
  int64_t applied_ = 0;
  LossScaler scaler_{o_.loss_scale};
  bool skipped_ = false;  // the last step's update was skipped
  std::vector<TimelineEvent> events_;
  std::vector<TimedOp> ops_;
  std::vector<std::pair<double, double>> norm_spans_, bucket_spans_, gather_spans_;
  std::string scatter_gather_mode_ = "auto";  // PTDP_SCATTER_GATHER_P2P
  bool scatter_gather_ = false;
  Clock::time_point t0_;
};

void Executor::setup() {
  const ParallelPlan& plan = o_.plan;
  const ModelSpec& m = o_.model;
  ShardLayout& layout = layout_;
  agree(control_, [&] {
    validate_options(o_);
    m.validate();
    t_ = plan.tensor_parallel;
    p_ = plan.pipeline_parallel;
    d_ = plan.data_parallel;
    cp_ = plan.context_parallel;
    dcp_ = d_ * cp_;
    const int64_t need = t_ * cp_ * p_ * d_;
    ranks_ = dry_ && world_.size() == 1 ? need : world_.size();
    if (ranks_ != need)
      throw InputError("world size",
                       std::to_string(world_.size()) +
                           " ranks, but the plan needs t * cp * p * d = " + std::to_string(t_) +
                           " * " + std::to_string(cp_) + " * " + std::to_string(p_) + " * " +
                           std::to_string(d_) + " = " + std::to_string(need));
    if (ranks_ > world_.size() && !o_.load_dir.empty())
      throw InputError("--load", "a dry run of the plan's " + std::to_string(ranks_) +
                                     " ranks in one process does not read their checkpoint "
                                     "shards: run it under mpirun -np " +
                                     std::to_string(ranks_));
    plan.validate(m);
    pg_ = std::make_unique<ProcessGroups>(ranks_, t_, p_, dcp_, world_.rank());
    pos_ = pg_->position();
    dp_index_ = pos_.dp / cp_;
    cpr_ = pos_.dp % cp_;
    layout.t = t_;
    layout.tp = pos_.tp;
    layout.p = p_;
    layout.pp = pos_.pp;
    layout.cp = cp_;
    layout.cp_rank = cpr_;
    layout.cp_a2a_size = plan.cp_a2a_size();
    layout.v = plan.virtual_stages;
    layout.micro_batch = plan.micro_batch_size;
    layout.sequence_parallel = plan.sequence_parallel;
    layout.recompute = plan.recompute;
    layout.recompute_layers = plan.recompute_layers;
    layout.recompute_modules = plan.recompute_modules;
    layout.dtype = o_.precision;
    layout.layers_per_stage = layers_per_model_chunk(m, plan);
    dist_ = plan.distributed_optimizer;
    // The distributed optimizer shards over the ranks of its instance (d * cp / K of them; a
    // Megatron-FSDP plan's states as it shards them: HFSDP's over every rank, one instance).
    instances_ = dist_ ? dcp_ / plan.optimizer_shards() : 1;
    layout.segment_multiple = dist_ ? dcp_ / instances_ : 1;
    // The expert grid spans a stage's t * cp * d ranks (Megatron-Core's): an MoE layer routes
    // each rank's own tokens, its sequence chunks under context parallelism included.
    expert_ = expert_position(t_, dcp_, m.is_moe() ? plan.expert_tp() : 1, plan.expert_parallel,
                              pos_.tp, pos_.dp, pos_.pp);
    layout.ep = expert_.ep;
    layout.ep_rank = expert_.ep_rank;
    layout.etp = expert_.etp;
    layout.etp_rank = expert_.etp_rank;
    layout.expert_segment_multiple = dist_ ? expert_.edp / instances_ : 1;
    // This rank's shards (the distributed optimizer's), and Megatron-FSDP's sharding where it
    // runs sharded.
    layout.shard_rank = pos_.dp % layout.segment_multiple;
    layout.expert_shard_rank =
        expert_.edp_rank % std::max<int64_t>(1, layout.expert_segment_multiple);
    if (runs_megatron_fsdp(m, plan)) layout.fsdp = plan.fsdp;
    validate_shard_layout(m, layout);
    segment_sizes_ = shard_segment_sizes(m, layout);
    m_ = plan.num_microbatches();
    schedule_ = make_pipeline_schedule(schedule_spec(plan, m.last_stage_shares_word_embedding()));
    data_ = o_.data == "synthetic" ? TokenSource::synthetic(m.vocab_size, o_.seed)
                                   : TokenSource::file(o_.data, m.vocab_size, m.seq_length);
    backend_ = make_backend(o_.backend);
    scatter_gather_mode_ = scatter_gather_p2p_mode();
  });
  if (dry_) return;
  data_world_ = &world_;
  if (!backend_->host_accessible()) {  // NCCL, or MPI on host copies (runtime/data_plane.h)
    DataPlane plane = make_device_data_plane(world_, control_, *backend_);
    data_plane_ = plane.kind;
    staged_world_ = std::move(plane.world);
    data_world_ = staged_world_.get();
  }
  const int key = static_cast<int>(world_.rank());
  // Named for messages (a timeout, the watchdog): "tensor-parallel 3" is tensor group 3.
  auto split = [&](int64_t color, const char* kind) {
    return data_world_->split(static_cast<int>(color), key,
                              kind + std::string(" ") + std::to_string(color));
  };
  tp_ = split(pg_->tensor_color(), "tensor-parallel");
  dp_ = split(pg_->data_color(), "data-parallel");
  pp_ = split(pg_->pipeline_color(), "pipeline");
  model_ = split(pg_->model_color(), "model-parallel");
  // The first and last stages' word embeddings (the tied output layer, or the copy the
  // multi-token prediction modules look their inputs up in) are kept equal.
  const bool embedding_member =
      p_ > 1 && (pos_.pp == 0 || pos_.pp == p_ - 1) && o_.model.last_stage_shares_word_embedding();
  embedding_ = split(embedding_member ? pg_->pipeline_color() : t_ * dcp_ + key, "embedding");
  if (m.is_moe()) {
    ep_ = split(expert_.ep_color, "expert-parallel");
    etp_ = split(expert_.etp_color, "expert-tensor-parallel");
    edp_ = split(expert_.edp_color, "expert-data-parallel");
  }
  shard_ = std::make_unique<GptShard>(m, layout, tp_.get(), o_.seed, backend_.get());
  shard_->set_expert_groups(ep_.get(), etp_.get());
  if (cp_ > 1) {  // the cp ranks of one (tp, dp, pp)
    const int64_t color = pos_.tp + t_ * (dp_index_ + d_ * pos_.pp);
    cp_group_ = split(color, "context-parallel");
    // a2a+p2p: the all-to-all groups of A adjacent context-parallel ranks, and the rings of the
    // cp / A ranks at one place in them (Megatron-Core's hierarchical context-parallel groups).
    const int64_t a = shard_->layout().cp_a2a_size;
    if (a > 1 && a < cp_) {
      cp_heads_ = split(color * (cp_ / a) + cpr_ / a, "context-parallel a2a");
      cp_ring_ = split(color * a + cpr_ % a, "context-parallel ring");
    }
    shard_->set_context_group(cp_group_.get(), cp_heads_.get(), cp_ring_.get());
  }
  const auto& segs = shard_->segments();
  for (size_t i = 0; i < segs.size(); ++i)
    if (i >= segment_sizes_.size() || segs[i].size != segment_sizes_[i])
      throw std::logic_error("the shard's parameter segments differ from shard_segment_sizes");
  DataParallelGroups groups;
  groups.tensor = tp_.get();
  groups.data = dp_.get();
  // Megatron-Core's instances: consecutive ranks of a data-parallel group of `size` (the dense
  // one's index is cpr + cp * dp here, as Megatron orders its data-parallel group with context
  // parallelism), this rank the `rank`-th, the group's colour `color`; with K > 1 each instance
  // and each set of replicas (one rank per instance) is a communicator of its own.
  auto shard_groups = [&](int64_t color, int64_t rank, int64_t size, const std::string& kind,
                          std::unique_ptr<Communicator>& instance,
                          std::unique_ptr<Communicator>& replicas) {
    OptimizerShards s;
    s.shards = size / instances_;
    s.shard_rank = rank % s.shards;
    s.replica_rank = rank / s.shards;
    if (instances_ > 1) {
      instance = split(color * instances_ + s.replica_rank, (kind + "optimizer-instance").c_str());
      replicas = split(color * s.shards + s.shard_rank, (kind + "optimizer-replica").c_str());
      s.replicas = replicas.get();
    }
    return s;
  };
  groups.dense_shards = shard_groups(pg_->data_color(), pos_.dp, dcp_, "", instance_, replicas_);
  if (instance_) groups.data = instance_.get();
  if (m.is_moe())
    groups.expert_shards = shard_groups(expert_.edp_color, expert_.edp_rank, expert_.edp, "expert-",
                                        expert_instance_, expert_replicas_);
  groups.embedding = embedding_.get();
  groups.norm = dist_ || m.is_moe() ? data_world_ : model_.get();
  groups.norm_spans_replicas = m.is_moe();
  groups.expert_data = expert_instance_ ? expert_instance_.get() : edp_.get();
  groups.expert_data_parallel = expert_.edp;
  groups.edp_rank = expert_.edp_rank;
  groups.etp_rank = expert_.etp_rank;
  groups.data_parallel = dcp_;
  groups.dp_rank = pos_.dp;
  groups.tp_rank = pos_.tp;
  optimizer_ = std::make_unique<DataParallelOptimizer>(*shard_, groups, dist_);
  if (shard_->layout().fsdp >= FsdpSharding::kOptimGrads) {
    fsdp_ = std::make_unique<MegatronFsdp>(*shard_, groups.data, groups.expert_data);
    shard_->set_fsdp(fsdp_.get());
    optimizer_->set_fsdp(fsdp_.get());
  }
  executor_ = std::make_unique<ScheduleExecutor>(*shard_, *pp_, *optimizer_,
                                                 schedule_.ranks[static_cast<size_t>(pos_.pp)],
                                                 pos_.pp, p_, dp_index_, m_);
  // Buckets only where there is a data-parallel reduction to hide.
  // (Megatron-FSDP reduces every part's gradients in its backward pass: nothing left to hide.)
  executor_->overlap_grad_reduce(o_.plan.overlap_grad_reduce && dcp_ > 1 && !fsdp_);
  executor_->asynchronous_sends(!schedule_.synchronous_p2p);
  // SC'21's scatter/gather of pipeline transfers: where Megatron-LM applies it (t > 1, not with
  // sequence parallelism, whose transfers are already 1/t) and the cost model prices it (the
  // pipeline crosses nodes: here, the job spans more than one host).
  if (plan.scatter_gather_p2p && t_ > 1 && p_ > 1 && !plan.sequence_parallel &&
      scatter_gather_mode_ != "never") {
    // Every rank sees the same hosts, so every rank decides alike.
    const auto hosts =
        scatter_gather_mode_ == "always" ? std::vector<std::string>{} : host_of_each_rank(control_);
    scatter_gather_ = scatter_gather_mode_ == "always" ||
                      std::set<std::string>(hosts.begin(), hosts.end()).size() > 1;
    if (scatter_gather_) executor_->scatter_gather(tp_.get(), pos_.tp);
  }
  optimizer_->overlap_param_gather(o_.plan.overlap_param_gather);
}

void Executor::load_checkpoint() {
  agree(control_, [&] {
    const int64_t step = read_latest(o_.load_dir);
    const int64_t params = total(segment_sizes_);
    const auto layout = checkpoint_layout(o_, params);
    CheckpointShard c = read_checkpoint_shard(o_.load_dir, world_.rank(), step, layout);
    const auto moments = static_cast<size_t>(
        moment_floats(segment_sizes_, dist_, dcp_ / instances_, expert_.edp / instances_));
    // A fourth array (since fp16 runs) holds the updates applied and the loss scaler's state;
    // without it every step was applied.
    if (c.arrays.size() < 3 || c.arrays.size() > 4 ||
        c.arrays[0].size() != static_cast<size_t>(params) || c.arrays[1].size() != moments ||
        c.arrays[2].size() != moments || (c.arrays.size() == 4 && c.arrays[3].size() != 4))
      throw InputError("--load", "the checkpoint's arrays do not fit this run");
    applied_ = c.step;
    if (c.arrays.size() == 4) {
      applied_ = static_cast<int64_t>(c.arrays[3][0]);
      if (applied_ < 0 || applied_ > c.step)
        throw InputError("--load", "the checkpoint's count of applied updates is malformed");
      scaler_.restore({c.arrays[3].begin() + 1, c.arrays[3].end()});
    }
    if (!dry_) {
      optimizer_->parameters_from_host(c.arrays[0]);
      DeviceBuffer* into[2] = {&optimizer_->adam_m(), &optimizer_->adam_v()};
      for (size_t i = 0; i < 2; ++i)
        backend_->upload(c.arrays[i + 1].data(), into[i]->data<float>(), into[i]->bytes());
    }
    first_step_ = c.step;
    if (first_step_ >= o_.steps)
      throw InputError("--steps", "the checkpoint has already completed " +
                                      std::to_string(first_step_) + " steps");
  });
}

std::vector<RankFootprint> Executor::dry_run(
    const std::function<void(const RankFootprint&)>& check) {
  setup();
  if (!o_.load_dir.empty()) load_checkpoint();
  // Every rank's footprint follows from the plan: each rank works out all of them (and a dry
  // run by one process of a plan of several ranks checks each rank's layout as its rank would).
  std::vector<RankFootprint> all;
  const bool every_rank_here = ranks_ > world_.size();
  for (int64_t r = 0; r < ranks_; ++r) {
    const GridPosition pos = ProcessGroups(ranks_, t_, p_, dcp_, r).position();
    ShardLayout l = layout_;
    l.tp = pos.tp;
    l.pp = pos.pp;
    l.cp_rank = pos.dp % cp_;
    if (every_rank_here) {
      const ModelSpec& m = o_.model;
      const ExpertPosition e = expert_position(t_, dcp_, m.is_moe() ? o_.plan.expert_tp() : 1,
                                               o_.plan.expert_parallel, pos.tp, pos.dp, pos.pp);
      l.ep = e.ep;
      l.ep_rank = e.ep_rank;
      l.etp = e.etp;
      l.etp_rank = e.etp_rank;
      l.expert_shard_rank = e.edp_rank % std::max<int64_t>(1, l.expert_segment_multiple);
      agree(control_, [&] { validate_shard_layout(m, l); });
    }
    l.shard_rank = pos.dp % l.segment_multiple;
    const std::vector<int64_t> sizes = shard_segment_sizes(o_.model, l);
    RankFootprint f;
    f.rank = r;
    f.tp = pos.tp;
    f.pp = pos.pp;
    f.dp = pos.dp / cp_;
    f.cp = pos.dp % cp_;
    f.parameter_floats = total(sizes);
    // AdamW's two moments (the distributed optimizer reduces its gradient shard in place).
    // Mixed precision adds the fp32 master weights of the same range.
    const int64_t states = 2 + (o_.precision != DType::kF32 ? 1 : 0);
    f.optimizer_floats =
        states * moment_floats(sizes, dist_, dcp_ / instances_, expert_.edp / instances_);
    f.precision = o_.precision;
    f.fsdp = l.fsdp >= FsdpSharding::kOptimGrads;
    if (f.fsdp) f.fsdp_held = fsdp_held(o_.model, l);
    all.push_back(f);
  }
  agree(control_, [&] {
    if (!check) return;
    if (every_rank_here)
      for (const RankFootprint& f : all) check(f);
    else
      check(all[static_cast<size_t>(world_.rank())]);
  });
  return all;
}

void Executor::save_checkpoint(int64_t completed) {
  const auto layout = checkpoint_layout(o_, shard_->flat_size());
  // The arrays come to the host before they are written.
  // The parameters in fp32 (the master weights with mixed precision).
  std::vector<std::vector<float>> host{optimizer_->parameters_to_host()};
  std::vector<std::span<const float>> arrays;
  for (DeviceBuffer* b : {&optimizer_->adam_m(), &optimizer_->adam_v()}) {
    host.emplace_back(static_cast<size_t>(b->size()));
    backend_->download(b->data<float>(), host.back().data(), b->bytes());
  }
  // The updates applied and the loss scaler's state (runtime/loss_scaler.h).
  host.push_back({static_cast<float>(applied_)});
  for (float v : scaler_.state()) host.back().push_back(v);
  for (const auto& h : host) arrays.emplace_back(h.data(), h.size());
  // Agreed on, so that a failed write (a full disk) stops every rank, and `latest` moves only
  // once every shard is in place.
  agree(control_,
        [&] { write_checkpoint_shard(o_.save_dir, world_.rank(), completed, layout, arrays); });
  agree(control_, [&] {
    if (world_.rank() == 0) write_latest(o_.save_dir, completed);
  });
  if (world_.rank() == 0 && o_.keep_checkpoints > 0) {
    try {
      prune_checkpoints(o_.save_dir, completed, o_.keep_checkpoints);
    } catch (const std::exception& e) {  // an old checkpoint left behind is not fatal
      std::fprintf(stderr, "ptdp: warning: --keep-checkpoints: %s\n", e.what());
    }
  }
}

void Executor::tokens_of(int64_t step, int64_t mb, std::vector<int32_t>& out) const {
  const int64_t b = o_.plan.micro_batch_size, s = o_.model.seq_length;
  out.resize(static_cast<size_t>(b * (s + 1)));
  // Megatron's order: data-parallel rank r takes the r-th contiguous slice of the global batch.
  // Every context-parallel rank of a replica reads the same sequences (and takes its chunks).
  const int64_t base = step * o_.plan.global_batch_size + dp_index_ * m_ * b + mb * b;
  for (int64_t i = 0; i < b; ++i) data_->sequence(base + i, s, out.data() + i * (s + 1));
}

double Executor::step(int64_t step, double* grad_norm, double* mtp_loss) {
  const bool fp16 = o_.precision == DType::kF16;
  StepContext ctx;
  ctx.step = applied_;
  ctx.lr = learning_rate(o_, applied_);
  ctx.loss_scale = fp16 ? scaler_.scale() : 1.0;
  ctx.optimizer.grad_scale = ctx.loss_scale;
  ctx.optimizer.skip_overflow = fp16;
  ctx.optimizer.beta1 = o_.beta1;
  ctx.optimizer.beta2 = o_.beta2;
  ctx.optimizer.eps = o_.eps;
  ctx.optimizer.weight_decay = o_.weight_decay;
  ctx.optimizer.clip_grad = o_.clip_grad;
  ctx.tokens = [&](int64_t mb, std::vector<int32_t>& out) { tokens_of(step, mb, out); };
  const bool record = o_.record_timeline && timeline_rank();
  const double loss_sum = executor_->run(ctx, grad_norm, record ? &events_ : nullptr, t0_);
  // Mean loss over the global batch, to every rank: each replica's last stage (tensor-parallel
  // rank 0) contributes its share, summed in rank order; with context parallelism each cp rank
  // the mean over its half of the chunks, all of equal size.
  // A non-finite gradient norm on any rank (its weights are now bad) makes the sum NaN too.
  const double mtp_sum = shard_->take_mtp_loss();  // on every rank, so none accumulates
  double loss = 0, mtp = 0;
  if (pos_.pp == p_ - 1 && pos_.tp == 0) {
    loss = loss_sum / static_cast<double>(m_ * dcp_);
    if (o_.model.mtp_num_layers > 0)
      mtp = mtp_sum / static_cast<double>(m_ * dcp_ * o_.model.mtp_num_layers);
  }
  *mtp_loss = control_.sum(mtp);
  // fp16: an overflow (a non-finite norm, the same on every rank) skipped the update; the
  // scaler backs off and the step is not a failure.
  skipped_ = fp16 && control_.max(int64_t{optimizer_->skipped()}) > 0;
  if (!fp16 || scaler_.update(skipped_)) ++applied_;
  if (!std::isfinite(*grad_norm) && !skipped_) loss = std::numeric_limits<double>::quiet_NaN();
  return control_.sum(loss);
}

void Executor::gather_timeline(TrainResult& r) {
  const auto all = gather_packed<PackedEvent>(control_, events_, [](const TimelineEvent& e) {
    return PackedEvent{e.pp,    e.dp, static_cast<int32_t>(e.kind), e.microbatch, e.chunk,
                       e.start, e.end};
  });
  const int32_t pp = static_cast<int32_t>(pos_.pp), dp = static_cast<int32_t>(dp_index_);
  const auto ops = gather_packed<PackedOp>(control_, ops_, [&](const TimedOp& o) {
    return PackedOp{pp,
                    dp,
                    o.chunk,
                    o.microbatch,
                    static_cast<int32_t>(o.id),
                    static_cast<int32_t>(o.role),
                    o.start,
                    o.end};
  });
  auto spans = [&](const std::vector<std::pair<double, double>>& v) {
    return gather_packed<PackedSpan>(control_, v, [&](const std::pair<double, double>& n) {
      return PackedSpan{pp, dp, n.first, n.second};
    });
  };
  const auto norms = spans(norm_spans_), buckets = spans(bucket_spans_),
             gathers = spans(gather_spans_);
  if (control_.rank() != 0) return;
  for (const auto& job :
       {std::pair{&norms, &r.norm_reductions}, std::pair{&buckets, &r.grad_buckets},
        std::pair{&gathers, &r.param_gathers}}) {
    std::vector<SyncEvent>* out = job.second;
    for_each_packed<PackedSpan>(*job.first, [out](const PackedSpan& p) {
      out->push_back({p.pp, p.dp, p.start, p.end});
    });
  }
  for_each_packed<PackedEvent>(all, [&](const PackedEvent& p) {
    r.timeline.push_back(
        {p.pp, p.dp, static_cast<ActionKind>(p.kind), p.microbatch, p.chunk, p.start, p.end});
  });
  for_each_packed<PackedOp>(ops, [&](const PackedOp& p) {
    r.op_timeline.push_back({p.pp, p.dp,
                             TimedOp{static_cast<OpId>(p.id), static_cast<OpRole>(p.role), p.chunk,
                                     p.microbatch, p.start, p.end}});
  });
}

TrainResult Executor::run(const std::function<void(const StepStats&)>& on_step) {
  MemoryCounter::reset_peak();
  setup();
  if (!o_.load_dir.empty()) load_checkpoint();
  TrainResult result;
  result.first_step = first_step_;
  {
    // Each parameter once (replicated ones on TP rank 0, DP replica 0 only).
    // Routed experts once per expert grid position (expert replica 0, expert-tensor rank 0).
    int64_t n = 0;
    for (const ParamInfo& p : shard_->param_infos()) {
      if (p.tied_copy) continue;
      if (p.expert ? expert_.edp_rank == 0 && (!p.tp_replicated || expert_.etp_rank == 0)
                   : pos_.dp == 0 && (!p.tp_replicated || pos_.tp == 0))
        n += p.real_size;
    }
    result.parameters = control_.sum(n);
  }
  control_.barrier();
  t0_ = Clock::now();
  if (o_.record_timeline && timeline_rank()) {
    executor_->time_ops(&ops_, t0_);
    optimizer_->time_norm_reduction(&norm_spans_, t0_);
    optimizer_->time_buckets(&bucket_spans_);
    optimizer_->time_param_gathers(&gather_spans_);
    // Megatron-FSDP's gathers and reductions, on the same data-parallel track.
    if (fsdp_) fsdp_->time_collectives(&gather_spans_, &bucket_spans_, t0_);
  }
  const int64_t tokens_per_step = o_.plan.global_batch_size * o_.model.seq_length;
  for (int64_t s = first_step_; s < o_.steps; ++s) {
    const auto begin = Clock::now();
    StepStats st;
    st.step = s;
    st.lr = learning_rate(o_, applied_);
    if (o_.precision == DType::kF16) st.loss_scale = scaler_.scale();
    st.loss = step(s, &st.grad_norm, &st.mtp_loss);
    // The step ends when its last kernel (the optimizer's) has run, not when the host has
    // queued it: otherwise its time would spill into the next step's first pass.
    backend_->synchronize();
    st.skipped = skipped_;
    // The same sum on every rank: every rank stops here, before anything is saved.
    if (!std::isfinite(st.loss)) throw NonFiniteLoss(s, st.loss, st.grad_norm);
    st.seconds = std::chrono::duration<double>(Clock::now() - begin).count();
    st.start = std::chrono::duration<double>(begin - t0_).count();
    st.tokens = tokens_per_step;
    result.steps.push_back(st);
    // A device's op markers are read here, between steps (runtime/op_timer.h).
    if (o_.record_timeline && timeline_rank()) executor_->flush_timing(&events_);
    if (world_.rank() == 0 && on_step) on_step(st);
    const bool last = s + 1 == o_.steps;
    const bool save =
        !o_.save_dir.empty() && (last || (o_.save_interval > 0 && (s + 1) % o_.save_interval == 0));
    // The updated parameters whole again (--overlap-param-gather leaves them in flight).
    if (last || save) optimizer_->finish_param_gather();
    if (save) save_checkpoint(s + 1);
  }
  if (o_.record_timeline) gather_timeline(result);
  result.peak_memory_bytes = control_.max(MemoryCounter::peak());
  result.peak_rss_bytes = control_.max(peak_rss_bytes());
  result.expert_load = control_.max(shard_->expert_load());
  result.scatter_gather_p2p = scatter_gather_;
  result.data_plane = data_plane_.empty() ? (world_.size() > 1 ? "mpi" : "self") : data_plane_;
  return result;
}

}  // namespace

namespace {

std::string non_finite_message(int64_t step, double loss, double grad_norm) {
  auto show = [](double x) {  // "nan" whatever its sign bit
    if (std::isnan(x)) return std::string("nan");
    char b[32];
    std::snprintf(b, sizeof b, "%g", x);
    return std::string(b);
  };
  return "step " + std::to_string(step + 1) + ": the loss is " + show(loss) + " (gradient norm " +
         show(grad_norm) + " on rank 0): not finite; every rank stops before saving these weights";
}

}  // namespace

NonFiniteLoss::NonFiniteLoss(int64_t s, double loss, double grad_norm)
    : std::runtime_error(non_finite_message(s, loss, grad_norm)), step(s) {}

double learning_rate(const TrainOptions& o, int64_t step) {
  return schedule_of(o).at(step);
}

LearningRateSchedule schedule_of(const TrainOptions& o) {
  LearningRateSchedule s;
  s.lr = o.lr;
  s.min_lr = o.min_lr;
  s.warmup_steps = o.warmup_steps;
  s.total_steps = o.steps;
  s.decay = o.lr_decay;
  return s;
}

namespace {

// The control plane beside `world`: a group of one, or MPI's (a duplicate of COMM_WORLD).
std::unique_ptr<ControlPlane> control_plane_for(const Communicator& world) {
  if (world.size() == 1) return make_self_control_plane();
  auto c = make_mpi_control_plane();
  if (!c) throw std::logic_error("a world of several ranks without MPI");
  return c;
}

}  // namespace

TrainResult train(const TrainOptions& options, Communicator& world,
                  const std::function<void(const StepStats&)>& on_step) {
  auto control = control_plane_for(world);
  Executor e(options, world, *control);
  return e.run(on_step);
}

std::vector<RankFootprint> dry_run(const TrainOptions& options, Communicator& world,
                                   const std::function<void(const RankFootprint&)>& check) {
  auto control = control_plane_for(world);
  Executor e(options, world, *control, true);
  return e.dry_run(check);
}

}  // namespace ptdp
