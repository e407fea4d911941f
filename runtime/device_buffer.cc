#include "runtime/device_buffer.h"

#include <utility>

namespace ptdp {

DeviceBuffer::DeviceBuffer(Backend& backend, DType t, int64_t n)
    : backend_(&backend), dtype_(t), n_(n) {
  if (n < 0) throw std::invalid_argument("DeviceBuffer of negative size");
  ptr_ = n > 0 ? backend.allocate(bytes()) : nullptr;
}

DeviceBuffer::~DeviceBuffer() {
  free();
}

void DeviceBuffer::free() {
  if (ptr_) backend_->deallocate(ptr_, bytes());
  ptr_ = nullptr;
  n_ = 0;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : backend_(o.backend_), dtype_(o.dtype_), n_(o.n_), ptr_(o.ptr_) {
  o.ptr_ = nullptr;
  o.n_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    free();
    backend_ = o.backend_;
    dtype_ = o.dtype_;
    n_ = o.n_;
    ptr_ = std::exchange(o.ptr_, nullptr);
    o.n_ = 0;
  }
  return *this;
}

}  // namespace ptdp
