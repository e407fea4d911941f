// Buffer: the runtime's float array. Every byte it holds is counted, so a run can report its
// peak memory (weights, gradients, optimizer states, activations and transfer buffers) the way
// the memory model predicts it, independent of the allocator's own slack.
//
// A Buffer lives in a memory space: host memory, or the memory of the backend registered with
// set_buffer_space() (the CUDA backend registers itself, so a rank's activations live on its
// GPU). Each Buffer keeps the space it was made in. Its elements may be read and written on the
// host (operator[], begin/end) only in host memory; data() is a pointer in the Buffer's space,
// for the backend's kernels and the communicators.
#pragma once

#include <cstddef>
#include <cstdint>

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

class Buffer {
 public:
  Buffer();
  // n zero elements; n elements of value v.
  explicit Buffer(size_t n);
  Buffer(size_t n, float v);
  Buffer(const Buffer& o);  // in o's space
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(const Buffer& o);
  Buffer& operator=(Buffer&& o) noexcept;
  ~Buffer();

  size_t size() const { return n_; }
  size_t capacity() const { return cap_; }
  bool empty() const { return n_ == 0; }
  float* data() { return p_; }
  const float* data() const { return p_; }
  // Keeps the first min(size, n) elements; new elements are zero. Grows as std::vector does
  // (at least doubling), so measured peaks do not depend on the space.
  void resize(size_t n);
  void clear() { n_ = 0; }  // keeps the capacity
  void swap(Buffer& o) noexcept;
  Backend* space() const { return space_; }
  bool on_host() const { return space_ == nullptr; }

  // Host memory only.
  float& operator[](size_t i) { return p_[i]; }
  const float& operator[](size_t i) const { return p_[i]; }
  float* begin() { return p_; }
  float* end() { return p_ + n_; }
  const float* begin() const { return p_; }
  const float* end() const { return p_ + n_; }

 private:
  void reallocate(size_t cap);
  void free_storage();

  Backend* space_ = nullptr;
  float* p_ = nullptr;
  size_t n_ = 0, cap_ = 0;
};

inline int64_t elems(const Buffer& b) {
  return static_cast<int64_t>(b.size());
}
inline void resize(Buffer& b, int64_t n) {
  b.resize(static_cast<size_t>(n));
}

// Releases a buffer's memory (clear() keeps the capacity).
inline void release(Buffer& b) {
  Buffer().swap(b);
}

}  // namespace ptdp
