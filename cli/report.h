// Turning predictions into what people and programs read: tables and JSON.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <ostream>
#include <string>

#include "core/cluster_spec.h"
#include "core/model_spec.h"
#include "core/output_file.h"  // write_file_atomically, check_writable
#include "core/parallel_plan.h"
#include "planner/cost_model.h"

namespace ptdp {

// The keys of `ptdp predict --json` (and of each entry of `ptdp plan --json`'s "plans").
nlohmann::json prediction_json(const ModelSpec& m, const ParallelPlan& p, const Prediction& r);
void print_prediction(std::ostream& out, const ModelSpec& m, const ClusterSpec& c,
                      const ParallelPlan& p, const Prediction& r);
// " in groups of N" where the interleaved schedule runs in microbatch groups other than p, else "".
std::string group_note(const ParallelPlan& p);
// "cp=N", with " (all_gather)" or " (a2a)" when the context-parallel attention is not the ring.
std::string context_note(const ParallelPlan& p);
// ", distributed optimizer" or ", Megatron-FSDP <strategy>" where the plan has one, else "".
std::string optimizer_note(const ParallelPlan& p);
std::string describe_job(const ModelSpec& m, const ClusterSpec& c, int64_t global_batch);
}  // namespace ptdp
