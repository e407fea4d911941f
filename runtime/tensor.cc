#include "runtime/tensor.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#include "runtime/backend.h"

namespace ptdp {
namespace {
std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<Backend*> g_space{nullptr};
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

Buffer::Buffer() : space_(buffer_space()) {}

Buffer::Buffer(size_t n) : Buffer() {
  resize(n);
}

Buffer::Buffer(size_t n, float v) : Buffer() {
  resize(n);
  if (n == 0 || v == 0.0f) return;
  if (on_host()) {
    std::fill(p_, p_ + n, v);
  } else {
    const std::vector<float> host(n, v);
    space_->upload(host.data(), p_, n * sizeof(float));
  }
}

Buffer::Buffer(const Buffer& o) : space_(o.space_) {
  if (o.n_ == 0) return;
  reallocate(o.n_);
  n_ = o.n_;
  if (on_host())
    std::memcpy(p_, o.p_, n_ * sizeof(float));
  else
    space_->copy(o.p_, p_, static_cast<int64_t>(n_));
}

Buffer::Buffer(Buffer&& o) noexcept : space_(o.space_), p_(o.p_), n_(o.n_), cap_(o.cap_) {
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
    free_storage();
    space_ = o.space_;
    p_ = o.p_;
    n_ = o.n_;
    cap_ = o.cap_;
    o.p_ = nullptr;
    o.n_ = o.cap_ = 0;
  }
  return *this;
}

Buffer::~Buffer() {
  free_storage();
}

void Buffer::swap(Buffer& o) noexcept {
  std::swap(space_, o.space_);
  std::swap(p_, o.p_);
  std::swap(n_, o.n_);
  std::swap(cap_, o.cap_);
}

void Buffer::free_storage() {
  if (!p_) return;
  if (on_host()) {
    MemoryCounter::freed(cap_ * sizeof(float));
    ::operator delete (p_, std::align_val_t{64});
  } else {
    space_->deallocate(p_, cap_ * sizeof(float));
  }
  p_ = nullptr;
  n_ = cap_ = 0;
}

void Buffer::reallocate(size_t cap) {
  float* p = nullptr;
  if (on_host()) {
    p = static_cast<float*>(::operator new (cap * sizeof(float), std::align_val_t{64}));
    MemoryCounter::allocated(cap * sizeof(float));
  } else {
    p = static_cast<float*>(space_->allocate(cap * sizeof(float)));
  }
  if (n_ > 0) {
    if (on_host())
      std::memcpy(p, p_, n_ * sizeof(float));
    else
      space_->copy(p_, p, static_cast<int64_t>(n_));
  }
  const size_t n = n_;
  free_storage();
  p_ = p;
  n_ = n;
  cap_ = cap;
}

void Buffer::resize(size_t n) {
  if (n > cap_) {
    // An empty Buffer takes the current space, so one made before a device backend registered
    // itself (a member of a long-lived object) still lands on the device.
    if (!p_) space_ = buffer_space();
    reallocate(std::max(n, n_ + n_));
  }
  if (n > n_) {
    if (on_host())
      std::fill(p_ + n_, p_ + n, 0.0f);
    else
      space_->fill_zero(p_ + n_, static_cast<int64_t>(n - n_));
  }
  n_ = n;
}

}  // namespace ptdp
