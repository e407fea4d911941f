// The NCCL communicator (runtime/cuda/nccl_communicator.h).
#include "runtime/cuda/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/common.h"
#include "runtime/watchdog.h"

namespace ptdp {
namespace {

using Clock = std::chrono::steady_clock;

CommDuration since(Clock::time_point start) {
  return std::chrono::duration_cast<CommDuration>(Clock::now() - start);
}

void check_cuda(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess)
    throw std::runtime_error("nccl communicator: " + what + ": " + cudaGetErrorString(e));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
    case DType::kF64:
      return ncclFloat64;
  }
  throw std::invalid_argument("nccl communicator: unknown element type");
}

// One NCCL communicator and what its operations share. Destroyed with the last Work or
// Communicator holding it.
struct Comm {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1, device = 0;
  cudaStream_t stream = nullptr;   // the communicator's own
  cudaStream_t compute = nullptr;  // the backend's: each operation waits for it first
  cudaEvent_t ready = nullptr;
  void* scratch = nullptr;  // one float for the barrier's all-reduce
  bool broken = false;      // timed out or failed: abort, do not finalize
  CommDuration timeout{300};

  Comm(int dev, cudaStream_t compute_stream, CommDuration t)
      : device(dev), compute(compute_stream), timeout(t) {
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaMalloc(&scratch, sizeof(float)), "cudaMalloc");
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  ~Comm() {
    cudaSetDevice(device);
    if (comm) {
      if (!broken && finalize()) {
        ncclCommDestroy(comm);
      } else {
        ncclCommAbort(comm);
      }
    }
    if (scratch) cudaFree(scratch);
    if (ready) cudaEventDestroy(ready);
    if (stream) cudaStreamDestroy(stream);
  }

  // The communicator's asynchronous state: ncclSuccess, ncclInProgress or an error.
  ncclResult_t state() const {
    ncclResult_t s = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &s);
    return r == ncclSuccess ? s : r;
  }

  // Polls until the calls made so far have been taken up (non-blocking communicators answer
  // ncclInProgress meanwhile), at most `timeout`.
  void settle(const std::string& group, const std::string& op) {
    if (!comm) return;  // a call that makes no communicator (the unique id) completes at once
    const auto start = Clock::now();
    for (;;) {
      const ncclResult_t s = state();
      if (s == ncclSuccess) return;
      if (s != ncclInProgress) {
        broken = true;
        throw std::runtime_error("nccl: " + op + " in group '" + group +
                                 "' failed: " + ncclGetErrorString(s));
      }
      if (since(start) > timeout) {
        broken = true;
        throw CommTimeout(group, op, {}, since(start),
                          "NCCL has not finished setting it up (a peer is missing or stopped)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // The result of an NCCL call: success, in progress (then settled), or an error.
  void call(ncclResult_t r, const std::string& group, const std::string& op) {
    if (r == ncclSuccess || r == ncclInProgress) {
      settle(group, op);
      return;
    }
    broken = true;
    throw std::runtime_error("nccl: " + op + " in group '" + group + "': " + ncclGetErrorString(r));
  }

 private:
  // Flushes the communicator's operations (bounded); false if it did not finish.
  bool finalize() {
    if (ncclCommFinalize(comm) == ncclSuccess || state() == ncclInProgress) {
      const auto start = Clock::now();
      while (state() == ncclInProgress) {
        if (since(start) > timeout) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    return state() == ncclSuccess;
  }
};

// Non-blocking, so that every wait is bounded here. PTDP_NCCL_BLOCKING=1 makes NCCL's calls
// blocking instead (their waits are then NCCL's, unbounded): a diagnosis of NCCL's
// non-blocking paths (scripts/gpu-check.sh), not for training.
ncclConfig_t non_blocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  const char* b = std::getenv("PTDP_NCCL_BLOCKING");
  const std::string blocking = b ? b : "0";
  if (blocking != "0" && blocking != "1")
    throw InputError("PTDP_NCCL_BLOCKING", "must be 0 or 1, not '" + blocking + "'");
  config.blocking = blocking == "1" ? 1 : 0;
  return config;
}

bool device_memory(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // older runtimes flag unregistered host memory as an error
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

// An operation in flight: completes when its stream passes the event recorded after it; then
// `finish` runs once (host outputs downloaded, temporaries freed).
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<Comm> c, cudaStream_t stream, std::string group, std::string op,
           CommDuration timeout, std::function<void()> finish)
      : c_(std::move(c)),
        group_(std::move(group)),
        op_(std::move(op)),
        timeout_(timeout),
        finish_(std::move(finish)) {
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(event_, stream), "cudaEventRecord");
  }
  ~NcclWork() override {
    if (!done_) {
      try {
        wait();
      } catch (const std::exception& e) {
        std::cerr << "ptdp: abandoning " << op_ << " in group '" << group_ << "': " << e.what()
                  << "\n";
      }
    }
    cudaEventDestroy(event_);
  }
  bool test() override {
    if (done_) return true;
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) {
      done_ = true;
      if (finish_) finish_();
      return true;
    }
    if (e != cudaErrorNotReady) {
      c_->broken = true;
      check_cuda(e, op_ + " in group '" + group_ + "'");
    }
    const ncclResult_t s = c_->state();
    if (s != ncclSuccess && s != ncclInProgress) {
      c_->broken = true;
      throw std::runtime_error("nccl: " + op_ + " in group '" + group_ +
                               "' failed: " + ncclGetErrorString(s));
    }
    return false;
  }
  void wait() override { wait(timeout_); }
  // Bounded by `timeout`; every stall timeout meanwhile the watchdog pings the other ranks, and
  // stops the job naming any that does not answer (runtime/watchdog.h), as MPI waits do.
  void wait(CommDuration timeout) override {
    const auto start = Clock::now();
    const CommDuration stall = stall_timeout();
    CommDuration next_check = stall;
    while (!test()) {
      if (since(start) > next_check && watchdog_active()) {
        watchdog_check_peers(group_, op_, since(start), "NCCL operation not completed");
        next_check = since(start) + stall;
      }
      if (since(start) > timeout) {
        c_->broken = true;  // the communicator is aborted, not finalized, when it goes
        throw CommTimeout(group_, op_, {}, since(start),
                          "the NCCL operation has not completed on this GPU (a peer stopped or "
                          "is not calling it)");
      }
      if (since(start) > CommDuration(1e-3))
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  std::shared_ptr<Comm> c_;
  std::string group_, op_;
  CommDuration timeout_;  // the communicator's when the operation was posted
  std::function<void()> finish_;
  cudaEvent_t event_ = nullptr;
  bool done_ = false;
};

// Device pointers used as they are; host ones staged through device temporaries.
class Staging {
 public:
  Staging(Comm& c, cudaStream_t st) : c_(c), st_(st) {}
  // The device address standing in for `p` (n bytes), its bytes uploaded when `input`.
  void* in(const void* p, size_t bytes) { return stage(const_cast<void*>(p), bytes, true, false); }
  void* out(void* p, size_t bytes) { return stage(p, bytes, false, true); }
  void* in_out(void* p, size_t bytes) { return stage(p, bytes, true, true); }
  // A device temporary of `bytes`, freed when the operation completes.
  void* temporary(size_t bytes) {
    // (kernels::cuda::allocate_async: out of memory, the backend's cached blocks go first)
    void* d = kernels::cuda::allocate_async(bytes, st_);
    temps_.push_back(d);
    return d;
  }
  // What runs when the operation has completed: downloads, then frees.
  std::function<void()> finish() {
    return [downloads = std::move(downloads_), temps = std::move(temps_), dev = c_.device]() {
      cudaSetDevice(dev);
      for (const auto& [host, device, bytes] : downloads)
        check_cuda(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), "download");
      for (void* t : temps) cudaFree(t);
    };
  }

 private:
  void* stage(void* p, size_t bytes, bool upload, bool download) {
    if (bytes == 0 || device_memory(p)) return p;
    void* d = temporary(bytes);
    if (upload) check_cuda(cudaMemcpyAsync(d, p, bytes, cudaMemcpyHostToDevice, st_), "upload");
    if (download) downloads_.push_back({p, d, bytes});
    return d;
  }
  struct Download {
    void* host;
    void* device;
    size_t bytes;
  };
  Comm& c_;
  cudaStream_t st_;
  std::vector<Download> downloads_;
  std::vector<void*> temps_;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(std::shared_ptr<Comm> c) : c_(std::move(c)) {
    set_timeout(c_->timeout);
  }
  int rank() const override { return c_->rank; }
  int size() const override { return c_->size; }

 protected:
  std::unique_ptr<Communicator> make_split(int color, int key) override {
    auto child = std::make_shared<Comm>(c_->device, c_->compute, timeout());
    ncclConfig_t config = non_blocking_config();
    c_->call(ncclCommSplit(c_->comm, color, key, &child->comm, &config), name(), "split");
    if (!child->comm) throw std::runtime_error("nccl: split of '" + name() + "' gave no group");
    child->call(ncclSuccess, name() + "/" + std::to_string(color), "split");
    child->call(ncclCommCount(child->comm, &child->size), name(), "split");
    child->call(ncclCommUserRank(child->comm, &child->rank), name(), "split");
    return std::make_unique<NcclCommunicator>(std::move(child));
  }

  std::unique_ptr<Work> start_all_reduce(void* data, size_t n, DType t, DeviceStream s) override {
    return run("all-reduce", s, [&](cudaStream_t st, Staging& io) {
      void* d = io.in_out(data, n * dtype_bytes(t));
      return ncclAllReduce(d, d, n, nccl_type(t), ncclSum, c_->comm, st);
    });
  }
  std::unique_ptr<Work> start_all_gather(const void* in, void* out, size_t n, DType t,
                                         DeviceStream s) override {
    return run("all-gather", s, [&](cudaStream_t st, Staging& io) {
      const size_t bytes = n * dtype_bytes(t);
      return ncclAllGather(io.in(in, bytes), io.out(out, bytes * size()), n, nccl_type(t), c_->comm,
                           st);
    });
  }
  std::unique_ptr<Work> start_reduce_scatter(const void* in, void* out, size_t n, DType t,
                                             DeviceStream s) override {
    return run("reduce-scatter", s, [&](cudaStream_t st, Staging& io) {
      const size_t bytes = n * dtype_bytes(t);
      if (in != out) {
        return ncclReduceScatter(io.in(in, bytes * size()), io.out(out, bytes), n, nccl_type(t),
                                 ncclSum, c_->comm, st);
      }
      // In place, the block at the start of the buffer (NCCL's own in-place form puts it at
      // rank * n): reduce into a temporary, then copy it to the start.
      void* whole = io.in_out(out, bytes * size());
      void* block = io.temporary(bytes);
      c_->call(ncclReduceScatter(whole, block, n, nccl_type(t), ncclSum, c_->comm, st), name(),
               "reduce-scatter");
      check_cuda(cudaMemcpyAsync(whole, block, bytes, cudaMemcpyDeviceToDevice, st),
                 "reduce-scatter copy");
      return ncclSuccess;
    });
  }
  // One ncclReduce to each rank's block, grouped so that they run as one operation.
  std::unique_ptr<Work> start_reduce_scatter_v(const void* in, void* out,
                                               std::span<const size_t> counts, DType t,
                                               DeviceStream s) override {
    const size_t all = total(counts);  // checks the counts before anything is queued
    return run("reduce-scatter", s, [&](cudaStream_t st, Staging& io) {
      const size_t eb = dtype_bytes(t);
      if (in == out) {
        // In place: each block's reduce writes only its root's own block, where it is.
        char* whole = static_cast<char*>(io.in_out(out, all * eb));
        size_t own = 0;
        for (int r = 0; r < rank(); ++r) own += counts[static_cast<size_t>(r)];
        return grouped_blocks(counts, [&](int root, size_t at, size_t n) {
          return ncclReduce(whole + at * eb, whole + own * eb, n, nccl_type(t), ncclSum, root,
                            c_->comm, st);
        });
      }
      const char* src = static_cast<const char*>(io.in(in, all * eb));
      void* dst = io.out(out, counts[static_cast<size_t>(rank())] * eb);
      return grouped_blocks(counts, [&](int root, size_t at, size_t n) {
        return ncclReduce(src + at * eb, dst, n, nccl_type(t), ncclSum, root, c_->comm, st);
      });
    });
  }
  // One ncclBroadcast from each rank into its block, grouped (in place where `in` is the block).
  std::unique_ptr<Work> start_all_gather_v(const void* in, void* out,
                                           std::span<const size_t> counts, DType t,
                                           DeviceStream s) override {
    const size_t all = total(counts);  // checks the counts before anything is queued
    return run("all-gather", s, [&](cudaStream_t st, Staging& io) {
      const size_t eb = dtype_bytes(t);
      char* dst = static_cast<char*>(io.out(out, all * eb));
      // A device `in` is used as it is (in place when it is this rank's block of a device out).
      const void* src = io.in(in, counts[static_cast<size_t>(rank())] * eb);
      return grouped_blocks(counts, [&](int root, size_t at, size_t n) {
        return ncclBroadcast(root == rank() ? src : dst + at * eb, dst + at * eb, n, nccl_type(t),
                             root, c_->comm, st);
      });
    });
  }
  std::unique_ptr<Work> start_broadcast(void* data, size_t n, DType t, int root,
                                        DeviceStream s) override {
    return run("broadcast", s, [&](cudaStream_t st, Staging& io) {
      void* d = io.in_out(data, n * dtype_bytes(t));
      return ncclBroadcast(d, d, n, nccl_type(t), root, c_->comm, st);
    });
  }
  std::unique_ptr<Work> start_batch(std::span<const P2P> ops, DeviceStream s) override {
    return run("send/recv", s, [&](cudaStream_t st, Staging& io) {
      ncclResult_t r = ncclGroupStart();
      for (const P2P& p : ops) {
        if (r != ncclSuccess) break;
        const size_t bytes = p.n * dtype_bytes(p.dtype);
        r = p.send ? ncclSend(io.in(p.data, bytes), p.n, nccl_type(p.dtype), p.peer, c_->comm, st)
                   : ncclRecv(io.out(p.data, bytes), p.n, nccl_type(p.dtype), p.peer, c_->comm, st);
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }
  std::unique_ptr<Work> start_barrier() override {
    return run("barrier", {}, [&](cudaStream_t st, Staging&) {
      return ncclAllReduce(c_->scratch, c_->scratch, 1, ncclFloat32, ncclSum, c_->comm, st);
    });
  }
  std::unique_ptr<Work> start_all_to_all_v(const void* in, std::span<const size_t> send_counts,
                                           void* out, std::span<const size_t> recv_counts, DType t,
                                           DeviceStream s) override {
    if (send_counts.size() != static_cast<size_t>(size()) ||
        recv_counts.size() != static_cast<size_t>(size()))
      throw std::invalid_argument("nccl all-to-all: one count per rank expected");
    return run("all-to-all", s, [&](cudaStream_t st, Staging& io) {
      const size_t eb = dtype_bytes(t);
      size_t sent = 0, received = 0;
      for (int r = 0; r < size(); ++r) sent += send_counts[r], received += recv_counts[r];
      const char* src = static_cast<const char*>(io.in(in, sent * eb));
      char* dst = static_cast<char*>(io.out(out, received * eb));
      ncclResult_t r = ncclGroupStart();
      size_t so = 0, ro = 0;
      for (int peer = 0; peer < size() && r == ncclSuccess; ++peer) {
        if (send_counts[peer] > 0)
          r = ncclSend(src + so * eb, send_counts[peer], nccl_type(t), peer, c_->comm, st);
        if (r == ncclSuccess && recv_counts[peer] > 0)
          r = ncclRecv(dst + ro * eb, recv_counts[peer], nccl_type(t), peer, c_->comm, st);
        so += send_counts[peer];
        ro += recv_counts[peer];
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

 private:
  size_t total(std::span<const size_t> counts) const {
    if (counts.size() != static_cast<size_t>(size()))
      throw std::invalid_argument("nccl: one count per rank expected in group '" + name() + "'");
    size_t sum = 0;
    for (size_t c : counts) sum += c;
    return sum;
  }
  // f(root, offset, count) for each rank's non-empty block (blocks in rank order), inside one
  // NCCL group; the first error, else the group's.
  template <typename F>
  static ncclResult_t grouped_blocks(std::span<const size_t> counts, F f) {
    ncclResult_t r = ncclGroupStart();
    size_t at = 0;
    for (size_t root = 0; root < counts.size() && r == ncclSuccess; at += counts[root++])
      if (counts[root] > 0) r = f(static_cast<int>(root), at, counts[root]);
    const ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
  }
  // Orders the operation after the compute stream's work, enqueues it, and returns its Work.
  template <typename Enqueue>
  std::unique_ptr<Work> run(const char* op, DeviceStream s, Enqueue enqueue) {
    check_cuda(cudaSetDevice(c_->device), "cudaSetDevice");
    cudaStream_t st = s.native ? static_cast<cudaStream_t>(s.native) : c_->stream;
    check_cuda(cudaEventRecord(c_->ready, c_->compute), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(st, c_->ready, 0), "cudaStreamWaitEvent");
    Staging io(*c_, st);
    c_->call(enqueue(st, io), name(), op);
    return std::make_unique<NcclWork>(c_, st, name(), op, timeout(), io.finish());
  }

  std::shared_ptr<Comm> c_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(ControlPlane& control, int device,
                                                     void* compute_stream, CommDuration timeout) {
  // A libnccl of an older minor release than the nccl.h compiled against may lack what the
  // header declares; refuse that pairing, naming both versions. (Codes are major * 10000 +
  // minor * 100 + patch; an older patch release has the same interface.)
  int runtime_version = 0;
  if (ncclGetVersion(&runtime_version) == ncclSuccess &&
      runtime_version / 100 < NCCL_VERSION_CODE / 100)
    throw std::runtime_error("nccl: the library loaded is version " + nccl_version() +
                             ", older than the nccl.h ptdp was built with (" +
                             std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
                             std::to_string(NCCL_PATCH) + "); PTDP_DATA_PLANE=staged avoids NCCL");
  auto c = std::make_shared<Comm>(device, static_cast<cudaStream_t>(compute_stream), timeout);
  c->rank = control.rank();
  c->size = control.size();
  ncclUniqueId id{};
  if (std::getenv("NCCL_COMM_ID") || control.size() == 1) {
    c->call(ncclGetUniqueId(&id), control.name(), "unique id");
  } else {
    std::vector<uint8_t> mine;
    if (control.rank() == 0) {
      c->call(ncclGetUniqueId(&id), control.name(), "unique id");
      mine.assign(reinterpret_cast<const uint8_t*>(&id),
                  reinterpret_cast<const uint8_t*>(&id) + sizeof id);
    }
    const auto all = control.all_gather_bytes(mine);
    if (all.empty() || all[0].size() != sizeof id)
      throw std::runtime_error("nccl: rank 0's unique id did not arrive");
    std::memcpy(&id, all[0].data(), sizeof id);
  }
  ncclConfig_t config = non_blocking_config();
  const ncclResult_t r = ncclCommInitRankConfig(&c->comm, c->size, id, c->rank, &config);
  c->call(r, control.name(), "init");
  auto world = std::make_unique<NcclCommunicator>(std::move(c));
  world->set_name(control.name());
  return world;
}

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X, Y, Z): X * 10000 + Y * 100 + Z from 2.9 on.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

}  // namespace ptdp
