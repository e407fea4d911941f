// A communicator whose buffers may live in a device backend's memory while the data plane under
// it (MPI, or the group of one) reads and writes host memory: each operation copies its device
// inputs to host buffers, runs the inner operation on them, and copies the outputs back to the
// device when it completes. Host pointers (a norm's partial sum) pass straight through.
//
// This is how ranks of the CUDA backend that share one GPU (NCCL refuses two ranks on one
// device) exchange activations and gradients: correct, not fast.
#pragma once

#include <memory>

#include "runtime/backend.h"
#include "runtime/communicator.h"

namespace ptdp {

// `inner` must outlive the result; `backend` says which pointers are device memory and moves
// the bytes. Groups split from the result are staged too.
std::unique_ptr<Communicator> make_host_staged_communicator(Communicator& inner, Backend& backend);

}  // namespace ptdp
