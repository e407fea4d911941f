// `ptdp simulate`: the discrete-event simulation of one configuration, next to its analytic
// prediction, with the timeline as a Chrome trace and an SVG picture.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "cli/job_flags.h"
#include "cli/report.h"
#include "cli/simulation.h"
#include "core/error.h"

namespace ptdp {
namespace {

struct SimulateFlags {
  JobFlags job;
  TimelineFlags timeline;
  bool full = false;
  std::vector<std::string> slow_ranks;
};

std::map<int64_t, double> parse_slow_ranks(const std::vector<std::string>& specs) {
  std::map<int64_t, double> out;
  for (const std::string& s : specs) {
    const auto colon = s.find(':');
    size_t used_rank = 0, used_factor = 0;
    int64_t rank = -1;
    double factor = 0;
    try {
      if (colon == std::string::npos) throw std::invalid_argument("no colon");
      rank = std::stoll(s.substr(0, colon), &used_rank);
      factor = std::stod(s.substr(colon + 1), &used_factor);
    } catch (const std::exception&) {
      throw InputError("--slow-rank", "'" + s + "' is not RANK:FACTOR (e.g. 3:1.5)");
    }
    if (used_rank != colon || used_factor != s.size() - colon - 1 || rank < 0 ||
        !(factor > 0 && factor <= 1000))
      throw InputError("--slow-rank",
                       "'" + s + "' is not RANK:FACTOR with RANK >= 0 and FACTOR in (0, 1000]");
    out[rank] = factor;
  }
  return out;
}

int run_simulate(const SimulateFlags& f, std::ostream& out, std::ostream& err) {
  const ModelSpec m = f.job.resolve_model();
  const ClusterSpec c = f.job.resolve_cluster();
  const HardwareProfile h = f.job.resolve_profile(c);
  const ParallelPlan p = f.job.resolve_plan(m, c);
  p.validate(m);
  const auto slow = parse_slow_ranks(f.slow_ranks);
  const CostModel cm(m, c, h);
  const Prediction pred = cm.predict(p);
  const bool progress = !f.job.json && isatty(STDERR_FILENO);
  if (progress) err << "simulating..." << std::flush;
  const SimulationResult sim = simulate_plan(cm, p, f.full, slow, f.timeline.wanted());
  if (progress) err << "\r             \r" << std::flush;
  f.timeline.write(sim, p, m);
  if (f.job.json) {
    nlohmann::json j = simulation_json(m, p, sim, pred);
    out << j.dump(2) << "\n";
    return 0;
  }
  print_simulation(out, m, c, p, sim, pred);
  return 0;
}

}  // namespace

Action add_simulate_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "simulate", "discrete-event simulation of one configuration, with its timeline");
  auto f = std::make_shared<SimulateFlags>();
  f->job.add_to(*sub, /*plan_flags_required=*/true);
  f->timeline.add_to(*sub);
  sub->add_flag("--full", f->full, "simulate every GPU, not one representative pipeline");
  sub->add_option("--slow-rank", f->slow_ranks,
                  "RANK:FACTOR: global rank RANK computes FACTOR times slower (needs --full; "
                  "repeatable)");
  return [f](std::ostream& out, std::ostream& err) { return run_simulate(*f, out, err); };
}

}  // namespace ptdp
