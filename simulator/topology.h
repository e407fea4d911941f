// Topology: the cluster as a graph of links with capacities, built from a ClusterSpec.
//
// Vertices are GPUs, one NVSwitch fabric per node, one network adapter (NIC) per rail of each
// node, and the switches of each tier of the fat tree (rail-optimised, as in a DGX SuperPOD:
// rail k of every node meets rail k of the other nodes in the same switches). Every link is a
// pair of directed edges with a capacity in bytes/s (datasheet bandwidth times the achieved
// fraction of the hardware profile) and a latency. Paths are shortest paths (Boost.Graph BFS),
// cached per GPU pair.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/cluster_spec.h"
#include "core/hardware_profile.h"

namespace ptdp {

struct Link {
  std::string name;         // e.g. "node3/gpu5->nvswitch", "node3/nic5->leaf0.r5"
  double capacity_Bps = 0;  // bytes per second, one direction
  double latency_s = 0;
};

class Topology {
 public:
  Topology(const ClusterSpec& c, const HardwareProfile& h);
  ~Topology();
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

  int64_t num_gpus() const { return num_gpus_; }
  int64_t num_vertices() const;
  const std::vector<Link>& links() const { return links_; }
  // Link indices from GPU `src` to GPU `dst` (empty when src == dst).
  const std::vector<int32_t>& path(int64_t src, int64_t dst);
  double path_latency_s(const std::vector<int32_t>& path) const;
  bool same_node(int64_t a, int64_t b) const { return a / gpus_per_node_ == b / gpus_per_node_; }

  struct Graph;  // the Boost.Graph adjacency list, kept out of this header

 private:
  std::unique_ptr<Graph> graph_;
  std::vector<Link> links_;
  int64_t num_gpus_ = 0, gpus_per_node_ = 1;
  std::map<std::pair<int64_t, int64_t>, std::vector<int32_t>> paths_;
};

}  // namespace ptdp
