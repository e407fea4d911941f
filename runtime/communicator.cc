#include "runtime/communicator.h"

#include <algorithm>
#include <stdexcept>

namespace ptdp {
namespace {

class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce(float*, size_t) override {}
  void all_gather(const float* in, float* out, size_t n) override {
    if (in != out) std::copy(in, in + n, out);
  }
  void reduce_scatter(const float* in, float* out, size_t n) override {
    if (in != out) std::copy(in, in + n, out);
  }
  void broadcast(float*, size_t, int) override {}
  void barrier() override {}
  void batch(std::span<const P2P> ops) override {
    if (!ops.empty()) throw std::logic_error("point-to-point in a group of one rank");
  }
  std::unique_ptr<Communicator> split(int, int) override {
    return std::make_unique<SelfCommunicator>();
  }
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator() {
  return std::make_unique<SelfCommunicator>();
}

}  // namespace ptdp
