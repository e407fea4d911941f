// `ptdp calibrate`: measure this machine (calibration/measure.h), fit the cost model's numbers
// to the measurements (calibration/fit.h) and describe both in one machine file: the cluster
// measured, its fitted hardware profile, what was measured and how well each fit holds
// (docs/file_formats.md, docs/calibration.md).
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/model_spec.h"
#include "runtime/communicator.h"

namespace ptdp {

struct CalibrateOptions {
  std::string backend = "cpu";
  // Weights and activations of the kernels measured: fp32, or bf16 as ptdp run --bf16 runs them
  // (--bf16). The machine file prices runs of that precision only.
  DType precision = DType::kF32;
  ModelSpec model;     // whose op list's shapes are measured
  bool quick = false;  // fewer sizes, shorter timings (under 2 minutes on two cores)
  // Seconds the measurements may take (0: no limit): each timing's target shrinks to fit.
  double time_limit_s = 0;
  // Group sizes to time the collectives over (each >= 2 and dividing the ranks); empty: every
  // divisor of the ranks from 2 up.
  std::vector<int64_t> group_sizes;
  std::string command;  // the command line, recorded in the file
  // Called on rank 0 as the work advances: fraction done, what is being measured.
  std::function<void(double, const std::string&)> progress;
};

// Throws InputError("--group-sizes") unless every size is at least 2 and divides `ranks` (a
// group of g ranks needs g ranks to run: mpirun -np g or more).
void check_group_sizes(const std::vector<int64_t>& sizes, int ranks);

// Collective over `world` (and `control`, its control plane): every rank measures. Returns the
// machine file (the same object on every rank). Before measuring anything, on every rank alike,
// throws InputError("--backend") for a backend make_backend refuses (an unknown name, cuda
// without a GPU) and InputError("--group-sizes") (check_group_sizes).
nlohmann::json calibrate(const CalibrateOptions& o, Communicator& world, ControlPlane& control);

// The fitted numbers and every fit's residuals, as text.
void print_calibration(std::ostream& out, const nlohmann::json& machine);

}  // namespace ptdp
