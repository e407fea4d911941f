#include "cli/simulation.h"

#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/report.h"
#include "planner/search.h"
#include "simulator/timeline_export.h"

namespace ptdp {
namespace {

constexpr size_t kLargeSvgBytes = size_t{50} << 20;

}  // namespace

void TimelineFlags::add_to(CLI::App& app) {
  app.add_option("--trace", trace_path,
                 "write the timeline as Chrome trace-event JSON (opens in ui.perfetto.dev)");
  app.add_option("--svg", svg_path, "write the timeline as an SVG Gantt chart");
}

void TimelineFlags::write(const SimulationResult& sim, const ParallelPlan& p,
                          const ModelSpec& m) const {
  const std::string title = "ptdp simulate: " + plan_summary(p) + ", " +
                            std::to_string(m.num_layers) + " layers, hidden " +
                            std::to_string(m.hidden_size) +
                            ", m=" + std::to_string(p.num_microbatches());
  if (!trace_path.empty()) {
    std::ostringstream s;
    write_chrome_trace(s, sim.timeline, title);
    write_file_atomically(trace_path, s.str(), "--trace");
  }
  if (!svg_path.empty()) {
    std::ostringstream s;
    write_svg(s, sim.timeline, sim.iteration, title);
    const std::string svg = s.str();
    write_file_atomically(svg_path, svg, "--svg");
    // A browser renders an SVG of some 50 MB at most: say so rather than leave a file that
    // will not open (a --full simulation of 3072 GPUs draws 2.4 M spans, 318 MB).
    if (svg.size() > kLargeSvgBytes)
      std::fprintf(stderr,
                   "ptdp: note: %s holds %zu spans (%.0f MB), more than a browser draws; the "
                   "trace (--trace, ui.perfetto.dev) or a simulation without --full shows it\n",
                   svg_path.c_str(), sim.timeline.size(), static_cast<double>(svg.size()) / 1e6);
  }
}

nlohmann::json simulation_json(const ModelSpec& m, const ParallelPlan& p,
                               const SimulationResult& sim, const Prediction& pred) {
  nlohmann::json j;
  j["configuration"] = to_json(p);
  j["megatron_flags"] = p.megatron_flags(m, pred.precision);
  j["ptdp_flags"] = p.ptdp_flags();  // give them with megatron_flags (empty: none)
  const double it = to_seconds(sim.iteration);
  j["iteration_time_s"] = it;
  j["predicted_iteration_time_s"] = pred.iteration_time_s;
  j["tokens_per_s"] = tokens_per_second(m, p, it);
  j["model_tflops_per_gpu"] = tflops_per_gpu(pred.model_flops, it, p.num_gpus());
  j["bubble_fraction"] = sim.bubble_fraction;
  j["critical_stage"] = sim.critical_stage;
  j["exposed_comm_s"] = {{"tp", to_seconds(sim.exposed_tp)},
                         {"pp", to_seconds(sim.exposed_pp)},
                         {"dp", to_seconds(sim.exposed_dp)},
                         {"cp", to_seconds(sim.exposed_cp)},
                         {"ep", to_seconds(sim.exposed_ep)}};
  j["stages"] = nlohmann::json::array();
  for (const StageStats& s : sim.stages) {
    j["stages"].push_back({{"rank", s.rank},
                           {"busy_s", to_seconds(s.busy())},
                           {"compute_s", to_seconds(s.compute)},
                           {"tp_comm_s", to_seconds(s.tp_comm)},
                           {"cp_comm_s", to_seconds(s.cp_comm)},
                           {"ep_comm_s", to_seconds(s.ep_comm)},
                           {"pp_comm_s", to_seconds(s.pp_comm)},
                           {"dp_comm_s", to_seconds(s.dp_comm)},
                           {"optimizer_s", to_seconds(s.optimizer)},
                           {"idle_s", to_seconds(s.idle)}});
  }
  j["events"] = sim.events;
  j["simulated_microbatches"] = sim.simulated_microbatches;
  return j;
}

void print_simulation(std::ostream& out, const ModelSpec& m, const ClusterSpec& c,
                      const ParallelPlan& p, const SimulationResult& sim, const Prediction& pred) {
  char buf[256];
  out << describe_job(m, c, p.global_batch_size) << "\n";
  out << plan_summary(p) << ", schedule " << to_string(p.schedule) << ", m=" << p.num_microbatches()
      << " microbatches\n\n";
  const double it = to_seconds(sim.iteration);
  std::snprintf(buf, sizeof buf,
                "simulated iteration %10.4f s   (analytic prediction %.4f s, %+.1f%%)\n"
                "model TFLOP/s/GPU   %10.1f\n"
                "pipeline bubble     %10.1f%%  of the busiest stage's work (stage %lld)\n"
                "exposed comm        tp %.4f s  pp %.4f s  dp %.4f s\n\n",
                it, pred.iteration_time_s, 100 * (it / pred.iteration_time_s - 1),
                tflops_per_gpu(pred.model_flops, it, p.num_gpus()), 100 * sim.bubble_fraction,
                static_cast<long long>(sim.critical_stage), to_seconds(sim.exposed_tp),
                to_seconds(sim.exposed_pp), to_seconds(sim.exposed_dp));
  out << buf;
  // Context- and expert-parallel columns only for plans that have them.
  const bool groups = p.context_parallel > 1 || p.expert_parallel * p.expert_tp() > 1;
  if (groups) {
    std::snprintf(buf, sizeof buf, "exposed cp/ep comm  cp %.4f s  ep %.4f s\n\n",
                  to_seconds(sim.exposed_cp), to_seconds(sim.exposed_ep));
    out << buf;
  }
  out << "stage   compute    tp comm    pp comm    dp comm  optimizer       idle"
      << (groups ? "    cp comm    ep comm" : "") << "   (seconds)\n";
  for (const StageStats& s : sim.stages) {
    std::snprintf(buf, sizeof buf, "%5lld %9.4f  %9.4f  %9.4f  %9.4f  %9.4f  %9.4f",
                  static_cast<long long>(s.rank), to_seconds(s.compute), to_seconds(s.tp_comm),
                  to_seconds(s.pp_comm), to_seconds(s.dp_comm), to_seconds(s.optimizer),
                  to_seconds(s.idle));
    out << buf;
    if (groups) {
      std::snprintf(buf, sizeof buf, "  %9.4f  %9.4f", to_seconds(s.cp_comm),
                    to_seconds(s.ep_comm));
      out << buf;
    }
    out << "\n";
  }
  std::snprintf(buf, sizeof buf, "\n%lld events", static_cast<long long>(sim.events));
  out << buf;
  if (sim.simulated_microbatches < p.num_microbatches())
    out << "; steady state extrapolated from " << sim.simulated_microbatches << " microbatches";
  out << "\n";
}

}  // namespace ptdp
