// DataParallelOptimizer: what happens to a rank's gradients after the backward passes of a
// step. Partial gradients of sequence-parallel parameters are all-reduced over the
// tensor-parallel group; the data-parallel group all-reduces the whole gradient buffer (or,
// with the distributed optimizer, reduce-scatters each segment so that every rank holds the
// averaged gradients of its 1/d shard); the first and last stage all-reduce the tied word
// embedding's gradient; then the global gradient norm (each parameter counted once), clipping
// and AdamW on what this rank owns, and with the distributed optimizer an all-gather of the
// updated parameters. Kernels run on the shard's backend.
//
// Mixed precision (a bf16 shard, --bf16): gradients stay fp32; AdamW updates fp32 master
// weights of what this rank owns (the whole model, or its 1/d shard with the distributed
// optimizer) and writes their bf16 rounding into the model, which the distributed optimizer
// then all-gathers in bf16. Bytes per parameter: 2 + 4 + 4 + 8 = 18, or 6 + 12 / d with the
// distributed optimizer, whose reduce-scatter sums each rank's shard in place in the gradient
// buffer (as Megatron-Core's), as the memory model counts.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "runtime/backend.h"
#include "runtime/communicator.h"
#include "runtime/fsdp.h"
#include "runtime/gpt_model.h"
#include "runtime/tensor.h"

namespace ptdp {

struct OptimizerSettings {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  double clip_grad = 1.0;  // 0: no clipping
  // fp16 loss scaling (runtime/loss_scaler.h): the gradients carry this factor, divided out
  // before clipping and AdamW; with skip_overflow a non-finite global norm skips the update.
  double grad_scale = 1.0;
  bool skip_overflow = false;
};

// The distributed optimizer's sharding of a group of segments, in K instances
// (--num-distributed-optimizer-instances; one: the whole group): `shards` ranks per instance,
// this rank the shard_rank-th of its instance and of the replica_rank-th instance; with K > 1
// `replicas` holds the K ranks, one per instance, that all-reduce the same shard after the
// reduce-scatter (null with one instance).
struct OptimizerShards {
  Communicator* replicas = nullptr;
  int64_t shards = 1, shard_rank = 0, replica_rank = 0;
};

struct DataParallelGroups {
  Communicator* tensor = nullptr;     // sequence-parallel partial gradients
  Communicator* data = nullptr;       // gradient reduction, distributed optimizer
  Communicator* embedding = nullptr;  // first and last stage (tied word embedding)
  Communicator* norm = nullptr;       // every rank whose gradients the global norm sums
  int64_t data_parallel = 1;
  int64_t dp_rank = 0, tp_rank = 0;
  // MoE models: the routed experts' segment (2) is reduced over the expert-data-parallel group
  // (and sharded over it by the distributed optimizer), scaled by 1 / data_parallel as
  // Megatron-Core scales it (its tokens came from every data-parallel replica).
  Communicator* expert_data = nullptr;
  int64_t expert_data_parallel = 1, edp_rank = 0, etp_rank = 0;
  // The norm group spans the data-parallel replicas without the distributed optimizer: the
  // dense parameters are counted on replica 0 only (and experts on expert replica 0).
  bool norm_spans_replicas = false;
  // With the distributed optimizer: how it shards the dense segments over `data` and the
  // experts' over `expert_data` (the ranks of this rank's optimizer instance).
  OptimizerShards dense_shards, expert_shards;
};

class DataParallelOptimizer {
 public:
  DataParallelOptimizer(GptShard& shard, const DataParallelGroups& groups, bool distributed);

  // Reduces every gradient not yet reduced by a bucket, then waits for the buckets. Under
  // Megatron-FSDP (set_fsdp) the backward passes reduced them into the shard already.
  void reduce_gradients();
  // Megatron-FSDP (runtime/fsdp.h; the distributed optimizer in one instance, no buckets):
  // reduce_gradients waits for its reductions, and step gathers only the weights it keeps whole.
  void set_fsdp(MegatronFsdp* fsdp);
  // --overlap-grad-reduce: [lo, hi) (inside one segment) holds final gradients (the backward
  // passes of the step are done with them); their reduction starts now, asynchronously, on the
  // segment's group (data-parallel, or expert-data-parallel for routed experts): an all-reduce,
  // or with the distributed optimizer an uneven reduce-scatter that hands each rank the part of
  // the bucket in its shard. With sequence parallelism the bucket's partial gradients are first
  // all-reduced over the tensor-parallel group (blocking; they are norms, biases and routers).
  // The ranks of a group call this for the same buckets in the same order (the same schedule
  // runs on each). A no-op where the group has one rank.
  void reduce_bucket(int64_t lo, int64_t hi);
  // --overlap-param-gather (with the distributed optimizer): step() leaves the parameters to be
  // gathered asynchronously, one uneven all-gather per range of a part of the shard
  // (GptShard::part_ranges) in the order the next forward passes use them, on the segment's
  // group. wait_params(lo, hi) waits for that range's gather (the forward pass calls it before
  // the part runs); finish_param_gather() for every one (before a checkpoint is written).
  void overlap_param_gather(bool on) { defer_gather_ = on && dist_ && !fsdp_; }
  void wait_params(int64_t lo, int64_t hi);
  void finish_param_gather();
  // Lets the buckets in flight progress (MPI moves a non-blocking collective on when it is
  // tested); never blocks.
  void progress();
  // Parameter gathers not yet waited for.
  size_t gathers_pending() const { return gathers_.size(); }
  void sync_embedding();
  // Clips by the global gradient norm and applies AdamW at `lr`; step counts the updates
  // applied before this one (AdamW's bias correction). Returns the norm before clipping (of the
  // gradients without o.grad_scale). With o.skip_overflow and a non-finite norm it changes
  // nothing, returns the norm and skipped() says so.
  double step(int64_t step, double lr, const OptimizerSettings& o);
  bool skipped() const { return skipped_; }

  // With a sink, appends when each step's gradient-norm all-reduce began and ended (seconds
  // since t0): besides its one float it waits for every rank of the group to finish its
  // backward passes, which `ptdp reconcile` counts as idle time. Null: stop recording.
  void time_norm_reduction(std::vector<std::pair<double, double>>* sink,
                           std::chrono::steady_clock::time_point t0) {
    norm_sink_ = sink;
    t0_ = t0;
  }

  // With a sink, appends each overlapped bucket's span (seconds since the t0 of
  // time_norm_reduction): from when it was queued to when this rank first saw it complete.
  void time_buckets(std::vector<std::pair<double, double>>* sink) { bucket_sink_ = sink; }
  // The same for each overlapped parameter gather: from when it was queued (in the optimizer
  // step) to when this rank first saw it complete.
  void time_param_gathers(std::vector<std::pair<double, double>>* sink) { gather_sink_ = sink; }

  // Adam moments (a 1/d shard of each segment with the distributed optimizer), for checkpoints.
  DeviceBuffer& adam_m() { return adam_m_; }
  DeviceBuffer& adam_v() { return adam_v_; }
  // The model's parameters in fp32 on the host, for checkpoints: the weights, where they are
  // bf16 widened, with the fp32 master weights of what this rank updates in their places (so
  // the ranks that own a range write it exactly). parameters_from_host sets the weights (rounded
  // to bf16 where they are bf16) and the master weights from such an array.
  std::vector<float> parameters_to_host();
  void parameters_from_host(const std::vector<float>& host);

 private:
  // The group that reduces (and with the distributed optimizer shards) segment `seg`, its size
  // and this rank's index in it.
  Communicator* group_of(size_t seg) const { return seg == 2 ? g_.expert_data : g_.data; }
  // The ranks whose gradients segment `seg` sums (and averages over).
  int64_t replicas_of(size_t seg) const {
    return seg == 2 ? g_.expert_data_parallel : g_.data_parallel;
  }
  // With the distributed optimizer, the sharding of segment `seg`.
  const OptimizerShards& sharding_of(size_t seg) const {
    return seg == 2 ? g_.expert_shards : g_.dense_shards;
  }
  // The ranks over which the distributed optimizer shards segment `seg` (those of an instance),
  // and this rank's place among them; without it, the ranks that reduce the segment together.
  int64_t shards_of(size_t seg) const { return dist_ ? sharding_of(seg).shards : replicas_of(seg); }
  int64_t shard_rank_of(size_t seg) const {
    if (dist_) return sharding_of(seg).shard_rank;
    return seg == 2 ? g_.edp_rank : g_.dp_rank;
  }
  // With the distributed optimizer in K > 1 instances: the K ranks that hold the same shard of
  // segment `seg` (null with one instance), and whether this rank is its instance 0's.
  Communicator* replicas_group_of(size_t seg) const {
    return dist_ ? sharding_of(seg).replicas : nullptr;
  }
  bool first_instance(size_t seg) const {
    return !replicas_group_of(seg) || sharding_of(seg).replica_rank == 0;
  }
  // All-reduces this rank's shard of each segment across the optimizer instances (K > 1).
  void reduce_across_instances();
  // The part of [lo, hi) (inside segment `seg`) in this rank's shard: [a, b), empty when a >= b.
  std::pair<int64_t, int64_t> own_part(size_t seg, int64_t lo, int64_t hi) const;
  // --overlap-grad-reduce with K > 1 instances: starts the across-instance all-reduce of this
  // rank's part of each queued bucket whose reduce-scatter has completed, in the order the
  // buckets were queued (the ranks of a replica group start them alike); stops at the first
  // bucket still reducing unless `block`, which waits for each.
  void start_across(bool block);
  // After the reduce-scatters: the across-instance all-reduce of the parts of this rank's shard
  // that no bucket covered, then the wait for every one in flight.
  void finish_across();
  // Whether this rank counts the parameter in the global gradient norm.
  bool counts_in_norm(const ParamInfo& p) const;
  // Calls f(param, lo, hi, state index of lo) for the part of each parameter this rank's
  // optimizer owns.
  void for_each_owned_range(
      const std::function<void(const ParamInfo&, int64_t, int64_t, int64_t)>& f);

  // Reduces the sequence-parallel partial gradients of the parameters inside [lo, hi) over the
  // tensor-parallel group.
  void reduce_sequence_parallel(int64_t lo, int64_t hi);
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  // A bucket's reduction or a part's gather in flight, with when it was queued and when this
  // rank first saw it complete (done < 0: not yet), for the timeline.
  struct InFlight {
    std::unique_ptr<Work> work;
    double queued = 0, done = -1;
  };
  using InFlightByRange = std::map<std::pair<int64_t, int64_t>, InFlight>;  // by [lo, hi)
  // Notes completion without blocking.
  void poll(InFlight& f) const;
  // Waits (bounded) and appends the span to `sink` (if any).
  void complete(InFlight& f, std::vector<std::pair<double, double>>* sink) const;
  // Starts the gather of every part's ranges from the ranks' shards.
  void start_param_gathers();
  // Starts the in-place gather of [lo, hi) (inside segment `seg`) from the ranks' blocks of it.
  std::unique_ptr<Work> start_gather(size_t seg, int64_t lo, int64_t hi);
  // The segment holding [lo, hi) (std::logic_error when none holds it whole).
  size_t segment_of(int64_t lo, int64_t hi) const;
  // With the distributed optimizer: where this rank's shard of segment `seg` starts in the
  // parameter (and gradient) buffer.
  int64_t own_shard(size_t seg) const;
  // The part of [lo, hi) of segment `seg` in each rank's shard of it, in rank order.
  std::vector<size_t> shard_counts(size_t seg, int64_t lo, int64_t hi) const;
  // Starts the reduction of [lo, hi) of segment `seg` over its group (see reduce_bucket).
  std::unique_ptr<Work> start_reduction(size_t seg, int64_t lo, int64_t hi);

  GptShard& shard_;
  Backend& be_;
  DataParallelGroups g_;
  bool dist_;
  MegatronFsdp* fsdp_ = nullptr;
  DeviceBuffer adam_m_, adam_v_;
  DeviceBuffer master_;                // fp32 master weights of a bf16 model (empty for fp32)
  std::vector<int64_t> state_offset_;  // per segment, into the state arrays
  // Buckets started this step, and parameter gathers not yet waited for.
  InFlightByRange buckets_, gathers_;
  // K > 1 instances: the buckets whose across-instance all-reduce is not started yet, in queue
  // order, and those started (by bucket range).
  std::vector<std::pair<int64_t, int64_t>> across_pending_;
  InFlightByRange across_;
  std::vector<std::pair<double, double>>* bucket_sink_ = nullptr;
  bool defer_gather_ = false;
  bool skipped_ = false;  // the last step() skipped its update (fp16 overflow)
  std::vector<std::pair<double, double>>* gather_sink_ = nullptr;
  std::vector<std::pair<double, double>>* norm_sink_ = nullptr;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace ptdp
