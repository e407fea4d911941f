// Communicator: the collectives and point-to-point transfers of the data plane, over one group
// of ranks, and ControlPlane: small host-side exchanges (agreement on failures, losses, counts,
// timelines) beside it. Backends: MPI (CPU ranks; OpenMPI is also the launcher) and, with the
// CUDA issue, NCCL for the data plane, behind these same interfaces.
//
// Memory space. Every data-plane buffer (the pointers given to Communicator) lives in the
// backend's memory space: host memory for MPI and the self communicator, device memory for the
// NCCL backend. ControlPlane always takes and returns host values.
//
// Element types. Each buffer is (pointer, element count, DType) for the types of core/dtype.h;
// reductions sum. bf16 and fp16 sums add in fp32 and round back to 16 bits at each step of the
// reduction; see runtime/mpi_communicator.cc for the MPI backend.
//
// Asynchrony. Each collective and the point-to-point batch has an `_async` form returning a
// Work handle; its buffers must stay alive and untouched until the Work completes. A DeviceStream
// argument names the device stream the operation is ordered on (the NCCL backend); the MPI
// backend ignores it. The blocking forms are the async form followed by wait().
//
// Bounded waits. No wait blocks for ever: Work::wait() gives up after the communicator's
// timeout (PTDP_COMM_TIMEOUT_S seconds, default 300, or set_timeout()) and throws CommTimeout
// naming the group, the operation and, where the backend knows them, the ranks not heard from.
// A timed-out operation is still posted: waiting again may complete it (when the late rank
// arrives). A collective cannot be withdrawn, so a group whose collective is never completed is
// unusable for further collectives, and a ControlPlane call that times out leaves that control
// plane unusable: treat both as fatal and stop the job.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace ptdp {

using CommDuration = std::chrono::duration<double>;  // seconds

// The default bound on a wait: PTDP_COMM_TIMEOUT_S (seconds, > 0) if set, else 300 s. Throws
// std::invalid_argument when the variable is set but is not a positive number.
CommDuration default_comm_timeout();

// Thrown when a wait outlives its bound. what() names the group, the operation and the ranks not
// heard from; the same facts are kept as fields.
class CommTimeout : public std::runtime_error {
 public:
  CommTimeout(std::string group, std::string operation, std::vector<int> missing_ranks,
              CommDuration waited, const std::string& detail);
  const std::string& group() const { return group_; }
  const std::string& operation() const { return operation_; }
  // Ranks of the group (not world ranks) whose side has not arrived; empty when not known
  // (a collective: MPI does not say which member has not joined).
  const std::vector<int>& missing_ranks() const { return missing_; }

 private:
  std::string group_, operation_;
  std::vector<int> missing_;
};

// The device stream an operation is ordered on: an opaque native handle (cudaStream_t for the
// NCCL backend), null for the default stream. Host backends ignore it.
struct DeviceStream {
  void* native = nullptr;
};

// An operation in flight. Destroying a Work that has not completed waits for it (bounded); if it
// still has not completed, point-to-point requests are cancelled and a collective is abandoned
// with a message on stderr (the job is then expected to stop).
class Work {
 public:
  virtual ~Work() = default;
  // True once the operation has completed (and its output buffers may be read). Never blocks.
  virtual bool test() = 0;
  // Blocks until completion, at most the communicator's timeout (or `timeout`); then throws
  // CommTimeout. After a timeout the Work is still pending: wait() may be called again.
  virtual void wait() = 0;
  virtual void wait(CommDuration timeout) = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // within this group
  virtual int size() const = 0;
  // A name for messages ("world", "tp", ...); split() children are named "<parent>/<color>".
  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }
  // The bound on each wait; children made by split() inherit it.
  CommDuration timeout() const { return timeout_; }
  void set_timeout(CommDuration t) { timeout_ = t; }

  // Point-to-point operations posted together and completed as one batch (like PyTorch's
  // batch_isend_irecv); peers are ranks of this group; n counts elements of `dtype`.
  struct P2P {
    bool send = true;
    void* data = nullptr;
    size_t n = 0;
    int peer = 0;
    int tag = 0;
    DType dtype = DType::kF32;
  };

  // --- Asynchronous forms (buffers in the backend's memory space) ---
  // Sums n elements in place across the group.
  std::unique_ptr<Work> all_reduce_async(void* data, size_t n, DType t, DeviceStream s = {}) {
    return start_all_reduce(data, n, t, s);
  }
  // in: n elements from each rank; out: size() * n elements, rank-major.
  std::unique_ptr<Work> all_gather_async(const void* in, void* out, size_t n, DType t,
                                         DeviceStream s = {}) {
    return start_all_gather(in, out, n, t, s);
  }
  // in: size() * n elements; out: this rank's n-element block of the element-wise sum. With
  // in == out the sum of the whole buffer is taken and the block lands at its start.
  std::unique_ptr<Work> reduce_scatter_async(const void* in, void* out, size_t n, DType t,
                                             DeviceStream s = {}) {
    return start_reduce_scatter(in, out, n, t, s);
  }
  // Uneven blocks (MPI_Reduce_scatter): in holds the sum of `counts` elements on every rank, the
  // blocks in rank order; out gets counts[rank()] elements, this rank's block of the element-wise
  // sum. With in == out (in place) the block's sum lands where the block is, after the blocks
  // of the ranks before it, and the other blocks are left undefined; otherwise in and out do not
  // overlap. The distributed optimizer reduces each rank's shard of the gradients so, in the
  // gradient buffer itself, as Megatron-Core does (runtime/grad_sync.h).
  std::unique_ptr<Work> reduce_scatter_v_async(const void* in, void* out,
                                               std::span<const size_t> counts, DType t,
                                               DeviceStream s = {}) {
    return start_reduce_scatter_v(in, out, counts, t, s);
  }
  // Uneven blocks (MPI_Allgatherv): rank r contributes counts[r] elements; out gets the sum of
  // `counts` elements, the blocks in rank order. `in` may be this rank's own block of `out` (in
  // place). --overlap-param-gather gathers each bucket of updated parameters so.
  std::unique_ptr<Work> all_gather_v_async(const void* in, void* out,
                                           std::span<const size_t> counts, DType t,
                                           DeviceStream s = {}) {
    return start_all_gather_v(in, out, counts, t, s);
  }
  // root's n elements to every rank.
  std::unique_ptr<Work> broadcast_async(void* data, size_t n, DType t, int root,
                                        DeviceStream s = {}) {
    return start_broadcast(data, n, t, root, s);
  }
  std::unique_ptr<Work> batch_async(std::span<const P2P> ops, DeviceStream s = {}) {
    return start_batch(ops, s);
  }
  std::unique_ptr<Work> barrier_async() { return start_barrier(); }
  // Variable-size all-to-all (MPI_Alltoallv): send_counts[r] elements of `in` (blocks in rank
  // order, contiguous) go to rank r; recv_counts[r] elements from rank r land in `out`, in rank
  // order. Both count vectors have size() entries; every rank's send_counts[r] must equal rank
  // r's recv_counts[this rank] (exchange the counts first, e.g. with an int64 all-to-all of ones).
  std::unique_ptr<Work> all_to_all_v_async(const void* in, std::span<const size_t> send_counts,
                                           void* out, std::span<const size_t> recv_counts, DType t,
                                           DeviceStream s = {}) {
    return start_all_to_all_v(in, send_counts, out, recv_counts, t, s);
  }

  // --- Blocking forms: the async form, then a bounded wait ---
  void all_reduce(void* data, size_t n, DType t) { all_reduce_async(data, n, t)->wait(); }
  void all_gather(const void* in, void* out, size_t n, DType t) {
    all_gather_async(in, out, n, t)->wait();
  }
  void reduce_scatter(const void* in, void* out, size_t n, DType t) {
    reduce_scatter_async(in, out, n, t)->wait();
  }
  void reduce_scatter_v(const void* in, void* out, std::span<const size_t> counts, DType t) {
    reduce_scatter_v_async(in, out, counts, t)->wait();
  }
  void all_gather_v(const void* in, void* out, std::span<const size_t> counts, DType t) {
    all_gather_v_async(in, out, counts, t)->wait();
  }
  void broadcast(void* data, size_t n, DType t, int root) {
    broadcast_async(data, n, t, root)->wait();
  }
  void batch(std::span<const P2P> ops) { batch_async(ops)->wait(); }
  void barrier() { barrier_async()->wait(); }
  void all_to_all_v(const void* in, std::span<const size_t> send_counts, void* out,
                    std::span<const size_t> recv_counts, DType t) {
    all_to_all_v_async(in, send_counts, out, recv_counts, t)->wait();
  }

  // --- float32 shorthands (the interface before DType) ---
  void all_reduce(float* data, size_t n) { all_reduce(data, n, DType::kF32); }
  void all_gather(const float* in, float* out, size_t n) { all_gather(in, out, n, DType::kF32); }
  void reduce_scatter(const float* in, float* out, size_t n) {
    reduce_scatter(in, out, n, DType::kF32);
  }
  void broadcast(float* data, size_t n, int root) { broadcast(data, n, DType::kF32, root); }

  // The ranks with equal `color` form a new group, ordered by `key`, named `name` (default
  // "<this name>/<color>") and with this timeout. Collective over this group and not bounded by
  // the timeout (MPI has no non-blocking split).
  std::unique_ptr<Communicator> split(int color, int key, std::string name = {});

 protected:
  Communicator();
  virtual std::unique_ptr<Communicator> make_split(int color, int key) = 0;
  virtual std::unique_ptr<Work> start_all_reduce(void* data, size_t n, DType t, DeviceStream s) = 0;
  virtual std::unique_ptr<Work> start_all_gather(const void* in, void* out, size_t n, DType t,
                                                 DeviceStream s) = 0;
  virtual std::unique_ptr<Work> start_reduce_scatter(const void* in, void* out, size_t n, DType t,
                                                     DeviceStream s) = 0;
  virtual std::unique_ptr<Work> start_broadcast(void* data, size_t n, DType t, int root,
                                                DeviceStream s) = 0;
  virtual std::unique_ptr<Work> start_batch(std::span<const P2P> ops, DeviceStream s) = 0;
  virtual std::unique_ptr<Work> start_barrier() = 0;
  // Communicators without an all-to-all (test doubles, the calibration's recorder) throw
  // std::logic_error from this default.
  virtual std::unique_ptr<Work> start_all_to_all_v(const void* in,
                                                   std::span<const size_t> send_counts, void* out,
                                                   std::span<const size_t> recv_counts, DType t,
                                                   DeviceStream s);
  // Likewise without the uneven reduce-scatter and all-gather.
  virtual std::unique_ptr<Work> start_reduce_scatter_v(const void* in, void* out,
                                                       std::span<const size_t> counts, DType t,
                                                       DeviceStream s);
  virtual std::unique_ptr<Work> start_all_gather_v(const void* in, void* out,
                                                   std::span<const size_t> counts, DType t,
                                                   DeviceStream s);

 private:
  std::string name_ = "world";
  CommDuration timeout_;
};

// Host-side exchanges over a group, separate from the data plane's traffic: every call is
// collective over the group and bounded by timeout() like Communicator's waits.
class ControlPlane {
 public:
  virtual ~ControlPlane() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }
  CommDuration timeout() const { return timeout_; }
  void set_timeout(CommDuration t) { timeout_ = t; }

  // Each rank's flag, indexed by rank.
  virtual std::vector<bool> all_gather_flags(bool flag) = 0;
  // The lowest rank that says failed, or -1 when none does.
  int agree(bool failed);
  // Exact integer sum.
  virtual int64_t sum(int64_t x) = 0;
  virtual int64_t max(int64_t x) = 0;
  // Sum added in rank order, so every rank gets the same bits whatever the reduction tree.
  virtual double sum(double x) = 0;
  virtual double max(double x) = 0;
  // Each rank's bytes (sizes may differ between ranks), indexed by rank.
  virtual std::vector<std::vector<uint8_t>> all_gather_bytes(const std::vector<uint8_t>& mine) = 0;
  virtual void barrier() = 0;
  // As Communicator::split (not bounded by the timeout).
  std::unique_ptr<ControlPlane> split(int color, int key, std::string name = {});

 protected:
  ControlPlane();
  virtual std::unique_ptr<ControlPlane> make_split(int color, int key) = 0;

 private:
  std::string name_ = "world";
  CommDuration timeout_;
};

// A group of one rank: collectives are copies, point-to-point is an error.
std::unique_ptr<Communicator> make_self_communicator();
std::unique_ptr<ControlPlane> make_self_control_plane();

// MPI's COMM_WORLD (MPI_Init on first use, MPI_Finalize at exit); null when ptdp was built
// without MPI. The control plane runs on its own duplicate of COMM_WORLD.
std::unique_ptr<Communicator> make_mpi_world();
std::unique_ptr<ControlPlane> make_mpi_control_plane();
bool mpi_available();

}  // namespace ptdp
