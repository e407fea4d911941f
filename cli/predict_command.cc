// `ptdp predict`: the analytic prediction of one configuration.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/job_flags.h"
#include "cli/report.h"
#include "core/plan_rules.h"
#include "planner/cost_model.h"
#include "planner/search.h"

namespace ptdp {
namespace {

// With cp > 1, the same plan with each --cp-comm-type the plan rules allow: its iteration time
// and whether it fits, for the user choosing among them (ptdp plan keeps the fastest).
nlohmann::json cp_comm_types(const CostModel& cm, const ModelSpec& m, const ParallelPlan& p) {
  nlohmann::json out = nlohmann::json::object();
  if (p.context_parallel == 1) return out;
  for (CpComm c : kCpComms) {
    // a2a+p2p with the plan's sizes, or those ptdp plan would take (the fastest in-node ones).
    ParallelPlan q = p;
    if (c == CpComm::kA2AP2P && p.cp_comm != CpComm::kA2AP2P)
      q.hierarchical_cp = fastest_hierarchical_cp(cm, m, p);
    q = with_cp_comm(q, c, m, cm.cluster().gpus_per_node);
    if (first_violated_rule(m, q) != PlanRule::kNone) continue;
    const Prediction r = cm.predict(q);
    nlohmann::json& row = out[to_string(c)];
    row = {{"iteration_time_s", r.iteration_time_s},
           {"cp_comm_s", r.breakdown.cp_comm},
           {"fits", r.memory.fits}};
    if (c == CpComm::kA2AP2P)
      row["hierarchical_context_parallel_sizes"] = {q.cp_a2a_size(), q.cp_ring_size()};
  }
  return out;
}

}  // namespace

Action add_predict_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "predict", "predict iteration time, throughput and memory of one configuration");
  auto flags = std::make_shared<JobFlags>();
  flags->add_to(*sub, /*plan_flags_required=*/true);
  return [flags](std::ostream& out, std::ostream&) {
    const ModelSpec m = flags->resolve_model();
    const ClusterSpec c = flags->resolve_cluster();
    const HardwareProfile h = flags->resolve_profile(c);
    const ParallelPlan p = flags->resolve_plan(m, c);
    p.validate(m);
    const CostModel cm(m, c, h);
    const Prediction r = cm.predict(p);
    const nlohmann::json types = cp_comm_types(cm, m, p);
    if (flags->json) {
      nlohmann::json j = prediction_json(m, p, r);
      if (!types.empty()) j["cp_comm_types"] = types;
      out << j.dump(2) << "\n";
    } else {
      print_prediction(out, m, c, p, r);
      if (!types.empty()) {
        out << "\n--cp-comm-type       iter s  cp comm s  fits\n";
        for (CpComm c : kCpComms) {
          const std::string name = to_string(c);
          if (!types.contains(name)) continue;
          const nlohmann::json& t = types[name];
          std::string label = name;  // a2a+p2p with its sizes, A x B
          if (t.contains("hierarchical_context_parallel_sizes"))
            label +=
                " " + std::to_string(t["hierarchical_context_parallel_sizes"][0].get<int64_t>()) +
                "x" + std::to_string(t["hierarchical_context_parallel_sizes"][1].get<int64_t>());
          char line[112];
          std::snprintf(line, sizeof line, "  %-14s %10.3f %10.3f  %s%s\n", label.c_str(),
                        t["iteration_time_s"].get<double>(), t["cp_comm_s"].get<double>(),
                        t["fits"].get<bool>() ? "yes" : "no",
                        c == p.cp_comm ? "   <- this plan" : "");
          out << line;
        }
      }
    }
    return 0;
  };
}

}  // namespace ptdp
