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

// One CTA tile shape cuBLAS may cut a GEMM's output into, and how fast an SM runs it relative
// to the best tile (smaller tiles reuse each loaded operand less).
struct GemmTile {
  int64_t m = 256;
  int64_t n = 128;
  double efficiency = 1.0;
};

// Achieved fraction of tensor-core peak for `batch` GEMMs of shape (m, n, k):
//   efficiency = max_efficiency * fill(m, n, batch) * s(k, k_half),  s(x, h) = x / (x + h)
// fill is how much of the GPU the output tiles keep busy. With sm_count > 0 it is counted
// (NVIDIA's tile and wave quantisation): for each tile shape (either orientation) the output
// is cut into tm x tn tiles, each SM works on one tile at a time, and a wave that leaves SMs
// idle costs as much as a full one:
//   tiles = batch * ceil(m / tm) * ceil(n / tn),  waves = ceil(tiles / sm_count)
//   fill  = tile.efficiency * batch * m * n / (waves * sm_count * tm * tn)
// and the best tile wins, as cuBLAS's heuristics aim to pick it.
// With sm_count = 0 a smooth curve stands in: fill = s(batch * m, m_half) * s(n, n_half).
// s(k, k_half) is the K loop's prologue and epilogue, amortised over a longer loop.
struct GemmEfficiency {
  double max_efficiency = 0.8;
  double m_half = 64;
  double n_half = 64;
  double k_half = 64;
  int64_t sm_count = 0;  // 0: the smooth curve instead of counted tiles and waves
  std::vector<GemmTile> tiles = {GemmTile{}};
  double at(double m, double n, double k, double batch = 1) const;
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
