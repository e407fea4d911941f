#include "runtime/tensor.h"

#include <algorithm>
#include <atomic>

namespace ptdp {
namespace {
std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
}  // namespace

void MemoryCounter::allocated(size_t bytes) {
  const int64_t now = g_current += static_cast<int64_t>(bytes);
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}
void MemoryCounter::freed(size_t bytes) {
  g_current -= static_cast<int64_t>(bytes);
}
int64_t MemoryCounter::current() {
  return g_current.load();
}
int64_t MemoryCounter::peak() {
  return g_peak.load();
}
void MemoryCounter::reset_peak() {
  g_peak = g_current.load();
}

}  // namespace ptdp
