#include "runtime/expert_groups.h"

#include <string>

#include "core/error.h"

namespace ptdp {

ExpertPosition expert_position(int64_t t, int64_t d, int64_t etp, int64_t ep, int64_t tp,
                               int64_t dp, int64_t pp) {
  const int64_t stage = t * d;
  if (etp < 1 || ep < 1 || stage % (etp * ep) != 0)
    throw InputError("--expert-model-parallel-size",
                     "expert-tensor-parallel-size * expert-model-parallel-size (" +
                         std::to_string(etp) + " * " + std::to_string(ep) +
                         ") must divide t * cp * d (" + std::to_string(stage) + ")");
  ExpertPosition e;
  e.etp = etp;
  e.ep = ep;
  e.edp = stage / (etp * ep);
  const int64_t r = tp + t * dp;  // index within the stage
  e.etp_rank = r % etp;
  e.ep_rank = (r / etp) % ep;
  e.edp_rank = r / (etp * ep);
  // Groups never span stages: each colour is offset by the stage.
  e.etp_color = pp * stage + r / etp;
  e.ep_color = pp * stage + e.edp_rank * etp + e.etp_rank;
  e.edp_color = pp * stage + e.ep_rank * etp + e.etp_rank;
  return e;
}

}  // namespace ptdp
