// Shared by the CUDA kernels' host-side declarations: the bf16 storage type and error checking.
// Every launcher in kernels/cuda/ takes a stream, queues its work there and returns at once; a
// launch error throws std::runtime_error naming the kernel. Bad shapes throw
// std::invalid_argument before anything is queued.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace ptdp::kernels::cuda {

using bf16 = __nv_bfloat16;

// Throws std::runtime_error("<what>: <CUDA's message>") unless e is cudaSuccess.
void check(cudaError_t e, const char* what);
// The number of visible CUDA devices; 0 (and the reason in *why, when given) if none or no driver.
int device_count(const char** why = nullptr);

// cudaMallocAsync for a temporary on `stream`. When the device is out of memory, the handler set
// with set_out_of_memory_handler runs (the CUDA backend's frees the device blocks it keeps for
// reuse) and the allocation is tried once more; then std::runtime_error("cudaMallocAsync: ...").
void* allocate_async(size_t bytes, cudaStream_t stream);
// handler(context) frees what device memory it can; one per process (the backend's), null clears.
using OutOfMemoryHandler = void (*)(void* context);
void set_out_of_memory_handler(OutOfMemoryHandler handler, void* context);

}  // namespace ptdp::kernels::cuda

#define PTDP_CUDA_CHECK(call) ::ptdp::kernels::cuda::check((call), #call)
