#include "simulator/flow_network.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ptdp {

FlowNetwork::FlowNetwork(const std::vector<Link>& links)
    : links_(links), on_link_(links.size()), link_mark_(links.size(), 0) {}

FlowNetwork::Picos FlowNetwork::completion(Picos now, const Flow& f) const {
  if (f.remaining <= 0) return now;
  return now + static_cast<Picos>(std::ceil(f.remaining / f.rate * 1e12));
}

int32_t FlowNetwork::start(Picos now, const std::vector<int32_t>* path, double bytes, int64_t tag,
                           std::vector<std::pair<Picos, int32_t>>* reschedule) {
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else {
    id = static_cast<int32_t>(flows_.size());
    flows_.emplace_back();
    flow_mark_.push_back(0);
  }
  Flow& f = flows_[static_cast<size_t>(id)];
  f = Flow{path, bytes, 0, now, 0, tag, true};
  bool shared = false;
  double bottleneck = std::numeric_limits<double>::infinity();
  for (int32_t l : *path) {
    shared |= !on_link_[static_cast<size_t>(l)].empty();
    bottleneck = std::min(bottleneck, links_[static_cast<size_t>(l)].capacity_Bps);
    on_link_[static_cast<size_t>(l)].push_back(id);
  }
  if (!shared) {
    f.rate = bottleneck;
    f.due = completion(now, f);
    reschedule->emplace_back(f.due, id);
  } else {
    rerate(now, {id}, reschedule);
  }
  return id;
}

void FlowNetwork::finish(Picos now, int32_t id, std::vector<std::pair<Picos, int32_t>>* reschedule) {
  Flow& f = flows_[static_cast<size_t>(id)];
  std::vector<int32_t> neighbours;
  for (int32_t l : *f.path) {
    auto& v = on_link_[static_cast<size_t>(l)];
    v.erase(std::find(v.begin(), v.end(), id));
    neighbours.insert(neighbours.end(), v.begin(), v.end());
  }
  f.active = false;
  free_.push_back(id);
  if (!neighbours.empty()) rerate(now, neighbours, reschedule);
}

void FlowNetwork::rerate(Picos now, const std::vector<int32_t>& seeds,
                         std::vector<std::pair<Picos, int32_t>>* reschedule) {
  ++epoch_;
  component_.clear();
  links_touched_.clear();
  for (int32_t s : seeds) {
    if (flow_mark_[static_cast<size_t>(s)] == epoch_) continue;
    flow_mark_[static_cast<size_t>(s)] = epoch_;
    component_.push_back(s);
  }
  // Every flow sharing a link with the component, transitively.
  for (size_t i = 0; i < component_.size(); ++i) {
    for (int32_t l : *flows_[static_cast<size_t>(component_[i])].path) {
      if (link_mark_[static_cast<size_t>(l)] == epoch_) continue;
      link_mark_[static_cast<size_t>(l)] = epoch_;
      links_touched_.push_back(l);
      for (int32_t g : on_link_[static_cast<size_t>(l)]) {
        if (flow_mark_[static_cast<size_t>(g)] == epoch_) continue;
        flow_mark_[static_cast<size_t>(g)] = epoch_;
        component_.push_back(g);
      }
    }
  }
  // Bring every flow's remaining bytes up to now at its old rate.
  for (int32_t id : component_) {
    Flow& f = flows_[static_cast<size_t>(id)];
    f.remaining = std::max(0.0, f.remaining - f.rate * static_cast<double>(now - f.last) / 1e12);
    f.last = now;
    f.rate = -1;  // not fixed yet
  }
  // Progressive filling: the most constrained link fixes the rate of its unfixed flows.
  std::vector<double> left(links_touched_.size());
  for (size_t i = 0; i < links_touched_.size(); ++i)
    left[i] = links_[static_cast<size_t>(links_touched_[i])].capacity_Bps;
  size_t unfixed = component_.size();
  while (unfixed > 0) {
    double best = std::numeric_limits<double>::infinity();
    size_t best_link = 0;
    for (size_t i = 0; i < links_touched_.size(); ++i) {
      int n = 0;
      for (int32_t g : on_link_[static_cast<size_t>(links_touched_[i])])
        n += flows_[static_cast<size_t>(g)].rate < 0;
      if (n == 0) continue;
      const double share = left[i] / n;
      if (share < best) {
        best = share;
        best_link = i;
      }
    }
    for (int32_t g : on_link_[static_cast<size_t>(links_touched_[best_link])]) {
      Flow& f = flows_[static_cast<size_t>(g)];
      if (f.rate >= 0) continue;
      f.rate = best;
      --unfixed;
      for (int32_t l : *f.path)
        for (size_t i = 0; i < links_touched_.size(); ++i)
          if (links_touched_[i] == l) left[i] -= best;
    }
  }
  for (int32_t id : component_) {
    Flow& f = flows_[static_cast<size_t>(id)];
    f.due = completion(now, f);
    reschedule->emplace_back(f.due, id);
  }
}

}  // namespace ptdp
