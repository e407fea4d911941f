// bfloat16 on the CPU: the rounding the CUDA kernels apply when they store bf16 (round to nearest,
// ties to even, as __float2bfloat16_rn does), so CPU twins and tests can reproduce device storage.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace ptdp::kernels {

inline uint16_t to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0)
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16_bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// x rounded to the nearest bf16 value, as a float.
inline float round_bf16(float x) {
  return from_bf16_bits(to_bf16_bits(x));
}

inline std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = to_bf16_bits(x[i]);
  return y;
}

inline std::vector<float> from_bf16(const std::vector<uint16_t>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = from_bf16_bits(x[i]);
  return y;
}

}  // namespace ptdp::kernels
