// From a configuration to the simulator's input: the cost model prices each model chunk's
// passes, the transfers, the gradient reduction and the optimizer step; the simulator replays
// the schedule against them (DESIGN.md: the simulator is handed op costs).
#pragma once

#include <map>

#include "planner/cost_model.h"
#include "simulator/simulator.h"

namespace ptdp {

SimulationInput simulation_input(const CostModel& cm, const ParallelPlan& p);

// Simulates `p` (valid for the model) and returns the result; `timeline` asks for spans.
SimulationResult simulate_plan(const CostModel& cm, const ParallelPlan& p, bool full = false,
                               const std::map<int64_t, double>& slowdown = {},
                               bool timeline = false);

}  // namespace ptdp
