// The CUDA runtime calls that the kernels of kernels/cuda/ and their tests make, on the host, for
// the emulated test programs (tests/cuda/emulated_cuda.h): one "device" whose memory is host
// memory, streams that run their work at once, and no failures other than the ones CUDA reports
// for bad arguments. Linked instead of libcudart.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "tests/cuda/emulated_asan.h"

namespace {

// The live allocations (start -> bytes), so cudaPointerGetAttributes can tell device memory from
// host memory as the CUDA backend and its data plane need.
std::map<std::uintptr_t, size_t>& allocations() {
  static std::map<std::uintptr_t, size_t> live;
  return live;
}
std::mutex& allocations_mutex() {
  static std::mutex m;
  return m;
}

struct FakeStream {};
// Kernels run at launch, so an event completes when it is recorded: it keeps the host time.
struct FakeEvent {
  std::chrono::steady_clock::time_point at = std::chrono::steady_clock::now();
};

}  // namespace

// The fiber switch of tests/cuda/emulated_cuda.h on x86-64: push the callee-saved registers,
// save the stack pointer, load the other fiber's, pop its registers and return into it.
#if defined(__x86_64__)
asm(R"(
  .pushsection .text
  .globl ptdp_emu_switch
  .type ptdp_emu_switch, @function
ptdp_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ptdp_emu_switch, .-ptdp_emu_switch
  .popsection
)");
#endif

struct CUstream_st : FakeStream {};
struct CUevent_st : FakeEvent {};

namespace emu {
int failing_allocations = 0;
// The next n cudaMallocAsync calls fail with cudaErrorMemoryAllocation (tests of what an
// allocation does when the device is full).
void fail_next_allocations(int n) {
  failing_allocations = n;
}
}  // namespace emu

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) {
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      break;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      break;
    case cudaDevAttrMultiProcessorCount:
      *value = 132;
      break;
    default:
      *value = 0;
  }
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) {
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  return cudaSuccess;
}
cudaError_t cudaPeekAtLastError() {
  return cudaSuccess;
}
const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "emulated CUDA error";
}

// 256-byte aligned, as cudaMalloc's are. Under ASan the padding past `bytes` is poisoned, so a
// kernel that reads or writes past its buffer is stopped there, as compute-sanitizer's memcheck
// would stop it on a GPU (a GPU itself would let it pass inside the allocation's granule).
cudaError_t cudaMalloc(void** p, size_t bytes) {
  const size_t padded = (bytes + 255) / 256 * 256 + 256;
  *p = std::aligned_alloc(256, padded);
  if (!*p) return cudaErrorMemoryAllocation;
  std::memset(*p, 0xff, bytes);  // NaN in every float type (initcheck: docs/gpu.md, "Tests")
#ifdef PTDP_EMU_ASAN
  ASAN_POISON_MEMORY_REGION(static_cast<char*>(*p) + bytes, padded - bytes);
#endif
  std::lock_guard<std::mutex> lock(allocations_mutex());
  allocations()[reinterpret_cast<std::uintptr_t>(*p)] = bytes;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(allocations_mutex());
    allocations().erase(reinterpret_cast<std::uintptr_t>(p));
  }
  std::free(p);
  return cudaSuccess;
}
// Pinned host memory is host memory.
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  *p = std::malloc(bytes > 0 ? bytes : 1);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  *a = cudaPointerAttributes{};
  a->type = cudaMemoryTypeUnregistered;
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(allocations_mutex());
  auto it = allocations().upper_bound(at);
  if (it != allocations().begin()) {
    --it;
    if (at < it->first + it->second || at == it->first) {
      a->type = cudaMemoryTypeDevice;
      a->devicePointer = const_cast<void*>(p);
    }
  }
  return cudaSuccess;
}
cudaError_t cudaMemset2DAsync(void* p, size_t pitch, int value, size_t width, size_t height,
                              cudaStream_t) {
  for (size_t r = 0; r < height; ++r) std::memset(static_cast<char*>(p) + r * pitch, value, width);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = new CUstream_st;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  return cudaStreamCreate(s);
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) {
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  return cudaEventCreate(e);
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
  e->at = std::chrono::steady_clock::now();
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t from, cudaEvent_t to) {
  *ms = std::chrono::duration<float, std::milli>(to->at - from->at).count();
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t) {
  return cudaSuccess;  // every stream has run its work already
}
cudaError_t cudaEventSynchronize(cudaEvent_t) {
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int) {
  *prop = cudaDeviceProp{};
  std::strncpy(prop->name, "host emulation", sizeof prop->name - 1);
  prop->totalGlobalMem = size_t{80} << 30;
  prop->l2CacheSize = 50 << 20;
  prop->multiProcessorCount = 132;
  prop->major = 9;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = 0;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 0;
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) {
  if (emu::failing_allocations > 0) {  // a full device, for the out-of-memory paths' tests
    --emu::failing_allocations;
    *p = nullptr;
    return cudaErrorMemoryAllocation;
  }
  return cudaMalloc(p, bytes);
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  return cudaFree(p);
}
// One pool, whose attributes the emulation accepts and ignores.
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int) {
  *pool = nullptr;
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void*) {
  return cudaSuccess;
}
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t, size_t) {
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  return cudaMemset(p, value, bytes);
}
cudaError_t cudaMemcpy(void* to, const void* from, size_t bytes, cudaMemcpyKind) {
  std::memmove(to, from, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* to, const void* from, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
  return cudaMemcpy(to, from, bytes, kind);
}
cudaError_t cudaDeviceSynchronize() {
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  *free_bytes = *total = size_t{80} << 30;
  return cudaSuccess;
}

}  // extern "C"
