// fp16 loss scaling, as Megatron-LM's --fp16 does it. The loss gradient is multiplied by the
// scale S before the backward pass, so that small activation gradients stay representable in
// fp16; the fp32 gradients are divided by S before clipping and AdamW. A step whose gradients
// overflowed (a non-finite global norm on every rank alike) is skipped: no update, no
// optimizer or learning-rate step.
//
// Static (--loss-scale S): S never changes. Dynamic (the default; Megatron's
// DynamicGradScaler): from --initial-loss-scale (2^32), each overflow spends one unit of
// --hysteresis (2) and, once those are spent, halves S (never below --min-loss-scale, 1);
// --loss-scale-window (1000) overflow-free steps in a row double S and restore the hysteresis.
#pragma once

#include <cstdint>
#include <vector>

namespace ptdp {

struct LossScaleSettings {
  double static_scale = 0;  // > 0: --loss-scale
  double initial_scale = 4294967296.0, min_scale = 1.0;
  int64_t window = 1000, hysteresis = 2;

  // InputError naming the flag.
  void validate() const;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScaleSettings& s = {});

  double scale() const { return scale_; }
  // After a step: whether its gradients overflowed. Returns true when the step's update was
  // applied (no overflow).
  bool update(bool overflow);

  // The state a checkpoint keeps (and restores): scale, good steps in a row, hysteresis left.
  std::vector<float> state() const;
  void restore(const std::vector<float>& state);

 private:
  LossScaleSettings s_;
  double scale_;
  int64_t good_steps_ = 0, hysteresis_left_;
};

}  // namespace ptdp
