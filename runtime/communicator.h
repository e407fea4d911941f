// Communicator: the collectives and point-to-point transfers the runtime needs, over one group
// of ranks. Backends: MPI (CPU ranks; OpenMPI is also the launcher) and, with the CUDA issue,
// NCCL, behind this same interface. Reductions sum. Buffers are float32.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

namespace ptdp {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // within this group
  virtual int size() const = 0;

  virtual void all_reduce(float* data, size_t n) = 0;
  // in: n floats from each rank; out: size() * n floats, rank-major.
  virtual void all_gather(const float* in, float* out, size_t n) = 0;
  // in: size() * n floats; out: this rank's n-float block of the element-wise sum.
  virtual void reduce_scatter(const float* in, float* out, size_t n) = 0;
  virtual void broadcast(float* data, size_t n, int root) = 0;
  virtual void barrier() = 0;

  // Point-to-point operations posted together and waited on as one batch (like PyTorch's
  // batch_isend_irecv followed by a wait); peers are ranks of this group.
  struct P2P {
    bool send = true;
    float* data = nullptr;
    size_t n = 0;
    int peer = 0;
    int tag = 0;
  };
  virtual void batch(std::span<const P2P> ops) = 0;

  // The ranks with equal `color` form a new group, ordered by `key`.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
};

// A group of one rank: collectives are copies, point-to-point is an error.
std::unique_ptr<Communicator> make_self_communicator();

// MPI's COMM_WORLD (MPI_Init on first use, MPI_Finalize at exit); null when ptdp was built
// without MPI.
std::unique_ptr<Communicator> make_mpi_world();
bool mpi_available();

}  // namespace ptdp
