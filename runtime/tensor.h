// Buffer: the runtime's float array. Every byte it holds is counted, so a run can report its
// peak memory (weights, gradients, optimizer states, activations and transfer buffers) the way
// the memory model predicts it, independent of the allocator's own slack.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace ptdp {

struct MemoryCounter {
  static void allocated(size_t bytes);
  static void freed(size_t bytes);
  static int64_t current();
  static int64_t peak();
  static void reset_peak();  // peak := current
};

template <typename T>
struct CountingAllocator {
  using value_type = T;
  CountingAllocator() = default;
  template <typename U>
  CountingAllocator(const CountingAllocator<U>&) {}
  T* allocate(size_t n) {
    MemoryCounter::allocated(n * sizeof(T));
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) {
    MemoryCounter::freed(n * sizeof(T));
    ::operator delete(p);
  }
  template <typename U>
  bool operator==(const CountingAllocator<U>&) const {
    return true;
  }
};

using Buffer = std::vector<float, CountingAllocator<float>>;

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
