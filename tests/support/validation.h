// The published Megatron-LM measurements (SC'21, tests/data/validation/megatron_sc21.json) as
// runnable cases: each is a model, a plan on the paper's cluster and the measured iteration
// time derived from the paper's TFLOP/s (its equation 3 divided by GPUs x TFLOP/s).
// Test-only: built as ptdp_test_support (tests/CMakeLists.txt), linked by the tests alone.
#pragma once

#include <string>
#include <vector>

#include "core/model_spec.h"
#include "core/parallel_plan.h"

namespace ptdp {

struct ValidationCase {
  std::string label;  // e.g. "table1 145.6B" or "fig12 interleaved B=24"
  ModelSpec model;
  ParallelPlan plan;
  double measured_tflops_per_gpu = 0;
  double measured_iteration_s = 0;
};

// SC'21 equation 3: FLOPs per iteration with full recomputation.
double sc21_equation3_flops(const ModelSpec& m, double global_batch);

// Reads the validation file; InputError on a malformed file.
std::vector<ValidationCase> load_sc21_cases(const std::string& path);

}  // namespace ptdp
