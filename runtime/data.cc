#include "runtime/data.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "kernels/cpu/hash.h"

namespace ptdp {
namespace {

uint64_t mix(uint64_t x) {
  return splitmix64(x);
}

}  // namespace

std::vector<uint16_t> tokenize_bytes(const std::string& text) {
  std::vector<uint16_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

int64_t tokenize_file(const std::string& input, const std::string& output) {
  std::error_code ec;
  if (std::filesystem::exists(input, ec) && !std::filesystem::is_regular_file(input, ec))
    throw InputError(input, "is not a regular file");
  std::ifstream in(input, std::ios::binary);
  if (!in) throw InputError(input, "cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  const std::vector<uint16_t> tokens = tokenize_bytes(text.str());
  if (tokens.empty()) throw InputError(input, "is empty");
  const std::string tmp = output + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InputError(output, "cannot be written");
    for (uint16_t t : tokens) {
      const char le[2] = {static_cast<char>(t & 0xff), static_cast<char>(t >> 8)};
      out.write(le, 2);
    }
    if (!out.flush()) {
      std::filesystem::remove(tmp);
      throw InputError(output, "could not be written completely");
    }
  }
  std::filesystem::rename(tmp, output);
  return static_cast<int64_t>(tokens.size());
}

TokenSource TokenSource::synthetic(int64_t vocab, uint64_t seed) {
  if (vocab < 2) throw InputError("--vocab-size", "synthetic data needs at least 2 tokens");
  TokenSource s;
  s.vocab_ = vocab;
  s.seed_ = seed;
  return s;
}

TokenSource TokenSource::file(const std::string& path, int64_t vocab, int64_t seq_length) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    throw InputError("--data", path + " is not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError("--data", path + " cannot be read");
  std::stringstream bytes;
  bytes << in.rdbuf();
  const std::string b = bytes.str();
  if (b.size() % 2 != 0)
    throw InputError("--data", path + " is not a file of uint16 tokens (odd size)");
  TokenSource s;
  s.vocab_ = vocab;
  s.tokens_.resize(b.size() / 2);
  for (size_t i = 0; i < s.tokens_.size(); ++i) {
    s.tokens_[i] = static_cast<uint16_t>(static_cast<unsigned char>(b[2 * i]) |
                                         (static_cast<unsigned char>(b[2 * i + 1]) << 8));
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
