#include "runtime/grad_sync.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <utility>

namespace ptdp {

DataParallelOptimizer::DataParallelOptimizer(GptShard& shard, const DataParallelGroups& groups,
                                             bool distributed)
    : shard_(shard), be_(shard.backend()), g_(groups), dist_(distributed) {
  if (shard_.segments().size() > 2 && !g_.expert_data)
    throw std::logic_error("an MoE shard's optimizer without an expert-data-parallel group");
  int64_t state = 0;
  for (size_t i = 0; i < shard_.segments().size(); ++i) {
    state_offset_.push_back(state);
    state += dist_ ? shard_.segments()[i].size / shards_of(i) : shard_.segments()[i].size;
  }
  adam_m_ = DeviceBuffer(be_, DType::kF32, state);
  adam_v_ = DeviceBuffer(be_, DType::kF32, state);
  if (shard_.params().dtype() != DType::kF32) {
    // Mixed precision: fp32 master weights of what this rank updates, from the model's weights.
    master_ = DeviceBuffer(be_, DType::kF32, state);
    for_each_owned_range([&](const ParamInfo&, int64_t lo, int64_t hi, int64_t base) {
      be_.copy(shard_.param_at(lo), master_.data<float>() + base, hi - lo);
    });
  }
}

void DataParallelOptimizer::set_fsdp(MegatronFsdp* fsdp) {
  if (fsdp && !dist_) throw std::logic_error("Megatron-FSDP needs the distributed optimizer");
  fsdp_ = fsdp;
  if (fsdp_) defer_gather_ = false;
}

std::vector<float> DataParallelOptimizer::parameters_to_host() {
  // The flat array (what this rank does not hold under Megatron-FSDP, zero: its weights come
  // from the other ranks' shards).
  std::vector<float> host(static_cast<size_t>(shard_.flat_size()), 0.0f);
  shard_.param_map().for_each_mapped(0, shard_.flat_size(), [&](int64_t lo, int64_t hi, Ptr at) {
    download_floats(be_, at, host.data() + lo, hi - lo);
  });
  if (master_.size() == 0) return host;
  std::vector<float> master(static_cast<size_t>(master_.size()));
  download_floats(be_, master_.ptr(), master.data(), master_.size());
  for_each_owned_range([&](const ParamInfo&, int64_t lo, int64_t hi, int64_t base) {
    std::copy_n(master.begin() + base, hi - lo, host.begin() + lo);
  });
  return host;
}

void DataParallelOptimizer::parameters_from_host(const std::vector<float>& host) {
  if (static_cast<int64_t>(host.size()) != shard_.flat_size())
    throw std::logic_error("parameters_from_host: the size differs from the shard's");
  shard_.param_map().for_each_mapped(0, shard_.flat_size(), [&](int64_t lo, int64_t hi, Ptr at) {
    upload_floats(be_, host.data() + lo, at, hi - lo);
  });
  if (master_.size() == 0) return;
  std::vector<float> master(static_cast<size_t>(master_.size()));
  for_each_owned_range([&](const ParamInfo&, int64_t lo, int64_t hi, int64_t base) {
    std::copy_n(host.begin() + lo, hi - lo, master.begin() + base);
  });
  upload_floats(be_, master.data(), master_.ptr(), master_.size());
}

void DataParallelOptimizer::for_each_owned_range(
    const std::function<void(const ParamInfo&, int64_t, int64_t, int64_t)>& f) {
  const auto& segs = shard_.segments();
  for (const ParamInfo& p : shard_.param_infos()) {
    const auto seg = static_cast<size_t>(p.segment);
    const Segment& s = segs[seg];
    int64_t lo = p.offset, hi = p.offset + p.size, base = 0;
    if (dist_) {
      const int64_t shard = s.size / shards_of(seg);
      const int64_t begin = s.offset + shard_rank_of(seg) * shard;
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

bool DataParallelOptimizer::counts_in_norm(const ParamInfo& p) const {
  if (p.tied_copy) return false;
  // With K optimizer instances each shard's reduced gradients are on K ranks: instance 0's count.
  if (!first_instance(static_cast<size_t>(p.segment))) return false;
  if (p.expert)
    return (dist_ || !g_.norm_spans_replicas || g_.edp_rank == 0) &&
           (!p.tp_replicated || g_.etp_rank == 0);
  if (!dist_ && g_.norm_spans_replicas && g_.dp_rank != 0) return false;
  return !p.tp_replicated || g_.tp_rank == 0;
}

void DataParallelOptimizer::reduce_sequence_parallel(int64_t lo, int64_t hi) {
  if (shard_.layout().t < 2) return;
  // Replicated parameters applied to a sequence slice (or, --qk-layernorm's norms, to the rank's
  // heads): their gradients are partial sums. Those a bucket has reduced already are skipped
  // (buckets never overlap, so a bucket's own call finds none of them; the final call looks
  // each parameter up among the buckets).
  const bool sp = shard_.layout().sequence_parallel;
  auto wanted = [&](const ParamInfo& p) {
    if (!((p.sp_partial && sp) || p.tp_partial) || p.offset < lo || p.offset + p.size > hi)
      return false;
    auto it = buckets_.upper_bound({p.offset, INT64_MAX});  // the first bucket after p's start
    return it == buckets_.begin() || std::prev(it)->first.second < p.offset + p.size;
  };
  // The parts of them this rank holds (all of each, but under Megatron-FSDP its shard's; the
  // tensor-parallel ranks hold the same parts).
  const FlatMap& held = shard_.grad_map();
  int64_t n = 0;
  for (const ParamInfo& p : shard_.param_infos())
    if (wanted(p))
      held.for_each_mapped(p.offset, p.offset + p.size,
                           [&](int64_t a, int64_t b, Ptr) { n += b - a; });
  if (n == 0) return;
  Buffer packed(static_cast<size_t>(n), DType::kF32);
  int64_t at = 0;
  for (const ParamInfo& p : shard_.param_infos())
    if (wanted(p))
      held.for_each_mapped(p.offset, p.offset + p.size, [&](int64_t a, int64_t b, Ptr g) {
        be_.copy(g.f(), packed.data() + at, b - a);
        at += b - a;
      });
  g_.tensor->all_reduce(packed.data(), packed.size());
  at = 0;
  for (const ParamInfo& p : shard_.param_infos())
    if (wanted(p))
      held.for_each_mapped(p.offset, p.offset + p.size, [&](int64_t a, int64_t b, Ptr g) {
        be_.copy(packed.data() + at, g.f(), b - a);
        at += b - a;
      });
}

int64_t DataParallelOptimizer::own_shard(size_t seg) const {
  const Segment& s = shard_.segments()[seg];
  return s.offset + shard_rank_of(seg) * (s.size / shards_of(seg));
}

size_t DataParallelOptimizer::segment_of(int64_t lo, int64_t hi) const {
  const auto& segs = shard_.segments();
  for (size_t i = 0; i < segs.size(); ++i)
    if (segs[i].offset <= lo && hi <= segs[i].offset + segs[i].size) return i;
  throw std::logic_error("a gradient bucket across parameter segments");
}

std::vector<size_t> DataParallelOptimizer::shard_counts(size_t seg, int64_t lo, int64_t hi) const {
  // Each rank's shard of a segment is a contiguous block: the range's blocks are its
  // intersections with them, in rank order.
  return block_counts(shard_.segments()[seg], shards_of(seg), lo, hi);
}

std::unique_ptr<Work> DataParallelOptimizer::start_reduction(size_t seg, int64_t lo, int64_t hi) {
  float* g = shard_.grad_at(lo);
  if (!dist_) return group_of(seg)->all_reduce_async(g, static_cast<size_t>(hi - lo), DType::kF32);
  // In place: the part of this rank's shard in [lo, hi) is summed where it is.
  return group_of(seg)->reduce_scatter_v_async(g, g, shard_counts(seg, lo, hi), DType::kF32);
}

void DataParallelOptimizer::reduce_bucket(int64_t lo, int64_t hi) {
  if (hi <= lo || fsdp_) return;  // Megatron-FSDP reduces every part's gradients itself
  const size_t seg = segment_of(lo, hi);
  if (replicas_of(seg) < 2) return;  // nothing to reduce over (or to shard)
  reduce_sequence_parallel(lo, hi);
  const double queued = seconds();
  buckets_.emplace(std::pair{lo, hi}, InFlight{start_reduction(seg, lo, hi), queued});
  if (replicas_group_of(seg)) across_pending_.emplace_back(lo, hi);
}

std::pair<int64_t, int64_t> DataParallelOptimizer::own_part(size_t seg, int64_t lo,
                                                            int64_t hi) const {
  const int64_t own = own_shard(seg), shard = shard_.segments()[seg].size / shards_of(seg);
  return {std::max(lo, own), std::min(hi, own + shard)};
}

void DataParallelOptimizer::start_across(bool block) {
  size_t started = 0;
  for (; started < across_pending_.size(); ++started) {
    const auto range = across_pending_[started];
    InFlight& rs = buckets_.at(range);
    if (block) {
      rs.work->wait();
    } else if (rs.done < 0 && !rs.work->test()) {
      break;
    }
    if (rs.done < 0) rs.done = seconds();
    const size_t seg = segment_of(range.first, range.second);
    Communicator* across = replicas_group_of(seg);
    const auto [a, b] = own_part(seg, range.first, range.second);
    if (a >= b || across->size() < 2) continue;
    across_.emplace(range, InFlight{across->all_reduce_async(
                                        shard_.grad_at(a), static_cast<size_t>(b - a), DType::kF32),
                                    seconds()});
  }
  across_pending_.erase(across_pending_.begin(),
                        across_pending_.begin() + static_cast<std::ptrdiff_t>(started));
}

void DataParallelOptimizer::finish_across() {
  start_across(true);
  // What no bucket covered of each shard: the gaps between the buckets' own parts.
  auto g = [this](int64_t off) { return shard_.grad_at(off); };
  const auto& segs = shard_.segments();
  for (size_t i = 0; i < segs.size(); ++i) {
    Communicator* across = replicas_group_of(i);
    if (!across || across->size() < 2) continue;
    const auto [own, end] = own_part(i, segs[i].offset, segs[i].offset + segs[i].size);
    int64_t at = own;
    for (const auto& [range, f] : buckets_) {
      if (segment_of(range.first, range.second) != i) continue;
      const auto [a, b] = own_part(i, range.first, range.second);
      if (a >= b) continue;
      if (a > at) across->all_reduce(g(at), static_cast<size_t>(a - at));
      at = std::max(at, b);
    }
    if (at < end) across->all_reduce(g(at), static_cast<size_t>(end - at));
  }
  for (auto& [range, f] : across_) complete(f, bucket_sink_);
  across_.clear();
}

void DataParallelOptimizer::start_param_gathers() {
  for (const auto& [lo, hi] : shard_.part_ranges()) {
    const size_t seg = segment_of(lo, hi);
    if (shards_of(seg) < 2) continue;  // the whole segment is this rank's
    const double queued = seconds();
    gathers_.emplace(std::pair{lo, hi}, InFlight{start_gather(seg, lo, hi), queued});
  }
}

std::unique_ptr<Work> DataParallelOptimizer::start_gather(size_t seg, int64_t lo, int64_t hi) {
  const std::vector<size_t> counts = shard_counts(seg, lo, hi);
  size_t own = 0;  // this rank's block starts after the blocks of the ranks before it
  for (int64_t r = 0; r < shard_rank_of(seg); ++r) own += counts[static_cast<size_t>(r)];
  const Ptr out = shard_.param_at(lo);
  return group_of(seg)->all_gather_v_async(out.at(static_cast<int64_t>(own)).p, out.p, counts,
                                           out.t);
}

void DataParallelOptimizer::poll(InFlight& f) const {
  if (f.done < 0 && f.work->test()) f.done = seconds();
}

void DataParallelOptimizer::complete(InFlight& f,
                                     std::vector<std::pair<double, double>>* sink) const {
  f.work->wait();
  if (f.done < 0) f.done = seconds();
  if (sink) sink->emplace_back(f.queued, f.done);
}

void DataParallelOptimizer::wait_params(int64_t lo, int64_t hi) {
  auto it = gathers_.find({lo, hi});
  if (it == gathers_.end()) return;
  complete(it->second, gather_sink_);
  gathers_.erase(it);
}

void DataParallelOptimizer::finish_param_gather() {
  for (auto& [range, gather] : gathers_) complete(gather, gather_sink_);
  gathers_.clear();
}

void DataParallelOptimizer::progress() {
  for (InFlightByRange* m : {&gathers_, &buckets_, &across_})
    for (auto& [range, f] : *m) poll(f);
  start_across(false);
}

void DataParallelOptimizer::reduce_gradients() {
  const int64_t d = g_.data_parallel;
  const double inv_d = static_cast<double>(1.0f / static_cast<float>(d));
  if (fsdp_) {
    // Megatron-FSDP: every part's gradients were reduce-scattered into the shard during the
    // backward passes (within the instance: HSDP's shards are then all-reduced across the
    // instances); the tensor-parallel partial sums are summed on it, then averaged.
    fsdp_->finish();
    // (HSDP's all-reduce across the instances on the trace's data-parallel track, as the
    // overlapped buckets' are.)
    const double across_start = seconds();
    reduce_across_instances();
    if (bucket_sink_ && (g_.dense_shards.replicas || g_.expert_shards.replicas))
      bucket_sink_->emplace_back(across_start, seconds());
    reduce_sequence_parallel(0, shard_.flat_size());
    for (size_t i = 0; d > 1 && i < shard_.segments().size(); ++i) {
      const int64_t n = shard_.segments()[i].size / shards_of(i);
      if (n > 0) be_.scale(shard_.grad_at(own_shard(i)), n, inv_d);
    }
    return;
  }
  // Everything is held here, in one buffer laid out as the flat array.
  float* g = shard_.grads().data<float>();
  const int64_t g_size = shard_.grads().size();
  reduce_sequence_parallel(0, g_size);
  const auto& segs = shard_.segments();
  if (!buckets_.empty()) {
    // --overlap-grad-reduce: what the buckets left of each segment, then the wait for all.
    std::vector<std::unique_ptr<Work>> rest;
    for (size_t i = 0; i < segs.size(); ++i) {
      // One replica: nothing to reduce; the distributed optimizer still takes its (whole) shard.
      if (shards_of(i) < 2 && !dist_) continue;
      if (dist_ && segs[i].size / shards_of(i) == 0) continue;
      int64_t at = segs[i].offset;
      const int64_t end = segs[i].offset + segs[i].size;
      for (const auto& [range, f] : buckets_) {
        const auto [lo, hi] = range;
        if (hi <= at || lo >= end) continue;
        if (lo > at) rest.push_back(start_reduction(i, at, lo));
        at = std::max(at, hi);
      }
      if (at < end) rest.push_back(start_reduction(i, at, end));
    }
    for (auto& w : rest) w->wait();
    finish_across();
    for (auto& [range, f] : buckets_) complete(f, bucket_sink_);
    buckets_.clear();
    if (d > 1) {
      if (!dist_) be_.scale(g, g_size, inv_d);
      for (size_t i = 0; dist_ && i < segs.size(); ++i)
        be_.scale(g + own_shard(i), segs[i].size / shards_of(i), inv_d);
    }
    return;
  }
  if (!dist_) {
    // The dense segments at once, then the experts' over their own group.
    const int64_t dense = segs.size() > 2 ? segs[2].offset : g_size;
    if (d > 1) g_.data->all_reduce(g, static_cast<size_t>(dense));
    if (segs.size() > 2 && g_.expert_data_parallel > 1)
      g_.expert_data->all_reduce(g + segs[2].offset, static_cast<size_t>(segs[2].size));
    if (d > 1) be_.scale(g, g_size, inv_d);
    return;
  }
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t shard = segs[i].size / shards_of(i);
    if (shard == 0) continue;
    // In place, as Megatron-Core reduces into its gradient buffer: no second buffer. One
    // reduce-scatter (its in-place form leaves this rank's sum at the segment's start), then
    // the sum moves to where the shard lies (the blocks do not overlap).
    float* seg = g + segs[i].offset;
    group_of(i)->reduce_scatter(seg, seg, static_cast<size_t>(shard));
    if (own_shard(i) != segs[i].offset) be_.copy(seg, g + own_shard(i), shard);
  }
  reduce_across_instances();
  for (size_t i = 0; d > 1 && i < segs.size(); ++i)
    be_.scale(g + own_shard(i), segs[i].size / shards_of(i), inv_d);
}

void DataParallelOptimizer::reduce_across_instances() {
  // Megatron-Core's second reduction with several distributed-optimizer instances: each
  // instance has summed its own ranks' gradients into their shards; the K ranks holding the
  // same shard add the instances' sums. (Without --overlap-grad-reduce: after the
  // reduce-scatters, as Megatron-Core does then; with it, per bucket, start_across.)
  const auto& segs = shard_.segments();
  for (size_t i = 0; i < segs.size(); ++i) {
    Communicator* across = replicas_group_of(i);
    const int64_t shard = segs[i].size / shards_of(i);
    if (!across || across->size() < 2 || shard == 0) continue;
    across->all_reduce(shard_.grad_at(own_shard(i)), static_cast<size_t>(shard));
  }
}

void DataParallelOptimizer::sync_embedding() {
  if (g_.embedding->size() < 2) return;
  const Segment& s = shard_.segments()[0];
  if (dist_)
    g_.embedding->all_reduce(shard_.grad_at(own_shard(0)),
                             static_cast<size_t>(s.size / shards_of(0)));
  else
    g_.embedding->all_reduce(shard_.grad_at(s.offset), static_cast<size_t>(s.size));
}

double DataParallelOptimizer::step(int64_t step, double lr, const OptimizerSettings& o) {
  finish_param_gather();  // every forward pass has waited for its part already
  // The gradients are reduced in place, shard or whole.
  // Global gradient norm: every parameter once (replicated ones on tensor-parallel rank 0, the
  // tied embedding on the first stage).
  // Adjacent ranges are summed as one: on a GPU each sum_squares is a device-to-host copy,
  // and one per parameter tensor cost milliseconds a step (docs/gpu.md).
  double sq = 0;
  int64_t run_lo = 0, run_hi = 0;
  auto flush = [&] {
    if (run_hi > run_lo) sq = be_.sum_squares(shard_.grad_at(run_lo), run_hi - run_lo, sq);
  };
  for_each_owned_range([&](const ParamInfo& p, int64_t lo, int64_t hi, int64_t) {
    if (!counts_in_norm(p)) return;
    if (lo != run_hi) {  // not adjacent: a new range
      flush();
      run_lo = run_hi = lo;
    }
    run_hi += hi - lo;
  });
  flush();
  float total = static_cast<float>(sq);
  auto now = [&] {
    be_.synchronize();
    return seconds();
  };
  const double norm_start = norm_sink_ ? now() : 0.0;
  g_.norm->all_reduce(&total, 1);
  if (norm_sink_) norm_sink_->emplace_back(norm_start, now());
  const double scaled_norm = std::sqrt(static_cast<double>(total));
  skipped_ = o.skip_overflow && !std::isfinite(scaled_norm);
  if (skipped_) return scaled_norm;  // fp16 overflow: the parameters stay as they are
  const double norm = scaled_norm / o.grad_scale;
  // Unscaling and clipping in one pass over the gradients.
  const double coef =
      (o.clip_grad > 0 && norm > o.clip_grad ? o.clip_grad / (norm + 1e-6) : 1.0) / o.grad_scale;
  AdamWSettings adam;
  adam.lr = lr;
  adam.beta1 = o.beta1;
  adam.beta2 = o.beta2;
  adam.eps = o.eps;
  // One update per run of ranges adjacent in every array (gradients, weights, moments, the
  // model's copy), in spans of one weight decay: on a GPU each run is one launch (a launch per
  // parameter tensor, then per span of one decay, left the step's optimizer bound by the host's
  // launches, docs/gpu.md).
  // Mixed precision: AdamW on the fp32 master weights, then their bf16 copy in the model.
  const bool mixed = master_.size() > 0;
  adam.weight_decay = o.weight_decay;  // the decayed spans'
  struct Run {
    int64_t lo = 0, n = 0, base = 0;
    std::vector<Backend::DecaySpan> spans;
  } run;
  auto update = [&] {
    if (run.n == 0) return;
    const Ptr param = shard_.param_at(run.lo);
    float* w = mixed ? master_.data<float>() + run.base : param.f();
    be_.adamw_update_spans(w, shard_.grad_at(run.lo), adam_m_.data<float>() + run.base,
                           adam_v_.data<float>() + run.base, mixed ? param : Ptr(), run.spans, adam,
                           step + 1, coef);
    run.n = 0;
  };
  for_each_owned_range([&](const ParamInfo& p, int64_t lo, int64_t hi, int64_t base) {
    const bool adjacent = run.n > 0 && lo == run.lo + run.n && base == run.base + run.n &&
                          shard_.grad_at(lo) == shard_.grad_at(run.lo) + run.n &&
                          shard_.param_at(lo).p == shard_.param_at(run.lo).at(run.n).p;
    if (!adjacent) {
      update();
      run.lo = lo;
      run.base = base;
      run.spans.clear();  // (an empty run's zero-length span too)
    }
    if (run.spans.empty() || run.spans.back().decay != p.decay)
      run.spans.push_back({run.n, 0, p.decay});
    run.spans.back().n += hi - lo;
    run.n += hi - lo;
  });
  update();
  if (dist_) {
    for (size_t i = 0; i < shard_.segments().size(); ++i) {
      const Segment& s = shard_.segments()[i];
      const int64_t shard = s.size / shards_of(i);
      if (shard == 0) continue;
      if (defer_gather_ && shards_of(i) > 1) continue;  // start_param_gathers() below
      // Megatron-FSDP's sharded layer weights stay sharded: only what stays whole is gathered
      // (in place, range by range).
      if (shard_.layout().fsdp == FsdpSharding::kOptimGradsParams) {
        for (int64_t part = 0; part < static_cast<int64_t>(shard_.parts(0).size()); ++part) {
          if (shard_.fsdp_unit(0, part)) continue;
          for (const auto& [lo, hi] : shard_.parts(0)[static_cast<size_t>(part)]) {
            if (lo >= s.offset && hi <= s.offset + s.size) start_gather(i, lo, hi)->wait();
          }
        }
        continue;
      }
      // In place: this rank's updated shard is its own block of the segment (no copy of the
      // segment beside the parameters, as Megatron-Core gathers into its parameter buffer).
      const std::vector<size_t> counts(static_cast<size_t>(shards_of(i)),
                                       static_cast<size_t>(shard));
      const Ptr out = shard_.param_at(s.offset);
      group_of(i)->all_gather_v(out.at(own_shard(i) - s.offset).p, out.p, counts, out.t);
    }
    if (defer_gather_) start_param_gathers();
  }
  return norm;
}

}  // namespace ptdp
