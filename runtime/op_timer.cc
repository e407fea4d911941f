#include "runtime/op_timer.h"

namespace ptdp {

OpTimer::~OpTimer() {
  try {
    resolve();
  } catch (...) {  // a failing backend: the spans are lost, the error is reported elsewhere
  }
}

double OpTimer::now() {
  be_.synchronize();
  return std::chrono::duration<double>(Clock::now() - t0_).count();
}

size_t OpTimer::new_mark() {
  if (!ref_) {  // the reference: a marker queued on an idle device, at a known host time
    ref_seconds_ = now();
    ref_ = be_.record_mark();
  }
  marks_.push_back(be_.record_mark());
  return marks_.size() - 1;
}

void OpTimer::resolve() {
  if (!ref_) return;
  be_.synchronize();
  for (const Pending& p : pending_) {
    TimedOp& op = (*sink_)[p.op];
    op.start = ref_seconds_ + be_.mark_seconds(ref_, marks_[p.start]);
    op.end = ref_seconds_ + be_.mark_seconds(ref_, marks_[p.end]);
  }
  for (void* m : marks_) be_.release_mark(m);
  be_.release_mark(ref_);
  marks_.clear();
  pending_.clear();
  ref_ = nullptr;
}

void OpTimer::pass(int64_t chunk, int64_t microbatch) {
  close();
  chunk_ = static_cast<int32_t>(chunk);
  microbatch_ = static_cast<int32_t>(microbatch);
}

void OpTimer::begin(OpId id, OpRole role) {
  if (device_) {
    const size_t m = new_mark();
    if (open_) pending_.back().end = m;
    sink_->push_back({id, role, chunk_, microbatch_, 0.0, 0.0});
    pending_.push_back({sink_->size() - 1, m, m});
    open_ = true;
    return;
  }
  const double t = now();
  if (open_) sink_->back().end = t;
  sink_->push_back({id, role, chunk_, microbatch_, t, t});
  open_ = true;
}

void OpTimer::weight_gradient() {
  if (open_) sink_->back().role = OpRole::kWeightGrad;
}

void OpTimer::close() {
  if (device_) {
    if (open_) pending_.back().end = new_mark();
    open_ = false;
    resolve();
    return;
  }
  if (!open_) return;
  sink_->back().end = now();
  open_ = false;
}

}  // namespace ptdp
