// The plan file `ptdp run --plan` reads: what `ptdp plan --out` writes (a ranked "plans" list,
// best first, each entry a plan or an object holding one under "configuration", and the
// "model"), or a file holding one plan object (core/parallel_plan.h's JSON).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/model_spec.h"
#include "core/parallel_plan.h"

namespace ptdp {

// A plan to run and its 1-based position in the --plan file (0 without a file).
struct NumberedPlan {
  ParallelPlan plan;
  int64_t index = 0;
  // The precision the plan was priced in, where the file says (`ptdp plan` writes it).
  std::optional<DType> priced;
};

// The plans that `index` selects from the file at `path` (empty: the first, i.e. the best; a
// rank 1..n; or "all"), and the file's model when it records one (*have_model says whether).
// Throws InputError("--plan" or "--plan-index", ...) for an unreadable file, a bad index or a
// malformed plan or model.
std::vector<NumberedPlan> read_plan_file(const std::string& path, const std::string& index,
                                         ModelSpec* model, bool* have_model);

}  // namespace ptdp
