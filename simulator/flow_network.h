// FlowNetwork: transfers in flight over a Topology, sharing link bandwidth max-min fairly.
//
// A flow holds every link of its path until its bytes are through. A link is tight when the
// flows on it, each at its path's bottleneck capacity, would exceed its capacity; only tight
// links can constrain a max-min fair allocation. Whenever a flow starts or ends, the flows
// connected to it through tight links are re-rated by progressive filling; flows that touch no
// tight link run at their path's bottleneck. Only flows whose rate changed are rescheduled.
// The network tells its owner when a flow's bytes are done through a callback-free queue of
// (time, flow) pairs that the owner's event loop polls.
#pragma once

#include <cstdint>
#include <vector>

#include "simulator/topology.h"

namespace ptdp {

class FlowNetwork {
 public:
  using Picos = int64_t;
  explicit FlowNetwork(const std::vector<Link>& links);

  // Starts a flow of `bytes` at `now` over `path`; returns its id. Completion times of this
  // flow and of the flows whose rates changed are appended to `reschedule`.
  int32_t start(Picos now, const std::vector<int32_t>* path, double bytes, int64_t tag,
                std::vector<std::pair<Picos, int32_t>>* reschedule);
  struct Spec {
    const std::vector<int32_t>* path;
    double bytes;
    int64_t tag;
  };
  // Starts every flow of `specs` at `now`, their ids appended to `ids`, with one re-rating.
  void start(Picos now, const std::vector<Spec>& specs, std::vector<int32_t>* ids,
             std::vector<std::pair<Picos, int32_t>>* reschedule);
  // Removes a finished flow (its bytes are through) and re-rates its neighbours.
  void finish(Picos now, int32_t flow, std::vector<std::pair<Picos, int32_t>>* reschedule);
  // Removes the flows of `flows` that are still active (a flow listed twice goes once), with one
  // re-rating; `flows` keeps those removed, in their order.
  void finish(Picos now, std::vector<int32_t>* flows,
              std::vector<std::pair<Picos, int32_t>>* reschedule);
  // The completion time most recently scheduled for `flow`; stale queue entries differ.
  Picos due(int32_t flow) const { return flows_[static_cast<size_t>(flow)].due; }
  int64_t tag(int32_t flow) const { return flows_[static_cast<size_t>(flow)].tag; }
  bool active(int32_t flow) const { return flows_[static_cast<size_t>(flow)].active; }

 private:
  struct Flow {
    const std::vector<int32_t>* path = nullptr;
    double remaining = 0;  // bytes
    double rate = 0;       // bytes per second
    Picos last = 0;        // when `remaining` was last brought up to date
    Picos due = 0;
    double solo = 0;  // bottleneck capacity of the path
    int64_t tag = 0;
    bool active = false;
  };
  int32_t add(Picos now, const std::vector<int32_t>* path, double bytes, int64_t tag);
  // Runs a new flow at its bottleneck, or adds it to seeds_ when one of its links is tight.
  void place(Picos now, int32_t id, std::vector<std::pair<Picos, int32_t>>* reschedule);
  void rerate(Picos now, const std::vector<int32_t>& seeds,
              std::vector<std::pair<Picos, int32_t>>* reschedule);
  Picos completion(Picos now, const Flow& f) const;

  const std::vector<Link>& links_;
  bool tight(int32_t link) const {
    return demand_[static_cast<size_t>(link)] >
           links_[static_cast<size_t>(link)].capacity_Bps * (1 + 1e-12);
  }
  std::vector<std::vector<int32_t>> on_link_;  // active flows per link
  std::vector<double> demand_;                 // sum of the solo rates of those flows
  std::vector<Flow> flows_;
  std::vector<int32_t> free_;
  // Scratch for rerate.
  std::vector<int32_t> component_, links_touched_, neighbours_, seeds_, one_;
  std::vector<double> old_rate_, left_;
  std::vector<int32_t> count_;
  std::vector<bool> was_tight_;  // finish: per links_touched_ entry, tight before the batch left
  std::vector<uint32_t> flow_mark_, link_mark_;
  std::vector<int32_t> link_pos_;
  uint32_t epoch_ = 0;
};

}  // namespace ptdp
