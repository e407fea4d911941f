// Built instead of mpi_communicator.cc when MPI is not found: one rank only.
#include <cstdio>
#include <cstdlib>

#include "runtime/communicator.h"
#include "runtime/watchdog.h"

namespace ptdp {

bool mpi_available() {
  return false;
}

std::unique_ptr<Communicator> make_mpi_world() {
  return nullptr;
}

std::unique_ptr<ControlPlane> make_mpi_control_plane() {
  return nullptr;
}

bool watchdog_active() {
  return false;
}

int64_t watchdog_checks() {
  return 0;
}

void watchdog_check_peers(const std::string&, const std::string&, CommDuration,
                          const std::string&) {}

[[noreturn]] void abort_job(const std::string& line) {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
  std::_Exit(3);
}

void start_watchdog(bool) {}
void stop_watchdog() {}

}  // namespace ptdp
