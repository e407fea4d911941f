#include "cli/cli.h"

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "cli/commands.h"
#include "core/error.h"

namespace ptdp {

int launcher_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    if (const char* v = std::getenv(name)) return std::atoi(v);
  }
  return -1;
}

namespace {

// An error that names one of two flags stating the same thing (the plan rules name the one
// Megatron uses for the layout) named by the one the user gave.
std::string as_given(const CLI::App& app, const InputError& e) {
  static const std::pair<const char*, const char*> kSame[] = {
      {"--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"},
      {"--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"},
  };
  for (const CLI::App* sub : app.get_subcommands())
    for (const auto& [named, other] : kSame) {
      if (e.field() != named) continue;
      const CLI::Option* given = sub->get_option_no_throw(other);
      const CLI::Option* stated = sub->get_option_no_throw(named);
      if (given && given->count() > 0 && !(stated && stated->count() > 0))
        return std::string(other) + ": " + std::string(e.what()).substr(e.field().size() + 2);
    }
  return e.what();
}

// run_cli, or with run_command false parse_cli.
int cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err, bool run_command) {
  CLI::App app{"ptdp: plan, predict, simulate and run Megatron-style PTD-P training", "ptdp"};
  app.require_subcommand(1);
  // A flag given twice takes its last value, as Megatron-LM's argparse does: launch scripts
  // override a shared flag line by appending (`$GPT_ARGS --num-layers 48`). CLI11 refused the
  // second ("At Most 1 required but received 2"). Options of several values keep them all.
  // Subcommands inherit the default.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // Only the subcommand named, when one is: building a subcommand's options is most of the
  // parse's time (CLI11 checks each new option against the others).
  static const std::pair<const char*, Action (*)(CLI::App&)> kCommands[] = {
      {"predict", add_predict_command},
      {"plan", add_plan_command},
      {"simulate", add_simulate_command},
      {"tokenize", add_tokenize_command},
      {"run", add_run_command},
      {"reconcile", add_reconcile_command},
      {"calibrate", add_calibrate_command},
  };
  const bool has_name = argc > 1 && argv[1][0] != '-';
  const std::string named = has_name ? argv[1] : "";
  bool known = false;
  for (const auto& [name, add] : kCommands) known |= has_name && named == name;
  if (has_name && !known) {
    std::string name = named;
    for (char& c : name) c = static_cast<unsigned char>(c) < 0x20 ? '?' : c;  // one line
    err << "ptdp: unknown subcommand '" << name
        << "' (commands: plan, predict, simulate, run, calibrate, reconcile, tokenize)\n";
    return 2;
  }
  std::map<std::string, Action> actions;
  for (const auto& [name, add] : kCommands)
    if (!has_name || named == name) actions[name] = add(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    out << app.help();
    return 0;
  } catch (const CLI::CallForAllHelp&) {
    out << app.help("", CLI::AppFormatMode::All);
    return 0;
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    for (char& c : msg) c = c == '\n' ? ' ' : c;
    // Under a launcher every rank parses the same flags: rank 0 reports.
    if (launcher_rank() <= 0) err << "ptdp: " << msg << "\n";
    return 2;
  }
  // An empty value (`--save ''`, `--tensor-model-parallel-size ''`, as an unset shell variable
  // gives) is refused: CLI11 takes it as the option left out, so a script whose $CKPT is unset
  // trained without checkpoints and exited 0.
  for (const CLI::App* sub : app.get_subcommands())
    for (const CLI::Option* o : sub->get_options()) {
      if (o->count() == 0 || o->get_expected_min() == 0) continue;  // absent, or a flag
      // Integers in decimal only: CLI11 reads them with base 0, so `--seed 010` was seed 8
      // and `--steps 0x10` 16 steps.
      const std::string type = o->get_type_name();
      const bool integer = type.rfind("INT", 0) == 0 || type.rfind("UINT", 0) == 0;
      for (const std::string& v : o->results()) {
        std::string problem;
        if (v.empty()) {
          problem = "needs a value, got an empty one";
        } else if (integer) {
          const std::string_view digits = std::string_view(v).substr(v[0] == '-' ? 1 : 0);
          if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos ||
              (digits.size() > 1 && digits[0] == '0'))
            problem = "'" + v + "' is not a decimal integer";
        }
        if (!problem.empty()) {
          if (launcher_rank() <= 0)  // one line, whatever the value holds
            err << "ptdp: " << InputError(o->get_name(), problem).what() << "\n";
          return 2;
        }
      }
    }
  if (!run_command) return 0;
  try {
    for (const auto& [name, action] : actions) {
      if (app.got_subcommand(name)) return action(out, err);
    }
  } catch (const InputError& e) {
    err << "ptdp: " << as_given(app, e) << "\n";
    return 2;
  } catch (const nlohmann::json::exception& e) {
    err << "ptdp: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    err << "ptdp: internal error: " << e.what() << "\n";
    return 1;
  }
  return 2;
}

}  // namespace

int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  return cli(argc, argv, out, err, true);
}

int parse_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  return cli(argc, argv, out, err, false);
}

}  // namespace ptdp
