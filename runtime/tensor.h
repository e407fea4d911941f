// Buffer: the runtime's array of activations. Every byte it holds is counted, so a run can
// report its peak memory (weights, gradients, optimizer states, activations and transfer
// buffers) the way the memory model predicts it, independent of the allocator's own slack.
//
// Element type. A Buffer holds fp32 or, with mixed precision (--bf16), bf16 elements. One made
// with a DType keeps it (statistics are fp32 whatever the run's precision). One made without
// takes the activation type current on its thread (set_activation_dtype) when it first
// allocates, so the model's activations follow the run's precision without each being named.
//
// A Buffer lives in a memory space: host memory, or the memory of the backend registered with
// set_buffer_space() (the CUDA backend registers itself, so a rank's activations live on its
// GPU). Each Buffer keeps the space it was made in. Its elements may be read and written on the
// host (operator[], begin/end) only in host memory; data() is a pointer in the Buffer's space,
// for the backend's kernels and the communicators.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "runtime/typed_ptr.h"

namespace ptdp {

class Backend;

struct MemoryCounter {
  static void allocated(size_t bytes);
  static void freed(size_t bytes);
  static int64_t current();
  static int64_t peak();
  static void reset_peak();  // peak := current
};

// The space new Buffers are made in: null (the default) for host memory, else a backend whose
// memory is not host-accessible. Process-wide: one device backend per process.
void set_buffer_space(Backend* space);
Backend* buffer_space();

// The element type Buffers made without one take when they first allocate: fp32 (the default)
// or bf16. Per thread (the ranks of a test may run in threads). ActivationDType sets it for a
// scope and restores the previous one.
void set_activation_dtype(DType t);
DType activation_dtype();
class ActivationDType {
 public:
  explicit ActivationDType(DType t) : previous_(activation_dtype()) { set_activation_dtype(t); }
  ~ActivationDType() { set_activation_dtype(previous_); }
  ActivationDType(const ActivationDType&) = delete;
  ActivationDType& operator=(const ActivationDType&) = delete;

 private:
  DType previous_;
};

class Buffer {
 public:
  Buffer();
  // Empty, of element type t for good.
  explicit Buffer(DType t);
  // n zero elements; n zero elements of type t; n fp32 elements of value v.
  explicit Buffer(size_t n);
  Buffer(size_t n, DType t);
  Buffer(size_t n, float v);
  Buffer(const Buffer& o);  // in o's space
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(const Buffer& o);
  Buffer& operator=(Buffer&& o) noexcept;
  ~Buffer();

  size_t size() const { return n_; }
  size_t capacity() const { return cap_; }
  bool empty() const { return n_ == 0; }
  DType dtype() const { return dtype_; }
  size_t bytes() const { return n_ * dtype_bytes(dtype_); }
  // The elements as fp32 (std::logic_error for a bf16 Buffer).
  float* data() { return static_cast<float*>(checked_f32()); }
  const float* data() const { return static_cast<const float*>(checked_f32()); }
  // The elements with their type, for the Backend's typed entry points and the communicators.
  Ptr ptr() { return {p_, dtype_}; }
  CPtr ptr() const { return {p_, dtype_}; }
  void* raw() { return p_; }
  const void* raw() const { return p_; }
  // Keeps the first min(size, n) elements; new elements are zero. Grows as std::vector does
  // (at least doubling), so measured peaks do not depend on the space.
  void resize(size_t n);
  // The same, but new elements are left for the caller to write before anything reads them: no
  // memset on a GPU; 0xFF bytes (NaN) on the host backends, so a read before the write shows.
  void resize_for_overwrite(size_t n);
  void clear() { n_ = 0; }  // keeps the capacity
  void swap(Buffer& o) noexcept;
  Backend* space() const { return space_; }
  bool on_host() const { return space_ == nullptr; }

  // Frees the memory (clear() keeps it); a Buffer made with a DType keeps it.
  void release();

  // Host memory and fp32 only.
  float& operator[](size_t i) { return data()[i]; }
  const float& operator[](size_t i) const { return data()[i]; }
  float* begin() { return data(); }
  float* end() { return data() + n_; }
  const float* begin() const { return data(); }
  const float* end() const { return data() + n_; }

 private:
  void* checked_f32() const;
  void reallocate(size_t cap, bool zeroed);
  void grow(size_t n, bool zero);
  size_t element() const { return dtype_bytes(dtype_); }

  Backend* space_ = nullptr;
  void* p_ = nullptr;
  size_t n_ = 0, cap_ = 0;
  DType dtype_ = DType::kF32;
  bool typed_ = false;  // made with a DType: keeps it
};

inline int64_t elems(const Buffer& b) {
  return static_cast<int64_t>(b.size());
}
inline void resize(Buffer& b, int64_t n) {
  b.resize(static_cast<size_t>(n));
}
inline void resize_for_overwrite(Buffer& b, int64_t n) {
  b.resize_for_overwrite(static_cast<size_t>(n));
}

// Releases a buffer's memory (clear() keeps the capacity).
inline void release(Buffer& b) {
  b.release();
}

}  // namespace ptdp
