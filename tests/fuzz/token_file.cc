// Fuzzes the token file reader of `ptdp run --data FILE` (runtime/data.h TokenSource::file).
// The first four input bytes are the vocabulary size and the sequence length (little-endian
// uint16 each, plus one, as a validated model has them positive); the rest is the file. From a
// file it accepts, sequences at the first, a middle and the largest index must be in range.
#include <vector>

#include "runtime/data.h"
#include "tests/fuzz/fuzz_support.h"

using namespace ptdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const int64_t vocab = 1 + (data[0] | data[1] << 8);
  const int64_t seq = 1 + (data[2] | data[3] << 8);
  const std::string path = fuzz::write_scratch_file("tokens.bin", data + 4, size - 4);
  fuzz::expect_value_or_input_error([&] {
    const TokenSource source = TokenSource::file(path, vocab, seq);
    std::vector<int32_t> out(static_cast<size_t>(seq + 1));
    for (const int64_t index : {int64_t{0}, int64_t{7}, INT64_MAX}) {
      source.sequence(index, seq, out.data());
      for (const int32_t t : out)
        if (t < 0 || t >= vocab) fuzz::fail("a sequence holds token " + std::to_string(t));
    }
  });
  return 0;
}
