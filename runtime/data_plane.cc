#include "runtime/data_plane.h"

#include <unistd.h>

#include <cstdlib>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "runtime/staged_communicator.h"
#ifdef PTDP_HAVE_NCCL_COMM
#include "runtime/cuda/nccl_communicator.h"
#endif

namespace ptdp {

namespace {

std::string host_name() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

// Every rank's string, rank-major.
std::vector<std::string> all_gather_strings(ControlPlane& control, const std::string& mine) {
  std::vector<std::string> all;
  for (const std::vector<uint8_t>& w :
       control.all_gather_bytes(std::vector<uint8_t>(mine.begin(), mine.end())))
    all.emplace_back(w.begin(), w.end());
  return all;
}

}  // namespace

std::vector<std::string> gpu_of_each_rank(ControlPlane& control, const Backend& backend) {
  return all_gather_strings(control, host_name() + "/" + std::to_string(backend.device_index()));
}

std::vector<std::string> host_of_each_rank(ControlPlane& control) {
  return all_gather_strings(control, host_name());
}

DataPlane make_device_data_plane(Communicator& world, ControlPlane& control, Backend& backend) {
  if (backend.host_accessible())
    throw std::logic_error("make_device_data_plane: the backend's memory is host memory");
  const char* env = std::getenv("PTDP_DATA_PLANE");
  const std::string want = env ? env : "auto";
  if (want != "auto" && want != "staged" && want != "nccl")
    throw InputError("PTDP_DATA_PLANE", "must be auto, staged or nccl, not '" + want + "'");
  DataPlane plane;
  std::string why_not;
  if (want != "staged") {
#ifdef PTDP_HAVE_NCCL_COMM
    if (backend.name() != "cuda") {
      why_not = "the " + std::string(backend.name()) + " backend is not a GPU";
    } else if (want == "auto" && control.size() == 1) {
      // A world of one rank exchanges nothing between devices; NCCL would only add its
      // bootstrap, which needs a usable network interface even for one rank.
      why_not = "one rank";
    } else if (const auto gpus = gpu_of_each_rank(control, backend);
               std::set<std::string>(gpus.begin(), gpus.end()).size() != gpus.size()) {
      why_not = "ranks share a GPU, which NCCL refuses";
    } else {
      plane.world = make_nccl_communicator(control, backend.device_index(), backend.native_stream(),
                                           world.timeout());
      plane.world->set_name(world.name());
      plane.kind = "nccl";
      return plane;
    }
#else
    (void)control;
    why_not = "this build has no NCCL";
#endif
    if (want == "nccl") throw InputError("PTDP_DATA_PLANE", "nccl cannot be used: " + why_not);
  }
  plane.world = make_host_staged_communicator(world, backend);
  plane.kind = "staged";
  return plane;
}

}  // namespace ptdp
