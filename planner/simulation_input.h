// From a configuration to the simulator's input: the cost model prices each model chunk's
// passes, the transfers, the gradient reduction and the optimizer step; the simulator replays
// the schedule against them.
//
// This adapter is its own library, ptdp_plan_sim (planner/CMakeLists.txt), linking
// ptdp_planner and ptdp_simulator: the simulator depends on core only (it is handed op costs,
// simulator/simulator.h) and the planner does not depend on the simulator, so only what
// needs both (the `ptdp` commands, the tests, bench/simulate_bench.cc) links this.
#pragma once

#include <map>

#include "planner/cost_model.h"
#include "simulator/simulator.h"

namespace ptdp {

SimulationInput simulation_input(const CostModel& cm, const ParallelPlan& p);

// The longest iteration simulate_plan takes on (slowed ranks included), in seconds.
inline constexpr double kMaxSimulatedSeconds = 1e6;

// Simulates `p` (valid for the model) and returns the result; `timeline` asks for spans.
// Throws InputError when the predicted iteration is beyond kMaxSimulatedSeconds.
SimulationResult simulate_plan(const CostModel& cm, const ParallelPlan& p, bool full = false,
                               const std::map<int64_t, double>& slowdown = {},
                               bool timeline = false);

}  // namespace ptdp
