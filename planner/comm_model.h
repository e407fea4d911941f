// Where a parallel group's ranks sit, and what a collective over them costs.
//
// Ranks are placed as Megatron-LM places them: tensor-parallel innermost, then data-parallel,
// then pipeline-parallel (global rank = tp + t * (dp + d * pp)), nodes filled in rank order.
#pragma once

#include <cstdint>

#include "core/cluster_spec.h"
#include "core/hardware_profile.h"
#include "core/layer_ops.h"
#include "core/parallel_plan.h"

namespace ptdp {

// The physical extent of one group: its size, how many of its ranks share a node, how many
// nodes it spans and how many groups of its kind run side by side on one node (they share
// the node's NICs).
struct GroupSpan {
  int64_t size = 1;
  int64_t ranks_per_node = 1;
  int64_t nodes = 1;
  int64_t concurrent_per_node = 1;
};

GroupSpan tensor_group_span(const ClusterSpec& c, const ParallelPlan& p);
GroupSpan data_group_span(const ClusterSpec& c, const ParallelPlan& p);
// True when neighbouring pipeline stages sit on different nodes.
bool pipeline_crosses_nodes(const ClusterSpec& c, const ParallelPlan& p);

class CommModel {
 public:
  CommModel(const ClusterSpec& c, const HardwareProfile& h) : cluster_(c), profile_(h) {}

  // Time of a collective of `bytes` (nccl-tests' size) over `span`, seconds.
  double collective_time(Collective kind, double bytes, const GroupSpan& span) const;
  // Bus bandwidth a collective over `span` achieves on large messages, bytes/s.
  double bus_bandwidth(const GroupSpan& span) const;
  // One activation (or gradient) transfer between adjacent pipeline stages of `bytes` per
  // tensor-parallel rank set; with scatter/gather each of the t ranks sends bytes/t over its
  // own NIC and the receivers all-gather over NVLink.
  double p2p_time(double bytes, const ParallelPlan& p) const;

 private:
  const ClusterSpec& cluster_;
  const HardwareProfile& profile_;
};

}  // namespace ptdp
