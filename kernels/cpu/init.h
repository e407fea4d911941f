// Deterministic initial weights: element (r, c) of a rows x cols block is drawn from N(0, sd)
// by a hash of (seed, the parameter's id, the element's index in the whole unsharded
// parameter), so every parallel layout of a model starts from the same weights.
#pragma once

#include <cstdint>
#include <functional>

namespace ptdp::kernels {

// One N(0, sd) value (Box-Muller on two hashed uniforms).
float hashed_normal(uint64_t seed, uint64_t id, uint64_t index, double sd);
// x[r * cols + c] = hashed_normal(seed, id, index(r, c), sd).
void fill_hashed_normal(float* x, int64_t rows, int64_t cols, uint64_t seed, uint64_t id, double sd,
                        const std::function<int64_t(int64_t, int64_t)>& index);

}  // namespace ptdp::kernels
