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

}  // namespace ptdp::kernels::cuda
