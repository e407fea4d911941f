// exp and tanh of floats as inline arithmetic, which the compiler vectorises: libm's expf and
// tanhf are calls, one element at a time (a tanh-approximation GELU spent 12-16 ns an element in
// them on this machine's EPYC). The same instructions run on every element, so a result does
// not depend on where in an array (or on which tensor-parallel rank) an element lies.
//
// exp_f32: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2, and a degree-7 polynomial
// for e^r (the coefficients of Cephes' expf, S. Moshier); within 2 ulp of the correctly rounded
// value over [-87.3, 88.3]. Below -87.3 it returns 0 (e^x is then at most about FLT_MIN, the
// normal floats ending at ln FLT_MIN = -87.34: masked scores, -inf, flush to 0); above 88.3 it
// returns e^88.3 (callers exponentiate x - max <= 0 or feed 1 / (1 + e^x)); NaN stays NaN. tanh_f32
// is within 2e-7 of tanh absolutely (what GELU adds it to 1 for), saturating to +-1 exactly.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace ptdp::kernels {

inline float exp_f32(float x) {
  constexpr float kLo = -87.3f, kHi = 88.3f;
  const bool under = x < kLo;
  x = x > kHi ? kHi : x;
  x = x < kLo ? kLo : x;
  // n = round(x / ln2) by the 1.5 x 2^23 shift (std::floor would keep the loop scalar: GCC
  // vectorises it only without -ftrapping-math); the shifted value holds n in its low bits.
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  float r = x - n * 0.693359375f;  // ln2 in two parts: the first exact in n's range
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n from the shifted value's bits, 0x4B400000 + n: the exponent 127 + n (n in [-126, 127]
  // here); no float-to-int conversion, so NaN passes through p.
  const uint32_t biased = std::bit_cast<uint32_t>(shifted) - 0x4B400000u + 127u;
  const float scale = std::bit_cast<float>(biased << 23);
  return under ? 0.0f : p * scale;
}

// std::exp for double (the reference twins), the inline form for float.
template <typename T>
inline T fast_exp(T x) {
  if constexpr (std::is_same_v<T, float>)
    return exp_f32(x);
  else
    return std::exp(x);
}

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = e^(-2|x|) in (0, 1]: no overflow, and where
// |tanh| nears 1 the derivative 1 - tanh^2 = 4e / (1 + e)^2 keeps its precision. Both from one
// exponential (a caller that drops the derivative does not compute it, inlined).
template <typename T>
inline void tanh_parts(T x, T* tanh, T* derivative) {
  const T e = fast_exp(T(-2) * std::fabs(x)), inv = T(1) / (T(1) + e);
  *tanh = std::copysign((T(1) - e) * inv, x);
  *derivative = T(4) * e * inv * inv;
}

inline float tanh_f32(float x) {
  float t, unused;
  tanh_parts(x, &t, &unused);
  return t;
}

}  // namespace ptdp::kernels
