// Fuzzes the model file loader, `--model FILE`: core/presets.h resolve_model reads the file
// (read_json_file) and model_from_json takes ptdp's model JSON or a Hugging Face config.json.
// A model it accepts must survive ptdp's own JSON round trip unchanged and have finite,
// positive sizes (parameters(), ParallelPlan::megatron_flags).
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/parallel_plan.h"
#include "core/presets.h"
#include "tests/fuzz/fuzz_support.h"

using namespace ptdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_scratch_file("model.json", data, size);
  std::optional<ModelSpec> m;
  fuzz::expect_value_or_input_error([&] { m = resolve_model(path); });
  if (!m) return 0;
  const double n = m->parameters();
  if (!std::isfinite(n) || n <= 0)
    fuzz::fail("parameters() of an accepted model: " + std::to_string(n));
  if (to_json(model_from_json(to_json(*m))) != to_json(*m))
    fuzz::fail("JSON round trip changed the model");
  (void)ParallelPlan{}.megatron_flags(*m);
  return 0;
}
