// Built instead of mpi_communicator.cc when MPI is not found: one rank only.
#include "runtime/communicator.h"

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

}  // namespace ptdp
