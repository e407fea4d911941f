#include "simulator/topology.h"

#include <algorithm>
#include <boost/graph/adjacency_list.hpp>
#include <boost/graph/breadth_first_search.hpp>
#include <stdexcept>

#include "core/units.h"

namespace ptdp {

struct Topology::Graph {
  // Edge property: index into links_.
  using G = boost::adjacency_list<boost::vecS, boost::vecS, boost::directedS, boost::no_property,
                                  boost::property<boost::edge_index_t, int32_t>>;
  G g;
};

namespace {

class Builder {
 public:
  Builder(Topology::Graph& g, std::vector<Link>& links) : g_(g), links_(links) {}
  int64_t vertex() { return static_cast<int64_t>(boost::add_vertex(g_.g)); }
  void link(int64_t a, int64_t b, const std::string& name, double bps, double latency) {
    add(a, b, name, bps, latency);
    add(b, a, name + "'", bps, latency);
  }

 private:
  void add(int64_t a, int64_t b, const std::string& name, double bps, double latency) {
    const int32_t id = static_cast<int32_t>(links_.size());
    links_.push_back({name, bps, latency});
    boost::add_edge(static_cast<size_t>(a), static_cast<size_t>(b), id, g_.g);
  }
  Topology::Graph& g_;
  std::vector<Link>& links_;
};

}  // namespace

Topology::Topology(const ClusterSpec& c, const HardwareProfile& h) : graph_(new Graph) {
  num_gpus_ = c.num_gpus();
  gpus_per_node_ = std::max<int64_t>(1, c.gpus_per_node);
  Builder b(*graph_, links_);
  const int64_t nodes = c.num_nodes;
  const int64_t rails = std::max<int64_t>(1, c.nics_per_node);
  for (int64_t g = 0; g < num_gpus_; ++g) b.vertex();  // GPUs are vertices 0..n-1
  const double nvlink = c.nvlink_bandwidth_gbps * kGB * h.nvlink.busbw_efficiency;
  const double nic = c.nic_bandwidth_gbps * kGB * h.network.busbw_efficiency;
  std::vector<std::vector<int64_t>> nic_vertex(static_cast<size_t>(nodes));
  for (int64_t n = 0; n < nodes; ++n) {
    const std::string node = "node" + std::to_string(n);
    const int64_t sw = b.vertex();
    for (int64_t i = 0; i < gpus_per_node_; ++i)
      b.link(n * gpus_per_node_ + i, sw, node + "/gpu" + std::to_string(i) + "-nvswitch", nvlink,
             c.nvlink_latency_us * kMicrosecond / 2);
    if (nodes == 1) continue;
    for (int64_t k = 0; k < rails; ++k) {
      const int64_t v = b.vertex();
      nic_vertex[static_cast<size_t>(n)].push_back(v);
      // GPUs of a rail reach their NIC over PCIe; the NIC's port is the bottleneck.
      for (int64_t i = 0; i < gpus_per_node_; ++i)
        if (i * rails / gpus_per_node_ == k)
          b.link(n * gpus_per_node_ + i, v, node + "/gpu" + std::to_string(i) + "-nic", nic * 4.0,
                 c.nic_latency_us * kMicrosecond / 2);
    }
  }
  if (nodes > 1) {
    // Switch tiers: a switch of tier i (per rail) reaches nodes_per_switch nodes; above the
    // last tier one core switch per rail joins everything.
    std::vector<TopologyTier> tiers = c.tiers;
    if (tiers.empty() || tiers.back().nodes_per_switch < nodes)
      tiers.push_back({"core", nodes, 1.0, tiers.empty() ? 0.0 : tiers.back().latency_us});
    for (int64_t k = 0; k < rails; ++k) {
      std::vector<int64_t> below;  // vertices of the previous level, one per group of nodes
      int64_t group = 1;           // nodes each vertex of `below` covers
      for (int64_t n = 0; n < nodes; ++n)
        below.push_back(nic_vertex[static_cast<size_t>(n)][static_cast<size_t>(k)]);
      double up_bw = nic;
      for (size_t ti = 0; ti < tiers.size(); ++ti) {
        const TopologyTier& tier = tiers[ti];
        // The top tier joins whatever is left below it.
        const int64_t per = ti + 1 == tiers.size()
                                ? static_cast<int64_t>(below.size())
                                : std::max<int64_t>(1, tier.nodes_per_switch / group);
        std::vector<int64_t> level;
        for (size_t i = 0; i < below.size(); ++i) {
          if (i % static_cast<size_t>(per) == 0) level.push_back(b.vertex());
          b.link(below[i], level.back(),
                 tier.name + std::to_string(level.size() - 1) + ".rail" + std::to_string(k) +
                     "-down" + std::to_string(i),
                 up_bw, tier.latency_us * kMicrosecond / 2);
        }
        // The next level's links carry everything below one switch, divided by the
        // oversubscription of this tier.
        up_bw = up_bw * static_cast<double>(per) / std::max(1.0, tier.oversubscription);
        group *= per;
        below = level;
        if (below.size() == 1) break;
      }
    }
  }
}

Topology::~Topology() = default;

int64_t Topology::num_vertices() const {
  return static_cast<int64_t>(boost::num_vertices(graph_->g));
}

const std::vector<int32_t>& Topology::path(int64_t src, int64_t dst) {
  auto key = std::make_pair(src, dst);
  auto it = paths_.find(key);
  if (it != paths_.end()) return it->second;
  if (src < 0 || dst < 0 || src >= num_gpus_ || dst >= num_gpus_)
    throw std::out_of_range("topology: GPU index out of range");
  std::vector<int32_t> links;
  if (src != dst) {
    using G = Graph::G;
    const G& g = graph_->g;
    std::vector<G::edge_descriptor> pred(boost::num_vertices(g));
    std::vector<char> reached(boost::num_vertices(g), 0);
    struct Found {};  // thrown to stop the search once dst is reached
    struct Recorder : boost::default_bfs_visitor {
      std::vector<G::edge_descriptor>* pred;
      std::vector<char>* reached;
      size_t dst;
      void tree_edge(G::edge_descriptor e, const G& gr) const {
        (*pred)[boost::target(e, gr)] = e;
        (*reached)[boost::target(e, gr)] = 1;
        if (boost::target(e, gr) == dst) throw Found{};
      }
    } rec;
    rec.pred = &pred;
    rec.reached = &reached;
    rec.dst = static_cast<size_t>(dst);
    try {
      boost::breadth_first_search(g, static_cast<size_t>(src), boost::visitor(rec));
    } catch (const Found&) {
    }
    if (!reached[static_cast<size_t>(dst)])
      throw std::logic_error("topology: no path between GPUs");
    auto index = boost::get(boost::edge_index, g);
    for (size_t v = static_cast<size_t>(dst); v != static_cast<size_t>(src);) {
      const auto e = pred[v];
      links.push_back(index[e]);
      v = boost::source(e, g);
    }
    std::reverse(links.begin(), links.end());
  }
  return paths_.emplace(key, std::move(links)).first->second;
}

double Topology::path_latency_s(const std::vector<int32_t>& path) const {
  double s = 0;
  for (int32_t l : path) s += links_[static_cast<size_t>(l)].latency_s;
  return s;
}

}  // namespace ptdp
