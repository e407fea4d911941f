#include "planner/comm_model.h"

#include <algorithm>

#include "core/units.h"

namespace ptdp {
namespace {

// A group of `size` ranks at `stride` in rank order, on nodes of `gpn` GPUs.
GroupSpan span_of(int64_t size, int64_t stride, int64_t gpn) {
  GroupSpan g;
  g.size = size;
  const int64_t extent = size * stride;  // consecutive ranks the group's pattern covers
  if (extent < gpn && gpn % extent != 0) {
    // The groups do not tile a node (t = 3 on 8-GPU nodes): some group straddles two nodes,
    // with as few as one rank on one side, and that slowest group sets the pace. Its ring
    // crosses over the one rank's rail while every GPU of the node may be doing the same.
    g.ranks_per_node = 1;
    g.nodes = 2;
    g.concurrent_per_node = gpn;
  } else if (extent <= gpn) {
    g.ranks_per_node = size;
    g.nodes = 1;
    g.concurrent_per_node = std::max<int64_t>(1, gpn / size);
  } else {
    g.ranks_per_node = std::max<int64_t>(1, gpn / stride);
    g.nodes = (size + g.ranks_per_node - 1) / g.ranks_per_node;
    g.concurrent_per_node = std::max<int64_t>(1, gpn / g.ranks_per_node);
  }
  return g;
}

double algorithm_factor(Collective kind, int64_t n) {
  const double nd = static_cast<double>(n);
  switch (kind) {
    case Collective::kAllReduce:
      return 2.0 * (nd - 1.0) / nd;
    case Collective::kAllGather:
    case Collective::kReduceScatter:
    case Collective::kAllToAll:  // each rank keeps 1/n of its buffer and sends the rest
      return (nd - 1.0) / nd;
    case Collective::kSendRecv:
      return 1.0;
  }
  return 1.0;
}

double ring_steps(Collective kind, int64_t n) {
  if (kind == Collective::kSendRecv) return 1.0;
  const double nd = static_cast<double>(n);
  return kind == Collective::kAllReduce ? 2.0 * (nd - 1.0) : nd - 1.0;
}

}  // namespace

double collective_algorithm_factor(Collective kind, int64_t n) {
  return algorithm_factor(kind, n);
}

GroupSpan tensor_group_span(const ClusterSpec& c, const ParallelPlan& p) {
  return span_of(p.tensor_parallel, 1, c.gpus_per_node);
}

GroupSpan data_group_span(const ClusterSpec& c, const ParallelPlan& p) {
  return span_of(p.data_parallel * p.context_parallel, p.tensor_parallel, c.gpus_per_node);
}

GroupSpan context_group_span(const ClusterSpec& c, const ParallelPlan& p) {
  return span_of(p.context_parallel, p.tensor_parallel, c.gpus_per_node);
}

GroupSpan context_group_span(const ClusterSpec& c, const ParallelPlan& p, Collective kind) {
  if (p.context_parallel <= 1 || p.cp_comm != CpComm::kA2AP2P) return context_group_span(c, p);
  const int64_t a = p.cp_a2a_size();
  return kind == Collective::kAllToAll
             ? span_of(a, p.tensor_parallel, c.gpus_per_node)
             : span_of(p.cp_ring_size(), p.tensor_parallel * a, c.gpus_per_node);
}

GroupSpan expert_group_span(const ClusterSpec& c, const ParallelPlan& p) {
  return span_of(p.expert_parallel, p.expert_tp(), c.gpus_per_node);
}

GroupSpan expert_tensor_group_span(const ClusterSpec& c, const ParallelPlan& p) {
  return span_of(p.expert_tp(), 1, c.gpus_per_node);
}

GroupSpan expert_data_group_span(const ClusterSpec& c, const ParallelPlan& p) {
  return span_of(p.expert_data_parallel(), p.expert_tp() * p.expert_parallel, c.gpus_per_node);
}

GroupSpan optimizer_instance_span(const ClusterSpec& c, const ParallelPlan& p) {
  return span_of(p.instance_ranks(), p.tensor_parallel, c.gpus_per_node);
}

GroupSpan optimizer_replica_span(const ClusterSpec& c, const ParallelPlan& p) {
  return span_of(p.instances(), p.tensor_parallel * p.instance_ranks(), c.gpus_per_node);
}

GroupSpan expert_optimizer_instance_span(const ClusterSpec& c, const ParallelPlan& p) {
  return span_of(p.expert_instance_ranks(), p.expert_tp() * p.expert_parallel, c.gpus_per_node);
}

GroupSpan expert_optimizer_replica_span(const ClusterSpec& c, const ParallelPlan& p) {
  return span_of(p.instances(), p.expert_tp() * p.expert_parallel * p.expert_instance_ranks(),
                 c.gpus_per_node);
}

GroupSpan ring_neighbour_span(const GroupSpan& group, const ClusterSpec& c) {
  GroupSpan pair;
  pair.size = group.size > 1 ? 2 : 1;
  if (group.nodes > 1) {
    pair.nodes = 2;
    pair.ranks_per_node = 1;
    pair.concurrent_per_node = std::max(group.concurrent_per_node, c.nics_per_node);
  } else {
    pair.ranks_per_node = pair.size;
    pair.concurrent_per_node = group.concurrent_per_node;
  }
  return pair;
}

bool pipeline_crosses_nodes(const ClusterSpec& c, const ParallelPlan& p) {
  return p.tensor_parallel * p.context_parallel * p.data_parallel >= c.gpus_per_node ||
         p.num_gpus() > c.gpus_per_node;
}

double CommModel::bus_bandwidth(const GroupSpan& span) const {
  const double nvlink = cluster_.nvlink_bandwidth_gbps * kGB * profile_.nvlink.busbw_efficiency;
  if (span.nodes <= 1) return nvlink;
  // A ring leaves each node once per channel; the group's share of the node's NICs carries it.
  const double nics =
      static_cast<double>(cluster_.nics_per_node) / static_cast<double>(span.concurrent_per_node);
  double net = nics * cluster_.nic_bandwidth_gbps * kGB * profile_.network.busbw_efficiency;
  for (const TopologyTier& tier : cluster_.tiers) {
    if (span.nodes > tier.nodes_per_switch) net /= tier.oversubscription;
  }
  return std::min(nvlink, net);
}

double CommModel::software_latency_us(Collective kind, int64_t n, bool inter_node) const {
  const LinkEfficiency& link = inter_node ? profile_.network : profile_.nvlink;
  return link.latency_us + link.per_step_latency_us * ring_steps(kind, n);
}

double CommModel::collective_time(Collective kind, double bytes, const GroupSpan& span,
                                  DType element) const {
  if (span.size <= 1 || bytes <= 0) return 0.0;
  // Measured on this machine (ptdp calibrate): its own latency and bus bandwidth.
  if (const CollectiveFit* f = profile_.find_collective(kind, span.size, span.nodes, element))
    return f->latency_us * kMicrosecond +
           algorithm_factor(kind, span.size) * bytes / (f->busbw_gbps * kGB);
  const bool inter = span.nodes > 1;
  if (kind == Collective::kAllToAll && inter) {
    // Every rank of the node exchanges at once (all the node's groups): each has its share of
    // the node's NICs for the part of its buffer bound for other nodes, and NVLink for the rest.
    const double gpn = static_cast<double>(span.ranks_per_node * span.concurrent_per_node);
    const double per_rank_net = static_cast<double>(cluster_.nics_per_node) *
                                cluster_.nic_bandwidth_gbps * kGB *
                                profile_.network.busbw_efficiency / std::max(1.0, gpn);
    const double n = static_cast<double>(span.size);
    const double local = static_cast<double>(span.ranks_per_node);
    double net = per_rank_net;
    for (const TopologyTier& tier : cluster_.tiers)
      if (span.nodes > tier.nodes_per_switch) net /= tier.oversubscription;
    const double nvlink = cluster_.nvlink_bandwidth_gbps * kGB * profile_.nvlink.busbw_efficiency;
    const double cross = bytes * (n - local) / n, within = bytes * (local - 1.0) / n;
    return (software_latency_us(kind, span.size, true) + cluster_.nic_latency_us) * kMicrosecond +
           std::max(cross / net, within / nvlink);
  }
  double latency_us = software_latency_us(kind, span.size, inter) +
                      (inter ? cluster_.nic_latency_us : cluster_.nvlink_latency_us);
  if (inter) {
    // A message that leaves one switch of a tier climbs to the next tier and back down.
    for (const TopologyTier& tier : cluster_.tiers) {
      if (span.nodes > tier.nodes_per_switch) latency_us += 2.0 * tier.latency_us;
    }
  }
  return latency_us * kMicrosecond +
         algorithm_factor(kind, span.size) * bytes / bus_bandwidth(span);
}

P2PSplit CommModel::p2p_split(double bytes, const ParallelPlan& p) const {
  P2PSplit s;
  s.inter_node = pipeline_crosses_nodes(cluster_, p);
  s.latency_s = software_latency_us(Collective::kSendRecv, 2, s.inter_node) * kMicrosecond;
  s.bytes = bytes;
  const int64_t t = p.tensor_parallel;
  // With sequence parallelism the message is already each rank's 1/t of the sequence, and
  // Megatron does not scatter it again (scatter_gather_tensors_in_pipeline and not
  // sequence_parallel).
  if (s.inter_node && p.scatter_gather_p2p && t > 1 && !p.sequence_parallel) {
    // Each tensor-parallel rank sends a 1/t slice on its own rail, then the slices are
    // all-gathered inside the receiving node.
    s.bytes = bytes / static_cast<double>(t);
    s.gather_s = collective_time(Collective::kAllGather, bytes, tensor_group_span(cluster_, p),
                                 profile_.activation_dtype);
  }
  return s;
}

double CommModel::p2p_time(double bytes, const ParallelPlan& p) const {
  const P2PSplit s = p2p_split(bytes, p);
  GroupSpan pair;
  pair.size = 2;
  if (!s.inter_node)
    return collective_time(Collective::kSendRecv, s.bytes, pair, profile_.activation_dtype);
  // Across nodes: each sender has its own rail with scatter/gather; without it the t ranks
  // that each send the full tensor share the node's rails.
  pair.nodes = 2;
  pair.ranks_per_node = 1;
  pair.concurrent_per_node = cluster_.gpus_per_node;
  return collective_time(Collective::kSendRecv, s.bytes, pair, profile_.activation_dtype) +
         s.gather_s;
}

}  // namespace ptdp
