// Helpers for the CUDA kernel tests: skipping without a GPU, device buffers, bf16 test data and
// tolerance checks against the CPU twins.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/common.h"
#include "runtime/float16.h"

// Skips the test, with the reason, when no CUDA device is visible.
#define PTDP_REQUIRE_GPU()                                                          \
  do {                                                                              \
    const char* ptdp_why = "unknown";                                               \
    if (::ptdp::kernels::cuda::device_count(&ptdp_why) == 0)                        \
      GTEST_SKIP() << "no CUDA device visible (" << ptdp_why << "); runs on a GPU " \
                   << "machine via scripts/gpu-check.sh";                           \
  } while (0)

namespace ptdp::cuda_test {

using kernels::cuda::bf16;

// bf16 rounding as the kernels store it (round to nearest even), via runtime/float16.h.
inline float round_bf16(float x) {
  return bf16_to_float(float_to_bf16(x));
}
inline std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = float_to_bf16(x[i]);
  return y;
}
inline std::vector<float> from_bf16(const std::vector<uint16_t>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = bf16_to_float(x[i]);
  return y;
}

// A cudaMalloc'd array of n T, freed on destruction. Made from a size it starts as all-ones bytes
// (NaN in every float type): an output that a kernel must write whole, so an element it leaves
// unwritten fails the comparison instead of passing as a zero. A buffer that a kernel adds to
// starts from host values (the second constructor).
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    PTDP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), sizeof(T) * (n ? n : 1)));
    PTDP_CUDA_CHECK(cudaMemset(p_, 0xff, sizeof(T) * (n ? n : 1)));
  }
  // From host data of the same element size (bf16 buffers take uint16_t bit patterns).
  template <typename H>
  explicit DeviceBuffer(const std::vector<H>& host) : DeviceBuffer(host.size()) {
    static_assert(sizeof(H) == sizeof(T));
    PTDP_CUDA_CHECK(cudaMemcpy(p_, host.data(), sizeof(T) * n_, cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(o.n_) {}
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;

  T* get() { return p_; }
  const T* get() const { return p_; }
  size_t size() const { return n_; }
  template <typename H = T>
  std::vector<H> download() const {
    static_assert(sizeof(H) == sizeof(T));
    PTDP_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<H> host(n_);
    PTDP_CUDA_CHECK(cudaMemcpy(host.data(), p_, sizeof(T) * n_, cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// A bf16 device buffer from float values (rounded) and back.
inline DeviceBuffer<bf16> to_device_bf16(const std::vector<float>& x) {
  return DeviceBuffer<bf16>(to_bf16(x));
}
inline std::vector<float> bf16_values(const DeviceBuffer<bf16>& d) {
  return from_bf16(d.download<uint16_t>());
}

// n normal(0, sd) values already rounded to bf16, so the CPU twin sees the device's inputs.
inline std::vector<float> random_bf16(size_t n, float sd, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> x(n);
  for (auto& v : x) v = round_bf16(dist(gen));
  return x;
}
inline std::vector<float> random_f32(size_t n, float sd, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> x(n);
  for (auto& v : x) v = dist(gen);
  return x;
}

// Every |got - want| <= atol + rtol * |want|; reports the worst element.
inline void expect_close(const std::vector<float>& got, const std::vector<float>& want, double atol,
                         double rtol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double tol = atol + rtol * std::fabs(static_cast<double>(want[i]));
    if (!(err <= tol)) ++bad;  // NaN counts as bad
    const double excess = std::isnan(err) ? INFINITY : err - tol;
    if (excess > worst_excess) worst_excess = excess, worst = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size()
                     << " elements out of tolerance; worst at " << worst << ": got " << got[worst]
                     << ", want " << want[worst] << " (atol " << atol << ", rtol " << rtol << ")";
}

// The largest |x|, to scale absolute tolerances.
inline double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::fmax(m, std::fabs(static_cast<double>(v)));
  return m;
}

}  // namespace ptdp::cuda_test
