// ScheduleExecutor: one step of a pipeline rank's action list (core/schedule.h, the list the
// simulator replays): forward and backward passes of the shard's chunks, the batched
// point-to-point transfers posted and waited on together (as Megatron's batch_isend_irecv), and
// the gradient reduction, embedding sync and optimizer step at the points the list puts them.
// Optionally records each action's start and end for the measured timeline.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "core/schedule.h"
#include "runtime/communicator.h"
#include "runtime/gpt_model.h"
#include "runtime/grad_sync.h"
#include "runtime/op_timer.h"
#include "runtime/tensor.h"

namespace ptdp {

// One executed action of one pipeline rank (tensor-parallel rank 0 of each replica).
struct TimelineEvent {
  int32_t pp = 0, dp = 0;
  ActionKind kind = ActionKind::kForward;
  int32_t microbatch = -1, chunk = -1;
  double start = 0, end = 0;  // seconds since the first step began
};

struct StepContext {
  int64_t step = 0;
  double lr = 0;
  OptimizerSettings optimizer;
  // The factor on the loss whose gradient the backward passes take (fp16 loss scaling).
  double loss_scale = 1.0;
  // The microbatch's token sequences ([b, s + 1]) for the first and the last stage.
  std::function<void(int64_t microbatch, std::vector<int32_t>&)> tokens;
};

class ScheduleExecutor {
 public:
  using Clock = std::chrono::steady_clock;

  // pipeline: the pipeline-parallel group; pp, p: this rank's stage and the stage count;
  // microbatches: m of one step; dp: the replica (for the timeline).
  ScheduleExecutor(GptShard& shard, Communicator& pipeline, DataParallelOptimizer& optimizer,
                   std::vector<PipelineAction> actions, int64_t pp, int64_t p, int64_t dp,
                   int64_t microbatches);

  // Runs the action list once. Returns the sum of this rank's microbatch losses (last stage)
  // and sets *grad_norm. With `events`, appends one event per action (times since t0).
  double run(const StepContext& step, double* grad_norm, std::vector<TimelineEvent>* events,
             Clock::time_point t0);
  // From now on, appends every op the shard executes to `sink` with its start and end (times
  // since t0), tagged with the pass's chunk and microbatch (runtime/op_timer.h).
  void time_ops(std::vector<TimedOp>* sink, Clock::time_point t0);
  // Makes the timed ops' spans final (OpTimer::flush: one synchronisation on a device) and gives
  // the pass events run() appended to `events` since the last call their device spans. Called
  // between steps, outside their timed spans.
  void flush_timing(std::vector<TimelineEvent>* events);
  // --overlap-grad-reduce: in each chunk's last backward pass of the step, each part's
  // gradients start their data-parallel reduction as soon as the part is done
  // (DataParallelOptimizer::reduce_bucket); the gradient-sync action then reduces the rest and
  // waits for them. The buckets in flight are tested after every action.
  void overlap_grad_reduce(bool on) { overlap_ = on; }
  // Schedules whose sends do not block (zb-h1: PipelineSchedule::synchronous_p2p false): a batch
  // of sends alone is posted and the rank goes on, its buffers kept until it completes (tested
  // after every action, waited for at the end of the step); a batch with a receive is waited
  // for as always.
  void asynchronous_sends(bool on) { async_sends_ = on; }
  // SC'21's scatter/gather of pipeline transfers: each of the t tensor-parallel ranks sends only
  // its 1/t of the boundary activation (or its gradient), identical on every one of them
  // without sequence parallelism, and the receivers all-gather the slices over `tensor`
  // (t ranks, this rank's index tp) once the transfer is done. Null: whole transfers.
  void scatter_gather(Communicator* tensor, int64_t tp) {
    sg_ = tensor;
    sg_rank_ = tp;
  }

 private:
  using Key = std::pair<int64_t, int64_t>;  // (microbatch, chunk)
  void flush_p2p();
  void test_sends();
  // The transfer of a boundary buffer to or from `peer`: all of it, or with scatter/gather this
  // rank's slice.
  Communicator::P2P transfer(bool send, Buffer& b, int64_t peer, int tag) const;

  GptShard& shard_;
  Communicator& pipeline_;
  DataParallelOptimizer& optimizer_;
  std::vector<PipelineAction> actions_;
  int64_t pp_, p_, dp_, m_;
  std::map<Key, Buffer> act_in_, act_out_, grad_in_, grad_out_;
  std::vector<Communicator::P2P> batch_;
  std::vector<Key> sent_fwd_, sent_bwd_;
  std::unique_ptr<OpTimer> timer_;  // null unless ops are timed
  // Pass events (index into run()'s events) timed on the device, and their OpTimer pass index.
  std::vector<std::pair<size_t, size_t>> device_passes_;
  bool overlap_ = false, async_sends_ = false;
  Communicator* sg_ = nullptr;  // scatter/gather over this tensor-parallel group
  int64_t sg_rank_ = 0;
  std::vector<Buffer*> gather_after_;  // received slices to all-gather after the batch
  struct Sending {                     // a batch of sends in flight and the buffers it reads
    std::unique_ptr<Work> work;
    std::vector<Buffer> buffers;
  };
  std::vector<Sending> sending_;
  std::vector<int64_t> last_backward_;  // per chunk: the index of its last backward action
};

}  // namespace ptdp
