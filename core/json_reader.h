// JsonObjectReader: strict reading of one JSON object of a ptdp file (model, cluster, plan,
// profile). Values must have the right type, every key must be known (typos are errors) and
// every error is an InputError naming the field ("gpu.memory_gib: expected a number, got
// string"). Documentation keys ("note", "source", "sources", "*_source", "*_note") are skipped.
// Absent keys leave the output untouched, so struct defaults apply.
// Defined in presets.cc, next to read_json_file.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace ptdp {

bool is_documentation_key(const std::string& key);

class JsonObjectReader {
 public:
  // Throws InputError(what, "expected a JSON object, got array") unless j is an object. Errors
  // about members name them as prefix + key, e.g. prefix "gpu." gives "gpu.memory_gib".
  JsonObjectReader(const nlohmann::json& j, const std::string& what, std::string prefix = "");

  void read(const std::string& key, int64_t& out);  // integers (2.0 is accepted, 2.5 is not)
  void read(const std::string& key, double& out);
  void read(const std::string& key, bool& out);
  void read(const std::string& key, std::string& out);
  void read(const std::string& key, std::vector<int64_t>& out);
  void read(const std::string& key, std::vector<std::string>& out);
  // The member, or nullptr when absent; either way the key counts as known.
  const nlohmann::json* member(const std::string& key);
  // The name errors use for a member: prefix + key (prefix + "\"\"" for the empty key).
  std::string field(const std::string& key) const { return prefix_ + (key.empty() ? "\"\"" : key); }

  // Throws InputError naming the first key that was neither read nor documentation.
  void reject_unknown_keys() const;

 private:
  const nlohmann::json& j_;
  std::string prefix_;
  std::vector<std::string> known_;
};

}  // namespace ptdp
