// OpTimer: the measured duration of every op a shard executes, for `ptdp run --trace` and
// `ptdp reconcile`. ShardContext::begin closes the previous op and opens the next; the schedule
// executor names the pass (chunk, microbatch) before it runs and closes the last op after it.
// Only attached when a trace is asked for: without one, the shard makes no clock reading.
// On a backend that runs kernels asynchronously the timer queues one of the backend's markers
// (CUDA events) at each op boundary and reads them all in flush(), which the trainer calls once
// a step has ended, outside its timed span: tracing then leaves the kernels' back-to-back
// execution as it is, across passes too. (Synchronising at every boundary added the launch
// latency to every op, a third of a GPT-2-124M step on an H100; reading the markers when each
// pass closed drained the device at every pass and put the reading, some 2 us a marker, inside
// the pass: 0.6-1.9 ms a pass of `pass_overhead` there.) A device pass's span is then the device
// time from its first op's start to its last op's end (pass_span). Host backends read a host
// clock at each boundary.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/layer_ops.h"
#include "runtime/backend.h"

namespace ptdp {

struct TimedOp {
  OpId id = OpId::kInputLayernorm;
  OpRole role = OpRole::kForward;
  int32_t chunk = -1, microbatch = -1;
  double start = 0, end = 0;  // seconds since the run's first step began
};

class OpTimer {
 public:
  using Clock = std::chrono::steady_clock;
  OpTimer(Backend& backend, Clock::time_point t0, std::vector<TimedOp>* sink)
      : be_(backend), t0_(t0), sink_(sink), device_(!backend.host_accessible()) {}
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // The pass the following ops belong to.
  void pass(int64_t chunk, int64_t microbatch);
  // Closes the open op (if any) and opens `id`.
  void begin(OpId id, OpRole role);
  // The open op computes a weight gradient (ShardContext::weight_gradient_done).
  void weight_gradient();
  // Host timing: ends the open op now, the pass staying open (what follows until the next op is
  // the pass's own time). Device timing: nothing (an op ends at the next marker; host-side
  // bookkeeping between kernels does not lengthen them).
  void end_op();
  // Closes the open op (end of a pass). With device timing, returns an index for pass_span()
  // (kNoPass for host timing or a pass without ops).
  static constexpr size_t kNoPass = static_cast<size_t>(-1);
  size_t close();
  // Reads every marker queued so far (one synchronisation); the ops' spans and pass_span() are
  // final after it. Nothing to do with host timing.
  void flush();
  // The device time of a pass that close() returned `pass` for, as (start, end) since t0; valid
  // after the flush() that follows the close().
  std::pair<double, double> pass_span(size_t pass) const { return pass_spans_.at(pass); }

 private:
  double now();       // seconds since t0, the backend synchronised
  size_t new_mark();  // a device marker queued now; its index in marks_

  Backend& be_;
  Clock::time_point t0_;
  std::vector<TimedOp>* sink_;
  int32_t chunk_ = -1, microbatch_ = -1;
  bool open_ = false;
  bool device_ = false;
  // Device timing: markers since the last flush(), the reference marker and its host time, and
  // for each pending op (an index into sink_) the markers of its start and end.
  struct Pending {
    size_t op, start, end;
  };
  struct PendingPass {
    size_t pass, start, end;
  };
  std::vector<void*> marks_;
  std::vector<Pending> pending_;
  std::vector<PendingPass> pending_passes_;
  std::vector<std::pair<double, double>> pass_spans_;  // every device pass's, once resolved
  size_t pass_first_mark_ = kNoPass;                   // the open pass's first marker
  void* ref_ = nullptr;
  double ref_seconds_ = 0;
};

}  // namespace ptdp
