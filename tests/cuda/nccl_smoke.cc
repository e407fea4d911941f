// nccl_smoke: NCCL alone, without ptdp's communicator, on one GPU in a group of one rank. Each
// step prints a line before and after it (flushed), so that a crash inside NCCL shows where it
// happened; scripts/gpu-check.sh runs it in every mode when nccl_communicator_test fails, to
// tell an NCCL or machine fault from one in ptdp's use of NCCL (docs/gpu.md).
//
// Usage: nccl_smoke blocking|nonblocking [split]
// Exit status: 0 when every step passed, 1 when a step returned an error (named on stderr).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

namespace {

bool blocking = true;

// Waits for a non-blocking communicator's calls to be taken up, at most 60 s.
ncclResult_t settle(ncclComm_t comm) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) return ncclInProgress;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

bool step(const char* what, ncclResult_t r, ncclComm_t comm = nullptr) {
  if (r == ncclInProgress && comm) r = settle(comm);
  if (r == ncclSuccess) {
    std::printf("nccl_smoke: %s: ok\n", what);
    std::fflush(stdout);
    return true;
  }
  std::fprintf(stderr, "nccl_smoke: %s: %s\n", what, ncclGetErrorString(r));
  return false;
}

bool cuda(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "nccl_smoke: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

void starting(const char* what) {
  std::printf("nccl_smoke: %s ...\n", what);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || (std::strcmp(argv[1], "blocking") != 0 && std::strcmp(argv[1], "nonblocking"))) {
    std::fprintf(stderr, "usage: nccl_smoke blocking|nonblocking [split]\n");
    return 2;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines in order with stderr's in one log
  blocking = std::strcmp(argv[1], "blocking") == 0;
  const bool split = argc > 2 && std::strcmp(argv[2], "split") == 0;
  int version = 0;
  ncclGetVersion(&version);
  std::printf("nccl_smoke: header %d.%d.%d, library code %d, %s%s\n", NCCL_MAJOR, NCCL_MINOR,
              NCCL_PATCH, version, blocking ? "blocking" : "non-blocking", split ? ", split" : "");
  int devices = 0;
  if (!cuda("cudaGetDeviceCount", cudaGetDeviceCount(&devices)) || devices == 0) {
    std::fprintf(stderr, "nccl_smoke: no CUDA device\n");
    return 1;
  }
  if (!cuda("cudaSetDevice", cudaSetDevice(0))) return 1;
  cudaStream_t stream = nullptr;
  float* x = nullptr;
  if (!cuda("cudaStreamCreate", cudaStreamCreate(&stream)) ||
      !cuda("cudaMalloc", cudaMalloc(&x, 1024 * sizeof(float))) ||
      !cuda("cudaMemset", cudaMemset(x, 0, 1024 * sizeof(float))))
    return 1;

  ncclUniqueId id;
  starting("ncclGetUniqueId");
  if (!step("ncclGetUniqueId", ncclGetUniqueId(&id))) return 1;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = blocking ? 1 : 0;
  ncclComm_t comm = nullptr;
  starting("ncclCommInitRankConfig");
  const ncclResult_t init = ncclCommInitRankConfig(&comm, 1, id, 0, &config);
  if (!step("ncclCommInitRankConfig", init, comm)) return 1;

  ncclComm_t use = comm, child = nullptr;
  if (split) {
    starting("ncclCommSplit");
    ncclConfig_t child_config = NCCL_CONFIG_INITIALIZER;
    child_config.blocking = config.blocking;
    const ncclResult_t r = ncclCommSplit(comm, 0, 0, &child, &child_config);
    if (!step("ncclCommSplit (parent)", r, comm)) return 1;
    if (!child || !step("ncclCommSplit (child)", settle(child))) return 1;
    use = child;
  }
  starting("ncclAllReduce");
  if (!step("ncclAllReduce", ncclAllReduce(x, x, 1024, ncclFloat32, ncclSum, use, stream), use))
    return 1;
  starting("cudaStreamSynchronize");
  if (!cuda("cudaStreamSynchronize", cudaStreamSynchronize(stream))) return 1;
  std::printf("nccl_smoke: all-reduce completed\n");
  if (child) {
    starting("child finalize and destroy");
    if (!step("ncclCommFinalize (child)", ncclCommFinalize(child), child) ||
        !step("ncclCommDestroy (child)", ncclCommDestroy(child)))
      return 1;
  }
  starting("finalize and destroy");
  if (!step("ncclCommFinalize", ncclCommFinalize(comm), comm) ||
      !step("ncclCommDestroy", ncclCommDestroy(comm)))
    return 1;
  cudaFree(x);
  cudaStreamDestroy(stream);
  std::printf("nccl_smoke: passed\n");
  return 0;
}
