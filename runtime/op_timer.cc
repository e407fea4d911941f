#include "runtime/op_timer.h"

namespace ptdp {

double OpTimer::now() {
  be_.synchronize();
  return std::chrono::duration<double>(Clock::now() - t0_).count();
}

void OpTimer::pass(int64_t chunk, int64_t microbatch) {
  close();
  chunk_ = static_cast<int32_t>(chunk);
  microbatch_ = static_cast<int32_t>(microbatch);
}

void OpTimer::begin(OpId id, OpRole role) {
  const double t = now();
  if (open_) sink_->back().end = t;
  sink_->push_back({id, role, chunk_, microbatch_, t, t});
  open_ = true;
}

void OpTimer::weight_gradient() {
  if (open_) sink_->back().role = OpRole::kWeightGrad;
}

void OpTimer::close() {
  if (!open_) return;
  sink_->back().end = now();
  open_ = false;
}

}  // namespace ptdp
