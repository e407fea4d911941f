// `ptdp predict`: the analytic prediction of one configuration.
#include <CLI/CLI.hpp>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/job_flags.h"
#include "cli/report.h"
#include "planner/cost_model.h"

namespace ptdp {

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
    const Prediction r = CostModel(m, c, h).predict(p);
    if (flags->json) {
      out << prediction_json(m, p, r).dump(2) << "\n";
    } else {
      print_prediction(out, m, c, p, r);
    }
    return 0;
  };
}

}  // namespace ptdp
