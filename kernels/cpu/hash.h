// Small deterministic hashes: splitmix64 (synthetic data, initial weights) and
// FNV-1a (parameter names, checkpoint checksums).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace ptdp {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t fnv1a(std::string_view bytes, uint64_t h = 1469598103934665603ULL) {
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ULL;
  return h;
}

}  // namespace ptdp
