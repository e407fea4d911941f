// Fuzzes the `ptdp` command line (cli/cli.h parse_cli: the flag parsing of run_cli for every
// subcommand, without running the command) and, for plan, predict, simulate and run, the
// resolution of the job flags (cli/job_flags.h: the model, cluster, profile and parallel
// configuration they name, as each command does before its work). The input is split on NUL
// or newline into the arguments after "ptdp".
//
// Nothing here starts a search, a simulation or a training run, and no file is read: inputs
// with an argument holding '/' or naming an existing path are skipped, so a name given to
// --model, --cluster or --profile can only miss or be a preset.
#include <CLI/CLI.hpp>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "cli/job_flags.h"
#include "tests/fuzz/fuzz_support.h"

using namespace ptdp;

namespace {

// What ptdp prints for bad input: one line on stderr (exit status 2).
void check_one_line(const std::string& err, int rc) {
  if (rc == 2) {
    if (err.empty() || err.back() != '\n' || err.find('\n') != err.size() - 1)
      fuzz::fail("exit status 2 without exactly one line on stderr: " + err);
  } else if (rc != 0) {
    fuzz::fail("parse_cli returned " + std::to_string(rc));
  }
}

void resolve_job_flags(const std::vector<const char*>& argv) {
  CLI::App app;
  JobFlags f;
  f.add_model_flags(app);
  f.add_cluster_flags(app);
  f.add_parallel_flags(app, false, false);
  app.allow_extras();  // the subcommand's other flags
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {
    return;  // parse_cli reported these
  }
  fuzz::expect_value_or_input_error([&] {
    const ModelSpec m = f.resolve_model();
    const ClusterSpec c = f.resolve_cluster();
    (void)f.resolve_profile(c);
    if (!f.global_batch_size) return;
    const ParallelPlan p = f.resolve_plan(m, c);
    p.validate(m);
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args{"ptdp"};
  std::string current;
  for (size_t i = 0; i <= size; ++i) {
    if (i == size || data[i] == '\0' || data[i] == '\n') {
      std::error_code ec;
      if (current.find('/') != std::string::npos || std::filesystem::exists(current, ec)) return 0;
      args.push_back(current);
      current.clear();
      if (args.size() > 64) return 0;
    } else {
      current += static_cast<char>(data[i]);
    }
  }
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int rc = parse_cli(static_cast<int>(argv.size()), argv.data(), out, err);
  check_one_line(err.str(), rc);
  if (rc != 0 || argv.size() < 2) return 0;
  const std::string command = argv[1];
  if (command == "plan" || command == "predict" || command == "simulate" || command == "run") {
    std::vector<const char*> rest{"ptdp"};
    rest.insert(rest.end(), argv.begin() + 2, argv.end());
    resolve_job_flags(rest);
  }
  return 0;
}
