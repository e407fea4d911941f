#include "calibration/measure.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <set>
#include <stdexcept>
#include <tuple>

#include "runtime/gpt_model.h"
#include "runtime/op_executor.h"
#include "runtime/tensor.h"

namespace ptdp {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// A tensor-parallel group of size t for ops that do not communicate (GEMMs and memory-bound
// kernels): what the op executor needs to shape them. Any data movement is a bug.
class ShapeOnlyGroup final : public Communicator {
 public:
  explicit ShapeOnlyGroup(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }

 protected:
  [[noreturn]] static void refuse() {
    throw std::logic_error("calibration: a compute op tried to communicate");
  }
  std::unique_ptr<Communicator> make_split(int, int) override { refuse(); }
  std::unique_ptr<Work> start_all_reduce(void*, size_t, DType, DeviceStream) override { refuse(); }
  std::unique_ptr<Work> start_all_gather(const void*, void*, size_t, DType, DeviceStream) override {
    refuse();
  }
  std::unique_ptr<Work> start_reduce_scatter(const void*, void*, size_t, DType,
                                             DeviceStream) override {
    refuse();
  }
  std::unique_ptr<Work> start_broadcast(void*, size_t, DType, int, DeviceStream) override {
    refuse();
  }
  std::unique_ptr<Work> start_batch(std::span<const P2P>, DeviceStream) override { refuse(); }
  std::unique_ptr<Work> start_barrier() override { refuse(); }

 private:
  int size_;
};

bool executed(OpId id) {
  return id != OpId::kWeightGradAccumulate && id != OpId::kEmbeddingGradAccumulate &&
         id != OpId::kOutputGradAccumulate;
}

}  // namespace

std::pair<double, double> Stopwatch::run(const std::function<void()>& f, int warmup,
                                         const std::function<void()>& before) {
  for (int i = 0; i < warmup; ++i) f();
  control_.barrier();
  auto t0 = Clock::now();
  if (before) before();
  f();
  const double one = control_.max(since(t0));
  // The loop in chunks, each started together; a rank's time is the mean over them: a run
  // sees every preemption by other work on the machine, so the measurement does too (as
  // nccl-tests averages its iterations).
  constexpr int kChunks = 5;
  const int64_t per_chunk = static_cast<int64_t>(
      std::clamp(std::ceil(target_s_ / kChunks / std::max(one, 1e-7)), 1.0, 20000.0));
  std::vector<double> chunk(kChunks);
  for (double& c : chunk) {
    control_.barrier();
    double wall = 0, cpu = 0;
    if (before) {  // the untimed eviction is left out of the CPU time as of the wall time
      for (int64_t i = 0; i < per_chunk; ++i) {
        before();
        t0 = Clock::now();  // the CPU time's window inside the wall time's
        const double cpu0 = thread_cpu_seconds();
        f();
        cpu += thread_cpu_seconds() - cpu0;
        wall += since(t0);
      }
    } else {
      t0 = Clock::now();
      const double cpu0 = thread_cpu_seconds();
      for (int64_t i = 0; i < per_chunk; ++i) f();
      cpu = thread_cpu_seconds() - cpu0;
      wall = since(t0);
    }
    c = wall / static_cast<double>(per_chunk);
    wall_s_ += wall;
    cpu_s_ += cpu;
  }
  double per = 0;
  for (double c : chunk) per += c / kChunks;
  return {control_.sum(per) / control_.size(), control_.max(per)};
}

double Stopwatch::mean_seconds(const std::function<void()>& f,
                               const std::function<void()>& before) {
  return run(f, 1, before).first;
}

CacheEvictor::CacheEvictor(double last_level_cache_bytes, Backend* device) : device_(device) {
  const size_t n =
      static_cast<size_t>(std::clamp(2 * last_level_cache_bytes, 1e6, 4e9) / sizeof(float));
  if (!device_) {
    junk_size_ = n;  // allocated on first use: a host backend that flushes never needs it
    return;
  }
  device_bytes_ = n * sizeof(float);
  device_junk_ = device_->allocate(device_bytes_);
}

CacheEvictor::~CacheEvictor() {
  if (device_junk_) device_->deallocate(device_junk_, device_bytes_);
}

void CacheEvictor::operator()() {
  if (device_) {
    // Read, not written: a write leaves the cache full of dirty lines, and the op timed next
    // would pay for writing the evictor's junk back to memory (on an H100, 50 MiB of L2: some
    // 17 us), which no op of a training step pays for another's data.
    volatile double sink =
        device_->sum_squares(static_cast<const float*>(device_junk_),
                             static_cast<int64_t>(device_bytes_ / sizeof(float)), 0.0);
    (void)sink;
    device_->synchronize();
    return;
  }
  stream(HUGE_VAL);
}

void CacheEvictor::stream(double bytes) {
  if (device_) {
    const auto n =
        static_cast<int64_t>(std::min(bytes, static_cast<double>(device_bytes_)) / sizeof(float));
    volatile double sink = device_->sum_squares(static_cast<const float*>(device_junk_), n, 0.0);
    (void)sink;
    device_->synchronize();
    return;
  }
  if (junk_.empty()) junk_.assign(junk_size_, 1.0f);
  const auto n =
      static_cast<size_t>(std::min(bytes / sizeof(float), static_cast<double>(junk_.size())));
  // One float per 64-byte line brings every line in.
  float sum = 0;
  for (size_t i = 0; i < n; i += 16) sum += junk_[i];
  volatile float sink = sum;
  (void)sink;
}

double Stopwatch::max_seconds(const std::function<void()>& f, int warmup) {
  return run(f, warmup).second;
}

// On a device whose kernels run asynchronously, a timed call that synchronises after one kernel
// measures the launch and the synchronisation too (some 10 us on an H100, more than many of the
// kernels themselves), which a training step's back-to-back kernels do not pay. So each timed
// call there queues the work kDeviceRepeats times and synchronises once; the mean per repeat is
// the kernel and the gap before the next. Host backends run each call as it is issued.
constexpr int kDeviceRepeats = 8;

ShardLayout op_layout(const ModelSpec& m, int64_t t, int64_t b, DType type) {
  ShardLayout l;
  l.t = t;
  l.micro_batch = b;
  l.dtype = type;
  l.sequence_parallel = m.is_moe() && t > 1;
  return l;
}

int repeats(const Backend& be) {
  return be.host_accessible() ? 1 : kDeviceRepeats;
}

std::vector<Op> executed_ops(const ModelSpec& m, int64_t t, int64_t b, DType type) {
  const ShardLayout l = op_layout(m, t, b, type);
  const LayerShape s = runtime_layer_shape(m, l);
  std::vector<Op> out;
  std::vector<PassOps> passes;
  if (m.num_moe_layers() < m.num_layers) passes.push_back(transformer_layer_ops(m, s));
  if (m.is_moe()) passes.push_back(moe_layer_ops(m, s));  // router, experts, (un)permutation
  passes.push_back(embedding_ops(m, s));
  passes.push_back(lm_head_ops(m, s));
  for (const PassOps& pass : passes)
    for (const std::vector<Op>* ops : {&pass.forward, &pass.backward})
      for (const Op& op : *ops)
        if (executed(op.id)) out.push_back(op);
  return out;
}

std::vector<Op> timed_ops(const ModelSpec& m, int64_t t, int64_t b, DType type,
                          const std::function<bool(const Op&)>& which) {
  // The same kernel on the same shape is timed once.
  std::vector<Op> ops;
  std::set<std::tuple<int, int64_t, int64_t, int64_t, int64_t, double>> seen;
  for (const Op& op : executed_ops(m, t, b, type)) {
    if (op.kind == OpKind::kCollective || (which && !which(op))) continue;
    if (seen.emplace(static_cast<int>(op.id), op.m, op.n, op.k, op.batch, op.bytes).second)
      ops.push_back(op);
  }
  return ops;
}

std::vector<OpSample> measure_ops(Backend& be, const ModelSpec& m,
                                  const std::vector<std::pair<int64_t, int64_t>>& tb, Stopwatch& sw,
                                  CacheEvictor* evict,
                                  const std::function<void(int, int)>& progress, DType type,
                                  const std::function<bool(const Op&)>& which) {
  std::vector<std::vector<Op>> todo;
  int total = 0;
  for (const auto& [t, b] : tb) {
    std::vector<Op> ops = timed_ops(m, t, b, type, which);
    total += static_cast<int>(ops.size()) * (evict ? 2 : 1);
    todo.push_back(std::move(ops));
  }
  std::vector<OpSample> out;
  int done = 0;
  for (size_t i = 0; i < tb.size(); ++i) {
    const auto [t, b] = tb[i];
    const ShardLayout l = op_layout(m, t, b, type);
    ShapeOnlyGroup group(static_cast<int>(t));
    OpExecutor exec(be, &group, m, l);
    for (const Op& op : todo[i]) {
      OpSample s;
      s.op = op;
      s.t = t;
      s.b = b;
      const int reps = repeats(be);
      auto call = [&] {
        exec.run(op);
        be.synchronize();
      };
      auto calls = [&] {
        for (int r = 0; r < reps; ++r) exec.run(op);
        be.synchronize();
      };
      s.seconds = sw.mean_seconds(calls) / reps;
      if (reps > 1) {  // the issue alone, the device drained before each call (untimed)
        s.host_seconds = sw.mean_seconds(
                             [&] {
                               for (int r = 0; r < reps; ++r) exec.run(op);
                             },
                             [&] { be.synchronize(); }) /
                         reps;
      }
      if (progress) progress(++done, total);
      if (evict) {
        // One call after the eviction, synchronised; the synchronisation's own cost (a warm
        // single call less the warm repeated mean) comes off again.
        // The input's touch must have run before the clock starts: on a device it is a kernel
        // queued asynchronously, and without the synchronisation the cold time counted it too
        // (on an H100 some 7 us on every op, 30 times the time of the smallest).
        const double cold_once = sw.mean_seconds(call, [&] {
          if (!exec.flush_from_caches()) (*evict)();
          exec.touch_input();
          be.synchronize();
        });
        const double warm_once = reps > 1 ? sw.mean_seconds(call) : s.seconds;
        s.cold_seconds = std::max(s.seconds, cold_once - (warm_once - s.seconds));
        if (progress) progress(++done, total);
      }
      out.push_back(s);
    }
  }
  return out;
}

CacheHits measure_cache_hits(Backend& be, const ModelSpec& m, int64_t t, int64_t b, Stopwatch& sw,
                             CacheEvictor& evict, const std::vector<double>& stream_bytes,
                             DType type) {
  CacheHits out;
  const std::vector<Op> ops =
      timed_ops(m, t, b, type, [](const Op& op) { return op.kind == OpKind::kGemm && !op.fused; });
  if (ops.empty()) return out;
  out.op = *std::max_element(ops.begin(), ops.end(),
                             [](const Op& x, const Op& y) { return x.flops() < y.flops(); });
  const ShardLayout l = op_layout(m, t, b, type);
  ShapeOnlyGroup group(static_cast<int>(t));
  OpExecutor exec(be, &group, m, l);
  auto call = [&] {
    exec.run(out.op);
    be.synchronize();
  };
  // Each timing after its stream, then the input operand read (the op before it leaves it).
  auto after = [&](const std::function<void()>& stream) {
    return sw.mean_seconds(call, [&] {
      stream();
      exec.touch_input();
      be.synchronize();
    });
  };
  out.warm_seconds = after([] {});
  out.cold_seconds = std::max(out.warm_seconds, after([&] { evict(); }));
  for (double bytes : stream_bytes) {
    CacheHitSample s;
    s.bytes = bytes;
    s.seconds = after([&] { evict.stream(bytes); });
    const double span = out.cold_seconds - out.warm_seconds;
    s.hit = span > 0 ? std::clamp((out.cold_seconds - s.seconds) / span, 0.0, 1.0) : 1.0;
    out.samples.push_back(s);
  }
  return out;
}

double time_linear(Backend& be, int64_t m, int64_t n, int64_t k, Stopwatch& sw, DType type) {
  Buffer x(static_cast<size_t>(m * k), 0.01f), w(static_cast<size_t>(n * k), 0.02f),
      y(static_cast<size_t>(m * n), type);
  if (type != DType::kF32) {  // the same values, narrowed
    Buffer xt(x.size(), type), wt(w.size(), type);
    be.copy(x.ptr(), xt.ptr(), elems(x));
    be.copy(w.ptr(), wt.ptr(), elems(w));
    x.swap(xt);
    w.swap(wt);
  }
  const int reps = repeats(be);
  return sw.mean_seconds([&] {
    for (int r = 0; r < reps; ++r) be.linear_forward(x.ptr(), w.ptr(), nullptr, y.ptr(), m, k, n);
    be.synchronize();
  }) / reps;
}

double stream_bandwidth(Backend& be, int64_t n, Stopwatch& sw) {
  Buffer x(static_cast<size_t>(n), 1e-3f), y(static_cast<size_t>(n), 0.f);
  const int reps = repeats(be);
  const double s = sw.mean_seconds([&] {
    for (int r = 0; r < reps; ++r) be.add(y.data(), x.data(), n);
    be.synchronize();
  }) / reps;
  return 12.0 * static_cast<double>(n) / s;
}

double time_optimizer(Backend& be, int64_t n, Stopwatch& sw, DType type) {
  Buffer p(static_cast<size_t>(n), 0.1f), g(static_cast<size_t>(n), 1e-3f),
      mm(static_cast<size_t>(n), 0.f), v(static_cast<size_t>(n), 0.f);
  // Mixed precision: the update also writes the model's 16-bit copy of the weights, as the
  // run's does (runtime/grad_sync.cc), in the same call.
  Buffer model(type == DType::kF32 ? 0 : static_cast<size_t>(n), type);
  AdamWSettings a;
  int64_t step = 0;
  return sw.mean_seconds([&] {
    const double sq = be.sum_squares(g.data(), n, 0.0);
    a.lr = sq > 0 ? 1e-4 : 0.0;
    // A clipping factor, as a run's early steps have (the gradient's scale is in the update).
    be.adamw_update(p.data(), g.data(), mm.data(), v.data(), model.empty() ? Ptr() : model.ptr(), n,
                    a, ++step, 0.5);
    be.fill_zero(g.data(), n);  // as the next step's start does (gradients then refilled)
    be.synchronize();
  });
}

double time_collective(Collective kind, Communicator& group, double bytes, Stopwatch& sw,
                       int warmup, DType type) {
  return time_collective_late(kind, group, bytes, 0.0, sw, warmup, type);
}

double time_collective_late(Collective kind, Communicator& group, double bytes, double delay_s,
                            Stopwatch& sw, int warmup, DType type) {
  const size_t element = dtype_bytes(type);
  const size_t n = static_cast<size_t>(std::max(1.0, bytes / static_cast<double>(element)));
  const size_t g = static_cast<size_t>(group.size());
  // Zeros: a sum's cost does not depend on the values (and zeros are no denormals).
  Buffer a(n, type), b(n, type);
  std::function<void()> f;
  switch (kind) {
    case Collective::kAllReduce:
      f = [&] { group.all_reduce(a.raw(), n, type); };
      break;
    case Collective::kAllGather:
      f = [&] { group.all_gather(a.raw(), b.raw(), n / g, type); };
      break;
    case Collective::kReduceScatter:
      f = [&] { group.reduce_scatter(a.raw(), b.raw(), n / g, type); };
      break;
    case Collective::kSendRecv: {
      const int peer = group.rank() ^ 1;
      f = [&, peer] {
        const Communicator::P2P ops[2] = {{true, a.raw(), n, peer, 7, type},
                                          {false, b.raw(), n, peer, 7, type}};
        group.batch(ops);
      };
      break;
    }
    case Collective::kAllToAll: {
      // Every rank sends a 1/g block to each other rank, as one batch of sends and receives.
      const size_t block = std::max<size_t>(1, n / g);
      f = [&, block] {
        std::vector<Communicator::P2P> ops;
        for (int r = 0; r < group.size(); ++r) {
          if (r == group.rank()) continue;
          const size_t at = element * (block * static_cast<size_t>(r) % n);
          ops.push_back({true, static_cast<char*>(a.raw()) + at, block, r, 8, type});
          ops.push_back({false, static_cast<char*>(b.raw()) + at, block, r, 8, type});
        }
        group.batch(ops);
      };
      break;
    }
  }
  if (delay_s <= 0) return sw.max_seconds(f, warmup);
  const bool late = group.rank() == 0;
  std::function<void()> delayed = [&] {
    if (late) {  // busy: a rank still computing
      const auto until = Clock::now() + std::chrono::duration<double>(delay_s);
      while (Clock::now() < until) {
      }
    }
    f();
  };
  return std::max(0.0, sw.max_seconds(delayed, warmup) - delay_s);
}

SkewSample time_arrival_skew(Backend& be, Communicator& group, const ModelSpec& m, Stopwatch& sw,
                             int warmup) {
  const int64_t g = group.size();
  const int64_t tokens = m.seq_length, in = m.hidden_size;
  const int64_t out = std::max<int64_t>(1, m.ffn_hidden() / g);
  Buffer x(static_cast<size_t>(tokens * in), 0.01f), w(static_cast<size_t>(out * in), 0.02f),
      y(static_cast<size_t>(tokens * out)), z(static_cast<size_t>(tokens * in), 1.0f);
  auto compute = [&] {
    be.linear_forward(x.data(), w.data(), nullptr, y.data(), tokens, in, out);
    be.synchronize();
  };
  auto reduce = [&] { group.all_reduce(z.data(), z.size()); };
  SkewSample s;
  s.ranks = g;
  s.compute_s = sw.mean_seconds(compute);
  s.all_reduce_s = sw.max_seconds(reduce, warmup);
  // The pair as a run alternates them; each rank also clocks its time inside the all-reduce.
  double in_reduce = 0;
  int64_t calls = 0;
  s.pair_s = sw.max_seconds(
      [&] {
        compute();
        const auto t0 = Clock::now();
        reduce();
        in_reduce += since(t0);
        ++calls;
      },
      warmup);
  s.in_all_reduce_s =
      sw.control().sum(in_reduce / static_cast<double>(std::max<int64_t>(calls, 1))) /
      static_cast<double>(sw.control().size());
  s.skew = std::max(0.0, (s.in_all_reduce_s - s.all_reduce_s) / s.compute_s);
  return s;
}

}  // namespace ptdp
