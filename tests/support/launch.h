// Starting the ptdp binary from a test, as a user does: under the MPI launcher on np ranks, or
// directly, with stdout and stderr captured. Each test process keeps its files in its own
// directory (CTest runs tests in parallel processes).
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

namespace ptdp::test {

struct Outcome {
  int status = -1;
  std::string out, err;
};

std::string read_file(const std::filesystem::path& p);
// A directory of this test process's own under the system's temporary directory.
std::filesystem::path scratch_dir(const std::string& test);
// Runs `binary args` under `mpiexec -np np` (np = 0: directly); files go to scratch_dir(test).
Outcome launch(const std::string& mpiexec, const std::string& binary, int np,
               const std::string& args, const std::string& test);

// The processes whose command line contains `marker` and whose environment says they are MPI
// rank `rank` (OMPI_COMM_WORLD_RANK); the launcher itself is never included.
std::vector<pid_t> ranks_of(const std::string& marker, const std::string& rank,
                            const std::string& launcher);

}  // namespace ptdp::test
