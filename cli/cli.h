// The `ptdp` command line, callable in-process (tests use this) as well as from main().
// Returns the process exit status: 0 success, 2 bad input (one line on `err`), 1 other failure.
#pragma once

#include <ostream>

namespace ptdp {

int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err);
// The flag parsing of run_cli alone: the same status and messages for bad flags (and --help),
// 0 where run_cli would go on to run the command, which it does not (tests/fuzz/cli_args.cc).
int parse_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

// The rank a launcher (mpirun, srun) gave this process, from its environment; -1 when the
// process was started directly.
int launcher_rank();

}  // namespace ptdp
