#include "runtime/communicator.h"

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "runtime/watchdog.h"

namespace ptdp {

namespace {

// Seconds from the environment variable `name`, or `fallback` when it is unset or empty.
CommDuration seconds_from_env(const char* name, double fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return CommDuration(fallback);
  char* end = nullptr;
  const double s = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(s > 0))
    throw std::invalid_argument(std::string(name) + "='" + env +
                                "' is not a positive number of seconds");
  return CommDuration(s);
}

}  // namespace

CommDuration default_comm_timeout() {
  return seconds_from_env("PTDP_COMM_TIMEOUT_S", 300.0);
}

CommDuration stall_timeout() {
  return seconds_from_env("PTDP_STALL_TIMEOUT_S", 30.0);
}

namespace {

std::string timeout_message(const std::string& group, const std::string& operation,
                            const std::vector<int>& missing, CommDuration waited,
                            const std::string& detail) {
  std::ostringstream m;
  m << "communication timed out after " << waited.count() << " s: " << operation << " in group '"
    << group << "'";
  if (!missing.empty()) {
    m << "; not heard from: rank" << (missing.size() > 1 ? "s" : "");
    for (size_t i = 0; i < missing.size(); ++i) m << (i ? ", " : " ") << missing[i];
  }
  if (!detail.empty()) m << "; " << detail;
  return m.str();
}

}  // namespace

CommTimeout::CommTimeout(std::string group, std::string operation, std::vector<int> missing_ranks,
                         CommDuration waited, const std::string& detail)
    : std::runtime_error(timeout_message(group, operation, missing_ranks, waited, detail)),
      group_(std::move(group)),
      operation_(std::move(operation)),
      missing_(std::move(missing_ranks)) {}

Communicator::Communicator() : timeout_(default_comm_timeout()) {}

std::unique_ptr<Work> Communicator::start_all_to_all_v(const void*, std::span<const size_t>, void*,
                                                       std::span<const size_t>, DType,
                                                       DeviceStream) {
  throw std::logic_error("communicator '" + name() + "' has no all-to-all");
}

std::unique_ptr<Work> Communicator::start_reduce_scatter_v(const void*, void*,
                                                           std::span<const size_t>, DType,
                                                           DeviceStream) {
  throw std::logic_error("communicator '" + name() + "' has no uneven reduce-scatter");
}

std::unique_ptr<Work> Communicator::start_all_gather_v(const void*, void*, std::span<const size_t>,
                                                       DType, DeviceStream) {
  throw std::logic_error("communicator '" + name() + "' has no uneven all-gather");
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, std::string name) {
  auto c = make_split(color, key);
  c->set_name(name.empty() ? name_ + "/" + std::to_string(color) : std::move(name));
  c->set_timeout(timeout_);
  return c;
}

ControlPlane::ControlPlane() : timeout_(default_comm_timeout()) {}

int ControlPlane::agree(bool failed) {
  const std::vector<bool> flags = all_gather_flags(failed);
  for (size_t r = 0; r < flags.size(); ++r)
    if (flags[r]) return static_cast<int>(r);
  return -1;
}

std::unique_ptr<ControlPlane> ControlPlane::split(int color, int key, std::string name) {
  auto c = make_split(color, key);
  c->set_name(name.empty() ? name_ + "/" + std::to_string(color) : std::move(name));
  c->set_timeout(timeout_);
  return c;
}

namespace {

class DoneWork final : public Work {
 public:
  bool test() override { return true; }
  void wait() override {}
  void wait(CommDuration) override {}
};

std::unique_ptr<Work> done() {
  return std::make_unique<DoneWork>();
}

class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }

 protected:
  std::unique_ptr<Work> start_all_reduce(void*, size_t, DType, DeviceStream) override {
    return done();
  }
  std::unique_ptr<Work> start_all_gather(const void* in, void* out, size_t n, DType t,
                                         DeviceStream) override {
    if (in != out && n > 0) std::memmove(out, in, n * dtype_bytes(t));
    return done();
  }
  std::unique_ptr<Work> start_reduce_scatter(const void* in, void* out, size_t n, DType t,
                                             DeviceStream) override {
    if (in != out && n > 0) std::memmove(out, in, n * dtype_bytes(t));
    return done();
  }
  std::unique_ptr<Work> start_reduce_scatter_v(const void* in, void* out,
                                               std::span<const size_t> counts, DType t,
                                               DeviceStream) override {
    if (counts.size() != 1) throw std::invalid_argument("reduce-scatter counts of a group of one");
    if (counts[0] > 0 && in != out) std::memmove(out, in, counts[0] * dtype_bytes(t));
    return done();
  }
  std::unique_ptr<Work> start_all_gather_v(const void* in, void* out,
                                           std::span<const size_t> counts, DType t,
                                           DeviceStream) override {
    if (counts.size() != 1) throw std::invalid_argument("all-gather counts of a group of one");
    if (counts[0] > 0 && in != out) std::memmove(out, in, counts[0] * dtype_bytes(t));
    return done();
  }
  std::unique_ptr<Work> start_broadcast(void*, size_t, DType, int root, DeviceStream) override {
    if (root != 0) throw std::out_of_range("broadcast root " + std::to_string(root));
    return done();
  }
  std::unique_ptr<Work> start_batch(std::span<const P2P> ops, DeviceStream) override {
    if (!ops.empty()) throw std::logic_error("point-to-point in a group of one rank");
    return done();
  }
  std::unique_ptr<Work> start_barrier() override { return done(); }
  std::unique_ptr<Work> start_all_to_all_v(const void* in, std::span<const size_t> send, void* out,
                                           std::span<const size_t> recv, DType t,
                                           DeviceStream) override {
    if (send.size() != 1 || recv.size() != 1 || send[0] != recv[0])
      throw std::invalid_argument("all-to-all counts of a group of one rank");
    if (in != out && send[0] > 0) std::memmove(out, in, send[0] * dtype_bytes(t));
    return done();
  }
  std::unique_ptr<Communicator> make_split(int, int) override {
    return std::make_unique<SelfCommunicator>();
  }
};

class SelfControlPlane final : public ControlPlane {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::vector<bool> all_gather_flags(bool flag) override { return {flag}; }
  int64_t sum(int64_t x) override { return x; }
  int64_t max(int64_t x) override { return x; }
  double sum(double x) override { return x; }
  double max(double x) override { return x; }
  std::vector<std::vector<uint8_t>> all_gather_bytes(const std::vector<uint8_t>& mine) override {
    return {mine};
  }
  void barrier() override {}

 protected:
  std::unique_ptr<ControlPlane> make_split(int, int) override {
    return std::make_unique<SelfControlPlane>();
  }
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator() {
  return std::make_unique<SelfCommunicator>();
}

std::unique_ptr<ControlPlane> make_self_control_plane() {
  return std::make_unique<SelfControlPlane>();
}

}  // namespace ptdp
