// Reading `ptdp plan --out` files for `ptdp run --plan` (cli/plan_file.h).
#include "cli/plan_file.h"

#include <nlohmann/json.hpp>
#include <stdexcept>

#include "core/error.h"
#include "core/presets.h"

namespace ptdp {

std::vector<NumberedPlan> read_plan_file(const std::string& path, const std::string& index,
                                         ModelSpec* model, bool* have_model) {
  const nlohmann::json j = read_json_file(path, "--plan");
  std::vector<const nlohmann::json*> listed;
  if (j.contains("plans")) {
    if (!j["plans"].is_array() || j["plans"].empty())
      throw InputError("--plan", "'plans' holds no plan");
    for (const nlohmann::json& p : j["plans"]) listed.push_back(&p);
  } else {
    listed.push_back(&j);
  }
  const int64_t n = static_cast<int64_t>(listed.size());
  int64_t first = 1, last = 1;
  if (index == "all") {
    last = n;
  } else if (!index.empty()) {
    size_t used = 0;
    int64_t k = 0;
    try {
      k = std::stoll(index, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != index.size() || k < 1)
      throw InputError("--plan-index",
                       "must be a plan's rank (1 = the best) or all, got '" + index + "'");
    if (k > n)
      throw InputError("--plan-index", std::to_string(k) + " exceeds the " + std::to_string(n) +
                                           " plans of " + path);
    first = last = k;
  }
  std::vector<NumberedPlan> out;
  for (int64_t k = first; k <= last; ++k) {
    const nlohmann::json* entry = listed[static_cast<size_t>(k - 1)];
    const nlohmann::json* plan = entry;
    if (plan->contains("configuration")) plan = &(*plan)["configuration"];
    try {
      out.push_back({plan_from_json(*plan), k, std::nullopt});
    } catch (const InputError& e) {
      throw InputError("--plan", e.what());
    }
    if (plan != entry && entry->contains("precision")) {
      const nlohmann::json& p = (*entry)["precision"];
      for (DType t : {DType::kF32, DType::kBF16, DType::kF16})
        if (p.is_string() && p.get<std::string>() == to_string(t)) out.back().priced = t;
      if (!out.back().priced)
        throw InputError("--plan", "plan " + std::to_string(k) +
                                       ": precision must be fp32, bf16 or fp16, got " + p.dump());
    }
  }
  *have_model = j.contains("model");
  if (*have_model) {
    try {
      *model = model_from_json(j["model"]);
    } catch (const InputError& e) {
      throw InputError("--plan", std::string("model: ") + e.what());
    }
  }
  return out;
}

}  // namespace ptdp
