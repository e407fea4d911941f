// ClusterSpec: the GPUs, how they are packed into nodes, and the links between them.
//
// Inside a node GPUs talk over NVLink/NVSwitch; between nodes each node has nics_per_node
// network adapters (one rail per GPU on a DGX) into a fat tree described by tiers.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/hardware_profile.h"

namespace ptdp {

struct GpuSpec {
  std::string name;
  double peak_tflops_16bit = 0;   // dense fp16/bf16 tensor-core peak, TFLOP/s
  double peak_tflops_fp8 = 0;     // dense FP8 tensor-core peak, TFLOP/s (0: no FP8 support)
  double memory_gib = 0;          // device memory, GiB
  double hbm_bandwidth_gbps = 0;  // device memory bandwidth, GB/s
  // FP8 copies Transformer Engine keeps of each linear layer's weight in FP8 training, a byte
  // per element each: 2 on Hopper, whose FP8 GEMMs take only the "TN" layout, so the weight's
  // transpose is cached beside it for the backward pass; 1 on Blackwell, whose FP8 GEMMs take
  // either (transformer_engine/pytorch/utils.py, is_non_tn_fp8_gemm_supported).
  int64_t fp8_weight_copies = 2;
};

// One level of the switch hierarchy above the nodes (leaf, spine, ...).
struct TopologyTier {
  std::string name;
  int64_t nodes_per_switch = 0;   // how many nodes one switch of this tier reaches
  double oversubscription = 1.0;  // >= 1; bandwidth up this tier divided by this
  double latency_us = 0;          // added per crossing of this tier
};

// The most GPUs a cluster may have: ten times the largest machines of 2024, and small enough
// that every GPU count ptdp multiplies stays far from overflowing (validate and resize refuse
// more, naming the field).
inline constexpr int64_t kMaxGpus = int64_t{1} << 20;

struct ClusterSpec {
  std::string name = "custom";
  GpuSpec gpu;
  int64_t gpus_per_node = 0;
  int64_t num_nodes = 0;
  double nvlink_bandwidth_gbps = 0;  // per GPU, one direction, GB/s
  double nvlink_latency_us = 0;
  int64_t nics_per_node = 0;
  double nic_bandwidth_gbps = 0;  // per NIC, one direction, GB/s
  double nic_latency_us = 0;
  std::vector<TopologyTier> tiers;
  // The profile measured on this machine when the cluster was read from a machine file
  // (`ptdp calibrate --out`); default_profile_for returns it. Null for presets.
  std::shared_ptr<const HardwareProfile> measured_profile;
  // From a machine file's "machine" object: the backend it measured and how many ranks took
  // part (its collectives were timed over groups of those ranks only). Empty / 0 otherwise.
  std::string measured_backend;
  // The element type of the activations measured ("fp32", "bf16"); empty for older files (fp32).
  std::string measured_activations;
  int64_t measured_ranks = 0;

  int64_t num_gpus() const { return gpus_per_node * num_nodes; }
  // Re-sizes the cluster to hold num_gpus (whole nodes, or one partial node when fewer GPUs
  // than a node are asked for). Throws InputError("num_gpus", ...) when not a whole number.
  void resize(int64_t num_gpus);
  void validate() const;
};

// Reads a cluster file, or a machine file (an object with "format": "ptdp-machine"; its
// "cluster" and its "profile", errors named "cluster.<field>" and "profile.<field>"; see
// docs/file_formats.md).
ClusterSpec cluster_from_json(const nlohmann::json& j);
// The cluster alone (a machine file's profile is written by the calibrator, not here).
nlohmann::json to_json(const ClusterSpec& c);

// The value of a machine file's "format".
inline constexpr const char* kMachineFileFormat = "ptdp-machine";
bool is_machine_file(const nlohmann::json& j);

}  // namespace ptdp
