#include "runtime/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace ptdp {

double LearningRateSchedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (decay != "cosine") return lr;
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - 1 - warmup_steps));
  const double x = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(3.141592653589793 * x));
}

void LearningRateSchedule::validate() const {
  if (!(lr > 0 && std::isfinite(lr))) throw InputError("--lr", "must be positive and finite");
  if (!(min_lr >= 0 && min_lr <= lr)) throw InputError("--min-lr", "must be in [0, --lr]");
  if (warmup_steps < 0) throw InputError("--lr-warmup-steps", "must not be negative");
  if (decay != "constant" && decay != "cosine")
    throw InputError("--lr-decay-style", "must be constant or cosine, got '" + decay + "'");
}

}  // namespace ptdp
