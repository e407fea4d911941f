// Built-in models, clusters and hardware profiles, and the resolvers the CLI uses:
// a name is looked up among the presets, anything else is read as a JSON file.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/cluster_spec.h"
#include "core/hardware_profile.h"
#include "core/model_spec.h"

namespace ptdp {

std::vector<std::string> model_preset_names();
std::vector<std::string> cluster_preset_names();
std::vector<std::string> profile_preset_names();

// Throw InputError("model"/"cluster"/"profile", ...) for unknown names or unreadable files.
ModelSpec resolve_model(const std::string& name_or_path);
ClusterSpec resolve_cluster(const std::string& name_or_path);
HardwareProfile resolve_profile(const std::string& name_or_path);
// The profile that matches a cluster's GPU (e.g. "a100-80gb" for dgx-a100-80gb).
HardwareProfile default_profile_for(const ClusterSpec& c);

// Reads a JSON file; InputError(field, ...) on missing file or malformed JSON.
nlohmann::json read_json_file(const std::string& path, const std::string& field);
// Refuses an input that exists and is not a regular file: a device (/dev/zero), a FIFO or a
// directory, where reading would hang or never end (InputError(field)).
void check_regular_input(const std::string& path, const std::string& field);
// The contents of an input file, after check_regular_input.
std::string read_input_file(const std::string& path, const std::string& field);

}  // namespace ptdp
