#include "kernels/cpu/init.h"

#include <cmath>

#include "kernels/cpu/hash.h"

namespace ptdp::kernels {

float hashed_normal(uint64_t seed, uint64_t id, uint64_t index, double sd) {
  const uint64_t a = splitmix64(seed ^ splitmix64(id ^ splitmix64(index)));
  const uint64_t b = splitmix64(a);
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  return static_cast<float>(sd * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

void fill_hashed_normal(float* x, int64_t rows, int64_t cols, uint64_t seed, uint64_t id, double sd,
                        const std::function<int64_t(int64_t, int64_t)>& index) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      x[r * cols + c] = hashed_normal(seed, id, static_cast<uint64_t>(index(r, c)), sd);
}

}  // namespace ptdp::kernels
