// train(): `ptdp run` on every rank. Builds the process groups and communicators for (t, p, d),
// this rank's GptShard on its backend, the data-parallel optimizer (runtime/grad_sync.h) and
// the pipeline schedule's action list for its pipeline rank (core/schedule.h, the list the
// simulator replays), then executes that list for every step (runtime/schedule_executor.h),
// saving checkpoints (runtime/checkpoint.h) at the intervals asked for.
//
// Every problem with the plan, the data or the checkpoint is found before the first step, and
// agreed on by all ranks, so that no rank trains while another has given up.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/model_spec.h"
#include "core/parallel_plan.h"
#include "core/schedule.h"
#include "runtime/communicator.h"
#include "runtime/loss_scaler.h"
#include "runtime/lr_schedule.h"
#include "runtime/schedule_executor.h"
#include "runtime/shard_footprint.h"

namespace ptdp {

struct TrainOptions {
  ModelSpec model;
  ParallelPlan plan;  // t, p, d (must match the world), b, B, v, schedule, recompute, SP, ...
  int64_t steps = 10;
  uint64_t seed = 1;
  std::string data = "synthetic";  // or a uint16 token file
  double lr = 1e-3, min_lr = 0.0;
  int64_t warmup_steps = 0;
  std::string lr_decay = "constant";  // or "cosine" (to min_lr at the last step)
  double weight_decay = 0.01, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double clip_grad = 1.0;  // 0: no clipping
  std::string save_dir;
  int64_t save_interval = 0;     // 0: only at the end (when save_dir is set)
  int64_t keep_checkpoints = 0;  // > 0: prune all but the newest N after each save; 0: keep all
  std::string load_dir;
  bool record_timeline = false;
  std::string backend = "cpu";  // --backend (runtime/backend.h)
  // Weights and activations (--bf16 or --fp16: 16-bit, with fp32 master weights and gradients;
  // else fp32). fp16 scales the loss (runtime/loss_scaler.h).
  DType precision = DType::kF32;
  LossScaleSettings loss_scale;
};

struct StepStats {
  int64_t step = 0;  // 0-based
  double loss = 0, grad_norm = 0, lr = 0, seconds = 0;
  // Multi-token prediction: the modules' mean loss (each unweighted, averaged over the modules);
  // 0 without them. `loss` is the main model's alone, as Megatron-LM logs "lm loss".
  double mtp_loss = 0;
  double start = 0;  // seconds since the first step began (world rank 0's clock)
  int64_t tokens = 0;
  // fp16: the loss scale the step ran with, and whether its gradients overflowed (the update,
  // the optimizer step and the learning-rate step skipped; grad_norm is then not finite).
  double loss_scale = 0;
  bool skipped = false;
};

// One timed op of a pass on pipeline rank pp of replica dp (tensor-parallel rank 0).
struct OpTimelineEvent {
  int32_t pp = 0, dp = 0;
  TimedOp op;
};

// A step-level collective's span on one rank (runtime/grad_sync.h): the gradient-norm
// all-reduce inside the optimizer step, an overlapped gradient bucket's reduction, or an
// overlapped parameter gather.
struct SyncEvent {
  int32_t pp = 0, dp = 0;
  double start = 0, end = 0;
};

struct TrainResult {
  int64_t first_step = 0;  // > 0 when resumed
  std::vector<StepStats> steps;
  int64_t parameters = 0;         // of the whole model
  int64_t peak_memory_bytes = 0;  // the most-loaded rank's tensors (params, grads, ...)
  int64_t peak_rss_bytes = 0;     // the most-loaded rank's resident set (VmHWM)
  // MoE models: the busiest expert-parallel rank's routed rows over its group's mean, summed
  // over the run's routings (the most unequal group's; GptShard::expert_load); 0 when dense.
  double expert_load = 0;
  // What carried the collectives and transfers: "mpi" (or "self" on one rank) for host
  // backends; "nccl" or "staged" (MPI on host copies) for a device backend (runtime/data_plane.h).
  std::string data_plane;
  // Whether pipeline transfers were scattered and gathered over the tensor-parallel group
  // (SC'21's optimisation; runtime/schedule_executor.h).
  bool scatter_gather_p2p = false;
  std::vector<TimelineEvent> timeline;       // on world rank 0, every replica and stage
  std::vector<OpTimelineEvent> op_timeline;  // the same, every op of every pass
  std::vector<SyncEvent> norm_reductions;    // the same, each step's norm all-reduce
  // The same, each --overlap-grad-reduce bucket (queued to seen complete; runtime/grad_sync.h).
  std::vector<SyncEvent> grad_buckets;
  // The same, each --overlap-param-gather part's parameter gather (queued to seen complete).
  std::vector<SyncEvent> param_gathers;
};

// Thrown on the ranks that did not find a problem another rank reported (exit quietly).
struct PeerFailed : std::runtime_error {
  PeerFailed() : std::runtime_error("another rank stopped the run") {}
};

// Thrown on every rank when a step's loss (or a gradient norm) is NaN or infinite: every rank
// stops at that step, before its weights are saved. what() names the step.
struct NonFiniteLoss : std::runtime_error {
  NonFiniteLoss(int64_t step, double loss, double grad_norm);
  int64_t step;
};

// Learning rate of step `step` (0-based): linear warm-up, then constant or cosine decay.
double learning_rate(const TrainOptions& o, int64_t step);
LearningRateSchedule schedule_of(const TrainOptions& o);

// Agreement before training, the reported loss, the parameter count, the timeline and the
// memory peaks travel on a host control plane beside `world` (runtime/communicator.h).
TrainResult train(const TrainOptions& options, Communicator& world,
                  const std::function<void(const StepStats&)>& on_step = {});

// What one rank of a run holds: its parameter buffer in elements of `precision` (gradients as
// many, in fp32) and its optimizer state in fp32 floats (AdamW's two moments, and with mixed
// precision the master weights, of what it updates: its 1/d shard with the distributed
// optimizer, whose gradients are reduced in place in the gradient buffer).
struct RankFootprint {
  int64_t rank = 0, tp = 0, pp = 0, dp = 0, cp = 0;  // cp: the context-parallel index
  int64_t parameter_floats = 0, optimizer_floats = 0;
  DType precision = DType::kF32;
  // Megatron-FSDP run sharded (runtime/fsdp.h): what the rank holds instead of every parameter
  // and gradient (runtime/shard_footprint.h).
  bool fsdp = false;
  FsdpHeld fsdp_held;
};

// `ptdp run --dry-run`: every check train() makes before its first step (options, model,
// plan, world size, data, the checkpoint to --load), agreed on by all ranks as train() agrees
// on them, without allocating the model. Then `check` runs on every rank with that rank's
// footprint (e.g. against the memory it has) and the ranks agree on it the same way. Returns
// every rank's footprint, on every rank. A world of one process with a plan of several ranks
// works out every rank of the plan here: each rank's layout checked, `check` run on each
// (a --load checkpoint is refused then: its shards are the ranks' to read).
std::vector<RankFootprint> dry_run(const TrainOptions& options, Communicator& world,
                                   const std::function<void(const RankFootprint&)>& check = {});

}  // namespace ptdp
