// Fuzzes the plan JSON reader, core/parallel_plan.h plan_from_json, and the plan rules it
// feeds (core/plan_rules.h check_plan) against four models: GPT-3 175B, Llama 3 8B (grouped
// query attention, SwiGLU), Mixtral 8x7B (experts) and a two-layer toy. For a plan the rules
// accept, what the runtime derives from it (GPU count, microbatches, chunk layers, Megatron flags)
// must be computable.
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>

#include "core/plan_rules.h"
#include "core/presets.h"
#include "tests/fuzz/fuzz_support.h"

using namespace ptdp;

namespace {

const std::vector<ModelSpec>& models() {
  static const std::vector<ModelSpec> ms = [] {
    ModelSpec toy;
    toy.num_layers = 2;
    toy.hidden_size = 8;
    toy.num_attention_heads = 2;
    toy.seq_length = 4;
    toy.vocab_size = 16;
    return std::vector<ModelSpec>{resolve_model("gpt3-175b"), resolve_model("llama3-8b"),
                                  resolve_model("mixtral-8x7b"), toy};
  }();
  return ms;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json j =
      nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;  // the JSON parser itself: plan_file covers its errors
  std::optional<ParallelPlan> p;
  fuzz::expect_value_or_input_error([&] { p = plan_from_json(j); });
  if (!p) return 0;
  if (to_json(plan_from_json(to_json(*p))) != to_json(*p))
    fuzz::fail("JSON round trip changed the plan");
  for (const ModelSpec& m : models()) {
    bool valid = false;
    fuzz::expect_value_or_input_error([&] {
      p->validate(m);
      valid = true;
    });
    if (valid != (first_violated_rule(m, *p) == PlanRule::kNone))
      fuzz::fail("check_plan and first_violated_rule disagree");
    if (!valid) continue;
    if (p->num_gpus() <= 0 || p->num_microbatches() <= 0) fuzz::fail("a valid plan has no work");
    if (m.is_moe() && p->expert_data_parallel() <= 0) fuzz::fail("a valid plan has no experts");
    const std::vector<int64_t> chunks = layers_per_model_chunk(m, *p);
    if (std::accumulate(chunks.begin(), chunks.end(), int64_t{0}) != m.num_layers)
      fuzz::fail("model chunks do not hold every layer");
    (void)p->megatron_flags(m);
  }
  return 0;
}
