// The learning-rate schedule of `ptdp run`: linear warm-up over the first steps, then constant
// or cosine decay to a floor at the last step (Megatron-LM's --lr-warmup-iters,
// --lr-decay-style, --min-lr).
#pragma once

#include <cstdint>
#include <string>

namespace ptdp {

struct LearningRateSchedule {
  double lr = 1e-3, min_lr = 0.0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  std::string decay = "constant";  // or "cosine"

  // Learning rate of `step` (0-based).
  double at(int64_t step) const;
  // InputError naming the flag (--lr, --min-lr, --lr-warmup-steps, --lr-decay-style).
  void validate() const;
};

}  // namespace ptdp
