// `ptdp reconcile`: a measured run (its trace, cli/trace_file.h) set against the cost model's
// prediction for the same model, plan and cluster (planner/op_breakdown.h), per op family, per
// pipeline stage, for the bubble, the iteration and the peak memory. docs/reconcile.md says how
// each measured figure is taken from the trace.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cli/trace_file.h"
#include "planner/cost_model.h"
#include "planner/op_breakdown.h"

namespace ptdp {

// One compared figure: seconds per iteration (bytes for memory).
struct Compared {
  double predicted = 0, measured = 0;
  double error() const { return measured - predicted; }
  // error / predicted; NaN when nothing was predicted.
  double relative_error() const;
};

// Rows of a stage, in this order: the op families of the passes (attention GEMMs ... embedding
// and head), "pass_overhead" (time inside passes between ops), then pipeline p2p, the
// data-parallel sync, the optimizer and "bubble" (the rest of the iteration). They add up to the
// iteration on both sides.
struct ReconcileRow {
  std::string name;  // family_name(), "pass_overhead" or "bubble"
  Compared time;
  Compared roles[4];  // per OpRole, for the op families
};

struct StageReconciliation {
  int64_t stage = 0;
  Compared busy;  // everything but the bubble
  std::vector<ReconcileRow> rows;
};

struct Reconciliation {
  int64_t measured_steps = 0, warmup_steps = 0;
  Compared iteration;
  Compared peak_memory;  // bytes: CostModel::memory's most loaded GPU, the run's tensor peak
  // MoE models: the busiest expert-parallel rank's routed rows over the mean, as priced
  // (expert_load) and as the run measured it (0: the trace does not say). The all-to-alls
  // wait for the busiest rank, so a measured load above the priced one shows as ep_comm.
  Compared expert_load;
  std::vector<StageReconciliation> stages;
  // The stage with the most measured busy time (it sets the pace).
  int64_t critical_stage = 0;
  // The stage row with the largest |error| and its error as a share of the iteration's error;
  // of the bubbles only the critical stage's competes (the others' follow from it).
  int64_t largest_stage = 0;
  std::string largest_row;
  double largest_error = 0, largest_share = 0;
};

// Throws InputError("--trace ...") when the trace has no measured step (only warm-up) or its
// events do not split into its steps.
Reconciliation reconcile(const RunTrace& trace, const CostModel& cost, const std::string& what);

}  // namespace ptdp
