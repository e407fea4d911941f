#include "runtime/staged_communicator.h"

#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

namespace ptdp {
namespace {

// A device range and the host bytes standing in for it.
struct Staged {
  void* device = nullptr;  // null: the operation's own pointer was host memory
  std::vector<uint8_t> host;
};

class StagedWork final : public Work {
 public:
  StagedWork(Backend& be, std::unique_ptr<Work> inner, std::vector<Staged> outputs)
      : be_(be), inner_(std::move(inner)), outputs_(std::move(outputs)) {}
  ~StagedWork() override {
    // Blocking forms have waited; an abandoned operation's outputs are not copied back.
    if (!done_ && inner_ && inner_->test()) finish();
  }
  bool test() override {
    if (done_) return true;
    if (!inner_->test()) return false;
    finish();
    return true;
  }
  void wait() override {
    if (done_) return;
    inner_->wait();
    finish();
  }
  void wait(CommDuration timeout) override {
    if (done_) return;
    inner_->wait(timeout);
    finish();
  }

 private:
  void finish() {
    done_ = true;
    for (Staged& s : outputs_)
      if (s.device) be_.upload(s.host.data(), s.device, s.host.size());
  }

  Backend& be_;
  std::unique_ptr<Work> inner_;
  std::vector<Staged> outputs_;
  bool done_ = false;
};

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(Communicator* inner, std::unique_ptr<Communicator> owned, Backend& be)
      : inner_(inner), owned_(std::move(owned)), be_(be) {
    set_name(inner_->name());
    set_timeout(inner_->timeout());
  }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }

 protected:
  std::unique_ptr<Communicator> make_split(int color, int key) override {
    auto child = inner_->split(color, key);
    Communicator* raw = child.get();
    return std::make_unique<StagedCommunicator>(raw, std::move(child), be_);
  }

  std::unique_ptr<Work> start_all_reduce(void* data, size_t n, DType t, DeviceStream s) override {
    sync();
    Staged io = stage_in(data, n * dtype_bytes(t));
    auto w = inner_->all_reduce_async(ptr(io, data), n, t, s);
    return done(std::move(w), one(std::move(io)));
  }
  std::unique_ptr<Work> start_all_gather(const void* in, void* out, size_t n, DType t,
                                         DeviceStream s) override {
    return copied(in, n, out, n * static_cast<size_t>(size()), t,
                  [&](const void* i, void* o) { return inner_->all_gather_async(i, o, n, t, s); });
  }
  std::unique_ptr<Work> start_reduce_scatter(const void* in, void* out, size_t n, DType t,
                                             DeviceStream s) override {
    if (in == out) {  // in place: the whole buffer goes down, this rank's block comes back
      sync();
      const size_t bytes = n * dtype_bytes(t);
      Staged io = stage_in(out, bytes * static_cast<size_t>(size()));
      void* p = ptr(io, out);
      auto w = inner_->reduce_scatter_async(p, p, n, t, s);
      if (io.device) io.host.resize(bytes);
      return done(std::move(w), one(std::move(io)));
    }
    return copied(in, n * static_cast<size_t>(size()), out, n, t, [&](const void* i, void* o) {
      return inner_->reduce_scatter_async(i, o, n, t, s);
    });
  }
  std::unique_ptr<Work> start_reduce_scatter_v(const void* in, void* out,
                                               std::span<const size_t> counts, DType t,
                                               DeviceStream s) override {
    if (in == out) {  // in place: the whole buffer goes down and comes back, its block summed
      sync();
      Staged io = stage_in(out, total(counts) * dtype_bytes(t));
      void* p = ptr(io, out);
      auto w = inner_->reduce_scatter_v_async(p, p, counts, t, s);
      return done(std::move(w), one(std::move(io)));
    }
    return copied(in, total(counts), out, mine(counts), t, [&](const void* i, void* o) {
      return inner_->reduce_scatter_v_async(i, o, counts, t, s);
    });
  }
  // Host copies do not alias: an in-place gather becomes an ordinary one.
  std::unique_ptr<Work> start_all_gather_v(const void* in, void* out,
                                           std::span<const size_t> counts, DType t,
                                           DeviceStream s) override {
    return copied(in, mine(counts), out, total(counts), t, [&](const void* i, void* o) {
      return inner_->all_gather_v_async(i, o, counts, t, s);
    });
  }
  std::unique_ptr<Work> start_broadcast(void* data, size_t n, DType t, int root,
                                        DeviceStream s) override {
    sync();
    Staged io = stage_in(data, n * dtype_bytes(t));
    auto w = inner_->broadcast_async(ptr(io, data), n, t, root, s);
    return done(std::move(w), one(std::move(io)));
  }
  std::unique_ptr<Work> start_batch(std::span<const P2P> ops, DeviceStream s) override {
    sync();
    std::vector<P2P> host(ops.begin(), ops.end());
    std::vector<Staged> outputs;
    std::vector<Staged> inputs;  // kept alive until the sends complete
    for (P2P& op : host) {
      const size_t bytes = op.n * dtype_bytes(op.dtype);
      Staged st = op.send ? stage_in(op.data, bytes) : stage_out(op.data, bytes);
      op.data = ptr(st, op.data);
      (op.send ? inputs : outputs).push_back(std::move(st));
    }
    auto w = inner_->batch_async(host, s);
    // Sends' host copies must outlive the operation: park them in the Work as outputs with
    // no device side.
    for (Staged& st : inputs) {
      st.device = nullptr;
      outputs.push_back(std::move(st));
    }
    return done(std::move(w), std::move(outputs));
  }
  std::unique_ptr<Work> start_barrier() override {
    sync();
    return inner_->barrier_async();
  }
  std::unique_ptr<Work> start_all_to_all_v(const void* in, std::span<const size_t> send_counts,
                                           void* out, std::span<const size_t> recv_counts, DType t,
                                           DeviceStream s) override {
    return copied(in, total(send_counts), out, total(recv_counts), t, [&](const void* i, void* o) {
      return inner_->all_to_all_v_async(i, send_counts, o, recv_counts, t, s);
    });
  }

 private:
  static size_t total(std::span<const size_t> counts) {
    return std::accumulate(counts.begin(), counts.end(), size_t{0});
  }
  size_t mine(std::span<const size_t> counts) const {
    const auto r = static_cast<size_t>(rank());
    return r < counts.size() ? counts[r] : 0;
  }
  // An operation reading n_in elements of `in` and writing n_out of `out` (separate buffers),
  // started by `start` on their host copies.
  template <class Start>
  std::unique_ptr<Work> copied(const void* in, size_t n_in, void* out, size_t n_out, DType t,
                               Start start) {
    sync();
    const size_t e = dtype_bytes(t);
    Staged src = stage_in(const_cast<void*>(in), n_in * e);
    Staged dst = stage_out(out, n_out * e);
    auto w = start(ptr(src, in), ptr(dst, out));
    return done(std::move(w), both(std::move(dst), std::move(src)));
  }
  // The inner group reports timeouts under this group's name and bound.
  void sync() {
    inner_->set_name(name());
    inner_->set_timeout(timeout());
  }
  Staged stage_in(void* p, size_t bytes) {
    Staged st;
    if (!p || bytes == 0 || !be_.device_pointer(p)) return st;
    st.device = p;
    st.host.resize(bytes);
    be_.download(p, st.host.data(), bytes);
    return st;
  }
  Staged stage_out(void* p, size_t bytes) {
    Staged st;
    if (!p || bytes == 0 || !be_.device_pointer(p)) return st;
    st.device = p;
    st.host.resize(bytes);
    return st;
  }
  static void* ptr(Staged& st, const void* original) {
    return st.device ? st.host.data() : const_cast<void*>(original);
  }
  // The output, copied back on completion, and the input, whose host copy the inner operation
  // may read until then.
  static std::vector<Staged> both(Staged out, Staged in) {
    std::vector<Staged> v = one(std::move(out));
    in.device = nullptr;
    v.push_back(std::move(in));
    return v;
  }
  static std::vector<Staged> one(Staged st) {
    std::vector<Staged> v;
    v.push_back(std::move(st));
    return v;
  }
  std::unique_ptr<Work> done(std::unique_ptr<Work> w, std::vector<Staged> outputs) {
    return std::make_unique<StagedWork>(be_, std::move(w), std::move(outputs));
  }

  Communicator* inner_;
  std::unique_ptr<Communicator> owned_;
  Backend& be_;
};

}  // namespace

std::unique_ptr<Communicator> make_host_staged_communicator(Communicator& inner, Backend& backend) {
  return std::make_unique<StagedCommunicator>(&inner, nullptr, backend);
}

}  // namespace ptdp
