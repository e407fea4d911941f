// The public flash-attention entry points (kernels/cuda/attention.h): shape checks, then the
// tensor-core or the CUDA-core implementation.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_tile.cuh"

namespace ptdp::kernels::cuda {
namespace {

bool aligned16(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

// Whether the current device has the tensor-core instructions of attention_mma.cu (sm_80+).
bool device_has_bf16_mma() {
  int device = 0, major = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
        "cudaDeviceGetAttribute");
  return major >= 8;
}

// kDefault resolved; `aligned`: every pointer of the call is 16-byte aligned.
FlashKernel resolve(FlashKernel kernel, bool aligned) {
  if (kernel == FlashKernel::kDefault) {
    const char* env = std::getenv("PTDP_FLASH_KERNEL");
    if (env && *env) {
      if (std::strcmp(env, "simt") == 0) return FlashKernel::kSimt;
      if (std::strcmp(env, "mma") != 0)
        throw std::invalid_argument(std::string("PTDP_FLASH_KERNEL: '") + env +
                                    "' is not mma or simt");
      kernel = FlashKernel::kTensorCore;
    } else {
      return aligned && device_has_bf16_mma() ? FlashKernel::kTensorCore : FlashKernel::kSimt;
    }
  }
  if (kernel == FlashKernel::kTensorCore) {
    if (!aligned)
      throw std::invalid_argument(
          "flash attention: the tensor-core kernel needs 16-byte aligned "
          "q, k, v, out and gradients");
    if (!device_has_bf16_mma())
      throw std::invalid_argument("flash attention: the tensor-core kernel needs sm_80 or later");
  }
  return kernel;
}

}  // namespace

void flash_attention_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse,
                             int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk, int64_t d,
                             cudaStream_t stream, FlashKernel kernel) {
  attention::check_shape(b, sq, sk, hq, hk, d);
  if (b <= 0 || sq <= 0 || hq <= 0) return;
  const bool aligned = aligned16(q) && aligned16(k) && aligned16(v) && aligned16(out);
  if (resolve(kernel, aligned) == FlashKernel::kTensorCore)
    attention::mma_forward(q, k, v, out, lse, b, sq, sk, hq, hk, d, stream);
  else
    attention::simt_forward(q, k, v, out, lse, b, sq, sk, hq, hk, d, stream);
}

void flash_attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                              const float* lse, const bf16* dout, bf16* dq, bf16* dk, bf16* dv,
                              int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk, int64_t d,
                              cudaStream_t stream, FlashKernel kernel) {
  attention::check_shape(b, sq, sk, hq, hk, d);
  if (b <= 0 || sk <= 0 || hq <= 0) return;
  if (sq == 0) {  // no query sees a key: the key and value gradients are zero
    const size_t bytes = sizeof(bf16) * static_cast<size_t>(b * sk * hk * d);
    check(cudaMemsetAsync(dk, 0, bytes, stream), "cudaMemsetAsync");
    check(cudaMemsetAsync(dv, 0, bytes, stream), "cudaMemsetAsync");
    return;
  }
  bool aligned = true;
  for (const void* p :
       {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v),
        static_cast<const void*>(out), static_cast<const void*>(dout), static_cast<const void*>(dq),
        static_cast<const void*>(dk), static_cast<const void*>(dv)})
    aligned = aligned && aligned16(p);
  if (resolve(kernel, aligned) == FlashKernel::kTensorCore)
    attention::mma_backward(q, k, v, out, lse, dout, dq, dk, dv, b, sq, sk, hq, hk, d, stream);
  else
    attention::simt_backward(q, k, v, out, lse, dout, dq, dk, dv, b, sq, sk, hq, hk, d, stream);
}

}  // namespace ptdp::kernels::cuda
