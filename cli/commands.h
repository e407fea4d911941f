// Subcommands of `ptdp`. Each registers its flags on a CLI11 sub-app and returns the action
// to run once parsing succeeded.
#pragma once

#include <CLI/App.hpp>
#include <functional>
#include <ostream>

namespace ptdp {

using Action = std::function<int(std::ostream& out, std::ostream& err)>;

Action add_predict_command(CLI::App& app);
Action add_plan_command(CLI::App& app);
Action add_simulate_command(CLI::App& app);
Action add_tokenize_command(CLI::App& app);
Action add_run_command(CLI::App& app);
Action add_reconcile_command(CLI::App& app);
Action add_calibrate_command(CLI::App& app);

}  // namespace ptdp
