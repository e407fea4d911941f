// HardwareProfile: how fast a GPU and its links really run, as opposed to their datasheet.
//
// The cost model multiplies datasheet numbers (ClusterSpec) by these efficiencies. Each number
// is physically meaningful and documented with its source in the preset's JSON and in
// docs/cost_model.md; `ptdp calibrate` will fit them from microbenchmarks.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace ptdp {

// Achieved fraction of tensor-core peak for a GEMM of shape (m, n, k):
//   efficiency = max_efficiency * s(m, m_half) * s(n, n_half) * s(k, k_half),  s(x, h) = x / (x +
//   h)
// A dimension of x_half elements halves throughput (too few tiles to fill the SMs, or too
// short a K loop to amortise the prologue); large GEMMs approach max_efficiency.
struct GemmEfficiency {
  double max_efficiency = 0.8;
  double m_half = 64;
  double n_half = 64;
  double k_half = 64;
  double at(double m, double n, double k) const;
};

// One kind of link a collective may span.
//   time = latency_us + per_step_latency_us * steps + algorithm_bytes / (busbw_efficiency * link
//   GB/s)
struct LinkEfficiency {
  double latency_us = 10;          // fixed cost of launching a collective on this link
  double per_step_latency_us = 1;  // each of the ring's steps (n-1 or 2(n-1))
  double busbw_efficiency = 0.8;   // achieved bus bandwidth / link bandwidth, large messages
};

struct HardwareProfile {
  std::string name = "custom";
  GemmEfficiency gemm;
  double hbm_efficiency = 0.8;            // achieved / datasheet bandwidth for streaming kernels
  double kernel_gap_us = 3;               // idle time between two dependent kernels on a stream
  LinkEfficiency nvlink;                  // collectives whose group stays inside a node
  LinkEfficiency network;                 // collectives whose group spans nodes
  double optimizer_bytes_per_param = 32;  // bytes moved per parameter by a fused AdamW step
  std::vector<std::string> sources;       // where each number comes from
};

HardwareProfile profile_from_json(const nlohmann::json& j);
nlohmann::json to_json(const HardwareProfile& p);

}  // namespace ptdp
