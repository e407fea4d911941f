#include "runtime/fsdp.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace ptdp {

bool runs_megatron_fsdp(const ModelSpec& /*m*/, const ParallelPlan& p) {
  // In K instances (HSDP) only with whole copies across them (--outer-dp-sharding-strategy
  // no_shard): the shards are the distributed optimizer's in its K instances then.
  const bool instances_ok = p.instances() == 1 || p.fsdp_outer == FsdpSharding::kNoShard;
  return p.shards_gradients() && p.instance_ranks() > 1 && p.distributed_optimizer &&
         instances_ok && p.pipeline_parallel == 1 && p.virtual_stages == 1;
}

MegatronFsdp::MegatronFsdp(GptShard& shard, Communicator* data, Communicator* expert_data)
    : shard_(shard),
      be_(shard.backend()),
      data_(data),
      expert_data_(expert_data),
      weights_(shard.layout().fsdp == FsdpSharding::kOptimGradsParams) {
  const ShardLayout& l = shard.layout();
  if (l.fsdp < FsdpSharding::kOptimGrads)
    throw std::logic_error("MegatronFsdp on a shard that holds whole gradients");
  if (l.p != 1 || l.v != 1)
    throw std::logic_error("Megatron-FSDP runs one pipeline stage of one chunk");
  if (!data || (shard.segments().size() > 2 && !expert_data))
    throw std::logic_error("MegatronFsdp without its data-parallel groups");
  const auto& parts = shard.parts(0);
  for (int64_t part = 0; part < static_cast<int64_t>(parts.size()); ++part)
    ranges_.push_back(make_ranges(part));
  for (int64_t part = 0; part < static_cast<int64_t>(parts.size()); ++part) {
    if (shard.fsdp_unit(0, part)) {
      if (last_unit_ < first_unit_) first_unit_ = part;
      last_unit_ = part;
    }
    for (const Range& r : ranges_of(part)) ++users_[r.lo];
  }
  // Layers gathered ahead of the one running: until kFsdpPrefetchElements are in flight, as
  // the memory model counts them (its average layer).
  const int64_t units = last_unit_ - first_unit_ + 1;
  if (units > 0) {
    int64_t elements = 0;
    for (int64_t part = first_unit_; part <= last_unit_; ++part)
      for (const Range& r : ranges_of(part)) elements += r.hi - r.lo;
    const double unit = static_cast<double>(elements) / static_cast<double>(units);
    units_ahead_ = unit > 0 ? static_cast<int64_t>(fsdp_units_ahead(unit)) : 0;
  }
}

MegatronFsdp::~MegatronFsdp() {
  // A pass that failed may leave collectives in flight: wait for them (bounded) so that no
  // communicator writes into a freed window. Errors here are the failure's echo.
  for (auto& [part, gathers] : gathered_)
    for (Gather& g : gathers) try {
        if (g.work) g.work->wait();
      } catch (...) {
      }
  for (GradWindow& w : reducing_) try {
      if (w.work) w.work->wait();
    } catch (...) {
    }
}

std::vector<MegatronFsdp::Range> MegatronFsdp::make_ranges(int64_t part) const {
  std::vector<Range> out;
  const auto& segs = shard_.segments();
  const auto& parts = shard_.parts(0);
  auto add = [&](const std::pair<int64_t, int64_t>& range) {
    Range r{range.first, range.second, 0};
    while (r.seg + 1 < segs.size() && r.lo >= segs[r.seg + 1].offset) ++r.seg;
    out.push_back(r);
  };
  // Parts: 0 the embedding, 1 + l layer l, the head, then each multi-token prediction module
  // (one stage: every layer is here). The output layer tied to the word embedding (the same
  // parameter) adds to the embedding part's segment-0 range (the word table) too. An MTP module
  // looks its tokens up in the word table and ends in the output layer: it adds to the word
  // table and (untied) to the head's ranges, whose windows then open at the last module's
  // backward pass.
  const bool tied = !shard_.model().untie_embeddings_and_output_weights;
  const int64_t head = shard_.model().num_layers + 1;
  auto add_word_table = [&] {
    for (const auto& range : parts.front())
      if (range.first < segs[0].offset + segs[0].size) add(range);
  };
  if (part == head && tied) add_word_table();
  if (part > head) {
    add_word_table();
    if (!tied)
      for (const auto& range : parts.at(static_cast<size_t>(head))) add(range);
  }
  for (const auto& range : parts.at(static_cast<size_t>(part))) add(range);
  return out;
}

std::pair<int64_t, int64_t> MegatronFsdp::own_part(const Range& r) const {
  const auto [a, b] = shard_.own_shard(r.seg);
  return {std::max(r.lo, a), std::min(r.hi, b)};
}

void MegatronFsdp::start_gather(int64_t part) {
  if (gathered_.count(part)) return;
  std::vector<Gather>& gathers = gathered_[part];
  for (const Range& r : ranges_of(part)) {
    Gather g;
    g.r = r;
    g.window = DeviceBuffer(be_, shard_.layout().dtype, r.hi - r.lo);
    const auto [a, b] = own_part(r);
    // This rank's block of the range from its shard (none: any pointer, no element is read).
    const Ptr in = b > a ? shard_.param_map().held_at(a) : g.window.ptr();
    g.started = seconds();
    g.work = group_of(r.seg)->all_gather_v_async(in.p, g.window.ptr().p, counts(r),
                                                 shard_.layout().dtype);
    gathers.push_back(std::move(g));
  }
}

void MegatronFsdp::map_gathered(int64_t part) {
  start_gather(part);
  for (Gather& g : gathered_.at(part)) {
    if (g.mapped) continue;
    g.work->wait();
    g.work.reset();
    if (gather_sink_) gather_sink_->emplace_back(g.started, seconds());
    shard_.param_map().overlay(g.r.lo, g.r.hi, g.window.ptr());
    g.mapped = true;
  }
}

void MegatronFsdp::drop_gathered(int64_t part) {
  auto it = gathered_.find(part);
  if (it == gathered_.end()) return;
  for (Gather& g : it->second) {
    if (g.work) g.work->wait();
    if (g.mapped) shard_.param_map().remove_overlay(g.r.lo);
  }
  gathered_.erase(it);
}

std::vector<int64_t> MegatronFsdp::ahead(int64_t part, int step) const {
  std::vector<int64_t> out;
  for (int64_t k = 0; k <= units_ahead_; ++k) {
    const int64_t q = part + step * k;
    if (q < first_unit_ || q > last_unit_) break;
    out.push_back(q);
  }
  return out;
}

void MegatronFsdp::before_forward(int64_t part) {
  if (!weights_ || !shard_.fsdp_unit(0, part)) return;
  for (int64_t q : ahead(part, +1)) start_gather(q);
  map_gathered(part);
}

void MegatronFsdp::after_forward(int64_t part) {
  if (weights_ && shard_.fsdp_unit(0, part)) drop_gathered(part);
}

void MegatronFsdp::before_backward(int64_t part) {
  if (weights_ && shard_.fsdp_unit(0, part)) {
    for (int64_t q : ahead(part, -1)) start_gather(q);
    map_gathered(part);
  }
  for (const Range& r : ranges_of(part)) {
    if (open_.count(r.lo)) continue;  // the tied word embedding's, opened by the output layer
    GradWindow w;
    w.r = r;
    w.window = DeviceBuffer(be_, DType::kF32, r.hi - r.lo);
    be_.fill_zero(w.window.data<float>(), r.hi - r.lo);
    w.users_left = users_.at(r.lo);
    shard_.grad_map().overlay(r.lo, r.hi, w.window.ptr());
    open_.emplace(r.lo, std::move(w));
  }
}

void MegatronFsdp::after_backward(int64_t part) {
  if (weights_ && shard_.fsdp_unit(0, part)) drop_gathered(part);
  for (const Range& r : ranges_of(part)) {
    auto it = open_.find(r.lo);
    if (it == open_.end()) throw std::logic_error("Megatron-FSDP: a gradient window not open");
    if (--it->second.users_left > 0) continue;
    GradWindow w = std::move(it->second);
    open_.erase(it);
    shard_.grad_map().remove_overlay(r.lo);
    // In place: this rank's block of the sum lands where the block lies in the window.
    float* g = w.window.data<float>();
    w.started = seconds();
    w.work = group_of(r.seg)->reduce_scatter_v_async(g, g, counts(r), DType::kF32);
    reducing_.push_back(std::move(w));
    // One reduction stays in flight behind the next part's backward pass.
    while (static_cast<double>(reducing_.size()) > kFsdpGradientUnitsInFlight - 1.0)
      complete_oldest();
  }
  // The end of the microbatch's backward pass: its last reductions complete before the next
  // microbatch's passes (whose output layer's window would otherwise meet them).
  if (open_.empty())
    while (!reducing_.empty()) complete_oldest();
}

void MegatronFsdp::complete_oldest() {
  GradWindow& w = reducing_.front();
  w.work->wait();
  if (reduction_sink_) reduction_sink_->emplace_back(w.started, seconds());
  const auto [a, b] = own_part(w.r);
  // Into the shard itself (not a window open over the same range).
  if (b > a)
    be_.add(shard_.grad_map().held_at(a).f(), w.window.data<float>() + (a - w.r.lo), b - a);
  reducing_.pop_front();
}

void MegatronFsdp::finish() {
  if (!open_.empty()) throw std::logic_error("Megatron-FSDP: a gradient window left open");
  while (!reducing_.empty()) complete_oldest();
}

}  // namespace ptdp
