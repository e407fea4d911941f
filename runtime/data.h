// Training data for `ptdp run`: deterministic synthetic tokens, or a file of uint16 tokens
// (little-endian, as `ptdp tokenize` writes it). A batch is b sequences of s + 1 tokens: inputs
// are the first s, targets the last s.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ptdp {

// Reads `input` and writes its byte-level tokens (0..255, each a little-endian uint16) to
// `output` atomically; InputError("input" or "output", ...) naming the path.
int64_t tokenize_file(const std::string& input, const std::string& output);

class TokenSource {
 public:
  // Synthetic: a fixed pseudo-random stream with learnable structure (each token depends on
  // the one before), the same for every rank and run with the same seed.
  static TokenSource synthetic(int64_t vocab, uint64_t seed);
  // A uint16 token file; InputError("--data", ...) if unreadable, empty, shorter than one
  // sequence, or holding a token >= vocab.
  static TokenSource file(const std::string& path, int64_t vocab, int64_t seq_length);

  // Sequence number `index` (any non-negative integer) of length s + 1, into out.
  void sequence(int64_t index, int64_t s, int32_t* out) const;

 private:
  std::vector<uint16_t> tokens_;  // empty for synthetic
  int64_t vocab_ = 0;
  uint64_t seed_ = 0;
};

}  // namespace ptdp
