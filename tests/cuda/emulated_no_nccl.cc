// The emulated CUDA backend test (tests/cuda/CMakeLists.txt) links the runtime's archive without
// NCCL: these stand in for the NCCL data plane, which the emulation does not run (its tests set
// PTDP_DATA_PLANE=staged, so the runtime never asks for it).
#include <stdexcept>
#include <string>

#include "runtime/cuda/nccl_communicator.h"

namespace ptdp {

std::unique_ptr<Communicator> make_nccl_communicator(ControlPlane&, int, void*, CommDuration) {
  throw std::logic_error("the host emulation of the CUDA backend has no NCCL");
}

std::string nccl_version() {
  return "none (host emulation)";
}

}  // namespace ptdp
