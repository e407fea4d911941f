// The MPI backend of Communicator and ControlPlane (OpenMPI from Debian). Host memory only.
//
// Every operation is posted with a non-blocking call (MPI_Iallreduce, MPI_Iallgather,
// MPI_Ireduce_scatter_block, MPI_Ibcast, MPI_Ibarrier, MPI_Isend/MPI_Irecv) and completed by
// polling MPI_Testsome, spinning (and yielding the core) for 20 ms and then sleeping with a
// pause growing from 20 to 250 us, until done or until the timeout, when CommTimeout is thrown.
// Polling also drives MPI's progress for the non-blocking collectives.
//
// bf16 and fp16 travel as 16-bit words (MPI_UINT16_T) and are summed by user-defined MPI ops
// (MPI_Op_create, commutative) that widen both operands to fp32, add, and round back to 16 bits
// with runtime/float16.h: one rounding per reduction step, half the traffic of an fp32 detour.
//
// Lost ranks. MPI starts with MPI_THREAD_MULTIPLE where the library provides it, for the
// watchdog thread (runtime/watchdog.h). A wait that lasts the stall timeout, or an MPI error
// while polling, makes the rank ask every peer whether it is alive: a lost peer is named and
// the job aborted; if all answer, the wait goes on up to the communicator's timeout.
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/float16.h"
#include "runtime/watchdog.h"

namespace ptdp {
namespace {

using Clock = std::chrono::steady_clock;

void check(int rc, const std::string& what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw std::runtime_error("MPI " + what + ": " + std::string(msg, static_cast<size_t>(len)));
  }
}

int count(size_t n) {
  if (n > static_cast<size_t>(INT32_MAX)) throw std::length_error("MPI message too large");
  return static_cast<int>(n);
}

void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

void fp16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = float_to_fp16(fp16_to_float(a[i]) + fp16_to_float(b[i]));
}

MPI_Op g_bf16_sum = MPI_OP_NULL;
MPI_Op g_fp16_sum = MPI_OP_NULL;

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::kF32:
      return MPI_FLOAT;
    case DType::kBF16:
    case DType::kF16:
      return MPI_UINT16_T;
    case DType::kI32:
      return MPI_INT32_T;
    case DType::kI64:
      return MPI_INT64_T;
    case DType::kF64:
      return MPI_DOUBLE;
  }
  throw std::invalid_argument("unknown DType");
}

MPI_Op sum_op(DType t) {
  if (t == DType::kBF16) return g_bf16_sum;
  if (t == DType::kF16) return g_fp16_sum;
  return MPI_SUM;
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  stop_watchdog();
  if (g_bf16_sum != MPI_OP_NULL) MPI_Op_free(&g_bf16_sum);
  if (g_fp16_sum != MPI_OP_NULL) MPI_Op_free(&g_fp16_sum);
  MPI_Finalize();
}

// MPI_Init on first use (MPI_Finalize at exit), the 16-bit sum ops, and error codes instead of
// aborts on COMM_WORLD (communicators split or duplicated from it inherit that).
void ensure_mpi() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    std::atexit(finalize_at_exit);
    start_watchdog(provided >= MPI_THREAD_MULTIPLE);
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  if (g_bf16_sum == MPI_OP_NULL) check(MPI_Op_create(bf16_sum, 1, &g_bf16_sum), "op create");
  if (g_fp16_sum == MPI_OP_NULL) check(MPI_Op_create(fp16_sum, 1, &g_fp16_sum), "op create");
}

// A communicator's identity for messages: its name and its members' world ranks.
struct GroupInfo {
  MPI_Comm comm = MPI_COMM_NULL;
  std::string name;
  std::vector<int> world_ranks;  // indexed by rank in the group
};

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? "," : "") << ranks[i];
  return s.str();
}

std::vector<int> world_ranks_of(MPI_Comm comm) {
  int n = 0;
  MPI_Comm_size(comm, &n);
  MPI_Group g, w;
  MPI_Comm_group(comm, &g);
  MPI_Comm_group(MPI_COMM_WORLD, &w);
  std::vector<int> mine(static_cast<size_t>(n)), world(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) mine[static_cast<size_t>(i)] = i;
  MPI_Group_translate_ranks(g, n, mine.data(), w, world.data());
  MPI_Group_free(&g);
  MPI_Group_free(&w);
  return world;
}

// One posted operation: its requests, and what to say if it does not complete.
class MpiWork final : public Work {
 public:
  struct Peer {  // for point-to-point requests: who the other side is
    bool send;
    int peer, tag;
    size_t n;
    DType dtype;
  };

  MpiWork(const GroupInfo& group, std::string operation, CommDuration timeout)
      : group_name_(group.name),
        world_ranks_(group.world_ranks),
        operation_(std::move(operation)),
        timeout_(timeout),
        stall_(stall_timeout()) {}

  ~MpiWork() override {
    if (remaining_ == 0) return;
    try {
      // Not waited on (an exception unwound past it): give it the usual bound before the
      // buffers go away, unless a wait has already timed out.
      if (!timed_out_ && poll(timeout_)) return;
    } catch (const std::exception&) {
    }
    abandon();
  }

  MPI_Request* add(const Peer* peer = nullptr) {
    reqs_.push_back(MPI_REQUEST_NULL);
    if (peer) peers_.push_back(*peer);
    ++remaining_;
    return &reqs_.back();
  }
  void reserve(size_t n) { reqs_.reserve(n); }
  // Buffers the operation uses, freed with the Work, or never if it is abandoned unfinished.
  void keep(std::shared_ptr<void> buffers) { keep_ = std::move(buffers); }

  bool test() override { return poll(CommDuration(0)); }
  void wait() override { wait(timeout_); }
  void wait(CommDuration timeout) override {
    if (poll(timeout)) return;
    timed_out_ = true;
    std::vector<int> missing;
    std::ostringstream detail;
    if (peers_.empty()) {
      detail << "a collective: MPI does not say which ranks have not joined; the group's world "
                "ranks are "
             << group_world_ranks();
    } else {
      detail << "pending:";
      bool first = true;
      for (size_t i = 0; i < reqs_.size(); ++i) {
        if (reqs_[i] == MPI_REQUEST_NULL) continue;
        const Peer& p = peers_[i];
        missing.push_back(p.peer);
        detail << (first ? " " : ", ") << (p.send ? "send of " : "recv of ") << p.n << " "
               << to_string(p.dtype) << (p.send ? " to rank " : " from rank ") << p.peer
               << " (world rank " << world_rank(p.peer) << ") tag " << p.tag;
        first = false;
      }
      std::sort(missing.begin(), missing.end());
      missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
    }
    throw CommTimeout(group_name_, operation_, std::move(missing), timeout, detail.str());
  }

 private:
  // Tests the requests until all are done (true) or `timeout` has passed (false). Each time
  // the wait has lasted the stall timeout, and on an MPI error, the watchdog checks that every
  // peer is alive (and aborts the job if one is not).
  // How long a wait polls without sleeping (then the pause grows from 20 to 250 us).
  static constexpr std::chrono::milliseconds kSpin{20};

  bool poll(CommDuration timeout) {
    if (remaining_ == 0) return true;
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(timeout);
    const auto stall = std::chrono::duration_cast<Clock::duration>(stall_);
    auto next_check = start + stall;
    auto pause = std::chrono::microseconds(20);
    std::vector<int> done(reqs_.size());
    for (;;) {
      int outcount = 0;
      const int rc = MPI_Testsome(static_cast<int>(reqs_.size()), reqs_.data(), &outcount,
                                  done.data(), MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(rc, msg, &len);
        watchdog_check_peers(group_name_, operation_, Clock::now() - start,
                             "MPI error: " + std::string(msg, static_cast<size_t>(len)));
        check(rc, operation_);  // every peer answers: an error of this rank's own
      }
      // MPI_UNDEFINED: no active request is left (also when a post failed and left none).
      remaining_ = outcount == MPI_UNDEFINED ? 0 : remaining_ - static_cast<size_t>(outcount);
      if (remaining_ == 0) return true;
      auto now = Clock::now();
      if (now >= deadline) return false;
      if (now >= next_check && watchdog_active()) {
        watchdog_check_peers(group_name_, operation_, now - start);
        now = Clock::now();
        next_check = now + stall;
        if (now >= deadline) return false;
      }
      // Spin first, yielding the core to any rank that shares it: tensor-parallel ranks meet
      // in a collective every few hundred microseconds, and one that slept would arrive late
      // to the next (and leave its non-blocking collective without progress meanwhile).
      if (now - start < kSpin) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, std::chrono::microseconds(250));
    }
  }

  // Gives up on what is still pending: receives are cancelled (their completion is then local),
  // sends are freed (OpenMPI cannot cancel a send), collectives cannot be cancelled or freed in
  // MPI and are left behind.
  void abandon() {
    bool collective = false;
    for (size_t i = 0; i < reqs_.size(); ++i) {
      if (reqs_[i] == MPI_REQUEST_NULL) continue;
      if (peers_.empty())
        collective = true;
      else if (!peers_[i].send)
        MPI_Cancel(&reqs_[i]);
    }
    if (!collective) {
      try {
        poll(CommDuration(1.0));
      } catch (const std::exception&) {
      }
      for (MPI_Request& r : reqs_)
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
      return;
    }
    static auto* graveyard = new std::vector<std::shared_ptr<void>>;  // never freed
    if (keep_) graveyard->push_back(std::move(keep_));
    std::fprintf(stderr,
                 "ptdp: abandoning an unfinished %s in group '%s' (world ranks %s); its buffers "
                 "may still be written\n",
                 operation_.c_str(), group_name_.c_str(), group_world_ranks().c_str());
  }

  int world_rank(int r) const {
    return r >= 0 && static_cast<size_t>(r) < world_ranks_.size()
               ? world_ranks_[static_cast<size_t>(r)]
               : -1;
  }
  std::string group_world_ranks() const { return rank_list(world_ranks_); }

  std::string group_name_;
  std::vector<int> world_ranks_;
  std::string operation_;
  CommDuration timeout_, stall_;
  std::vector<MPI_Request> reqs_;
  std::vector<Peer> peers_;  // parallel to reqs_ for a point-to-point batch, else empty
  size_t remaining_ = 0;
  bool timed_out_ = false;
  std::shared_ptr<void> keep_;
};

std::string describe(const char* op, size_t n, DType t) {
  return std::string(op) + " of " + std::to_string(n) + " " + to_string(t);
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, bool owned) : owned_(owned) {
    g_.comm = comm;
    MPI_Comm_rank(comm, &rank_);
    MPI_Comm_size(comm, &size_);
    g_.world_ranks = world_ranks_of(comm);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&g_.comm);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

 protected:
  std::unique_ptr<Work> start_all_reduce(void* data, size_t n, DType t, DeviceStream) override {
    auto w = work(describe("all-reduce", n, t));
    check(MPI_Iallreduce(MPI_IN_PLACE, data, count(n), mpi_type(t), sum_op(t), g_.comm, w->add()),
          "all-reduce");
    return w;
  }
  std::unique_ptr<Work> start_all_gather(const void* in, void* out, size_t n, DType t,
                                         DeviceStream) override {
    auto w = work(describe("all-gather", n, t));
    const MPI_Datatype m = mpi_type(t);
    check(MPI_Iallgather(in, count(n), m, out, count(n), m, g_.comm, w->add()), "all-gather");
    return w;
  }
  std::unique_ptr<Work> start_reduce_scatter(const void* in, void* out, size_t n, DType t,
                                             DeviceStream) override {
    auto w = work(describe("reduce-scatter", n, t));
    // in == out: MPI_IN_PLACE, the input read from out and the result left in its first block.
    check(MPI_Ireduce_scatter_block(in == out ? MPI_IN_PLACE : in, out, count(n), mpi_type(t),
                                    sum_op(t), g_.comm, w->add()),
          "reduce-scatter");
    return w;
  }
  std::unique_ptr<Work> start_reduce_scatter_v(const void* in, void* out,
                                               std::span<const size_t> counts, DType t,
                                               DeviceStream) override {
    if (counts.size() != static_cast<size_t>(size_))
      throw std::invalid_argument("reduce-scatter: one count per rank");
    auto v = std::make_shared<std::vector<int>>(counts.size());
    size_t total = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      (*v)[r] = count(counts[r]);
      total += counts[r];
    }
    auto w = work(describe("reduce-scatter", total, t));
    w->keep(v);
    if (in == out) {
      // In place, each block's sum where the block is: one reduce to each block's rank
      // (MPI_IN_PLACE's reduce-scatter would put this rank's block at the buffer's start).
      char* base = static_cast<char*>(out);
      size_t at = 0;
      for (int r = 0; r < size_; ++r) {
        void* block = base + at * dtype_bytes(t);
        check(MPI_Ireduce(r == rank_ ? MPI_IN_PLACE : block, block, (*v)[static_cast<size_t>(r)],
                          mpi_type(t), sum_op(t), r, g_.comm, w->add()),
              "reduce-scatter");
        at += counts[static_cast<size_t>(r)];
      }
      return w;
    }
    check(MPI_Ireduce_scatter(in, out, v->data(), mpi_type(t), sum_op(t), g_.comm, w->add()),
          "reduce-scatter");
    return w;
  }
  std::unique_ptr<Work> start_all_gather_v(const void* in, void* out,
                                           std::span<const size_t> counts, DType t,
                                           DeviceStream) override {
    const auto n = static_cast<size_t>(size_);
    if (counts.size() != n) throw std::invalid_argument("all-gather: one count per rank");
    auto v = std::make_shared<std::vector<int>>(2 * n);  // counts, then displacements
    size_t at = 0;
    for (size_t r = 0; r < n; ++r) {
      (*v)[r] = count(counts[r]);
      (*v)[n + r] = count(at);
      at += counts[r];
    }
    auto w = work(describe("all-gather", at, t));
    w->keep(v);
    const MPI_Datatype m = mpi_type(t);
    // This rank's own block of out: MPI_IN_PLACE (MPI forbids aliased buffers otherwise).
    const void* own = static_cast<const char*>(out) +
                      static_cast<size_t>((*v)[n + static_cast<size_t>(rank_)]) * dtype_bytes(t);
    check(MPI_Iallgatherv(in == own ? MPI_IN_PLACE : in, (*v)[static_cast<size_t>(rank_)], m, out,
                          v->data(), v->data() + n, m, g_.comm, w->add()),
          "all-gather");
    return w;
  }
  std::unique_ptr<Work> start_all_to_all_v(const void* in, std::span<const size_t> send, void* out,
                                           std::span<const size_t> recv, DType t,
                                           DeviceStream) override {
    const auto n = static_cast<size_t>(size_);
    if (send.size() != n || recv.size() != n)
      throw std::invalid_argument("all-to-all: one send and one receive count per rank");
    // Counts and displacements as MPI wants them (int), kept alive with the Work.
    auto v = std::make_shared<std::vector<int>>(4 * n);
    int* sc = v->data();
    int *sd = sc + n, *rc = sc + 2 * n, *rd = sc + 3 * n;
    size_t s_at = 0, r_at = 0;
    for (size_t r = 0; r < n; ++r) {
      sc[r] = count(send[r]);
      sd[r] = count(s_at);
      rc[r] = count(recv[r]);
      rd[r] = count(r_at);
      s_at += send[r];
      r_at += recv[r];
    }
    auto w = work(describe("all-to-all", s_at, t));
    w->keep(v);
    const MPI_Datatype m = mpi_type(t);
    check(MPI_Ialltoallv(in, sc, sd, m, out, rc, rd, m, g_.comm, w->add()), "all-to-all");
    return w;
  }
  std::unique_ptr<Work> start_broadcast(void* data, size_t n, DType t, int root,
                                        DeviceStream) override {
    auto w = work(describe("broadcast", n, t) + " from rank " + std::to_string(root));
    check(MPI_Ibcast(data, count(n), mpi_type(t), root, g_.comm, w->add()), "broadcast");
    return w;
  }
  std::unique_ptr<Work> start_batch(std::span<const P2P> ops, DeviceStream) override {
    auto w = work("point-to-point batch of " + std::to_string(ops.size()));
    w->reserve(ops.size());
    for (const P2P& o : ops) {
      const MpiWork::Peer peer{o.send, o.peer, o.tag, o.n, o.dtype};
      MPI_Request* r = w->add(&peer);
      if (o.send)
        check(MPI_Isend(o.data, count(o.n), mpi_type(o.dtype), o.peer, o.tag, g_.comm, r), "send");
      else
        check(MPI_Irecv(o.data, count(o.n), mpi_type(o.dtype), o.peer, o.tag, g_.comm, r), "recv");
    }
    return w;
  }
  std::unique_ptr<Work> start_barrier() override {
    auto w = work("barrier");
    check(MPI_Ibarrier(g_.comm, w->add()), "barrier");
    return w;
  }
  std::unique_ptr<Communicator> make_split(int color, int key) override {
    MPI_Comm sub;
    check(MPI_Comm_split(g_.comm, color, key, &sub), "split");
    return std::make_unique<MpiCommunicator>(sub, true);
  }

 private:
  std::unique_ptr<MpiWork> work(std::string operation) {
    g_.name = name();
    return std::make_unique<MpiWork>(g_, std::move(operation), timeout());
  }

  GroupInfo g_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

class MpiControlPlane final : public ControlPlane {
 public:
  explicit MpiControlPlane(MPI_Comm comm) {
    g_.comm = comm;
    MPI_Comm_rank(comm, &rank_);
    MPI_Comm_size(comm, &size_);
    g_.world_ranks = world_ranks_of(comm);
  }
  ~MpiControlPlane() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&g_.comm);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::vector<bool> all_gather_flags(bool flag) override {
    const std::vector<uint8_t> all = gather<uint8_t>(flag ? 1 : 0, MPI_UINT8_T, "flag all-gather");
    return std::vector<bool>(all.begin(), all.end());
  }
  int64_t sum(int64_t x) override { return reduce(x, MPI_INT64_T, MPI_SUM, "int64 sum"); }
  int64_t max(int64_t x) override { return reduce(x, MPI_INT64_T, MPI_MAX, "int64 max"); }
  double sum(double x) override {
    double s = 0;
    for (double v : gather(x, MPI_DOUBLE, "double sum")) s += v;
    return s;
  }
  double max(double x) override { return reduce(x, MPI_DOUBLE, MPI_MAX, "double max"); }
  std::vector<std::vector<uint8_t>> all_gather_bytes(const std::vector<uint8_t>& mine) override {
    const std::vector<int64_t> sizes =
        gather(static_cast<int64_t>(mine.size()), MPI_INT64_T, "byte all-gather (sizes)");
    // Everything MPI reads or writes until completion, the count arrays included, lives in
    // `s`, which the Work keeps (MpiWork::keep).
    struct Scratch {
      std::vector<int> counts, displs;
      std::vector<uint8_t> mine, flat;
    };
    auto s = std::make_shared<Scratch>();
    s->counts.resize(sizes.size());
    s->displs.resize(sizes.size());
    int64_t total = 0;
    for (size_t r = 0; r < sizes.size(); ++r) {
      s->displs[r] = count(static_cast<size_t>(total));
      s->counts[r] = count(static_cast<size_t>(sizes[r]));
      total += sizes[r];
    }
    s->mine = mine;
    s->mine.push_back(0);                            // never a null buffer
    s->flat.resize(static_cast<size_t>(total) + 1);  // likewise
    auto w = work("byte all-gather of " + std::to_string(total) + " bytes");
    w->keep(s);
    check(MPI_Iallgatherv(s->mine.data(), s->counts[static_cast<size_t>(rank_)], MPI_UINT8_T,
                          s->flat.data(), s->counts.data(), s->displs.data(), MPI_UINT8_T, g_.comm,
                          w->add()),
          "byte all-gather");
    w->wait();
    std::vector<std::vector<uint8_t>> out(sizes.size());
    for (size_t r = 0; r < sizes.size(); ++r) {
      const auto at = s->flat.begin() + s->displs[r];
      out[r].assign(at, at + s->counts[r]);
    }
    return out;
  }
  void barrier() override {
    auto w = work("control barrier");
    check(MPI_Ibarrier(g_.comm, w->add()), "barrier");
    w->wait();
  }

 protected:
  std::unique_ptr<ControlPlane> make_split(int color, int key) override {
    MPI_Comm sub;
    check(MPI_Comm_split(g_.comm, color, key, &sub), "split");
    return std::make_unique<MpiControlPlane>(sub);
  }

 private:
  std::unique_ptr<MpiWork> work(std::string operation) {
    g_.name = name();
    return std::make_unique<MpiWork>(g_, std::move(operation), timeout());
  }
  // Each rank's x, by rank. The buffers are the Work's (kept if it is abandoned).
  template <class T>
  std::vector<T> gather(T x, MPI_Datatype t, const char* what) {
    auto s = std::make_shared<std::vector<T>>(static_cast<size_t>(size_) + 1);
    s->back() = x;
    auto w = work(what);
    w->keep(s);
    check(MPI_Iallgather(&s->back(), 1, t, s->data(), 1, t, g_.comm, w->add()), what);
    w->wait();
    s->pop_back();
    return *s;
  }
  template <class T>
  T reduce(T x, MPI_Datatype t, MPI_Op op, const char* what) {
    auto s = std::make_shared<T>(x);
    auto w = work(what);
    w->keep(s);
    check(MPI_Iallreduce(MPI_IN_PLACE, s.get(), 1, t, op, g_.comm, w->add()), what);
    w->wait();
    return *s;
  }

  GroupInfo g_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool mpi_available() {
  return true;
}

std::unique_ptr<Communicator> make_mpi_world() {
  ensure_mpi();
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, false);
}

std::unique_ptr<ControlPlane> make_mpi_control_plane() {
  ensure_mpi();
  MPI_Comm dup;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "control-plane duplicate");
  return std::make_unique<MpiControlPlane>(dup);
}

}  // namespace ptdp
