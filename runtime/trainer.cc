#include "runtime/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>

#include "core/error.h"
#include "core/plan_rules.h"
#include "kernels/cpu/kernels.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/gpt_model.h"
#include "runtime/process_groups.h"
#include "runtime/shard_footprint.h"
#include "runtime/tensor.h"

namespace ptdp {
namespace {

using Clock = std::chrono::steady_clock;
using Key = std::pair<int64_t, int64_t>;  // (microbatch, chunk)

// Runs f on every rank. If it throws on any rank, the lowest such rank rethrows its error and
// the others throw PeerFailed, so every rank stops before training and one says why.
template <class F>
void agree(Communicator& world, F f) {
  std::exception_ptr error;
  try {
    f();
  } catch (const std::exception&) {
    error = std::current_exception();
  }
  std::vector<float> failed(static_cast<size_t>(world.size()));
  const float mine = error ? 1.0f : 0.0f;
  world.all_gather(&mine, failed.data(), 1);
  for (int r = 0; r < world.size(); ++r) {
    if (failed[static_cast<size_t>(r)] == 0.0f) continue;
    if (r == world.rank()) std::rethrow_exception(error);
    throw PeerFailed();
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
nlohmann::json checkpoint_layout(const TrainOptions& o, int64_t flat_size) {
  const ParallelPlan& p = o.plan;
  return {{"model", to_json(o.model)},
          {"t", p.tensor_parallel},
          {"p", p.pipeline_parallel},
          {"d", p.data_parallel},
          {"v", p.virtual_stages},
          {"layers_per_stage", p.layers_per_stage},
          {"distributed_optimizer", p.distributed_optimizer},
          {"global_batch_size", p.global_batch_size},
          {"micro_batch_size", p.micro_batch_size},
          {"parameters_on_rank", flat_size}};
}

int64_t total(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// Floats of one AdamW moment for parameter segments of these sizes: all of them, or with the
// distributed optimizer this rank's 1/d of each.
int64_t moment_floats(const std::vector<int64_t>& segments, bool distributed, int64_t d) {
  int64_t n = 0;
  for (int64_t s : segments) n += distributed ? s / d : s;
  return n;
}

void validate_options(const TrainOptions& o) {
  if (o.steps <= 0) throw InputError("--steps", "must be positive");
  if (!(o.lr > 0)) throw InputError("--lr", "must be positive");
  if (o.min_lr < 0 || o.min_lr > o.lr) throw InputError("--min-lr", "must be in [0, --lr]");
  if (o.warmup_steps < 0) throw InputError("--lr-warmup-steps", "must not be negative");
  if (o.lr_decay != "constant" && o.lr_decay != "cosine")
    throw InputError("--lr-decay-style", "must be constant or cosine, got '" + o.lr_decay + "'");
  if (o.clip_grad < 0) throw InputError("--clip-grad", "must not be negative");
  if (o.weight_decay < 0) throw InputError("--weight-decay", "must not be negative");
  if (o.save_interval < 0) throw InputError("--save-interval", "must not be negative");
  if (o.save_interval > 0 && o.save_dir.empty())
    throw InputError("--save-interval", "needs --save DIR");
  if (o.plan.schedule == Schedule::kZeroBubbleH1)
    throw InputError("--pipeline-schedule",
                     "ptdp run executes gpipe, 1f1b and interleaved; zb-h1 is simulated only");
}

class Executor {
 public:
  Executor(const TrainOptions& o, Communicator& world, bool dry = false)
      : o_(o), world_(world), dry_(dry) {}

  TrainResult run(const std::function<void(const StepStats&)>& on_step);
  std::vector<RankFootprint> dry_run(const std::function<void(const RankFootprint&)>& check);

 private:
  void setup();
  void load_checkpoint();
  void save_checkpoint(int64_t completed);
  double step(int64_t step, double* grad_norm);
  void run_p2p(std::vector<Communicator::P2P>& batch, std::vector<Key>& sent_fwd,
               std::vector<Key>& sent_bwd);
  void tokens_of(int64_t step, int64_t mb, std::vector<int32_t>& out) const;
  void grad_sync();
  void embedding_sync();
  double optimizer_step(int64_t step);
  template <class F>
  void for_each_owned_range(F f);
  void gather_timeline(TrainResult& r);

  const TrainOptions& o_;
  Communicator& world_;
  const bool dry_;  // check and size everything, allocate nothing
  ShardLayout layout_;
  std::vector<int64_t> segment_sizes_;
  std::unique_ptr<ProcessGroups> pg_;
  std::unique_ptr<Communicator> tp_, dp_, pp_, model_, embedding_;
  std::unique_ptr<GptShard> shard_;
  PipelineSchedule schedule_;
  std::optional<TokenSource> data_;
  int64_t t_ = 1, p_ = 1, d_ = 1, m_ = 1, first_step_ = 0;
  GridPosition pos_;
  bool dist_ = false;
  // Optimizer state: with the distributed optimizer only this rank's shard of each segment.
  Buffer adam_m_, adam_v_, shard_grads_;
  std::vector<int64_t> state_offset_;  // per segment, into the state arrays
  std::map<Key, Buffer> act_in_, act_out_, grad_in_, grad_out_;
  std::vector<TimelineEvent> events_;
  Clock::time_point t0_;
};

void Executor::setup() {
  const ParallelPlan& plan = o_.plan;
  const ModelSpec& m = o_.model;
  ShardLayout& layout = layout_;
  agree(world_, [&] {
    validate_options(o_);
    m.validate();
    t_ = plan.tensor_parallel;
    p_ = plan.pipeline_parallel;
    d_ = plan.data_parallel;
    if (world_.size() != t_ * p_ * d_)
      throw InputError("world size", std::to_string(world_.size()) +
                                         " ranks, but the plan needs t * p * d = " +
                                         std::to_string(t_) + " * " + std::to_string(p_) + " * " +
                                         std::to_string(d_) + " = " + std::to_string(t_ * p_ * d_));
    plan.validate(m);
    pg_ = std::make_unique<ProcessGroups>(world_.size(), t_, p_, d_, world_.rank());
    pos_ = pg_->position();
    layout.t = t_;
    layout.tp = pos_.tp;
    layout.p = p_;
    layout.pp = pos_.pp;
    layout.v = plan.virtual_stages;
    layout.micro_batch = plan.micro_batch_size;
    layout.sequence_parallel = plan.sequence_parallel;
    layout.recompute = plan.recompute;
    layout.layers_per_stage = layers_per_model_chunk(m, plan);
    dist_ = plan.distributed_optimizer;
    layout.segment_multiple = dist_ ? d_ : 1;
    validate_shard_layout(m, layout);
    segment_sizes_ = shard_segment_sizes(m, layout);
    m_ = plan.num_microbatches();
    schedule_ = make_pipeline_schedule(schedule_spec(plan, !m.untie_embeddings_and_output_weights));
    data_ = o_.data == "synthetic" ? TokenSource::synthetic(m.vocab_size, o_.seed)
                                   : TokenSource::file(o_.data, m.vocab_size, m.seq_length);
  });
  if (dry_) return;
  const int key = static_cast<int>(world_.rank());
  tp_ = world_.split(static_cast<int>(pg_->tensor_color()), key);
  dp_ = world_.split(static_cast<int>(pg_->data_color()), key);
  pp_ = world_.split(static_cast<int>(pg_->pipeline_color()), key);
  model_ = world_.split(static_cast<int>(pg_->model_color()), key);
  const bool embedding_member = p_ > 1 && (pos_.pp == 0 || pos_.pp == p_ - 1) &&
                                !o_.model.untie_embeddings_and_output_weights;
  embedding_ = world_.split(
      embedding_member ? static_cast<int>(pg_->pipeline_color()) : static_cast<int>(t_ * d_ + key),
      key);
  shard_ = std::make_unique<GptShard>(m, layout, tp_.get(), o_.seed);

  const auto& segs = shard_->segments();
  int64_t state = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const Segment& s = segs[i];
    if (i >= segment_sizes_.size() || s.size != segment_sizes_[i])
      throw std::logic_error("the shard's parameter segments differ from shard_segment_sizes");
    state_offset_.push_back(state);
    state += dist_ ? s.size / d_ : s.size;
  }
  adam_m_.assign(static_cast<size_t>(state), 0.0f);
  adam_v_.assign(static_cast<size_t>(state), 0.0f);
  if (dist_) shard_grads_.assign(static_cast<size_t>(state), 0.0f);
}

void Executor::load_checkpoint() {
  agree(world_, [&] {
    const int64_t step = read_latest(o_.load_dir);
    const int64_t params = total(segment_sizes_);
    const auto layout = checkpoint_layout(o_, params);
    CheckpointShard c = read_checkpoint_shard(o_.load_dir, world_.rank(), step, layout);
    const auto moments = static_cast<size_t>(moment_floats(segment_sizes_, dist_, d_));
    if (c.arrays.size() != 3 || c.arrays[0].size() != static_cast<size_t>(params) ||
        c.arrays[1].size() != moments || c.arrays[2].size() != moments)
      throw InputError("--load", "the checkpoint's arrays do not fit this run");
    if (!dry_) {
      std::copy(c.arrays[0].begin(), c.arrays[0].end(), shard_->params().begin());
      std::copy(c.arrays[1].begin(), c.arrays[1].end(), adam_m_.begin());
      std::copy(c.arrays[2].begin(), c.arrays[2].end(), adam_v_.begin());
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
  // Every rank's footprint follows from the plan: each rank works out all of them.
  std::vector<RankFootprint> all;
  for (int64_t r = 0; r < world_.size(); ++r) {
    const GridPosition pos = ProcessGroups(world_.size(), t_, p_, d_, r).position();
    ShardLayout l = layout_;
    l.tp = pos.tp;
    l.pp = pos.pp;
    const std::vector<int64_t> sizes = shard_segment_sizes(o_.model, l);
    RankFootprint f;
    f.rank = r;
    f.tp = pos.tp;
    f.pp = pos.pp;
    f.dp = pos.dp;
    f.parameter_floats = total(sizes);
    // AdamW's two moments, and with the distributed optimizer the reduced gradient shard.
    f.optimizer_floats = (dist_ ? 3 : 2) * moment_floats(sizes, dist_, d_);
    all.push_back(f);
  }
  agree(world_, [&] {
    if (check) check(all[static_cast<size_t>(world_.rank())]);
  });
  return all;
}

void Executor::save_checkpoint(int64_t completed) {
  const auto layout = checkpoint_layout(o_, static_cast<int64_t>(shard_->params().size()));
  write_checkpoint_shard(o_.save_dir, world_.rank(), completed, layout,
                         {std::span<const float>(shard_->params().data(), shard_->params().size()),
                          std::span<const float>(adam_m_.data(), adam_m_.size()),
                          std::span<const float>(adam_v_.data(), adam_v_.size())});
  world_.barrier();
  if (world_.rank() == 0) write_latest(o_.save_dir, completed);
}

void Executor::tokens_of(int64_t step, int64_t mb, std::vector<int32_t>& out) const {
  const int64_t b = o_.plan.micro_batch_size, s = o_.model.seq_length;
  out.resize(static_cast<size_t>(b * (s + 1)));
  // Megatron's order: data-parallel rank r takes the r-th contiguous slice of the global batch.
  const int64_t base = step * o_.plan.global_batch_size + pos_.dp * m_ * b + mb * b;
  for (int64_t i = 0; i < b; ++i) data_->sequence(base + i, s, out.data() + i * (s + 1));
}

void Executor::run_p2p(std::vector<Communicator::P2P>& batch, std::vector<Key>& sent_fwd,
                       std::vector<Key>& sent_bwd) {
  pp_->batch(batch);
  batch.clear();
  for (const Key& k : sent_fwd) act_out_.erase(k);
  for (const Key& k : sent_bwd) grad_out_.erase(k);
  sent_fwd.clear();
  sent_bwd.clear();
}

// Calls f(param, lo, hi, state_index_of_lo) for the part of each parameter this rank's
// optimizer owns: all of it, or with the distributed optimizer its data-parallel shard.
template <class F>
void Executor::for_each_owned_range(F f) {
  const auto& segs = shard_->segments();
  for (const ParamInfo& p : shard_->param_infos()) {
    const Segment& s = segs[static_cast<size_t>(p.segment)];
    int64_t lo = p.offset, hi = p.offset + p.size, base = 0;
    if (dist_) {
      const int64_t shard = s.size / d_;
      const int64_t begin = s.offset + pos_.dp * shard;
      lo = std::max(lo, begin);
      hi = std::min(hi, begin + shard);
      if (lo >= hi) continue;
      base = state_offset_[static_cast<size_t>(p.segment)] + (lo - begin);
    } else {
      base = lo;
    }
    f(p, lo, hi, base);
  }
}

void Executor::grad_sync() {
  Buffer& g = shard_->grads();
  if (o_.plan.sequence_parallel && t_ > 1) {
    // Replicated parameters applied to a sequence slice: their gradients are partial sums.
    Buffer packed;
    for (const ParamInfo& p : shard_->param_infos())
      if (p.sp_partial)
        packed.insert(packed.end(), g.begin() + p.offset, g.begin() + p.offset + p.size);
    tp_->all_reduce(packed.data(), packed.size());
    size_t at = 0;
    for (const ParamInfo& p : shard_->param_infos())
      if (p.sp_partial) {
        std::copy(packed.begin() + static_cast<int64_t>(at),
                  packed.begin() + static_cast<int64_t>(at) + p.size, g.begin() + p.offset);
        at += static_cast<size_t>(p.size);
      }
  }
  const float inv_d = 1.0f / static_cast<float>(d_);
  if (!dist_) {
    if (d_ > 1) {
      dp_->all_reduce(g.data(), g.size());
      for (float& x : g) x *= inv_d;
    }
    return;
  }
  const auto& segs = shard_->segments();
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t shard = segs[i].size / d_;
    if (shard == 0) continue;
    float* out = shard_grads_.data() + state_offset_[i];
    dp_->reduce_scatter(g.data() + segs[i].offset, out, static_cast<size_t>(shard));
    if (d_ > 1)
      for (int64_t j = 0; j < shard; ++j) out[j] *= inv_d;
  }
}

void Executor::embedding_sync() {
  if (embedding_->size() < 2) return;
  const Segment& s = shard_->segments()[0];
  if (dist_)
    embedding_->all_reduce(shard_grads_.data() + state_offset_[0],
                           static_cast<size_t>(s.size / d_));
  else
    embedding_->all_reduce(shard_->grads().data() + s.offset, static_cast<size_t>(s.size));
}

double Executor::optimizer_step(int64_t step) {
  Buffer& params = shard_->params();
  float* grads = dist_ ? shard_grads_.data() : shard_->grads().data();
  // Global gradient norm: every parameter once (replicated ones on tensor-parallel rank 0, the
  // tied embedding on the first stage).
  double sq = 0;
  for_each_owned_range([&](const ParamInfo& p, int64_t lo, int64_t hi, int64_t base) {
    if (p.tied_copy || (p.tp_replicated && pos_.tp != 0)) return;
    const float* gp = grads + (dist_ ? base : lo);
    for (int64_t i = 0; i < hi - lo; ++i) sq += static_cast<double>(gp[i]) * gp[i];
  });
  float total = static_cast<float>(sq);
  (dist_ ? world_ : *model_).all_reduce(&total, 1);
  const double norm = std::sqrt(static_cast<double>(total));
  const double coef = o_.clip_grad > 0 && norm > o_.clip_grad ? o_.clip_grad / (norm + 1e-6) : 1.0;
  kernels::AdamW adam;
  adam.lr = learning_rate(o_, step);
  adam.beta1 = o_.beta1;
  adam.beta2 = o_.beta2;
  adam.eps = o_.eps;
  for_each_owned_range([&](const ParamInfo& p, int64_t lo, int64_t hi, int64_t base) {
    float* gp = grads + (dist_ ? base : lo);
    const int64_t n = hi - lo;
    if (coef != 1.0)
      for (int64_t i = 0; i < n; ++i) gp[i] = static_cast<float>(gp[i] * coef);
    kernels::AdamW a = adam;
    a.weight_decay = p.decay ? o_.weight_decay : 0.0;
    kernels::adamw_step(params.data() + lo, gp, adam_m_.data() + base, adam_v_.data() + base, n, a,
                        step + 1);
  });
  if (dist_) {
    const auto& segs = shard_->segments();
    Buffer gathered;
    for (const Segment& s : segs) {
      const int64_t shard = s.size / d_;
      if (shard == 0) continue;
      gathered.resize(static_cast<size_t>(s.size));
      dp_->all_gather(params.data() + s.offset + pos_.dp * shard, gathered.data(),
                      static_cast<size_t>(shard));
      std::copy(gathered.begin(), gathered.end(), params.begin() + s.offset);
    }
  }
  return norm;
}

double Executor::step(int64_t step, double* grad_norm) {
  std::fill(shard_->grads().begin(), shard_->grads().end(), 0.0f);
  const auto& actions = schedule_.ranks[static_cast<size_t>(pos_.pp)];
  const int64_t v = shard_->num_chunks();
  const int64_t next = (pos_.pp + 1) % p_, prev = (pos_.pp + p_ - 1) % p_;
  auto tag = [v](int dir, int64_t mb, int64_t chunk) {
    return static_cast<int>(((mb * v + chunk) * 2 + dir) % 32768);
  };
  std::vector<Communicator::P2P> batch;
  std::vector<Key> sent_fwd, sent_bwd;
  std::vector<int32_t> tokens;
  double loss_sum = 0;
  const bool record = o_.record_timeline && pos_.tp == 0;
  double group_start = -1;
  const size_t group_first_event = events_.size();
  for (const PipelineAction& a : actions) {
    const double start = std::chrono::duration<double>(Clock::now() - t0_).count();
    const Key key{a.microbatch, a.chunk};
    switch (a.kind) {
      case ActionKind::kForward: {
        const bool first = shard_->first_stage(a.chunk), last = shard_->last_stage(a.chunk);
        if (first || last) tokens_of(step, a.microbatch, tokens);
        Buffer out;
        const Buffer* in = first ? nullptr : &act_in_.at(key);
        loss_sum += shard_->forward(a.chunk, a.microbatch, tokens.data(), in, &out);
        if (!first) act_in_.erase(key);
        if (!last) act_out_[key] = std::move(out);
        break;
      }
      case ActionKind::kBackward: {
        const bool first = shard_->first_stage(a.chunk), last = shard_->last_stage(a.chunk);
        Buffer gin;
        const Buffer* gout = last ? nullptr : &grad_in_.at(key);
        shard_->backward(a.chunk, a.microbatch, gout, &gin, 1.0 / static_cast<double>(m_));
        if (!last) grad_in_.erase(key);
        if (!first) grad_out_[key] = std::move(gin);
        break;
      }
      case ActionKind::kSendForward: {
        const int64_t rc = pos_.pp == p_ - 1 ? a.chunk + 1 : a.chunk;
        Buffer& b = act_out_.at(key);
        batch.push_back(
            {true, b.data(), b.size(), static_cast<int>(next), tag(0, a.microbatch, rc)});
        sent_fwd.push_back(key);
        break;
      }
      case ActionKind::kRecvForward: {
        Buffer& b = act_in_[key];
        b.resize(static_cast<size_t>(shard_->boundary_elements()));
        batch.push_back(
            {false, b.data(), b.size(), static_cast<int>(prev), tag(0, a.microbatch, a.chunk)});
        break;
      }
      case ActionKind::kSendBackward: {
        const int64_t rc = pos_.pp == 0 ? a.chunk - 1 : a.chunk;
        Buffer& b = grad_out_.at(key);
        batch.push_back(
            {true, b.data(), b.size(), static_cast<int>(prev), tag(1, a.microbatch, rc)});
        sent_bwd.push_back(key);
        break;
      }
      case ActionKind::kRecvBackward: {
        Buffer& b = grad_in_[key];
        b.resize(static_cast<size_t>(shard_->boundary_elements()));
        batch.push_back(
            {false, b.data(), b.size(), static_cast<int>(next), tag(1, a.microbatch, a.chunk)});
        break;
      }
      case ActionKind::kGradSync:
        grad_sync();
        break;
      case ActionKind::kEmbeddingSync:
        embedding_sync();
        break;
      case ActionKind::kOptimizerStep:
        *grad_norm = optimizer_step(step);
        break;
      case ActionKind::kBackwardInput:
      case ActionKind::kBackwardWeight:
        throw std::logic_error("zero-bubble actions are not executed by ptdp run");
    }
    const bool p2p = is_p2p(a.kind);
    if (p2p && group_start < 0) group_start = start;
    if (p2p && !a.batched_with_next) run_p2p(batch, sent_fwd, sent_bwd);
    if (record) {
      const double end = std::chrono::duration<double>(Clock::now() - t0_).count();
      events_.push_back({static_cast<int32_t>(pos_.pp), static_cast<int32_t>(pos_.dp), a.kind,
                         a.microbatch, a.chunk, p2p ? group_start : start, end});
      if (p2p && !a.batched_with_next) {
        // Every action of a batched call spans the call.
        for (size_t i = events_.size(); i-- > group_first_event;) {
          TimelineEvent& e = events_[i];
          if (!is_p2p(e.kind) || e.start != group_start) break;
          e.end = end;
        }
      }
    }
    if (p2p && !a.batched_with_next) group_start = -1;
  }
  if (!batch.empty()) throw std::logic_error("schedule ends inside a batched transfer");
  // Mean loss over the global batch, to every rank.
  float loss = 0;
  if (pos_.pp == p_ - 1 && pos_.tp == 0)
    loss = static_cast<float>(loss_sum / static_cast<double>(m_ * d_));
  world_.all_reduce(&loss, 1);
  return loss;
}

void Executor::gather_timeline(TrainResult& r) {
  // Eight floats per event; times as microseconds split into a float and its remainder.
  std::vector<float> mine;
  for (const TimelineEvent& e : events_) {
    const double s = e.start * 1e6, d = (e.end - e.start) * 1e6;
    const float s_hi = static_cast<float>(s), d_hi = static_cast<float>(d);
    mine.insert(mine.end(),
                {static_cast<float>(e.pp), static_cast<float>(e.dp), static_cast<float>(e.kind),
                 static_cast<float>(e.microbatch), static_cast<float>(e.chunk), s_hi,
                 static_cast<float>(s - s_hi), d_hi + static_cast<float>(d - d_hi)});
  }
  const int n = world_.size();
  std::vector<float> counts(static_cast<size_t>(n));
  const float count = static_cast<float>(mine.size());
  world_.all_gather(&count, counts.data(), 1);
  const size_t most = static_cast<size_t>(*std::max_element(counts.begin(), counts.end()));
  mine.resize(most, 0.0f);
  std::vector<float> all(most * static_cast<size_t>(n));
  world_.all_gather(mine.data(), all.data(), most);
  if (world_.rank() != 0) return;
  for (int rank = 0; rank < n; ++rank) {
    const float* f = all.data() + static_cast<size_t>(rank) * most;
    for (size_t i = 0; i + 8 <= static_cast<size_t>(counts[static_cast<size_t>(rank)]); i += 8) {
      TimelineEvent e;
      e.pp = static_cast<int32_t>(f[i]);
      e.dp = static_cast<int32_t>(f[i + 1]);
      e.kind = static_cast<ActionKind>(static_cast<int>(f[i + 2]));
      e.microbatch = static_cast<int32_t>(f[i + 3]);
      e.chunk = static_cast<int32_t>(f[i + 4]);
      e.start = (static_cast<double>(f[i + 5]) + f[i + 6]) * 1e-6;
      e.end = e.start + static_cast<double>(f[i + 7]) * 1e-6;
      r.timeline.push_back(e);
    }
  }
}

TrainResult Executor::run(const std::function<void(const StepStats&)>& on_step) {
  MemoryCounter::reset_peak();
  setup();
  if (!o_.load_dir.empty()) load_checkpoint();
  TrainResult result;
  result.first_step = first_step_;
  {
    // Each parameter once (replicated ones on TP rank 0, DP replica 0 only). Summed exactly
    // in three 12-bit limbs, since the communicator reduces floats.
    int64_t n = 0;
    for (const ParamInfo& p : shard_->param_infos())
      if (!p.tied_copy && pos_.dp == 0 && (!p.tp_replicated || pos_.tp == 0)) n += p.real_size;
    float limbs[3] = {static_cast<float>(n & 4095), static_cast<float>((n >> 12) & 4095),
                      static_cast<float>(n >> 24)};
    world_.all_reduce(limbs, 3);
    result.parameters =
        std::llround(limbs[0]) + (std::llround(limbs[1]) << 12) + (std::llround(limbs[2]) << 24);
  }
  world_.barrier();
  t0_ = Clock::now();
  const int64_t tokens_per_step = o_.plan.global_batch_size * o_.model.seq_length;
  for (int64_t s = first_step_; s < o_.steps; ++s) {
    const auto begin = Clock::now();
    StepStats st;
    st.step = s;
    st.lr = learning_rate(o_, s);
    st.loss = step(s, &st.grad_norm);
    st.seconds = std::chrono::duration<double>(Clock::now() - begin).count();
    st.tokens = tokens_per_step;
    result.steps.push_back(st);
    if (world_.rank() == 0 && on_step) on_step(st);
    const bool last = s + 1 == o_.steps;
    if (!o_.save_dir.empty() && (last || (o_.save_interval > 0 && (s + 1) % o_.save_interval == 0)))
      save_checkpoint(s + 1);
  }
  if (o_.record_timeline) gather_timeline(result);
  std::vector<float> peaks(static_cast<size_t>(2 * world_.size()));
  const float mine[2] = {static_cast<float>(MemoryCounter::peak()),
                         static_cast<float>(peak_rss_bytes())};
  world_.all_gather(mine, peaks.data(), 2);
  for (size_t i = 0; i < peaks.size(); i += 2) {
    result.peak_memory_bytes = std::max(result.peak_memory_bytes, static_cast<int64_t>(peaks[i]));
    result.peak_rss_bytes = std::max(result.peak_rss_bytes, static_cast<int64_t>(peaks[i + 1]));
  }
  return result;
}

}  // namespace

double learning_rate(const TrainOptions& o, int64_t step) {
  if (o.warmup_steps > 0 && step < o.warmup_steps)
    return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  if (o.lr_decay != "cosine") return o.lr;
  const double span = static_cast<double>(std::max<int64_t>(1, o.steps - 1 - o.warmup_steps));
  const double x = std::min(1.0, static_cast<double>(step - o.warmup_steps) / span);
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(3.141592653589793 * x));
}

TrainResult train(const TrainOptions& options, Communicator& world,
                  const std::function<void(const StepStats&)>& on_step) {
  Executor e(options, world);
  return e.run(on_step);
}

std::vector<RankFootprint> dry_run(const TrainOptions& options, Communicator& world,
                                   const std::function<void(const RankFootprint&)>& check) {
  Executor e(options, world, true);
  return e.dry_run(check);
}

}  // namespace ptdp
