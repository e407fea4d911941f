#include "simulator/flow_network.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ptdp {

FlowNetwork::FlowNetwork(const std::vector<Link>& links)
    : links_(links),
      on_link_(links.size()),
      demand_(links.size(), 0.0),
      link_mark_(links.size(), 0),
      link_pos_(links.size(), 0) {}

FlowNetwork::Picos FlowNetwork::completion(Picos now, const Flow& f) const {
  if (f.remaining <= 0) return now;
  return now + static_cast<Picos>(std::ceil(f.remaining / f.rate * 1e12));
}

int32_t FlowNetwork::add(Picos now, const std::vector<int32_t>* path, double bytes, int64_t tag) {
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
  f = Flow{path, bytes, 0, now, 0, 0, tag, true};
  double bottleneck = std::numeric_limits<double>::infinity();
  for (int32_t l : *path)
    bottleneck = std::min(bottleneck, links_[static_cast<size_t>(l)].capacity_Bps);
  f.solo = bottleneck;
  for (int32_t l : *path) {
    on_link_[static_cast<size_t>(l)].push_back(id);
    demand_[static_cast<size_t>(l)] += bottleneck;
  }
  return id;
}

void FlowNetwork::start(Picos now, const std::vector<Spec>& specs, std::vector<int32_t>* ids,
                        std::vector<std::pair<Picos, int32_t>>* reschedule) {
  const size_t first = ids->size();
  for (const Spec& s : specs) ids->push_back(add(now, s.path, s.bytes, s.tag));
  // With every new flow on its links, those on a tight link are re-rated (with what they
  // share it with); the others run at their bottleneck.
  seeds_.clear();
  for (size_t i = first; i < ids->size(); ++i) place(now, (*ids)[i], reschedule);
  if (!seeds_.empty()) rerate(now, seeds_, reschedule);
}

void FlowNetwork::place(Picos now, int32_t id, std::vector<std::pair<Picos, int32_t>>* reschedule) {
  Flow& f = flows_[static_cast<size_t>(id)];
  if (std::any_of(f.path->begin(), f.path->end(), [&](int32_t l) { return tight(l); })) {
    seeds_.push_back(id);
    return;
  }
  f.rate = f.solo;
  f.due = completion(now, f);
  reschedule->emplace_back(f.due, id);
}

int32_t FlowNetwork::start(Picos now, const std::vector<int32_t>* path, double bytes, int64_t tag,
                           std::vector<std::pair<Picos, int32_t>>* reschedule) {
  const int32_t id = add(now, path, bytes, tag);
  seeds_.clear();
  place(now, id, reschedule);
  if (!seeds_.empty()) rerate(now, seeds_, reschedule);
  return id;
}

void FlowNetwork::finish(Picos now, int32_t id,
                         std::vector<std::pair<Picos, int32_t>>* reschedule) {
  one_.assign(1, id);
  finish(now, &one_, reschedule);
}

void FlowNetwork::finish(Picos now, std::vector<int32_t>* flows,
                         std::vector<std::pair<Picos, int32_t>>* reschedule) {
  // Mark the batch and the links it leaves; a link that was tight with it wakes its others.
  ++epoch_;
  links_touched_.clear();
  was_tight_.clear();
  size_t kept = 0;
  for (int32_t id : *flows) {
    Flow& f = flows_[static_cast<size_t>(id)];
    if (!f.active) continue;
    f.active = false;
    (*flows)[kept++] = id;
    for (int32_t l : *f.path) {
      if (link_mark_[static_cast<size_t>(l)] == epoch_) continue;
      link_mark_[static_cast<size_t>(l)] = epoch_;
      links_touched_.push_back(l);
      was_tight_.push_back(tight(l));
    }
  }
  flows->resize(kept);
  neighbours_.clear();
  for (size_t i = 0; i < links_touched_.size(); ++i) {
    const int32_t l = links_touched_[i];
    auto& v = on_link_[static_cast<size_t>(l)];
    double& demand = demand_[static_cast<size_t>(l)];
    v.erase(std::remove_if(v.begin(), v.end(),
                           [&](int32_t g) {
                             const Flow& f = flows_[static_cast<size_t>(g)];
                             if (f.active) return false;
                             demand -= f.solo;
                             return true;
                           }),
            v.end());
    if (v.empty()) demand = 0;  // no drift from rounding
    if (was_tight_[i]) neighbours_.insert(neighbours_.end(), v.begin(), v.end());
  }
  for (int32_t id : *flows) free_.push_back(id);
  if (!neighbours_.empty()) rerate(now, neighbours_, reschedule);
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
      if (link_mark_[static_cast<size_t>(l)] == epoch_ || !tight(l)) continue;
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
  old_rate_.resize(component_.size());
  for (size_t i = 0; i < component_.size(); ++i) {
    Flow& f = flows_[static_cast<size_t>(component_[i])];
    f.remaining = std::max(0.0, f.remaining - f.rate * static_cast<double>(now - f.last) / 1e12);
    f.last = now;
    old_rate_[i] = f.rate;
    f.rate = -1;  // not fixed yet
  }
  // Progressive filling over the tight links: the link with the smallest fair share fixes the
  // rate of its unfixed flows (all links tied at that share at once); a flow whose own path
  // bottleneck is below the share is held there instead.
  const size_t nl = links_touched_.size();
  left_.assign(nl, 0.0);
  count_.assign(nl, 0);
  std::vector<double>& left = left_;
  std::vector<int32_t>& count = count_;
  for (size_t i = 0; i < nl; ++i) {
    const int32_t l = links_touched_[i];
    left[i] = links_[static_cast<size_t>(l)].capacity_Bps;
    link_pos_[static_cast<size_t>(l)] = static_cast<int32_t>(i);
    count[i] = static_cast<int32_t>(on_link_[static_cast<size_t>(l)].size());
  }
  auto fix = [&](Flow& f, double rate) {
    f.rate = rate;
    for (int32_t l : *f.path) {
      if (link_mark_[static_cast<size_t>(l)] != epoch_) continue;
      const size_t i = static_cast<size_t>(link_pos_[static_cast<size_t>(l)]);
      left[i] -= rate;
      --count[i];
    }
  };
  size_t unfixed = component_.size();
  while (unfixed > 0) {
    double best = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < nl; ++i)
      if (count[i] > 0) best = std::min(best, std::max(0.0, left[i]) / count[i]);
    bool held = false;
    for (int32_t id : component_) {
      Flow& f = flows_[static_cast<size_t>(id)];
      if (f.rate < 0 && f.solo <= best) {
        fix(f, f.solo);
        --unfixed;
        held = true;
      }
    }
    if (held) continue;
    for (size_t i = 0; i < nl; ++i) {
      if (count[i] == 0 || std::max(0.0, left[i]) / count[i] > best * (1 + 1e-12)) continue;
      for (int32_t g : on_link_[static_cast<size_t>(links_touched_[i])]) {
        Flow& f = flows_[static_cast<size_t>(g)];
        if (f.rate >= 0) continue;
        fix(f, best);
        --unfixed;
      }
    }
  }
  for (size_t i = 0; i < component_.size(); ++i) {
    Flow& f = flows_[static_cast<size_t>(component_[i])];
    if (f.rate == old_rate_[i] && f.due >= now) continue;  // unchanged: its event stands
    f.due = completion(now, f);
    reschedule->emplace_back(f.due, component_[i]);
  }
}

}  // namespace ptdp
