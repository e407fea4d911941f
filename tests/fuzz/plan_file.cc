// Fuzzes the file `ptdp run --plan FILE [--plan-index K]` reads (cli/plan_file.h
// read_plan_file): what `ptdp plan --out` writes, or one plan object. The first input byte
// picks --plan-index (none, all, or a rank); the rest is the file. Each plan read is then
// checked against the file's model (or GPT-3 175B) as `ptdp run` does.
#include "cli/plan_file.h"

#include <nlohmann/json.hpp>

#include "core/presets.h"
#include "tests/fuzz/fuzz_support.h"

using namespace ptdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string index = data[0] == 0 ? "" : data[0] == 1 ? "all" : std::to_string(data[0] - 1);
  const std::string path = fuzz::write_scratch_file("plans.json", data + 1, size - 1);
  fuzz::expect_value_or_input_error([&] {
    ModelSpec model;
    bool have_model = false;
    const std::vector<NumberedPlan> plans = read_plan_file(path, index, &model, &have_model);
    if (plans.empty()) fuzz::fail("read_plan_file returned no plan");
    if (!have_model) model = resolve_model("gpt3-175b");
    for (const NumberedPlan& np : plans) {
      np.plan.validate(model);
      (void)np.plan.num_gpus();
    }
  });
  return 0;
}
