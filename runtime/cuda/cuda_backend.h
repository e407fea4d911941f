// The CUDA backend of ptdp run (runtime/backend.h): a rank's parameters, gradients, optimizer
// states and activations in the memory of one GPU, its kernels queued on one stream.
//
// Arithmetic: fp32 throughout, as the CPU backend, so a run on the GPU can be checked against
// the CPU backend's losses step by step. GEMMs are cuBLAS SGEMMs (TF32 tensor cores only when
// PTDP_CUDA_MATH=tf32 or bf16, docs/gpu.md); the rest are the kernels of
// runtime/cuda/fp32_kernels.h. With mixed precision (--bf16) the typed calls run natively on
// bf16: cuBLAS with bf16 operands, the bf16 kernels of kernels/cuda/ (flash attention, norms,
// GELU, SwiGLU) and the fp32 kernels' bf16-storage twins (docs/gpu.md).
//
// Device choice: the local rank (OMPI_COMM_WORLD_LOCAL_RANK, else LOCAL_RANK, else 0) modulo the
// number of visible devices, so several ranks may share one GPU; their data plane then goes
// through host memory (make_host_staged_communicator in runtime/staged_communicator.h).
#pragma once

#include <memory>

#include "runtime/backend.h"

namespace ptdp {

// Throws InputError naming --backend when no CUDA device is visible. The backend registers its
// memory as the space of new Buffers (runtime/tensor.h) while it lives.
std::unique_ptr<Backend> make_cuda_backend();

}  // namespace ptdp
