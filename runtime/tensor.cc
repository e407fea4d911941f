#include "runtime/tensor.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "runtime/backend.h"

namespace ptdp {
namespace {
std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<Backend*> g_space{nullptr};
thread_local DType t_activation = DType::kF32;
}  // namespace

void MemoryCounter::allocated(size_t bytes) {
  const int64_t now = g_current += static_cast<int64_t>(bytes);
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}
void MemoryCounter::freed(size_t bytes) {
  g_current -= static_cast<int64_t>(bytes);
}
int64_t MemoryCounter::current() {
  return g_current.load();
}
int64_t MemoryCounter::peak() {
  return g_peak.load();
}
void MemoryCounter::reset_peak() {
  g_peak = g_current.load();
}

void set_buffer_space(Backend* space) {
  g_space = space;
}
Backend* buffer_space() {
  return g_space.load();
}

void set_activation_dtype(DType t) {
  if (t != DType::kF32 && t != DType::kBF16 && t != DType::kF16)
    throw std::invalid_argument("activations are fp32, bf16 or fp16, not " + to_string(t));
  t_activation = t;
}
DType activation_dtype() {
  return t_activation;
}

Buffer::Buffer() : space_(buffer_space()) {}

Buffer::Buffer(DType t) : space_(buffer_space()), dtype_(t), typed_(true) {}

Buffer::Buffer(size_t n) : Buffer() {
  resize(n);
}

Buffer::Buffer(size_t n, DType t) : Buffer(t) {
  resize(n);
}

Buffer::Buffer(size_t n, float v) : Buffer(DType::kF32) {
  resize(n);
  if (n == 0 || v == 0.0f) return;
  if (on_host()) {
    std::fill(data(), data() + n, v);
  } else {
    const std::vector<float> host(n, v);
    space_->upload(host.data(), p_, n * sizeof(float));
  }
}

Buffer::Buffer(const Buffer& o) : space_(o.space_), dtype_(o.dtype_), typed_(o.typed_) {
  if (o.n_ == 0) return;
  reallocate(o.n_, false);  // every element is copied
  n_ = o.n_;
  if (on_host())
    std::memcpy(p_, o.p_, bytes());
  else
    space_->copy_bytes(o.p_, p_, bytes());
}

Buffer::Buffer(Buffer&& o) noexcept
    : space_(o.space_), p_(o.p_), n_(o.n_), cap_(o.cap_), dtype_(o.dtype_), typed_(o.typed_) {
  o.p_ = nullptr;
  o.n_ = o.cap_ = 0;
}

Buffer& Buffer::operator=(const Buffer& o) {
  if (this != &o) {
    Buffer copy(o);
    swap(copy);
  }
  return *this;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    space_ = o.space_;
    p_ = o.p_;
    n_ = o.n_;
    cap_ = o.cap_;
    dtype_ = o.dtype_;
    typed_ = o.typed_;
    o.p_ = nullptr;
    o.n_ = o.cap_ = 0;
  }
  return *this;
}

Buffer::~Buffer() {
  release();
}

void Buffer::swap(Buffer& o) noexcept {
  std::swap(space_, o.space_);
  std::swap(p_, o.p_);
  std::swap(n_, o.n_);
  std::swap(cap_, o.cap_);
  std::swap(dtype_, o.dtype_);
  std::swap(typed_, o.typed_);
}

void* Buffer::checked_f32() const {
  if (dtype_ != DType::kF32)
    throw std::logic_error("a " + to_string(dtype_) + " Buffer read as fp32");
  return p_;
}

void Buffer::release() {
  if (!p_) return;
  if (on_host()) {
    MemoryCounter::freed(cap_ * element());
    ::operator delete (p_, std::align_val_t{64});
  } else {
    space_->deallocate(p_, cap_ * element());
  }
  p_ = nullptr;
  n_ = cap_ = 0;
}

void Buffer::reallocate(size_t cap, bool zeroed) {
  void* p = nullptr;
  if (on_host()) {
    p = ::operator new (cap* element(), std::align_val_t{64});
    MemoryCounter::allocated(cap * element());
  } else {
    p = zeroed ? space_->allocate(cap * element())
               : space_->allocate_for_overwrite(cap * element());
  }
  if (n_ > 0) {
    if (on_host())
      std::memcpy(p, p_, bytes());
    else
      space_->copy_bytes(p_, p, bytes());
  }
  const size_t n = n_;
  release();
  p_ = p;
  n_ = n;
  cap_ = cap;
}

void Buffer::resize(size_t n) {
  grow(n, true);
}

void Buffer::resize_for_overwrite(size_t n) {
  grow(n, false);
}

// New elements zeroed, or (for overwrite) left as the space leaves them: 0xFF bytes on the host.
void Buffer::grow(size_t n, bool zero) {
  if (n > cap_) {
    // An empty Buffer takes the current space, so one made before a device backend registered
    // itself (a member of a long-lived object) still lands on the device.
    // Likewise it takes the thread's activation type unless it was made with one.
    if (!p_) {
      space_ = buffer_space();
      if (!typed_) dtype_ = activation_dtype();
    }
    // Not zeroed here: the new elements are zeroed (or poisoned) just below, and the capacity
    // beyond n is written by whatever grows into it later. (Zeroing both queued two memsets per
    // new activation on a GPU, whose host-side cost showed in every small op's span.)
    reallocate(std::max(n, n_ + n_), false);
  }
  if (n > n_) {
    char* from = static_cast<char*>(p_) + n_ * element();
    const size_t bytes = (n - n_) * element();
    if (on_host())
      std::memset(from, zero ? 0 : 0xFF, bytes);
    else if (zero)
      space_->zero_bytes(from, bytes);
    else
      space_->poison_bytes(from, bytes);
  }
  n_ = n;
}

}  // namespace ptdp
