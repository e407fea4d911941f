// ClusterSpec: resizing, validation and JSON I/O (nested "gpu" object, "tiers" array).
#include "core/cluster_spec.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/json_reader.h"

namespace ptdp {

using nlohmann::json;

namespace {

// A rate or size in [lo, hi]: beyond what any machine has, times overflow the simulator's
// picosecond clock or print as hundreds of digits.
void require_in(const std::string& field, double value, double lo, double hi) {
  if (!(value >= lo && value <= hi))
    throw InputError(field, "must be in [" + error_number(lo) + ", " + error_number(hi) +
                                "], got " + error_number(value));
}

}  // namespace

void ClusterSpec::resize(int64_t n) {
  require_positive("num_gpus", n);
  if (n > kMaxGpus)
    throw InputError("num_gpus", std::to_string(n) + " exceeds the " + std::to_string(kMaxGpus) +
                                     " GPUs ptdp handles");
  require_positive("gpus_per_node", gpus_per_node);
  if (n <= gpus_per_node) {
    num_nodes = 1;
    gpus_per_node = n;
    return;
  }
  if (n % gpus_per_node != 0)
    throw InputError("num_gpus", std::to_string(n) + " is not a multiple of gpus_per_node (" +
                                     std::to_string(gpus_per_node) + ")");
  num_nodes = n / gpus_per_node;
}

void ClusterSpec::validate() const {
  // From a CPU rank of a sanitizer build (0.9 GFLOP/s measured) to past any accelerator; an
  // iteration too long for the simulator's clock is refused there (simulate_plan).
  require_in("gpu.peak_tflops_16bit", gpu.peak_tflops_16bit, 1e-6, 1e6);
  if (gpu.peak_tflops_fp8 != 0) require_in("gpu.peak_tflops_fp8", gpu.peak_tflops_fp8, 1e-6, 1e6);
  require_in("gpu.memory_gib", gpu.memory_gib, 1e-3, 1e6);
  require_in("gpu.hbm_bandwidth_gbps", gpu.hbm_bandwidth_gbps, 1e-3, 1e7);
  if (gpu.fp8_weight_copies != 1 && gpu.fp8_weight_copies != 2)
    throw InputError("gpu.fp8_weight_copies",
                     "must be 1 or 2, got " + std::to_string(gpu.fp8_weight_copies));
  require_positive("gpus_per_node", gpus_per_node);
  require_positive("num_nodes", num_nodes);
  if (gpus_per_node > kMaxGpus)
    throw InputError("gpus_per_node", std::to_string(gpus_per_node) + " exceeds the " +
                                          std::to_string(kMaxGpus) + " GPUs ptdp handles");
  if (num_nodes > kMaxGpus / gpus_per_node)
    throw InputError("num_nodes", std::to_string(num_nodes) + " nodes of " +
                                      std::to_string(gpus_per_node) + " GPUs exceed the " +
                                      std::to_string(kMaxGpus) + " GPUs ptdp handles");
  require_in("nvlink_bandwidth_gbps", nvlink_bandwidth_gbps, 1e-3, 1e7);
  require_in("nvlink_latency_us", nvlink_latency_us, 0, 1e6);
  require_positive("nics_per_node", nics_per_node);
  require_in("nic_bandwidth_gbps", nic_bandwidth_gbps, 1e-3, 1e7);
  require_in("nic_latency_us", nic_latency_us, 0, 1e6);
  int64_t below = 1;  // nodes reached by the tier below
  for (size_t i = 0; i < tiers.size(); ++i) {
    const std::string prefix = "tiers[" + std::to_string(i) + "].";
    const TopologyTier& t = tiers[i];
    require_positive(prefix + "nodes_per_switch", t.nodes_per_switch);
    if (t.nodes_per_switch <= below)
      throw InputError(prefix + "nodes_per_switch", std::to_string(t.nodes_per_switch) +
                                                        " must exceed the tier below it (" +
                                                        std::to_string(below) + ")");
    require_in(prefix + "oversubscription", t.oversubscription, 1, 1e6);
    require_in(prefix + "latency_us", t.latency_us, 0, 1e6);
    below = t.nodes_per_switch;
  }
}

bool is_machine_file(const json& j) {
  return j.is_object() && j.contains("format") && j["format"] == kMachineFileFormat;
}

namespace {

// Runs f, naming the part of a machine file a field belongs to ("profile.gemm.k_half").
template <class F>
auto in_part(const std::string& part, F f) {
  try {
    return f();
  } catch (const InputError& e) {
    const std::string what = e.what();
    const std::string rest = what.substr(std::min(what.size(), e.field().size() + 2));
    if (e.field() == part) throw InputError(part, rest);
    throw InputError(part + "." + e.field(), rest);
  }
}

ClusterSpec machine_from_json(const json& j) {
  JsonObjectReader r(j, "cluster");
  std::string format;
  r.read("format", format);
  const json* c = r.member("cluster");
  const json* p = r.member("profile");
  // What was measured and how well the fits hold: documentation to the loader, checked to be
  // objects so that a truncated file is refused.
  for (const char* key : {"machine", "measurements", "fits"}) {
    const json* v = r.member(key);
    if (v && !v->is_object())
      throw InputError(key, std::string("expected a JSON object, got ") + v->type_name());
  }
  r.reject_unknown_keys();
  if (!c) throw InputError("cluster", "a machine file needs its \"cluster\" object");
  if (!p) throw InputError("profile", "a machine file needs its \"profile\" object");
  if (c->is_object() && is_machine_file(*c))
    throw InputError("cluster", "a machine file's cluster may not be another machine file");
  ClusterSpec out = in_part("cluster", [&] { return cluster_from_json(*c); });
  out.measured_profile = std::make_shared<const HardwareProfile>(
      in_part("profile", [&] { return profile_from_json(*p); }));
  if (const json* m = r.member("machine")) {
    const auto backend = m->find("backend");
    if (backend != m->end() && backend->is_string()) out.measured_backend = *backend;
    const auto activations = m->find("activations");
    if (activations != m->end() && activations->is_string())
      out.measured_activations = *activations;
    const auto ranks = m->find("ranks");
    if (ranks != m->end() && ranks->is_number_integer() && ranks->get<int64_t>() > 0)
      out.measured_ranks = ranks->get<int64_t>();
  }
  return out;
}

}  // namespace

ClusterSpec cluster_from_json(const json& j) {
  if (is_machine_file(j)) return machine_from_json(j);
  JsonObjectReader r(j, "cluster");
  ClusterSpec c;
  r.read("name", c.name);
  if (const json* g = r.member("gpu")) {
    JsonObjectReader gr(*g, "gpu", "gpu.");
    gr.read("name", c.gpu.name);
    gr.read("peak_tflops_16bit", c.gpu.peak_tflops_16bit);
    gr.read("peak_tflops_fp8", c.gpu.peak_tflops_fp8);
    gr.read("memory_gib", c.gpu.memory_gib);
    gr.read("hbm_bandwidth_gbps", c.gpu.hbm_bandwidth_gbps);
    gr.read("fp8_weight_copies", c.gpu.fp8_weight_copies);
    gr.reject_unknown_keys();
  }
  r.read("gpus_per_node", c.gpus_per_node);
  r.read("num_nodes", c.num_nodes);
  r.read("nvlink_bandwidth_gbps", c.nvlink_bandwidth_gbps);
  r.read("nvlink_latency_us", c.nvlink_latency_us);
  r.read("nics_per_node", c.nics_per_node);
  r.read("nic_bandwidth_gbps", c.nic_bandwidth_gbps);
  r.read("nic_latency_us", c.nic_latency_us);
  if (const json* tiers = r.member("tiers")) {
    if (!tiers->is_array())
      throw InputError("tiers", std::string("expected an array, got ") + tiers->type_name());
    for (size_t i = 0; i < tiers->size(); ++i) {
      const std::string name = "tiers[" + std::to_string(i) + "]";
      JsonObjectReader tr((*tiers)[i], name, name + ".");
      TopologyTier t;
      tr.read("name", t.name);
      tr.read("nodes_per_switch", t.nodes_per_switch);
      tr.read("oversubscription", t.oversubscription);
      tr.read("latency_us", t.latency_us);
      tr.reject_unknown_keys();
      c.tiers.push_back(t);
    }
  }
  r.reject_unknown_keys();
  c.validate();
  return c;
}

json to_json(const ClusterSpec& c) {
  json tiers = json::array();
  for (const TopologyTier& t : c.tiers)
    tiers.push_back({{"name", t.name},
                     {"nodes_per_switch", t.nodes_per_switch},
                     {"oversubscription", t.oversubscription},
                     {"latency_us", t.latency_us}});
  return json{{"name", c.name},
              {"gpu",
               {{"name", c.gpu.name},
                {"peak_tflops_16bit", c.gpu.peak_tflops_16bit},
                {"peak_tflops_fp8", c.gpu.peak_tflops_fp8},
                {"memory_gib", c.gpu.memory_gib},
                {"hbm_bandwidth_gbps", c.gpu.hbm_bandwidth_gbps},
                {"fp8_weight_copies", c.gpu.fp8_weight_copies}}},
              {"gpus_per_node", c.gpus_per_node},
              {"num_nodes", c.num_nodes},
              {"nvlink_bandwidth_gbps", c.nvlink_bandwidth_gbps},
              {"nvlink_latency_us", c.nvlink_latency_us},
              {"nics_per_node", c.nics_per_node},
              {"nic_bandwidth_gbps", c.nic_bandwidth_gbps},
              {"nic_latency_us", c.nic_latency_us},
              {"tiers", tiers}};
}

}  // namespace ptdp
