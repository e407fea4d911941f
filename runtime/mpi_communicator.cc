// The MPI backend of Communicator (OpenMPI from Debian).
#include <mpi.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/communicator.h"

namespace ptdp {
namespace {

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw std::runtime_error(std::string(what) + ": " + std::string(msg, static_cast<size_t>(len)));
  }
}

int count(size_t n) {
  if (n > static_cast<size_t>(INT32_MAX)) throw std::length_error("MPI message too large");
  return static_cast<int>(n);
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce(float* data, size_t n) override {
    check(MPI_Allreduce(MPI_IN_PLACE, data, count(n), MPI_FLOAT, MPI_SUM, comm_), "all-reduce");
  }
  void all_gather(const float* in, float* out, size_t n) override {
    check(MPI_Allgather(in, count(n), MPI_FLOAT, out, count(n), MPI_FLOAT, comm_), "all-gather");
  }
  void reduce_scatter(const float* in, float* out, size_t n) override {
    check(MPI_Reduce_scatter_block(in, out, count(n), MPI_FLOAT, MPI_SUM, comm_), "reduce-scatter");
  }
  void broadcast(float* data, size_t n, int root) override {
    check(MPI_Bcast(data, count(n), MPI_FLOAT, root, comm_), "broadcast");
  }
  void barrier() override { check(MPI_Barrier(comm_), "barrier"); }
  void batch(std::span<const P2P> ops) override {
    std::vector<MPI_Request> reqs(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
      const P2P& o = ops[i];
      if (o.send)
        check(MPI_Isend(o.data, count(o.n), MPI_FLOAT, o.peer, o.tag, comm_, &reqs[i]), "send");
      else
        check(MPI_Irecv(o.data, count(o.n), MPI_FLOAT, o.peer, o.tag, comm_, &reqs[i]), "recv");
    }
    check(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE), "wait");
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm sub;
    check(MPI_Comm_split(comm_, color, key, &sub), "split");
    return std::make_unique<MpiCommunicator>(sub, true);
  }

 private:
  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool mpi_available() {
  return true;
}

std::unique_ptr<Communicator> make_mpi_world() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    std::atexit(finalize_at_exit);
  }
  // Errors come back as codes (and become exceptions) instead of aborting in MPI.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, false);
}

}  // namespace ptdp
