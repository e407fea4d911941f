#include "runtime/data.h"

#include <bit>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/output_file.h"
#include "core/presets.h"
#include "kernels/cpu/hash.h"

namespace ptdp {
namespace {

uint64_t mix(uint64_t x) {
  return splitmix64(x);
}

}  // namespace

int64_t tokenize_file(const std::string& input, const std::string& output) {
  check_regular_input(input, "input");
  std::error_code ec;
  std::ifstream in(input, std::ios::binary);
  if (!in) throw InputError("input", "'" + input + "' cannot be read");
  const std::string target = resolve_output(output, "output");
  if (std::filesystem::exists(target, ec) && std::filesystem::equivalent(input, target, ec))
    throw InputError("output", "'" + output + "' is the input file; give another name");
  // Tokens straight from fixed-size reads: the text is never held whole, and the output (two
  // bytes a token) is written in one piece at the end, so an interrupted run leaves nothing.
  std::string bytes;
  const auto size = std::filesystem::file_size(input, ec);
  if (!ec) bytes.reserve(2 * static_cast<size_t>(size));  // no regrowth: twice the input at most
  std::vector<char> chunk(size_t{1} << 20);
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    const size_t got = static_cast<size_t>(in.gcount());
    const size_t at = bytes.size();
    bytes.resize(at + 2 * got);
    for (size_t i = 0; i < got; ++i) {  // little-endian uint16: the byte, then 0
      bytes[at + 2 * i] = chunk[i];
      bytes[at + 2 * i + 1] = 0;
    }
  }
  if (in.bad()) throw InputError("input", "'" + input + "' could not be read completely");
  if (bytes.empty()) throw InputError("input", "'" + input + "' is empty");
  write_file_atomically(output, bytes, "output");
  return static_cast<int64_t>(bytes.size() / 2);
}

TokenSource TokenSource::synthetic(int64_t vocab, uint64_t seed) {
  if (vocab < 2) throw InputError("--vocab-size", "synthetic data needs at least 2 tokens");
  TokenSource s;
  s.vocab_ = vocab;
  s.seed_ = seed;
  return s;
}

TokenSource TokenSource::file(const std::string& path, int64_t vocab, int64_t seq_length) {
  check_regular_input(path, "--data");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw InputError("--data", path + " cannot be read");
  const std::streamoff size = in.tellg();
  if (size < 0) throw InputError("--data", path + " cannot be read");
  if (size % 2 != 0)
    throw InputError("--data", path + " is not a file of uint16 tokens (odd size)");
  TokenSource s;
  s.vocab_ = vocab;
  s.tokens_.resize(static_cast<size_t>(size / 2));  // read in place: one copy of the data
  in.seekg(0);
  if (!in.read(reinterpret_cast<char*>(s.tokens_.data()), size))
    throw InputError("--data", path + " could not be read completely");
  for (size_t i = 0; i < s.tokens_.size(); ++i) {
    if constexpr (std::endian::native == std::endian::big)
      s.tokens_[i] = static_cast<uint16_t>((s.tokens_[i] >> 8) | (s.tokens_[i] << 8));
    if (s.tokens_[i] >= vocab)
      throw InputError("--data", path + " holds token " + std::to_string(s.tokens_[i]) +
                                     " at position " + std::to_string(i) +
                                     ", not below the vocabulary size " + std::to_string(vocab));
  }
  if (static_cast<int64_t>(s.tokens_.size()) < seq_length + 1)
    throw InputError("--data", path + " has " + std::to_string(s.tokens_.size()) +
                                   " tokens, fewer than one sequence (" +
                                   std::to_string(seq_length + 1) + ")");
  return s;
}

void TokenSource::sequence(int64_t index, int64_t s, int32_t* out) const {
  if (tokens_.empty()) {
    // A noisy walk: the next token is the previous one plus a small step, so a model can
    // learn the structure and the loss falls below log(vocab).
    uint64_t state = mix(seed_ ^ mix(static_cast<uint64_t>(index)));
    int64_t t = static_cast<int64_t>(state % static_cast<uint64_t>(vocab_));
    for (int64_t i = 0; i <= s; ++i) {
      out[i] = static_cast<int32_t>(t);
      state = mix(state);
      t = (t + 1 + static_cast<int64_t>(state % 3)) % vocab_;
    }
    return;
  }
  // Consecutive windows of s + 1 tokens, wrapping around the file.
  const int64_t n = static_cast<int64_t>(tokens_.size());
  const int64_t windows = std::max<int64_t>(1, (n - 1) / s);
  const int64_t start = (index % windows) * s;
  for (int64_t i = 0; i <= s; ++i) out[i] = tokens_[static_cast<size_t>((start + i) % n)];
}

}  // namespace ptdp
