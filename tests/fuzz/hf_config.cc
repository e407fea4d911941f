// Fuzzes the Hugging Face config.json reading of core/model_spec.cc (model_from_json on an
// object holding "num_hidden_layers", the key that selects it). Inputs that are JSON objects
// without that key get it (the value 1), so every parsed object drives the Hugging Face path.
#include <nlohmann/json.hpp>
#include <optional>

#include "core/model_spec.h"
#include "tests/fuzz/fuzz_support.h"

using namespace ptdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;  // the JSON parser itself: model_json covers its errors
  if (j.is_object() && !j.contains("num_hidden_layers")) j["num_hidden_layers"] = 1;
  std::optional<ModelSpec> m;
  fuzz::expect_value_or_input_error([&] { m = model_from_json(j); });
  if (!m) return 0;
  if (to_json(model_from_json(to_json(*m))) != to_json(*m))
    fuzz::fail("JSON round trip changed the model");
  return 0;
}
