// The data plane of a rank whose backend keeps its buffers in device memory: NCCL where it can
// run, else MPI (or the group of one) on host copies (runtime/staged_communicator.h).
//
// NCCL is used when this build has it (PTDP_HAVE_NCCL), the backend is "cuda", there are at least
// two ranks (one rank has nothing to exchange, and NCCL's bootstrap wants a network interface even
// then; "nccl" still forces it), and no two ranks use the same GPU (NCCL refuses that; every rank's
// host name and device index are compared over the control plane). PTDP_DATA_PLANE overrides the
// choice: "staged" always stages through the host, "nccl" refuses (InputError naming
// PTDP_DATA_PLANE) where NCCL cannot run; "auto" or unset choose as above. Collective over
// `control`: every rank must call it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "runtime/backend.h"
#include "runtime/communicator.h"

namespace ptdp {

struct DataPlane {
  std::unique_ptr<Communicator> world;  // rank r is world's rank r, with world's timeout
  std::string kind;                     // "nccl" or "staged"
};

// `world` and `control` must outlive the result. `backend` must not be host-accessible.
DataPlane make_device_data_plane(Communicator& world, ControlPlane& control, Backend& backend);

// Every rank's GPU as "host/device index", rank-major (collective over `control`): ranks with
// equal entries share a GPU.
std::vector<std::string> gpu_of_each_rank(ControlPlane& control, const Backend& backend);
// Every rank's host name, rank-major (collective over `control`).
std::vector<std::string> host_of_each_rank(ControlPlane& control);

}  // namespace ptdp
