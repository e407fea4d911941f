// Runs `ptdp ARGS...` in this process (cli/cli.h's run_cli) and returns what it printed: for
// tests of the command line that need no launcher.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "cli/cli.h"

namespace ptdp::test {

struct CliResult {
  int status;
  std::string out, err;
};

inline CliResult run_ptdp(std::vector<std::string> args) {
  args.insert(args.begin(), "ptdp");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int status = run_cli(static_cast<int>(argv.size()), argv.data(), out, err);
  return {status, out.str(), err.str()};
}

}  // namespace ptdp::test
