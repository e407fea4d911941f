// Reporting simulations: the table, the JSON and the timeline files shared by
// `ptdp simulate` and `ptdp plan --simulate-top`.
#pragma once

#include <CLI/App.hpp>
#include <nlohmann/json_fwd.hpp>
#include <ostream>
#include <string>

#include "planner/simulation_input.h"

namespace ptdp {

struct TimelineFlags {
  std::string trace_path, svg_path;
  void add_to(CLI::App& app);
  bool wanted() const { return !trace_path.empty() || !svg_path.empty(); }
  // Writes the files asked for (atomically); does nothing when none was.
  void write(const SimulationResult& sim, const ParallelPlan& p, const ModelSpec& m) const;
};

nlohmann::json simulation_json(const ModelSpec& m, const ParallelPlan& p,
                               const SimulationResult& sim, const Prediction& pred);
void print_simulation(std::ostream& out, const ModelSpec& m, const ClusterSpec& c,
                      const ParallelPlan& p, const SimulationResult& sim, const Prediction& pred);

}  // namespace ptdp
