// MegatronFsdp: Megatron-FSDP's sharding (--use-megatron-fsdp --data-parallel-sharding-strategy
// optim_grads | optim_grads_params, megatron/core/distributed/fsdp) as ptdp run executes it, on
// a GptShard of one pipeline stage and one chunk (the plan rule).
//
// The shards are the distributed optimizer's (runtime/grad_sync.h): rank r of the d x cp
// data-parallel ranks (the routed experts': of the expert-data-parallel ranks) holds block r of
// each parameter segment, and the shard holds only that block of the gradients (optim_grads),
// and with optim_grads_params also of the decoder layers' weights (the units), the embedding,
// final norm and output layer staying whole (GptShard's param_map and grad_map).
//
// Around each part's passes (GptShard calls the four hooks; parts as GptShard::parts):
// - optim_grads_params, a decoder layer's forward and backward pass: its weights are
//   all-gathered from the shards into a window mapped over the flat array while the pass runs,
//   and dropped after it. The layers after it (forward) or before it (backward) are gathered
//   ahead, asynchronously, until kFsdpPrefetchElements unsharded elements (or every layer) are
//   in flight, as Megatron-FSDP's all-gather pipeline does and the memory model counts.
// - every part's backward pass: its gradients accumulate in a zeroed fp32 window (one per
//   range; a shared one stays open from its first user's backward pass to its last's: the tied
//   word embedding's, the output layer's and the embedding's, and with multi-token prediction
//   the word table and the untied output layer, which the modules use, from the last module's);
//   the multi-token prediction modules' weights stay whole, as the embedding's and the output
//   layer's do; when its last user is done the window is reduce-scattered over
//   the data-parallel group (in place, uneven blocks: this rank's block of the sum where it
//   lies) and the block added to the shard. One reduction stays in flight while the next part
//   computes (kFsdpGradientUnitsInFlight windows at most), and finish() waits for the rest
//   before the optimizer step.
// The sequence-parallel partial gradients are then summed over the tensor-parallel ranks on the
// shard (the sums are linear), and the optimizer steps on the shard as the distributed
// optimizer does; only what stays whole is all-gathered after it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/device_buffer.h"
#include "runtime/gpt_model.h"

namespace ptdp {

// Whether ptdp run shards a plan as Megatron-FSDP (optim_grads or optim_grads_params over
// more than one data-parallel rank of an optimizer instance, at p = 1; in K instances, HSDP,
// with whole copies across them: each instance shards over its d cp / K ranks and the shards
// are all-reduced across the instances once a step); other
// Megatron-FSDP plans (HFSDP's states sharded across the instances too) run with the
// distributed optimizer's layout, and the run says so (cli/dry_run.h).
bool runs_megatron_fsdp(const ModelSpec& m, const ParallelPlan& p);

class MegatronFsdp {
 public:
  // data: the d x cp data-parallel ranks (dense segments; with K instances this rank's
  // instance's); expert_data: the routed experts' (MoE models). The shard's layout says the
  // strategy and this rank's shards.
  MegatronFsdp(GptShard& shard, Communicator* data, Communicator* expert_data);
  ~MegatronFsdp();
  MegatronFsdp(const MegatronFsdp&) = delete;
  MegatronFsdp& operator=(const MegatronFsdp&) = delete;

  void before_forward(int64_t part);
  void after_forward(int64_t part);
  void before_backward(int64_t part);
  void after_backward(int64_t part);
  // Waits for every gradient reduction in flight and adds it to the shard.
  void finish();
  // With sinks, appends each weight gather's and each gradient reduction's span (seconds since
  // t0: from when it was started to when this rank waited it complete), the trace's data-parallel
  // events (param_gathers and grad_buckets); null: stop recording.
  void time_collectives(std::vector<std::pair<double, double>>* gathers,
                        std::vector<std::pair<double, double>>* reductions,
                        std::chrono::steady_clock::time_point t0) {
    gather_sink_ = gathers;
    reduction_sink_ = reductions;
    t0_ = t0;
  }

 private:
  struct Range {
    int64_t lo = 0, hi = 0;
    size_t seg = 0;
  };
  struct Gather {  // one range of a layer's weights
    Range r;
    DeviceBuffer window;
    std::unique_ptr<Work> work;
    bool mapped = false;
    double started = 0;
  };
  struct GradWindow {
    Range r;
    DeviceBuffer window;
    int users_left = 0;
    std::unique_ptr<Work> work;
    double started = 0;
  };
  // The ranges part `part`'s passes read and add to (made once: ranges_).
  std::vector<Range> make_ranges(int64_t part) const;
  const std::vector<Range>& ranges_of(int64_t part) const {
    return ranges_[static_cast<size_t>(part)];
  }
  Communicator* group_of(size_t seg) const { return seg == 2 ? expert_data_ : data_; }
  // Each rank's block of r (GptShard::shard_counts), and this rank's.
  std::vector<size_t> counts(const Range& r) const {
    return shard_.shard_counts(r.seg, r.lo, r.hi);
  }
  std::pair<int64_t, int64_t> own_part(const Range& r) const;
  // optim_grads_params: starts the gather of layer part `part` (if not started).
  void start_gather(int64_t part);
  // Waits for `part`'s gather and maps its windows.
  void map_gathered(int64_t part);
  void drop_gathered(int64_t part);
  // The layer parts to have gathered while `part` runs, in the direction of the pass.
  std::vector<int64_t> ahead(int64_t part, int step) const;
  // Completes the oldest reduction in flight: its block added to the shard.
  void complete_oldest();

  GptShard& shard_;
  Backend& be_;
  Communicator* data_;
  Communicator* expert_data_;
  bool weights_;
  int64_t first_unit_ = 1, last_unit_ = 0;           // the decoder layers' parts
  int64_t units_ahead_ = 0;                          // layers gathered ahead of the one running
  std::vector<std::vector<Range>> ranges_;           // per part
  std::map<int64_t, std::vector<Gather>> gathered_;  // by part, gathered or in flight
  std::map<int64_t, int> users_;  // per range (by lo): the parts whose backward passes add to it
  std::map<int64_t, GradWindow> open_;  // gradient windows by lo
  std::deque<GradWindow> reducing_;
  std::vector<std::pair<double, double>>*gather_sink_ = nullptr, *reduction_sink_ = nullptr;
  std::chrono::steady_clock::time_point t0_;
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
};

}  // namespace ptdp
