// Preset lookup and file resolution (presets.h), plus the strict JSON object reader
// (json_reader.h) that every ptdp file format uses.
#include "core/presets.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "core/embedded_presets.h"
#include "core/error.h"
#include "core/json_reader.h"

namespace ptdp {

using nlohmann::json;

// ---- JsonObjectReader ----

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// "string \"abc\"", "number 2.5", "array": what a value is, for error messages.
std::string describe(const json& v) {
  std::string text = v.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  if (v.is_object() || v.is_array()) return v.type_name();
  return std::string(v.type_name()) + " " + text;
}

int64_t to_int(const json& v, const std::string& field) {
  if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<int64_t>();
  if (v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t{INT64_MAX}) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    // The range first: converting a double outside int64's range is undefined behaviour.
    if (d > -9.2e18 && d < 9.2e18 && d == std::trunc(d)) return static_cast<int64_t>(d);
  }
  throw InputError(field, "expected an integer, got " + describe(v));
}

std::string to_str(const json& v, const std::string& field) {
  if (!v.is_string()) throw InputError(field, "expected a string, got " + describe(v));
  return v.get<std::string>();
}

const json& array_member(const json& v, const std::string& field) {
  if (!v.is_array()) throw InputError(field, "expected an array, got " + describe(v));
  return v;
}

}  // namespace

bool is_documentation_key(const std::string& key) {
  return key == "note" || key == "source" || key == "sources" || ends_with(key, "_source") ||
         ends_with(key, "_note");
}

JsonObjectReader::JsonObjectReader(const json& j, const std::string& what, std::string prefix)
    : j_(j), prefix_(std::move(prefix)) {
  if (!j.is_object())
    throw InputError(what, std::string("expected a JSON object, got ") + j.type_name());
}

const json* JsonObjectReader::member(const std::string& key) {
  known_.push_back(key);
  auto it = j_.find(key);
  return it == j_.end() ? nullptr : &*it;
}

void JsonObjectReader::read(const std::string& key, int64_t& out) {
  if (const json* v = member(key)) out = to_int(*v, field(key));
}

void JsonObjectReader::read(const std::string& key, double& out) {
  const json* v = member(key);
  if (!v) return;
  if (!v->is_number()) throw InputError(field(key), "expected a number, got " + describe(*v));
  out = v->get<double>();
}

void JsonObjectReader::read(const std::string& key, bool& out) {
  const json* v = member(key);
  if (!v) return;
  if (!v->is_boolean()) throw InputError(field(key), "expected true or false, got " + describe(*v));
  out = v->get<bool>();
}

void JsonObjectReader::read(const std::string& key, std::string& out) {
  if (const json* v = member(key)) out = to_str(*v, field(key));
}

void JsonObjectReader::read(const std::string& key, std::vector<int64_t>& out) {
  const json* v = member(key);
  if (!v) return;
  out.clear();
  for (const json& e : array_member(*v, field(key))) out.push_back(to_int(e, field(key)));
}

void JsonObjectReader::read(const std::string& key, std::vector<std::string>& out) {
  const json* v = member(key);
  if (!v) return;
  out.clear();
  for (const json& e : array_member(*v, field(key))) out.push_back(to_str(e, field(key)));
}

void JsonObjectReader::reject_unknown_keys() const {
  for (const auto& [key, value] : j_.items()) {
    if (is_documentation_key(key) || std::count(known_.begin(), known_.end(), key) > 0) continue;
    std::string known;
    for (const std::string& k : known_) known += (known.empty() ? "" : ", ") + k;
    throw InputError(field(key), "unknown key (known keys: " + known + ")");
  }
}

// ---- files and presets ----

void check_regular_input(const std::string& path, const std::string& field) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    throw InputError(field, "'" + path + "' is not a regular file");
}

std::string read_input_file(const std::string& path, const std::string& field) {
  check_regular_input(path, field);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(field, "cannot open '" + path + "'");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

json read_json_file(const std::string& path, const std::string& field) {
  const std::string text = read_input_file(path, field);
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    throw InputError(field, path + ": invalid JSON at byte " + std::to_string(e.byte));
  } catch (const json::exception& e) {  // e.g. out_of_range for a number past a double's range
    throw InputError(field, path + ": " + e.what());
  }
}

namespace {

std::vector<std::string> preset_names(const std::string& kind) {
  std::vector<std::string> names;
  for (const EmbeddedPreset& p : embedded_presets())
    if (kind == p.kind) names.push_back(p.name);
  return names;
}

// Looks name_or_path up among the presets of one kind, then on disk.
template <typename Spec>
Spec resolve(const std::string& kind, const std::string& field, const std::string& name_or_path,
             Spec (*from_json)(const json&)) {
  for (const EmbeddedPreset& p : embedded_presets()) {
    if (kind != p.kind || name_or_path != p.name) continue;
    try {
      return from_json(json::parse(p.json));
    } catch (const std::exception& e) {  // a broken built-in preset is a bug, not bad input
      throw std::logic_error("preset " + kind + "/" + p.name + ": " + e.what());
    }
  }
  std::error_code ec;
  if (std::filesystem::exists(name_or_path, ec))
    return from_json(read_json_file(name_or_path, field));
  std::string names;
  for (const std::string& n : preset_names(kind)) names += (names.empty() ? "" : ", ") + n;
  throw InputError(field, "unknown preset or file '" + name_or_path + "' (presets: " + names + ")");
}

}  // namespace

std::vector<std::string> model_preset_names() {
  return preset_names("models");
}
std::vector<std::string> cluster_preset_names() {
  return preset_names("clusters");
}
std::vector<std::string> profile_preset_names() {
  return preset_names("profiles");
}

ModelSpec resolve_model(const std::string& name_or_path) {
  return resolve<ModelSpec>("models", "model", name_or_path, &model_from_json);
}

ClusterSpec resolve_cluster(const std::string& name_or_path) {
  return resolve<ClusterSpec>("clusters", "cluster", name_or_path, &cluster_from_json);
}

HardwareProfile resolve_profile(const std::string& name_or_path) {
  return resolve<HardwareProfile>("profiles", "profile", name_or_path, &profile_from_json);
}

HardwareProfile default_profile_for(const ClusterSpec& c) {
  if (c.measured_profile) return *c.measured_profile;  // a machine file (ptdp calibrate)
  // The GPU families the built-in profiles describe, matched on the GPU's name. Blackwell
  // (B200, and the GB200's GPUs) before the rest, since "GB200" contains "B200".
  static const std::pair<const char*, const char*> kFamilies[] = {
      {"B200", "b200"}, {"H200", "h200-sxm"}, {"H100", "h100-sxm"}, {"A100", "a100-80gb"}};
  for (const auto& [family, profile] : kFamilies)
    if (c.gpu.name.find(family) != std::string::npos) return resolve_profile(profile);
  // Another GPU priced as an A100 would be silently wrong by a factor of its speed.
  throw InputError("profile", "no built-in hardware profile for GPU '" + c.gpu.name +
                                  "' (A100, H100, H200 and B200 have one): pass --profile");
}

}  // namespace ptdp
