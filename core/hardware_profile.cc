// HardwareProfile: the GEMM efficiency curve and measured table, and JSON I/O (nested "gemm",
// "nvlink", "network" objects, a "sources" array, and the optional measured "collectives",
// "memory_efficiency", "fused_ops", "memory_ops", "activation_dtype", "cache"). Reading checks that
// every number is physically possible.
#include "core/hardware_profile.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/cluster_spec.h"
#include "core/error.h"
#include "core/json_reader.h"
#include "core/layer_ops.h"

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

// Interpolates log(value(entry)) over `table` at the point `q` (log2 coordinates; `at(entry)`
// gives an entry's): Gaussian weights of one octave, and `prior` (a log value) with the weight
// of one entry two octaves away. An exact entry returns its own value; entries whose value is
// not positive (not measured) are skipped.
template <class Entry, class At, class Value>
double interpolate_log(const std::vector<Entry>& table, const std::array<double, 4>& q,
                       double prior, At at, Value value) {
  constexpr double kPriorWeight = 0.1353352832366127;  // exp(-2^2 / 2)
  double wsum = kPriorWeight, lsum = kPriorWeight * prior;
  for (const Entry& e : table) {
    const double v = value(e);
    if (!(v > 0)) continue;
    const std::array<double, 4> x = at(e);
    double d2 = 0;
    for (int i = 0; i < 4; ++i) d2 += (q[i] - x[i]) * (q[i] - x[i]);
    if (d2 < 1e-18) return v;
    const double w = std::exp(-d2 / 2);
    if (w < 1e-12) continue;
    wsum += w;
    lsum += w * std::log(v);
  }
  return std::exp(lsum / wsum);
}

// A GEMM shape's point: log2(m, n, k, batch).
std::array<double, 4> gemm_point(double m, double n, double k, double batch) {
  return {std::log2(std::max(m, 1.0)), std::log2(std::max(n, 1.0)), std::log2(std::max(k, 1.0)),
          std::log2(std::max(batch, 1.0))};
}

template <class Value>
double interpolate_gemm_log(const std::vector<GemmMeasurement>& table, double m, double n, double k,
                            double batch, double prior, Value value) {
  return interpolate_log(
      table, gemm_point(m, n, k, batch), prior,
      [](const GemmMeasurement& e) {
        return gemm_point(static_cast<double>(e.m), static_cast<double>(e.n),
                          static_cast<double>(e.k), static_cast<double>(e.batch));
      },
      value);
}

}  // namespace

double HardwareProfile::gemm_efficiency(double m, double n, double k, double batch) const {
  const double c = gemm.at(m, n, k, batch);
  if (gemm_table.empty()) return c;
  // The measured/curve ratio (an entry's own where the shape is in the table), tending to 1 (the
  // curve alone) away from every entry.
  const double ratio = interpolate_gemm_log(gemm_table, m, n, k, batch, 0.0, [&](const auto& e) {
    const double ce = gemm.at(static_cast<double>(e.m), static_cast<double>(e.n),
                              static_cast<double>(e.k), static_cast<double>(e.batch));
    return ce > 0 ? e.efficiency / ce : 0.0;
  });
  return std::clamp(c * ratio, std::numeric_limits<double>::min(), 1.0);
}

double HardwareProfile::cache_hit(double working_set_bytes) const {
  if (!cache.hit_curve.empty()) {
    double bytes = 0, hit = 1;  // the previous point, from (0, 1)
    for (const CacheModel::Hit& p : cache.hit_curve) {
      const double h = std::min(hit, p.hit);  // non-increasing: noise does not raise the hit
      if (working_set_bytes <= p.bytes)
        return p.bytes > bytes ? hit + (h - hit) * (working_set_bytes - bytes) / (p.bytes - bytes)
                               : h;
      bytes = p.bytes;
      hit = h;
    }
    // Beyond the curve the kept part thins as the working set grows: the last hit scaled by
    // last bytes / working set (to 0 for a working set far beyond the cache).
    return hit * bytes / working_set_bytes;
  }
  if (!(cache.bytes_per_rank > 0) || !(working_set_bytes > cache.bytes_per_rank)) return 1.0;
  return cache.bytes_per_rank / working_set_bytes;
}

double HardwareProfile::gemm_cold_factor(double m, double n, double k, double batch) const {
  double mean = 0;  // of log cold_factor over the entries with a cold time
  int measured = 0;
  for (const GemmMeasurement& e : gemm_table)
    if (e.cold_factor > 0) mean += std::log(e.cold_factor), ++measured;
  if (measured == 0) return 1.0;
  return interpolate_gemm_log(gemm_table, m, n, k, batch, mean / measured,
                              [](const GemmMeasurement& e) { return e.cold_factor; });
}

double HardwareProfile::fused_op_seconds(std::string_view op, double size, double rows) const {
  // Log distance; 0 for an unrecorded side, so that files without rows price by size alone.
  auto apart = [](double a, double b) { return a > 0 && b > 0 ? std::abs(std::log(a / b)) : 0.0; };
  auto distance = [&](const FusedOpMeasurement& e) {  // nearest in rows, then in size
    return std::pair(apart(rows, e.rows), apart(std::max(size, 1.0), e.size));
  };
  const FusedOpMeasurement* best = nullptr;
  for (const FusedOpMeasurement& e : fused_ops)
    if (e.op == op && (!best || distance(e) < distance(*best))) best = &e;
  if (!best) return -1;
  return best->seconds * std::max(size, 1.0) / best->size;
}

double HardwareProfile::memory_op_ratio(std::string_view op, double bytes,
                                        const std::function<double(double)>& fitted) const {
  auto point = [](double b) { return std::array<double, 4>{std::log2(std::max(b, 1.0)), 0, 0, 0}; };
  bool measured = false;
  for (const FusedOpMeasurement& e : memory_ops) measured = measured || e.op == op;
  if (!measured) return 1.0;
  return interpolate_log(
      memory_ops, point(bytes), 0.0, [&](const FusedOpMeasurement& e) { return point(e.size); },
      [&](const FusedOpMeasurement& e) {
        const double f = e.op == op ? fitted(e.size) : 0.0;
        return f > 0 ? e.seconds / f : 0.0;
      });
}

double HardwareProfile::host_issue_us(std::string_view op) const {
  if (host_op_us.empty()) return 0;
  if (auto it = host_op_us.find(op); it != host_op_us.end()) return it->second;
  double mean = 0;
  for (const auto& [name, us] : host_op_us) mean += us;
  return mean / static_cast<double>(host_op_us.size());
}

double HardwareProfile::memory_cold_factor_of(const std::string& family) const {
  const auto& f = cache.memory_cold_factor;
  if (f.empty()) return 1.0;
  if (auto it = f.find(family); it != f.end()) return it->second;
  double mean = 0;
  for (const auto& [name, v] : f) mean += std::log(v);
  return std::exp(mean / static_cast<double>(f.size()));
}

std::string collective_key(Collective c) {
  switch (c) {
    case Collective::kAllReduce:
      return "all_reduce";
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kSendRecv:
      return "send_recv";
    case Collective::kAllToAll:
      return "all_to_all";
  }
  return "?";
}

std::string memory_family(OpId id) {
  switch (id) {
    case OpId::kInputLayernorm:
    case OpId::kQkLayernorm:
    case OpId::kLatentLayernorm:
    case OpId::kPostAttentionLayernorm:
    case OpId::kFinalLayernorm:
    case OpId::kMtpNorms:
      return "norm";
    case OpId::kInputLayernormBackward:
    case OpId::kQkLayernormBackward:
    case OpId::kLatentLayernormBackward:
    case OpId::kPostAttentionLayernormBackward:
    case OpId::kFinalLayernormBackward:
    case OpId::kMtpNormsBackward:
      return "norm_backward";
    case OpId::kAttnSoftmax:
      return "softmax";
    case OpId::kAttnSoftmaxBackward:
      return "softmax_backward";
    case OpId::kAttnDropout:
    case OpId::kAttnDropoutBackward:
      return "dropout";
    case OpId::kBiasGelu:
    case OpId::kSwiglu:
    case OpId::kExpertActivation:
      return "activation";
    case OpId::kBiasGeluBackward:
    case OpId::kSwigluBackward:
    case OpId::kExpertActivationBackward:
      return "activation_backward";
    case OpId::kRouterTopk:
      return "routing";
    case OpId::kRouterTopkBackward:
      return "routing_backward";
    case OpId::kMoePermute:
    case OpId::kMoeUnpermute:
      return "permute";
    case OpId::kMoePermuteBackward:
    case OpId::kMoeUnpermuteBackward:
      return "permute_backward";
    case OpId::kRotaryEmbedding:
      return "rotary";
    case OpId::kRotaryEmbeddingBackward:
      return "rotary_backward";
    case OpId::kWordEmbeddingLookup:
    case OpId::kEmbeddingPositionDropout:
      return "embedding";
    case OpId::kWordEmbeddingGradScatterAdd:
    case OpId::kEmbeddingDropoutBackward:
      return "embedding_backward";
    case OpId::kCrossEntropy:
      return "cross_entropy";
    case OpId::kCrossEntropyBackward:
      return "cross_entropy_backward";
    case OpId::kAttnBiasDropoutAdd:
    case OpId::kMlpBiasDropoutAdd:
      return "elementwise";
    case OpId::kAttnBiasDropoutAddBackward:
    case OpId::kMlpBiasDropoutAddBackward:
    case OpId::kWeightGradAccumulate:
    case OpId::kEmbeddingGradAccumulate:
    case OpId::kOutputGradAccumulate:
      return "elementwise_backward";
    default:
      return "";
  }
}

const std::vector<std::string>& memory_families() {
  static const std::vector<std::string> f = {"norm",
                                             "norm_backward",
                                             "softmax",
                                             "softmax_backward",
                                             "dropout",
                                             "activation",
                                             "activation_backward",
                                             "rotary",
                                             "rotary_backward",
                                             "embedding",
                                             "embedding_backward",
                                             "cross_entropy",
                                             "cross_entropy_backward",
                                             "elementwise",
                                             "elementwise_backward",
                                             "routing",
                                             "routing_backward",
                                             "permute",
                                             "permute_backward",
                                             "optimizer"};
  return f;
}

const CollectiveFit* HardwareProfile::find_collective(Collective kind, int64_t ranks, int64_t nodes,
                                                      DType element) const {
  const CollectiveFit* fp32 = nullptr;
  for (const CollectiveFit& f : collectives) {
    if (f.kind != kind || f.ranks != ranks || f.nodes != nodes) continue;
    if (f.dtype == element) return &f;
    if (f.dtype == DType::kF32) fp32 = &f;
  }
  return fp32;
}

double HardwareProfile::memory_efficiency_of(const std::string& family) const {
  auto it = memory_efficiency.find(family);
  return it == memory_efficiency.end() ? hbm_efficiency : it->second;
}

namespace {

// A fraction of a peak: in [1e-6, 1] (smaller ones price an iteration at ages, beyond what
// the simulator's clock and the reports' columns hold).
void require_fraction(const std::string& field, double v) {
  if (!(v >= 1e-6 && v <= 1))
    throw InputError(field, "must be in [1e-6, 1], got " + error_number(v));
}

void require_non_negative(const std::string& field, double v) {
  if (!(v >= 0)) throw InputError(field, "must not be negative, got " + error_number(v));
}

// A per-family efficiency (above 1 where a kernel's working set stays in cache, on CPU ranks)
// or cold over warm time (an evicted cache does not cost a factor above 1000): in (0, 1000].
void require_per_family_value(const std::string& field, double v) {
  if (!(v > 0 && v <= 1000))
    throw InputError(field, "must be in (0, 1000], got " + error_number(v));
}

// {family: value} over memory_families(), each value in (0, 1000]; `field` names the object.
std::map<std::string, double> family_values_from_json(const json& j, const std::string& field) {
  JsonObjectReader r(j, field, field + ".");
  std::map<std::string, double> out;
  for (const std::string& family : memory_families()) {
    if (!r.member(family)) continue;
    double v = 0;
    r.read(family, v);
    require_per_family_value(field + "." + family, v);
    out[family] = v;
  }
  r.reject_unknown_keys();
  return out;
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
    if (t.m <= 0) throw InputError(name + ".m", "must be positive, got " + error_number(t.m));
    if (t.n <= 0) throw InputError(name + ".n", "must be positive, got " + error_number(t.n));
    require_fraction(name + ".efficiency", t.efficiency);
    tiles.push_back(t);
  }
  return tiles;
}

std::vector<GemmMeasurement> table_from_json(const json& j) {
  if (!j.is_array())
    throw InputError("gemm.table", "must be an array of {m, n, k, batch, efficiency}");
  std::vector<GemmMeasurement> table;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string name = "gemm.table[" + std::to_string(i) + "]";
    JsonObjectReader r(j[i], name, name + ".");
    GemmMeasurement e;
    r.read("m", e.m);
    r.read("n", e.n);
    r.read("k", e.k);
    r.read("batch", e.batch);
    r.read("efficiency", e.efficiency);
    if (r.member("cold_factor")) {
      r.read("cold_factor", e.cold_factor);
      require_per_family_value(name + ".cold_factor", e.cold_factor);
    }
    r.reject_unknown_keys();
    for (const auto& [key, v] :
         {std::pair<const char*, int64_t>{"m", e.m}, {"n", e.n}, {"k", e.k}, {"batch", e.batch}}) {
      if (v <= 0 || v > (int64_t{1} << 40))
        throw InputError(name + "." + key, "must be in [1, 2^40], got " + std::to_string(v));
    }
    require_fraction(name + ".efficiency", e.efficiency);
    table.push_back(e);
  }
  return table;
}

json table_to_json(const std::vector<GemmMeasurement>& table) {
  json a = json::array();
  for (const GemmMeasurement& e : table) {
    json j{{"m", e.m}, {"n", e.n}, {"k", e.k}, {"batch", e.batch}, {"efficiency", e.efficiency}};
    if (e.cold_factor > 0) j["cold_factor"] = e.cold_factor;
    a.push_back(j);
  }
  return a;
}

// "fused_ops" (`key`) or "memory_ops": {op, size, seconds[, rows]} per measured op.
std::vector<FusedOpMeasurement> measured_ops_from_json(const json& j, const std::string& key) {
  if (!j.is_array()) throw InputError(key, "must be an array of {op, size, seconds[, rows]}");
  std::vector<FusedOpMeasurement> ops;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string name = key + "[" + std::to_string(i) + "]";
    JsonObjectReader r(j[i], name, name + ".");
    FusedOpMeasurement e;
    r.read("op", e.op);
    r.read("size", e.size);
    r.read("seconds", e.seconds);
    if (r.member("rows")) {
      r.read("rows", e.rows);
      if (!(e.rows >= 1 && e.rows <= 1e9))
        throw InputError(name + ".rows", "must be in [1, 1e9], got " + error_number(e.rows));
    }
    r.reject_unknown_keys();
    bool known = false;
    for (int id = 0; id < kNumOpIds && !known; ++id) known = op_name(static_cast<OpId>(id)) == e.op;
    if (!known)
      throw InputError(
          name + ".op",
          "must name an op of the layer op list (core/layer_ops.h), got '" + e.op + "'");
    if (!(e.size > 0 && e.size <= 1e21))
      throw InputError(name + ".size", "must be in (0, 1e21], got " + error_number(e.size));
    if (!(e.seconds >= 0 && e.seconds <= 1e4))
      throw InputError(name + ".seconds", "must be in [0, 1e4], got " + error_number(e.seconds));
    ops.push_back(e);
  }
  return ops;
}

CacheModel cache_from_json(const json& j) {
  JsonObjectReader r(j, "cache", "cache.");
  CacheModel c;
  r.read("bytes_per_rank", c.bytes_per_rank);
  // Up to a petabyte: a cache larger than that is a typo.
  if (!(c.bytes_per_rank >= 0 && c.bytes_per_rank <= 1e15))
    throw InputError("cache.bytes_per_rank",
                     "must be in [0, 1e15], got " + error_number(c.bytes_per_rank));
  if (const json* f = r.member("memory_cold_factor"))
    c.memory_cold_factor = family_values_from_json(*f, "cache.memory_cold_factor");
  if (const json* h = r.member("hit_curve")) {
    if (!h->is_array()) throw InputError("cache.hit_curve", "must be an array of {bytes, hit}");
    for (size_t i = 0; i < h->size(); ++i) {
      const std::string name = "cache.hit_curve[" + std::to_string(i) + "]";
      JsonObjectReader pr((*h)[i], name, name + ".");
      CacheModel::Hit p;
      pr.read("bytes", p.bytes);
      pr.read("hit", p.hit);
      pr.reject_unknown_keys();
      const double previous = c.hit_curve.empty() ? 0.0 : c.hit_curve.back().bytes;
      if (!(p.bytes > previous && p.bytes <= 1e15))
        throw InputError(name + ".bytes", "must be in (" + error_number(previous) +
                                              ", 1e15] (ascending), got " + error_number(p.bytes));
      if (!(p.hit >= 0 && p.hit <= 1))
        throw InputError(name + ".hit", "must be in [0, 1], got " + error_number(p.hit));
      c.hit_curve.push_back(p);
    }
  }
  r.reject_unknown_keys();
  return c;
}

Collective collective_from_key(const std::string& field, const std::string& key) {
  for (Collective c : {Collective::kAllReduce, Collective::kAllGather, Collective::kReduceScatter,
                       Collective::kSendRecv, Collective::kAllToAll})
    if (collective_key(c) == key) return c;
  throw InputError(
      field,
      "must be all_reduce, all_gather, reduce_scatter, send_recv or all_to_all, got '" + key + "'");
}

// "fp32", "bf16" or "fp16".
DType float_dtype_from_json(const std::string& field, const json& a) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16})
    if (a == to_string(t)) return t;
  throw InputError(field, "must be fp32, bf16 or fp16, got " + a.dump());
}

std::vector<CollectiveFit> collectives_from_json(const json& j) {
  if (!j.is_array())
    throw InputError("collectives",
                     "must be an array of {collective, ranks, nodes, latency_us, "
                     "busbw_gbps[, dtype]}");
  std::vector<CollectiveFit> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string name = "collectives[" + std::to_string(i) + "]";
    JsonObjectReader r(j[i], name, name + ".");
    CollectiveFit f;
    std::string kind;
    r.read("collective", kind);
    f.kind = collective_from_key(name + ".collective", kind);
    r.read("ranks", f.ranks);
    r.read("nodes", f.nodes);
    r.read("latency_us", f.latency_us);
    r.read("busbw_gbps", f.busbw_gbps);
    if (const json* d = r.member("dtype")) f.dtype = float_dtype_from_json(name + ".dtype", *d);
    r.reject_unknown_keys();
    if (f.ranks < 2 || f.ranks > (int64_t{1} << 20))
      throw InputError(name + ".ranks", "must be in [2, 2^20], got " + std::to_string(f.ranks));
    if (f.nodes < 1 || f.nodes > f.ranks)
      throw InputError(name + ".nodes", "must be in [1, ranks], got " + std::to_string(f.nodes));
    require_non_negative(name + ".latency_us", f.latency_us);
    if (!(f.busbw_gbps > 0 && f.busbw_gbps < 1e9))
      throw InputError(name + ".busbw_gbps", "must be positive, got " + error_number(f.busbw_gbps));
    out.push_back(f);
  }
  return out;
}

json collectives_to_json(const std::vector<CollectiveFit>& fits) {
  json a = json::array();
  for (const CollectiveFit& f : fits) {
    json c = {{"collective", collective_key(f.kind)},
              {"ranks", f.ranks},
              {"nodes", f.nodes},
              {"latency_us", f.latency_us},
              {"busbw_gbps", f.busbw_gbps}};
    if (f.dtype != DType::kF32) c["dtype"] = to_string(f.dtype);
    a.push_back(c);
  }
  return a;
}

json tiles_to_json(const std::vector<GemmTile>& tiles) {
  json a = json::array();
  for (const GemmTile& t : tiles)
    a.push_back({{"m", t.m}, {"n", t.n}, {"efficiency", t.efficiency}});
  return a;
}

}  // namespace

HardwareProfile profile_from_json(const json& j) {
  // A machine file (ptdp calibrate) as a profile: its measured profile.
  if (is_machine_file(j)) {
    if (!j.contains("profile")) throw InputError("profile", "the machine file has no profile");
    if (is_machine_file(j["profile"]))
      throw InputError("profile", "a machine file's profile may not be another machine file");
    try {
      return profile_from_json(j["profile"]);
    } catch (const InputError& e) {
      const std::string what = e.what();
      throw InputError("profile." + e.field(),
                       what.substr(std::min(what.size(), e.field().size() + 2)));
    }
  }
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
    if (const json* t = gr.member("table")) p.gemm_table = table_from_json(*t);
    gr.reject_unknown_keys();
  }
  if (const json* f = r.member("fused_ops")) p.fused_ops = measured_ops_from_json(*f, "fused_ops");
  if (const json* f = r.member("memory_ops"))
    p.memory_ops = measured_ops_from_json(*f, "memory_ops");
  r.read("hbm_efficiency", p.hbm_efficiency);
  r.read("kernel_gap_us", p.kernel_gap_us);
  if (const json* l = r.member("nvlink")) p.nvlink = link_from_json(*l, "nvlink");
  if (const json* l = r.member("network")) p.network = link_from_json(*l, "network");
  r.read("optimizer_bytes_per_param", p.optimizer_bytes_per_param);
  r.read("sources", p.sources);
  if (const json* c = r.member("collectives")) p.collectives = collectives_from_json(*c);
  if (const json* me = r.member("memory_efficiency"))
    p.memory_efficiency = family_values_from_json(*me, "memory_efficiency");
  if (const json* c = r.member("cache")) p.cache = cache_from_json(*c);
  if (const json* h = r.member("host_op_us")) {
    if (!h->is_object())
      throw InputError("host_op_us", "must be an object of op name: microseconds");
    for (int i = 0; i < kNumOpIds; ++i) {
      const std::string name(op_name(static_cast<OpId>(i)));
      if (!h->contains(name)) continue;
      const json& v = (*h)[name];
      if (!v.is_number() || !(v.get<double>() >= 0 && v.get<double>() <= 1e6))
        throw InputError("host_op_us." + name, "must be a number in [0, 1e6], got " + v.dump());
      p.host_op_us[name] = v.get<double>();
    }
    for (const auto& [name, v] : h->items())
      if (!p.host_op_us.count(name))
        throw InputError("host_op_us." + name, "is not an op of the layer op list");
  }
  r.read("arrival_skew", p.arrival_skew);
  if (!(p.arrival_skew >= 0 && p.arrival_skew <= 10))
    throw InputError("arrival_skew", "must be in [0, 10], got " + error_number(p.arrival_skew));
  if (const json* a = r.member("activation_dtype"))
    p.activation_dtype = float_dtype_from_json("activation_dtype", *a);
  r.reject_unknown_keys();

  require_fraction("gemm.max_efficiency", p.gemm.max_efficiency);
  require_non_negative("gemm.m_half", p.gemm.m_half);
  require_non_negative("gemm.n_half", p.gemm.n_half);
  require_non_negative("gemm.k_half", p.gemm.k_half);
  if (p.gemm.sm_count < 0)
    throw InputError("gemm.sm_count", "must not be negative, got " + error_number(p.gemm.sm_count));
  require_fraction("hbm_efficiency", p.hbm_efficiency);
  if (!(p.kernel_gap_us >= 0 && p.kernel_gap_us <= 1e6))
    throw InputError("kernel_gap_us", "must be in [0, 1e6], got " + error_number(p.kernel_gap_us));
  if (!(p.optimizer_bytes_per_param > 0))
    throw InputError("optimizer_bytes_per_param",
                     "must be positive, got " + error_number(p.optimizer_bytes_per_param));
  return p;
}

json to_json(const HardwareProfile& p) {
  json j{{"name", p.name},
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
  // The measured parts only where present, so that presets write what they read.
  if (!p.gemm_table.empty()) j["gemm"]["table"] = table_to_json(p.gemm_table);
  for (const auto& [key, ops] :
       {std::pair{"fused_ops", &p.fused_ops}, {"memory_ops", &p.memory_ops}}) {
    if (ops->empty()) continue;
    json& a = j[key] = json::array();
    for (const FusedOpMeasurement& e : *ops) {
      json f = {{"op", e.op}, {"size", e.size}, {"seconds", e.seconds}};
      if (e.rows > 0) f["rows"] = e.rows;
      a.push_back(f);
    }
  }
  if (!p.collectives.empty()) j["collectives"] = collectives_to_json(p.collectives);
  if (!p.memory_efficiency.empty()) j["memory_efficiency"] = p.memory_efficiency;
  if (p.activation_dtype != DType::kBF16) j["activation_dtype"] = to_string(p.activation_dtype);
  if (p.arrival_skew > 0) j["arrival_skew"] = p.arrival_skew;
  if (!p.host_op_us.empty()) j["host_op_us"] = p.host_op_us;
  if (p.cache.bytes_per_rank > 0 || !p.cache.memory_cold_factor.empty() ||
      !p.cache.hit_curve.empty()) {
    j["cache"] = {{"bytes_per_rank", p.cache.bytes_per_rank}};
    if (!p.cache.memory_cold_factor.empty())
      j["cache"]["memory_cold_factor"] = p.cache.memory_cold_factor;
    if (!p.cache.hit_curve.empty()) {
      json& a = j["cache"]["hit_curve"] = json::array();
      for (const CacheModel::Hit& h : p.cache.hit_curve)
        a.push_back({{"bytes", h.bytes}, {"hit", h.hit}});
    }
  }
  return j;
}

}  // namespace ptdp
