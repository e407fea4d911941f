// What `ptdp run --json` printed, for the MPI tests that launch it (tests/support/launch.h).
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support/launch.h"

namespace ptdp::test {

// The JSON of a run that must succeed; a test failure naming `what` (and an empty value) when
// it failed or printed none.
inline nlohmann::json json_of(const Outcome& r, const std::string& what) {
  EXPECT_EQ(r.status, 0) << what << "\n" << r.err;
  try {
    return nlohmann::json::parse(r.out);
  } catch (const nlohmann::json::exception&) {
    ADD_FAILURE() << "no JSON from " << what << ":\n" << r.out << r.err;
    return {};
  }
}

inline std::vector<double> losses(const nlohmann::json& j) {
  return j.contains("losses") ? j["losses"].get<std::vector<double>>() : std::vector<double>{};
}

}  // namespace ptdp::test
