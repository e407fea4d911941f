// Fuzzes checkpoint reading for `ptdp run --load DIR` (runtime/checkpoint.h): read_latest on
// DIR/latest and read_checkpoint_shard on DIR/step_0000000/rank_00000.bin. Input: byte 0 holds
// flags (bit 0: append the file's checksum, so that inputs get past it to the header and the
// arrays; bit 1: write DIR/latest from the next byte0 >> 4 bytes), the rest is the shard file.
#include "runtime/checkpoint.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>

#include "kernels/cpu/hash.h"
#include "tests/fuzz/fuzz_support.h"

using namespace ptdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const nlohmann::json expected = nlohmann::json::parse(fuzz::kCheckpointLayout);
  const std::string dir = (fuzz::scratch_dir() / "ckpt").string();
  std::filesystem::create_directories(checkpoint_step_dir(dir, 0));
  const uint8_t flags = data[0];
  size_t pos = 1;
  const std::string latest = (std::filesystem::path(dir) / "latest").string();
  std::filesystem::remove(latest);
  if (flags & 2) {
    const size_t n = std::min<size_t>(flags >> 4, size - pos);
    fuzz::write_scratch_file("ckpt/latest", data + pos, n);
    pos += n;
  }
  std::string shard(reinterpret_cast<const char*>(data + pos), size - pos);
  if (flags & 1) {
    const uint64_t sum = fnv1a(shard);
    shard.append(reinterpret_cast<const char*>(&sum), sizeof sum);
  }
  const std::string file = checkpoint_file(dir, 0, 0);
  fuzz::write_scratch_file(std::filesystem::relative(file, fuzz::scratch_dir()).string(),
                           reinterpret_cast<const uint8_t*>(shard.data()), shard.size());
  fuzz::expect_value_or_input_error([&] { (void)read_latest(dir); });
  fuzz::expect_value_or_input_error([&] {
    const CheckpointShard c = read_checkpoint_shard(dir, 0, 0, expected);
    size_t floats = 0;
    for (const auto& a : c.arrays) floats += a.size();
    if (floats * sizeof(float) > shard.size()) fuzz::fail("arrays larger than the file");
  });
  return 0;
}
