#include "runtime/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"

namespace ptdp {

void LossScaleSettings::validate() const {
  auto finite_positive = [](double v) { return std::isfinite(v) && v > 0; };
  if (static_scale < 0 || !std::isfinite(static_scale))
    throw InputError("--loss-scale", "must be positive");
  if (!finite_positive(initial_scale) || initial_scale > 1e38)
    throw InputError("--initial-loss-scale", "must be positive and at most 1e38");
  if (!finite_positive(min_scale) || min_scale > initial_scale)
    throw InputError("--min-loss-scale", "must be positive and at most --initial-loss-scale");
  if (window < 1) throw InputError("--loss-scale-window", "must be at least 1");
  if (hysteresis < 1) throw InputError("--hysteresis", "must be at least 1");
}

LossScaler::LossScaler(const LossScaleSettings& s)
    : s_(s),
      scale_(s.static_scale > 0 ? s.static_scale : s.initial_scale),
      hysteresis_left_(s.hysteresis) {}

bool LossScaler::update(bool overflow) {
  if (s_.static_scale > 0) return !overflow;
  if (overflow) {
    good_steps_ = 0;
    if (--hysteresis_left_ <= 0) scale_ = std::max(scale_ / 2, s_.min_scale);
    return false;
  }
  if (++good_steps_ == s_.window) {
    good_steps_ = 0;
    hysteresis_left_ = s_.hysteresis;
    scale_ = std::min(scale_ * 2, 1e38);
  }
  return true;
}

std::vector<float> LossScaler::state() const {
  // Powers of two and counts below 2^24: exact in float.
  return {static_cast<float>(scale_), static_cast<float>(good_steps_),
          static_cast<float>(hysteresis_left_)};
}

void LossScaler::restore(const std::vector<float>& state) {
  if (state.size() != 3 || !(state[0] > 0) || !std::isfinite(state[0]))
    throw InputError("--load", "the checkpoint's loss-scale state is malformed");
  if (s_.static_scale > 0) return;  // a static scale is the flag's
  scale_ = state[0];
  good_steps_ = static_cast<int64_t>(state[1]);
  hysteresis_left_ = static_cast<int64_t>(state[2]);
}

}  // namespace ptdp
