// Where a parallel group's ranks sit, and what a collective over them costs.
//
// Ranks are placed as Megatron-LM places them: tensor-parallel innermost, then context-
// parallel, then data-parallel, then pipeline-parallel (global rank = tp + t * (cpr + cp * (dp +
// d * pp))), nodes filled in rank order. The experts regroup a stage's t * cp * d ranks as
// expert-tensor (innermost), expert-parallel, then expert-data-parallel.
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

// The bytes a ring moves per rank, over the buffer's bytes (nccl-tests' busbw / algbw):
// 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for send/recv.
double collective_algorithm_factor(Collective kind, int64_t n);

GroupSpan tensor_group_span(const ClusterSpec& c, const ParallelPlan& p);
// The ranks that reduce the dense parameters' gradients: d * cp of them (Megatron's
// data-parallel group with context parallelism).
GroupSpan data_group_span(const ClusterSpec& c, const ParallelPlan& p);
GroupSpan context_group_span(const ClusterSpec& c, const ParallelPlan& p);
// The context-parallel ranks a collective of `kind` runs over: the whole cp group, but with
// a2a+p2p its all-to-alls within groups of A adjacent ranks (cp_a2a_size) and its ring steps
// among the B = cp / A groups (cp_ring_size, a stride of t A).
GroupSpan context_group_span(const ClusterSpec& c, const ParallelPlan& p, Collective kind);
GroupSpan expert_group_span(const ClusterSpec& c, const ParallelPlan& p);
GroupSpan expert_tensor_group_span(const ClusterSpec& c, const ParallelPlan& p);
GroupSpan expert_data_group_span(const ClusterSpec& c, const ParallelPlan& p);
// With the distributed optimizer in K instances (--num-distributed-optimizer-instances): the
// ranks of one instance, which reduce-scatter the gradients and all-gather the weights (the
// whole data-parallel group when K = 1), and the K ranks, one per instance, that all-reduce a
// shard across the instances. The experts' likewise over their expert-data-parallel ranks.
GroupSpan optimizer_instance_span(const ClusterSpec& c, const ParallelPlan& p);
GroupSpan optimizer_replica_span(const ClusterSpec& c, const ParallelPlan& p);
GroupSpan expert_optimizer_instance_span(const ClusterSpec& c, const ParallelPlan& p);
GroupSpan expert_optimizer_replica_span(const ClusterSpec& c, const ParallelPlan& p);
// A ring's neighbours within `group`: two ranks, across nodes when the group spans nodes,
// where each crossing pair has one NIC (a GPU sends on its own rail) however few rings cross.
GroupSpan ring_neighbour_span(const GroupSpan& group, const ClusterSpec& c);
// True when neighbouring pipeline stages sit on different nodes.
bool pipeline_crosses_nodes(const ClusterSpec& c, const ParallelPlan& p);

// One pipeline transfer of `bytes` (one activation or its gradient), split into what moves it:
// a fixed software latency, the bytes each tensor-parallel rank sends to its counterpart on the
// neighbouring stage (bytes/t with the scatter/gather optimisation across nodes) and, with
// scatter/gather, the all-gather of the slices inside the receiving node. CommModel::p2p_time
// prices the bytes on the links in closed form; the simulator moves them as flows over its
// topology, which adds the links' own latencies (planner/simulation_input.cc).
struct P2PSplit {
  bool inter_node = false;  // the neighbouring stages sit on different nodes
  double latency_s = 0;     // software latency of the send/receive pair
  double bytes = 0;         // per tensor-parallel rank
  double gather_s = 0;      // all-gather in the receiving node (0 without scatter/gather)
};

class CommModel {
 public:
  CommModel(const ClusterSpec& c, const HardwareProfile& h) : cluster_(c), profile_(h) {}

  // Time of a collective of `bytes` (nccl-tests' size) of `element`s over `span`, seconds. The
  // element type picks a calibrated fit timed on it (a 16-bit sum is another kernel); the link
  // model prices bytes alike.
  double collective_time(Collective kind, double bytes, const GroupSpan& span, DType element) const;
  // Bus bandwidth a collective over `span` achieves on large messages, bytes/s.
  double bus_bandwidth(const GroupSpan& span) const;
  // One activation (or gradient) transfer between adjacent pipeline stages of `bytes` per
  // tensor-parallel rank set; with scatter/gather each of the t ranks sends bytes/t over its
  // own NIC and the receivers all-gather over NVLink.
  double p2p_time(double bytes, const ParallelPlan& p) const;
  P2PSplit p2p_split(double bytes, const ParallelPlan& p) const;

 private:
  // The launch and per-ring-step latency of a collective over `n` ranks, microseconds
  // (without the links' own latencies).
  double software_latency_us(Collective kind, int64_t n, bool inter_node) const;

  const ClusterSpec& cluster_;
  const HardwareProfile& profile_;
};

}  // namespace ptdp
