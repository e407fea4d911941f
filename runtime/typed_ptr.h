// Ptr and CPtr: a pointer into a backend's memory with the element type it points at. The
// Backend's typed entry points (runtime/backend.h) take them for activations and weights, which
// are fp32 or, with mixed precision (--bf16), bf16; gradients of weights, master weights, Adam
// states and statistics (norm mean and rstd, attention log-sum-exp) stay fp32 and plain float*.
// A float* converts implicitly, so fp32 callers pass pointers as before.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "core/dtype.h"

namespace ptdp {

struct Ptr {
  void* p = nullptr;
  DType t = DType::kF32;

  Ptr() = default;
  Ptr(std::nullptr_t) {}   // NOLINT: a null pointer of any type
  Ptr(float* f) : p(f) {}  // NOLINT: fp32, as before types
  Ptr(void* data, DType type) : p(data), t(type) {}

  explicit operator bool() const { return p != nullptr; }
  bool f32() const { return t == DType::kF32; }
  // The elements as fp32; std::logic_error for another type.
  float* f() const {
    if (t != DType::kF32) throw std::logic_error("a " + to_string(t) + " tensor read as fp32");
    return static_cast<float*>(p);
  }
  // The pointer `elements` further on (a null pointer stays null).
  Ptr at(int64_t elements) const {
    if (!p) return *this;
    return {static_cast<char*>(p) + elements * static_cast<int64_t>(dtype_bytes(t)), t};
  }
};

struct CPtr {
  const void* p = nullptr;
  DType t = DType::kF32;

  CPtr() = default;
  CPtr(std::nullptr_t) {}          // NOLINT
  CPtr(const float* f) : p(f) {}   // NOLINT
  CPtr(Ptr x) : p(x.p), t(x.t) {}  // NOLINT
  CPtr(const void* data, DType type) : p(data), t(type) {}

  explicit operator bool() const { return p != nullptr; }
  bool f32() const { return t == DType::kF32; }
  const float* f() const {
    if (t != DType::kF32) throw std::logic_error("a " + to_string(t) + " tensor read as fp32");
    return static_cast<const float*>(p);
  }
  CPtr at(int64_t elements) const {
    if (!p) return *this;
    return {static_cast<const char*>(p) + elements * static_cast<int64_t>(dtype_bytes(t)), t};
  }
};

}  // namespace ptdp
