// The measurements of `ptdp calibrate`: each kernel of the layer op list through the op
// executor (runtime/op_executor.h), a generic GEMM grid, streaming memory bandwidth, the
// optimizer's per-parameter kernels, and the collectives over every group size the ranks allow,
// timed as nccl-tests times them. Every function is collective over the control plane: all
// ranks call it with the same arguments, and all ranks run each kernel at the same time (ranks
// that share cores are measured as they will run).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/layer_ops.h"
#include "core/model_spec.h"
#include "runtime/backend.h"
#include "runtime/communicator.h"
#include "runtime/gpt_model.h"  // ShardLayout

namespace ptdp {

// Times a function on every rank at once: one warm-up call, then as many calls as fill
// `target_s` on the slowest rank (the same count on every rank), in five chunks each started
// together; a rank's time is the mean over the chunks. Chunks are long enough (target / 5:
// 10 ms with --quick, else 30 ms) to span the scheduler's time slices, so that a CPU shared
// with other work is measured at the share the ranks get, as a run gets it. With `before`,
// that runs untimed ahead of every call (each call then timed alone).
class Stopwatch {
 public:
  Stopwatch(ControlPlane& control, double target_s) : control_(control), target_s_(target_s) {}
  // Seconds per call: the mean over ranks (compute) or the slowest rank (collectives).
  double mean_seconds(const std::function<void()>& f, const std::function<void()>& before = {});
  double max_seconds(const std::function<void()>& f, int warmup = 1);
  ControlPlane& control() { return control_; }
  // This rank's CPU time over wall time in the timed loops: below 1 when the machine's other
  // work (or ranks sharing a core) took the CPU away (recorded, not priced).
  double cpu_share() const { return wall_s_ > 0 ? cpu_s_ / wall_s_ : 1.0; }

 private:
  std::pair<double, double> run(const std::function<void()>& f, int warmup,
                                const std::function<void()>& before = {});
  ControlPlane& control_;
  double target_s_;
  double wall_s_ = 0, cpu_s_ = 0;
};

// One op of the list, with the layout it was listed for, and its measured time: warm (its
// operands in cache from the call before) and cold (the caches evicted before each call, then
// its input operand read, as the op before it in a pass leaves it; 0 when not measured).
struct OpSample {
  Op op;
  int64_t t = 1, b = 1;
  double seconds = 0;
  double cold_seconds = 0;
  // On a device whose kernels run asynchronously: the host's time to issue the op (launches,
  // allocations, the runtime's own work), the device idle; 0 where not measured.
  double host_seconds = 0;
};

// Evicts the CPU caches by reading a buffer twice the node's last-level cache (every rank at
// once, as the ranks share it); with a device backend, the device's cache by reading a device
// buffer twice its size (then waiting for the device). measure_ops uses it only where the
// backend cannot flush the op's own buffers (Backend::flush_from_caches): on the CPU the
// buffer costs its size in reads every time, a minute of a quick calibration on a machine
// that reports a 300 MiB L3.
class CacheEvictor {
 public:
  explicit CacheEvictor(double last_level_cache_bytes, Backend* device = nullptr);
  ~CacheEvictor();
  CacheEvictor(const CacheEvictor&) = delete;
  CacheEvictor& operator=(const CacheEvictor&) = delete;
  void operator()();
  // Reads the first `bytes` of the buffer (at most all of it): what a rank streams through the
  // cache between two uses of an op's operands.
  void stream(double bytes);

 private:
  std::vector<float> junk_;  // host caches
  size_t junk_size_ = 0;
  Backend* device_ = nullptr;  // or the device's
  void* device_junk_ = nullptr;
  size_t device_bytes_ = 0;
};

// How much of an op's operands the cache keeps while a rank streams `bytes` of other data
// between two calls (every rank at once): the op list's largest GEMM at (t, b) timed warm, cold
// (evict) and after each stream; hit = (cold - time) / (cold - warm), clamped to [0, 1].
struct CacheHitSample {
  double bytes = 0;    // streamed per rank
  double seconds = 0;  // the GEMM's time after the stream
  double hit = 0;
};
struct CacheHits {
  Op op;  // the GEMM timed
  double warm_seconds = 0, cold_seconds = 0;
  std::vector<CacheHitSample> samples;
};
CacheHits measure_cache_hits(Backend& be, const ModelSpec& m, int64_t t, int64_t b, Stopwatch& sw,
                             CacheEvictor& evict, const std::vector<double>& stream_bytes,
                             DType type);

// The ops of one transformer layer, the embedding and the LM head for (t, b), as ptdp run
// executes them (runtime_layer_shape), without those it does not execute.
// `type`: of weights and activations (fp32, or bf16 as ptdp run --bf16 runs them).
std::vector<Op> executed_ops(const ModelSpec& m, int64_t t, int64_t b, DType type = DType::kF32);

// The layout a model's ops are timed in at (t, b): MoE layers with t > 1 run only with
// sequence parallelism (as in Megatron-Core, and in ptdp run), so their shapes are taken with it.
ShardLayout op_layout(const ModelSpec& m, int64_t t, int64_t b, DType type);

// The distinct GEMMs and memory-bound ops of executed_ops(m, t, b) (those `which` accepts,
// when given): what measure_ops times for (t, b).
std::vector<Op> timed_ops(const ModelSpec& m, int64_t t, int64_t b, DType type,
                          const std::function<bool(const Op&)>& which = {});

// Times every distinct GEMM and memory-bound op of executed_ops(m, t, b) for each (t, b) (those
// `which` accepts, when given), warm, and cold too with an evictor. `progress(done, total)`
// after each.
std::vector<OpSample> measure_ops(Backend& be, const ModelSpec& m,
                                  const std::vector<std::pair<int64_t, int64_t>>& tb, Stopwatch& sw,
                                  CacheEvictor* evict,
                                  const std::function<void(int, int)>& progress,
                                  DType type = DType::kF32,
                                  const std::function<bool(const Op&)>& which = {});

// A generic GEMM (y = x W^T through the backend's typed linear kernel) of m x k by k x n, its
// operands of `type`.
double time_linear(Backend& be, int64_t m, int64_t n, int64_t k, Stopwatch& sw,
                   DType type = DType::kF32);

// Streaming bandwidth of y += x over n floats (12 bytes per element), bytes/s.
double stream_bandwidth(Backend& be, int64_t n, Stopwatch& sw);

// The optimizer's work per parameter in ptdp run: zeroing the gradients, their sum of squares,
// and the update (Backend::adamw_update: AdamW on the clipped gradient, and under mixed precision
// (`type` 16-bit) the model's copy of the weights, 2 bytes more than counted here); seconds for
// n parameters, and the bytes those kernels move (kOptimizerBytes each).
inline constexpr double kOptimizerBytesPerParam = 4 + 4 + 28;
double time_optimizer(Backend& be, int64_t n, Stopwatch& sw, DType type = DType::kF32);

// One collective over groups of `group` consecutive ranks (all groups at once), of `bytes` as
// nccl-tests counts them (the whole buffer: an all-gather's output, a reduce-scatter's input).
// send/recv: ranks exchange with their partner (rank ^ 1) in each group of 2.
struct CommSample {
  Collective kind = Collective::kAllReduce;
  int64_t ranks = 2, nodes = 1;
  DType dtype = DType::kF32;  // the elements on the wire (and summed)
  double bytes = 0, seconds = 0;
  double algbw_gbps = 0, busbw_gbps = 0;
};
// A collective of `bytes` over `group`, on elements of `type`: a 16-bit sum is another kernel
// (MPI sums bf16 and fp16 with user-defined ops, several times slower than its fp32 sum).
double time_collective(Collective kind, Communicator& group, double bytes, Stopwatch& sw,
                       int warmup, DType type = DType::kF32);
// The same collective when the group's rank 0 arrives `delay_s` after the others (as in a run,
// where ranks finish their compute apart): seconds from the last arrival to completion on the
// slowest rank. Recorded beside the fits, not priced (docs/calibration.md).
double time_collective_late(Collective kind, Communicator& group, double bytes, double delay_s,
                            Stopwatch& sw, int warmup, DType type = DType::kF32);

// Arrival skew over `group`: a layer-sized GEMM (the FC1 of `m` at t = the group size, one
// sequence) and then the all-reduce of its output, as tensor-parallel ranks alternate them.
// skew = (time inside each all-reduce of the pair, mean over ranks - the all-reduce in
// lockstep) / compute: the wait for the slowest rank, as a fraction of the compute before it
// (HardwareProfile::arrival_skew). It is what a run's trace counts as tensor-parallel
// communication beyond the collective itself; (pair - compute - all-reduce) would also count
// a GEMM slowed by the all-reduce before it, and varies about twice as much between
// calibrations (docs/calibration.md).
struct SkewSample {
  int64_t ranks = 0;
  double compute_s = 0, all_reduce_s = 0, pair_s = 0, skew = 0;
  double in_all_reduce_s = 0;  // mean over ranks of each all-reduce of the pair
};
SkewSample time_arrival_skew(Backend& be, Communicator& group, const ModelSpec& m, Stopwatch& sw,
                             int warmup);

}  // namespace ptdp
