// Fuzzes the cluster file loader, `--cluster FILE`: core/presets.h resolve_cluster reads the
// file and cluster_from_json checks it (core/cluster_spec.cc). An accepted cluster is then
// resized as `--num-gpus` does (ClusterSpec::resize) to one GPU, to itself, to twice itself and
// to 10^12 GPUs, which must be refused; each resize may only succeed or throw InputError.
#include <nlohmann/json.hpp>
#include <optional>

#include "core/presets.h"
#include "tests/fuzz/fuzz_support.h"

using namespace ptdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_scratch_file("cluster.json", data, size);
  std::optional<ClusterSpec> c;
  fuzz::expect_value_or_input_error([&] { c = resolve_cluster(path); });
  if (!c) return 0;
  if (c->num_gpus() <= 0) fuzz::fail("an accepted cluster has no GPUs");
  if (to_json(cluster_from_json(to_json(*c))) != to_json(*c))
    fuzz::fail("JSON round trip changed the cluster");
  // A GPU without a built-in profile is refused (InputError naming profile), not priced as
  // another GPU.
  fuzz::expect_value_or_input_error([&] { (void)default_profile_for(*c); });
  for (const int64_t n : {int64_t{1}, c->num_gpus(), 2 * c->num_gpus(), int64_t{1000000000000}}) {
    ClusterSpec sized = *c;
    bool resized = false;
    fuzz::expect_value_or_input_error([&] {
      sized.resize(n);
      sized.validate();
      resized = true;
    });
    if (resized && sized.num_gpus() != n) fuzz::fail("resize gave another size");
    if (resized && n == 1000000000000) fuzz::fail("a cluster of 10^12 GPUs was accepted");
  }
  return 0;
}
