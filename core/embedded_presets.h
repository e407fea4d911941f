// The preset JSON files of core/presets/<kind>/<name>.json, compiled in (see embed_presets.cmake).
#pragma once

#include <string>
#include <vector>

namespace ptdp {

struct EmbeddedPreset {
  const char* kind;  // "models", "clusters" or "profiles"
  const char* name;  // file name without .json
  const char* json;
};

const std::vector<EmbeddedPreset>& embedded_presets();

}  // namespace ptdp
