// Fuzzes the hardware profile loader, `--profile FILE`: core/presets.h resolve_profile reads
// the file and profile_from_json checks it (core/hardware_profile.cc). An accepted profile must
// give every GEMM a usable efficiency (GemmEfficiency::at and, with a measured table,
// HardwareProfile::gemm_efficiency in (0, 1]), since the cost model divides by it.
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/presets.h"
#include "tests/fuzz/fuzz_support.h"

using namespace ptdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_scratch_file("profile.json", data, size);
  std::optional<HardwareProfile> p;
  fuzz::expect_value_or_input_error([&] { p = resolve_profile(path); });
  if (!p) return 0;
  if (to_json(profile_from_json(to_json(*p))) != to_json(*p))
    fuzz::fail("JSON round trip changed the profile");
  const double shapes[][4] = {
      {1, 1, 1, 1}, {2048, 12288, 12288, 1}, {8192, 128, 64, 96}, {1e6, 1e6, 1e6, 1e3}};
  for (const auto& s : shapes) {
    const double e = p->gemm.at(s[0], s[1], s[2], s[3]);
    if (!(e > 0 && e <= 1))
      fuzz::fail("GEMM efficiency " + std::to_string(e) + " of an accepted profile");
    // With a measured table (ptdp calibrate) the interpolated efficiency, which the cost model
    // uses, must be a fraction too.
    const double t = p->gemm_efficiency(s[0], s[1], s[2], s[3]);
    if (!(t > 0 && t <= 1))
      fuzz::fail("measured GEMM efficiency " + std::to_string(t) + " of an accepted profile");
  }
  return 0;
}
