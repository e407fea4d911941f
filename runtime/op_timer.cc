#include "runtime/op_timer.h"

namespace ptdp {
namespace {

// Markers held before they are read mid-step anyway (a synchronisation): bounds the events a
// very long step keeps alive. A GPT-3-sized stage queues some 40 a layer and microbatch.
constexpr size_t kMaxPendingMarks = size_t{1} << 16;

}  // namespace

// Markers not read by a flush() (a step that failed) are released unread: the sink they would
// be written to may be gone already.
OpTimer::~OpTimer() {
  for (void* m : marks_) be_.release_mark(m);
  if (ref_) be_.release_mark(ref_);
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

void OpTimer::flush() {
  if (!ref_) return;
  be_.synchronize();
  auto at = [&](size_t mark) { return ref_seconds_ + be_.mark_seconds(ref_, marks_[mark]); };
  for (const Pending& p : pending_) {
    TimedOp& op = (*sink_)[p.op];
    op.start = at(p.start);
    op.end = at(p.end);
  }
  for (const PendingPass& p : pending_passes_) pass_spans_[p.pass] = {at(p.start), at(p.end)};
  for (void* m : marks_) be_.release_mark(m);
  be_.release_mark(ref_);
  marks_.clear();
  pending_.clear();
  pending_passes_.clear();
  ref_ = nullptr;
}

void OpTimer::pass(int64_t chunk, int64_t microbatch) {
  close();
  chunk_ = static_cast<int32_t>(chunk);
  microbatch_ = static_cast<int32_t>(microbatch);
}

void OpTimer::begin(OpId id, OpRole role) {
  if (device_) {
    // Past kMaxPendingMarks, read early, but only between passes (a pass's markers go together).
    if (marks_.size() >= kMaxPendingMarks && !open_) flush();
    const size_t m = new_mark();
    if (open_) pending_.back().end = m;
    if (pass_first_mark_ == kNoPass) pass_first_mark_ = m;
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

void OpTimer::end_op() {
  if (device_ || !open_) return;
  sink_->back().end = now();
  open_ = false;
}

size_t OpTimer::close() {
  if (device_) {
    size_t pass = kNoPass;
    if (open_) {
      const size_t end = new_mark();
      pending_.back().end = end;
      pass = pass_spans_.size();
      pass_spans_.emplace_back(0.0, 0.0);
      pending_passes_.push_back({pass, pass_first_mark_, end});
    }
    open_ = false;
    pass_first_mark_ = kNoPass;
    return pass;
  }
  if (open_) sink_->back().end = now();
  open_ = false;
  return kNoPass;
}

}  // namespace ptdp
