#include "kernels/cuda/common.h"

#include <stdexcept>
#include <string>

namespace ptdp::kernels::cuda {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

int device_count(const char** why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = cudaGetErrorString(e);
    (void)cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  if (n == 0 && why) *why = "cudaGetDeviceCount returned 0";
  return n;
}

namespace {
OutOfMemoryHandler oom_handler = nullptr;
void* oom_context = nullptr;
}  // namespace

void set_out_of_memory_handler(OutOfMemoryHandler handler, void* context) {
  oom_handler = handler;
  oom_context = context;
}

void* allocate_async(size_t bytes, cudaStream_t stream) {
  void* p = nullptr;
  cudaError_t e = cudaMallocAsync(&p, bytes, stream);
  if (e == cudaErrorMemoryAllocation && oom_handler) {
    (void)cudaGetLastError();  // not sticky; cleared so the retry's status is its own
    oom_handler(oom_context);
    e = cudaMallocAsync(&p, bytes, stream);
  }
  check(e, "cudaMallocAsync");
  return p;
}

}  // namespace ptdp::kernels::cuda
