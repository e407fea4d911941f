// Training data: byte-level tokenization, token files, deterministic synthetic sequences.
#include "runtime/data.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace ptdp {
namespace {

std::string temp(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("ptdp_data_test_" + name)).string();
}

TEST(Data, TokenizeRoundTripsAnyBytes) {
  const std::string in = temp("in.txt"), out = temp("tokens.bin");
  const std::string text = std::string("héllo\n\0\xff", 9);
  std::ofstream(in, std::ios::binary) << text;
  EXPECT_EQ(tokenize_file(in, out), 9);
  EXPECT_EQ(std::filesystem::file_size(out), 18u);
  const TokenSource src = TokenSource::file(out, 256, 4);
  int32_t seq[5];
  src.sequence(0, 4, seq);
  for (int i = 0; i < 5; ++i)
    EXPECT_EQ(seq[i], static_cast<unsigned char>(text[static_cast<size_t>(i)]));
  src.sequence(1, 4, seq);  // the next window starts s tokens later
  EXPECT_EQ(seq[0], static_cast<unsigned char>(text[4]));
}

TEST(Data, BadFilesAreRejectedNamingTheFlag) {
  EXPECT_THROW(TokenSource::file(temp("missing.bin"), 256, 4), InputError);
  const std::string odd = temp("odd.bin");
  std::ofstream(odd, std::ios::binary) << "abc";
  EXPECT_THROW(TokenSource::file(odd, 256, 1), InputError);
  const std::string big = temp("big.bin");
  std::ofstream(big, std::ios::binary) << std::string("\x00\x01\x00\x00", 4);  // token 256
  try {
    TokenSource::file(big, 256, 1);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), "--data");
  }
  const std::string tiny = temp("tiny.bin");
  std::ofstream(tiny, std::ios::binary) << std::string("\x01\x00", 2);
  EXPECT_THROW(TokenSource::file(tiny, 256, 8), InputError);
  EXPECT_THROW(tokenize_file(temp("missing.txt"), temp("x.bin")), InputError);
}

TEST(Data, SyntheticIsDeterministicAndInRange) {
  const TokenSource a = TokenSource::synthetic(128, 1), b = TokenSource::synthetic(128, 1),
                    c = TokenSource::synthetic(128, 2);
  int32_t x[33], y[33], z[33];
  a.sequence(7, 32, x);
  b.sequence(7, 32, y);
  c.sequence(7, 32, z);
  bool differs = false;
  for (int i = 0; i < 33; ++i) {
    EXPECT_EQ(x[i], y[i]);
    EXPECT_GE(x[i], 0);
    EXPECT_LT(x[i], 128);
    differs |= x[i] != z[i];
    if (i > 0) {
      const int step = (x[i] - x[i - 1] + 128) % 128;
      EXPECT_GE(step, 1);
      EXPECT_LE(step, 3);
    }
  }
  EXPECT_TRUE(differs);
}

}  // namespace
}  // namespace ptdp
