// The NCCL data plane (runtime/communicator.h's Communicator over NCCL): collectives and batched
// point-to-point transfers on device buffers, one rank per GPU (NCCL refuses two ranks on one
// device; ranks sharing a GPU use the host-staged MPI data plane, runtime/staged_communicator.h).
//
// Bootstrap. Rank 0's ncclUniqueId reaches every rank over the control plane (MPI under mpirun).
// Where NCCL_COMM_ID (host:port) is set, every rank derives the same id from it instead, as NCCL
// documents, and nothing is exchanged.
//
// Groups. split() is ncclCommSplit, so the tensor-, pipeline-, data-parallel and embedding groups
// share the parent's setup.
//
// Ordering. Each operation first waits (a CUDA event, not the host) for the work queued so far on
// `compute_stream`, which produced its inputs, then runs on the communicator's own stream, or on
// the DeviceStream given. Its Work completes when that stream passes an event recorded after it;
// the caller then reads the outputs (the runtime waits before it uses them).
//
// Point-to-point. NCCL has no tags: within a batch, and between batches, the transfers between one
// pair of ranks are matched in the order they are posted, which the pipeline schedule keeps.
//
// Host pointers (a norm's partial sum) are staged through a device buffer: uploaded before the
// operation, downloaded when it completes.
//
// Bounded waits. The communicators are non-blocking (ncclConfig_t::blocking = 0): setup, split
// and every enqueue are polled with ncclCommGetAsyncError, and Work::wait() polls its event, each
// up to the communicator's timeout; past it CommTimeout names the group and the operation. While
// a Work waits, every stall timeout the watchdog (runtime/watchdog.h) pings the other ranks and
// stops the job naming any that does not answer, as MPI waits do. A
// communicator that timed out or failed is aborted (ncclCommAbort) when destroyed, not finalized,
// so a stuck peer cannot hang the exit.
#pragma once

#include <memory>
#include <string>

#include "runtime/communicator.h"

namespace ptdp {

// A communicator over the ranks of `control` (rank r is control's rank r), on CUDA device `device`
// (made current by the caller). `compute_stream` is a cudaStream_t. Collective over `control`.
std::unique_ptr<Communicator> make_nccl_communicator(ControlPlane& control, int device,
                                                     void* compute_stream, CommDuration timeout);

// NCCL's version as "2.28.3", for machine files and messages.
std::string nccl_version();

}  // namespace ptdp
