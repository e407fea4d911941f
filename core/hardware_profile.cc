// HardwareProfile: the GEMM efficiency curve and JSON I/O (nested "gemm", "nvlink", "network"
// objects, a "sources" array). Reading checks that every number is physically possible.
#include "core/hardware_profile.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/json_reader.h"

namespace ptdp {

using nlohmann::json;

double GemmEfficiency::at(double m, double n, double k, double batch) const {
  auto s = [](double x, double half) { return x / (x + half); };
  if (sm_count <= 0) return max_efficiency * s(batch * m, m_half) * s(n, n_half) * s(k, k_half);
  const double sms = static_cast<double>(sm_count);
  auto fill = [&](double tm, double tn) {
    const double tiles = batch * std::ceil(m / tm) * std::ceil(n / tn);
    const double waves = std::ceil(tiles / sms);
    return batch * m * n / (waves * sms * tm * tn);
  };
  double f = 0;
  for (const GemmTile& t : tiles) {
    const double tm = static_cast<double>(t.m), tn = static_cast<double>(t.n);
    f = std::max(f, t.efficiency * std::max(fill(tm, tn), fill(tn, tm)));
  }
  return max_efficiency * f * s(k, k_half);
}

namespace {

std::string str(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// A fraction of a peak: in (0, 1].
void require_fraction(const std::string& field, double v) {
  if (!(v > 0 && v <= 1)) throw InputError(field, "must be in (0, 1], got " + str(v));
}

void require_non_negative(const std::string& field, double v) {
  if (!(v >= 0)) throw InputError(field, "must not be negative, got " + str(v));
}

LinkEfficiency link_from_json(const json& j, const std::string& name) {
  JsonObjectReader r(j, name, name + ".");
  LinkEfficiency l;
  r.read("latency_us", l.latency_us);
  r.read("per_step_latency_us", l.per_step_latency_us);
  r.read("busbw_efficiency", l.busbw_efficiency);
  r.reject_unknown_keys();
  require_non_negative(name + ".latency_us", l.latency_us);
  require_non_negative(name + ".per_step_latency_us", l.per_step_latency_us);
  require_fraction(name + ".busbw_efficiency", l.busbw_efficiency);
  return l;
}

json link_to_json(const LinkEfficiency& l) {
  return json{{"latency_us", l.latency_us},
              {"per_step_latency_us", l.per_step_latency_us},
              {"busbw_efficiency", l.busbw_efficiency}};
}

std::vector<GemmTile> tiles_from_json(const json& j) {
  if (!j.is_array() || j.empty())
    throw InputError("gemm.tiles", "must be a non-empty array of {m, n, efficiency}");
  std::vector<GemmTile> tiles;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string name = "gemm.tiles[" + std::to_string(i) + "]";
    JsonObjectReader r(j[i], name, name + ".");
    GemmTile t;
    r.read("m", t.m);
    r.read("n", t.n);
    r.read("efficiency", t.efficiency);
    r.reject_unknown_keys();
    if (t.m <= 0) throw InputError(name + ".m", "must be positive, got " + str(t.m));
    if (t.n <= 0) throw InputError(name + ".n", "must be positive, got " + str(t.n));
    require_fraction(name + ".efficiency", t.efficiency);
    tiles.push_back(t);
  }
  return tiles;
}

json tiles_to_json(const std::vector<GemmTile>& tiles) {
  json a = json::array();
  for (const GemmTile& t : tiles)
    a.push_back({{"m", t.m}, {"n", t.n}, {"efficiency", t.efficiency}});
  return a;
}

}  // namespace

HardwareProfile profile_from_json(const json& j) {
  JsonObjectReader r(j, "profile");
  HardwareProfile p;
  r.read("name", p.name);
  if (const json* g = r.member("gemm")) {
    JsonObjectReader gr(*g, "gemm", "gemm.");
    gr.read("max_efficiency", p.gemm.max_efficiency);
    gr.read("m_half", p.gemm.m_half);
    gr.read("n_half", p.gemm.n_half);
    gr.read("k_half", p.gemm.k_half);
    gr.read("sm_count", p.gemm.sm_count);
    if (const json* t = gr.member("tiles")) p.gemm.tiles = tiles_from_json(*t);
    gr.reject_unknown_keys();
  }
  r.read("hbm_efficiency", p.hbm_efficiency);
  r.read("kernel_gap_us", p.kernel_gap_us);
  if (const json* l = r.member("nvlink")) p.nvlink = link_from_json(*l, "nvlink");
  if (const json* l = r.member("network")) p.network = link_from_json(*l, "network");
  r.read("optimizer_bytes_per_param", p.optimizer_bytes_per_param);
  r.read("sources", p.sources);
  r.reject_unknown_keys();

  require_fraction("gemm.max_efficiency", p.gemm.max_efficiency);
  require_non_negative("gemm.m_half", p.gemm.m_half);
  require_non_negative("gemm.n_half", p.gemm.n_half);
  require_non_negative("gemm.k_half", p.gemm.k_half);
  if (p.gemm.sm_count < 0)
    throw InputError("gemm.sm_count", "must not be negative, got " + str(p.gemm.sm_count));
  require_fraction("hbm_efficiency", p.hbm_efficiency);
  require_non_negative("kernel_gap_us", p.kernel_gap_us);
  if (!(p.optimizer_bytes_per_param > 0))
    throw InputError("optimizer_bytes_per_param",
                     "must be positive, got " + str(p.optimizer_bytes_per_param));
  return p;
}

json to_json(const HardwareProfile& p) {
  return json{{"name", p.name},
              {"gemm",
               {{"max_efficiency", p.gemm.max_efficiency},
                {"m_half", p.gemm.m_half},
                {"n_half", p.gemm.n_half},
                {"k_half", p.gemm.k_half},
                {"sm_count", p.gemm.sm_count},
                {"tiles", tiles_to_json(p.gemm.tiles)}}},
              {"hbm_efficiency", p.hbm_efficiency},
              {"kernel_gap_us", p.kernel_gap_us},
              {"nvlink", link_to_json(p.nvlink)},
              {"network", link_to_json(p.network)},
              {"optimizer_bytes_per_param", p.optimizer_bytes_per_param},
              {"sources", p.sources}};
}

}  // namespace ptdp
