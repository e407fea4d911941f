// DType: the element types ptdp names, in ops of the layer op list (what an op reads and
// writes) and in the runtime's communicators and buffers (what travels between ranks).
//
//   fp32  4 bytes   gradients, master weights and Adam states; the CPU backend's activations
//   bf16  2 bytes   weights and activations on GPUs (Megatron's default)
//   fp16  2 bytes   weights and activations of SC'21's fp16 runs
//   int32 4 bytes   token ids
//   int64 8 bytes   counts and flags exchanged on the control plane
//   f64   8 bytes   losses and norms exchanged on the control plane
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ptdp {

enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kI64, kF64 };

constexpr size_t dtype_bytes(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kI64:
    case DType::kF64:
      return 8;
  }
  return 0;
}

inline std::string to_string(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kF64:
      return "f64";
  }
  return "?";
}

// The DType of a C++ element type (float, double, int32_t, int64_t).
template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::kF32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::kF64;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::kI32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::kI64;
}

}  // namespace ptdp
