// Units used across ptdp. Sizes are bytes (double, since they feed arithmetic), times are
// seconds in the analytic model and integer picoseconds in the simulator.
#pragma once

#include <cstdint>

namespace ptdp {

inline constexpr double kKiB = 1024.0;
inline constexpr double kMiB = 1024.0 * kKiB;
inline constexpr double kGiB = 1024.0 * kMiB;
inline constexpr double kGB = 1e9;      // bandwidths are decimal: GB/s
inline constexpr double kTFLOP = 1e12;  // FLOP/s are decimal: TFLOP/s
inline constexpr double kMicrosecond = 1e-6;

inline constexpr double to_mib(double bytes) {
  return bytes / kMiB;
}
inline constexpr double to_gib(double bytes) {
  return bytes / kGiB;
}

}  // namespace ptdp
