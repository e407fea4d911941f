// The least-squares fits of `ptdp calibrate`: the GEMM efficiency curve to the measured
// table, latency and bandwidth of a collective, and the per-kernel gap with per-family
// throughput of memory-bound kernels. Every fit reports its residuals, relative to the measured
// value (docs/calibration.md).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace ptdp {

// (model - measured) / measured over the points of a fit.
struct FitResiduals {
  int64_t points = 0;
  double rms_relative = 0;
  double max_relative = 0;
};
FitResiduals residuals_of(const std::vector<double>& model, const std::vector<double>& measured);
nlohmann::json to_json(const FitResiduals& r);

// One measured GEMM: `batch` products of (m x k) by (k x n) at `efficiency` of the peak.
struct GemmSample {
  double m = 1, n = 1, k = 1, batch = 1;
  double efficiency = 1;
};

// GemmEfficiency's smooth curve (core/hardware_profile.h, sm_count = 0):
//   efficiency = max_efficiency * s(batch m, m_half) s(n, n_half) s(k, k_half),  s(x, h) = x/(x+h)
// fitted in log space (relative error) by a coarse grid over the halves and Levenberg-Marquardt.
struct GemmCurveFit {
  double max_efficiency = 1, m_half = 0, n_half = 0, k_half = 0;
  FitResiduals residuals;  // of the efficiency
};
GemmCurveFit fit_gemm_curve(const std::vector<GemmSample>& samples);

// seconds = latency_s + x * seconds_per_unit, minimising relative error; latency_s >= 0 and
// seconds_per_unit > 0 (x: bytes, or bytes times an algorithm factor).
struct LinearFit {
  double latency_s = 0;
  double seconds_per_unit = 0;
  FitResiduals residuals;  // of the seconds
};
LinearFit fit_latency_bandwidth(const std::vector<double>& x, const std::vector<double>& seconds);

// Memory-bound kernels: seconds = gap_s + bytes * seconds_per_byte[family], one gap shared by
// every kernel (the fixed per-op cost) and one throughput per family, minimising relative
// error; gap_s >= 0.
struct MemoryFit {
  double gap_s = 0;
  std::vector<double> seconds_per_byte;  // per family index
  std::vector<FitResiduals> residuals;   // per family
  FitResiduals all;
};
MemoryFit fit_memory_kernels(const std::vector<int>& family, const std::vector<double>& bytes,
                             const std::vector<double>& seconds, int families);

}  // namespace ptdp
