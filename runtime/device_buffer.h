// DeviceBuffer: one contiguous allocation of typed elements in a backend's memory (the
// parameter buffer, the gradient buffer, optimizer states), and typed views into it. A view is
// a span of device pointers: host code may dereference it only where the backend is
// host_accessible() (the CPU backend); otherwise data moves through Backend::upload/download.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>

#include "core/dtype.h"
#include "runtime/backend.h"

namespace ptdp {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // n zero-filled elements of type t on `backend`.
  DeviceBuffer(Backend& backend, DType t, int64_t n);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  DType dtype() const { return dtype_; }
  int64_t size() const { return n_; }
  size_t bytes() const { return static_cast<size_t>(n_) * dtype_bytes(dtype_); }
  Backend* backend() const { return backend_; }

  // The elements as T (T must be the buffer's type).
  template <typename T>
  T* data() {
    check<T>();
    return static_cast<T*>(ptr_);
  }
  template <typename T>
  const T* data() const {
    check<T>();
    return static_cast<const T*>(ptr_);
  }
  // The elements with their type (runtime/typed_ptr.h).
  Ptr ptr() { return {ptr_, dtype_}; }
  CPtr ptr() const { return {ptr_, dtype_}; }
  // Elements [offset, offset + n) as T, bounds-checked.
  template <typename T>
  std::span<T> view(int64_t offset, int64_t n) {
    if (offset < 0 || n < 0 || offset + n > n_)
      throw std::out_of_range("DeviceBuffer::view outside the buffer");
    return {data<T>() + offset, static_cast<size_t>(n)};
  }

 private:
  template <typename T>
  void check() const {
    if (dtype_of<T>() != dtype_) throw std::logic_error("DeviceBuffer read as another type");
  }
  void free();

  Backend* backend_ = nullptr;
  DType dtype_ = DType::kF32;
  int64_t n_ = 0;
  void* ptr_ = nullptr;
};

}  // namespace ptdp
