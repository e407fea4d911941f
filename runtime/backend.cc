// Backends: the CPU backend, each of whose calls is the kernel of the same name in kernels/cpu/.
#include "runtime/backend.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/flash.h"
#include "kernels/cpu/fused.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/moe.h"
#include "runtime/float16.h"
#include "runtime/tensor.h"
#ifdef PTDP_HAVE_CUDA_BACKEND
#include "runtime/cuda/cuda_backend.h"
#endif

namespace ptdp {
namespace {

namespace k = kernels;

// Whether every operand has the first one's element type.
bool one_type(std::initializer_list<DType> types) {
  for (DType t : types)
    if (t != *types.begin()) return false;
  return true;
}

// bf16 elements as their bit patterns (kernels/cpu/moe.h's row moves).
const uint16_t* bits(CPtr x) {
  return static_cast<const uint16_t*>(x.p);
}
uint16_t* bits(Ptr x) {
  return static_cast<uint16_t*>(x.p);
}

float load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16:
      return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
    default:
      throw std::invalid_argument("convert: " + to_string(t) + " is not a float type");
  }
}

}  // namespace

// A type that is not a float type throws before anything is written: `load` for the source
// (at the first element), the switch for the destination.
void convert_on_host(const void* from, DType from_type, void* to, DType to_type, int64_t n) {
  if (from_type == to_type) {
    if (n > 0) std::memmove(to, from, static_cast<size_t>(n) * dtype_bytes(from_type));
    return;
  }
  switch (to_type) {
    case DType::kF32:
      for (int64_t i = 0; i < n; ++i) static_cast<float*>(to)[i] = load(from, from_type, i);
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i)
        static_cast<uint16_t*>(to)[i] = float_to_bf16(load(from, from_type, i));
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i)
        static_cast<uint16_t*>(to)[i] = float_to_fp16(load(from, from_type, i));
      return;
    default:
      throw std::invalid_argument("convert: " + to_string(to_type) + " is not a float type");
  }
}

void upload_floats(Backend& be, const float* host, Ptr to, int64_t n) {
  if (to.f32()) return be.upload(host, to.p, static_cast<size_t>(n) * sizeof(float));
  std::vector<uint8_t> typed(static_cast<size_t>(n) * dtype_bytes(to.t));
  convert_on_host(host, DType::kF32, typed.data(), to.t, n);
  be.upload(typed.data(), to.p, typed.size());
}

void download_floats(Backend& be, CPtr from, float* host, int64_t n) {
  if (from.f32()) return be.download(from.p, host, static_cast<size_t>(n) * sizeof(float));
  std::vector<uint8_t> typed(static_cast<size_t>(n) * dtype_bytes(from.t));
  be.download(from.p, typed.data(), typed.size());
  convert_on_host(typed.data(), from.t, host, DType::kF32, n);
}

namespace {

class CpuBackend : public Backend {
 public:
  std::string_view name() const override { return "cpu"; }

  void linear_forward(const float* x, const float* w, const float* b, float* y, int64_t n,
                      int64_t in, int64_t out) override {
    k::linear_forward(x, w, b, y, n, in, out);
  }
  void linear_dgrad(const float* w, const float* dy, float* dx, int64_t n, int64_t in,
                    int64_t out) override {
    k::linear_backward<float>(nullptr, w, dy, dx, nullptr, nullptr, n, in, out);
  }
  void linear_wgrad(const float* x, const float* dy, float* dw, float* db, int64_t n, int64_t in,
                    int64_t out) override {
    k::linear_backward<float>(x, nullptr, dy, nullptr, dw, db, n, in, out);
  }
  void attention_scores(const float* q, const float* kk, float* scores, int64_t b, int64_t s,
                        int64_t hq, int64_t hk, int64_t d) override {
    k::attention_scores_forward(q, kk, scores, b, s, hq, hk, d);
  }
  void attention_scores_backward(const float* q, const float* kk, const float* dscores, float* dq,
                                 float* dk, int64_t b, int64_t s, int64_t hq, int64_t hk,
                                 int64_t d) override {
    k::attention_scores_backward(q, kk, dscores, dq, dk, b, s, hq, hk, d);
  }
  void causal_softmax(float* scores, int64_t rows, int64_t s) override {
    k::causal_softmax_forward(scores, rows, s);
  }
  void causal_softmax_backward(const float* probs, const float* dprobs, float* dscores,
                               int64_t rows, int64_t s) override {
    k::causal_softmax_backward(probs, dprobs, dscores, rows, s);
  }
  void attention_context(const float* probs, const float* v, float* out, int64_t b, int64_t s,
                         int64_t hq, int64_t hk, int64_t d) override {
    k::attention_context_forward(probs, v, out, b, s, hq, hk, d);
  }
  void attention_context_backward(const float* probs, const float* v, const float* dout,
                                  float* dprobs, float* dv, int64_t b, int64_t s, int64_t hq,
                                  int64_t hk, int64_t d) override {
    k::attention_context_backward(probs, v, dout, dprobs, dv, b, s, hq, hk, d);
  }

  void flash_attention_forward(const float* q, const float* kk, const float* v, float* out,
                               float* lse, int64_t b, int64_t sq, int64_t sk, int64_t hq,
                               int64_t hk, int64_t d) override {
    k::flash_attention_forward(q, kk, v, out, lse, b, sq, sk, hq, hk, d);
  }
  void flash_attention_backward(const float* q, const float* kk, const float* v, const float* out,
                                const float* lse, const float* dout, float* dq, float* dk,
                                float* dv, int64_t b, int64_t sq, int64_t sk, int64_t hq,
                                int64_t hk, int64_t d) override {
    k::flash_attention_backward(q, kk, v, out, lse, dout, dq, dk, dv, b, sq, sk, hq, hk, d);
  }

  void norm_forward(const float* x, const float* g, const float* beta, float* y, float* mean,
                    float* rstd, int64_t n, int64_t h) override {
    if (beta)
      k::layernorm_forward(x, g, beta, y, mean, rstd, n, h);
    else
      k::rmsnorm_forward(x, g, y, rstd, n, h);
  }
  void norm_backward(const float* x, const float* g, bool has_beta, const float* mean,
                     const float* rstd, const float* dy, float* dx, float* dg, float* dbeta,
                     int64_t n, int64_t h) override {
    if (has_beta)
      k::layernorm_backward(x, g, mean, rstd, dy, dx, dg, dbeta, n, h);
    else
      k::rmsnorm_backward(x, g, rstd, dy, dx, dg, n, h);
  }
  void gelu(const float* x, float* y, int64_t n) override { k::gelu_forward(x, y, n); }
  void gelu_backward(const float* x, const float* dy, float* dx, int64_t n) override {
    k::gelu_backward(x, dy, dx, n);
  }
  void swiglu(const float* x, float* y, int64_t n, int64_t f) override {
    k::swiglu_forward(x, y, n, f);
  }
  void swiglu_backward(const float* x, const float* dy, float* dx, int64_t n, int64_t f) override {
    k::swiglu_backward(x, dy, dx, n, f);
  }

  void rope(float* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base,
            bool inverse) override {
    k::rope(x, b, s, heads, d, base, inverse);
  }

  void copy(const float* x, float* y, int64_t n) override {
    if (n > 0) std::memcpy(y, x, sizeof(float) * static_cast<size_t>(n));
  }
  void fill_zero(float* x, int64_t n) override { std::fill(x, x + n, 0.0f); }
  void add(float* y, const float* x, int64_t n) override { k::add(y, x, n); }
  void add_bias(float* y, const float* bias, int64_t rows, int64_t width) override {
    k::add_bias(y, bias, rows, width);
  }
  void bias_grad(const float* dy, float* db, int64_t rows, int64_t width) override {
    k::bias_grad(dy, db, rows, width);
  }
  void scale(float* x, int64_t n, double f) override { k::scale(x, n, f); }
  void split_columns3(const float* x, float* y0, float* y1, float* y2, int64_t n, int64_t a,
                      int64_t b, int64_t c) override {
    k::split_columns3(x, y0, y1, y2, n, a, b, c);
  }
  void concat_columns3(const float* x0, const float* x1, const float* x2, float* y, int64_t n,
                       int64_t a, int64_t b, int64_t c) override {
    k::concat_columns3(x0, x1, x2, y, n, a, b, c);
  }
  void sequence_unshard(const float* shards, float* full, int64_t t, int64_t b, int64_t s,
                        int64_t width) override {
    k::sequence_unshard(shards, full, t, b, s, width);
  }
  void sequence_shard(const float* full, float* shards, int64_t t, int64_t b, int64_t s,
                      int64_t width) override {
    k::sequence_shard(full, shards, t, b, s, width);
  }

  // The typed glue that only moves elements runs on any one element type as it is, with no
  // widened copies (a bf16 run's split of q, k and v, their gradients' concatenation, and the
  // sequence-parallel reorders).
  bool native_split_columns3(CPtr x, Ptr y0, Ptr y1, Ptr y2, int64_t n, int64_t a, int64_t b,
                             int64_t c) override {
    if (!one_type({x.t, y0.t, y1.t, y2.t})) return false;
    k::split_columns3(x.p, y0.p, y1.p, y2.p, n, a, b, c, dtype_bytes(x.t));
    return true;
  }
  bool native_concat_columns3(CPtr x0, CPtr x1, CPtr x2, Ptr y, int64_t n, int64_t a, int64_t b,
                              int64_t c) override {
    if (!one_type({x0.t, x1.t, x2.t, y.t})) return false;
    k::concat_columns3(x0.p, x1.p, x2.p, y.p, n, a, b, c, dtype_bytes(y.t));
    return true;
  }
  bool native_sequence_unshard(CPtr shards, Ptr full, int64_t t, int64_t b, int64_t s,
                               int64_t width) override {
    if (!one_type({shards.t, full.t})) return false;
    k::sequence_unshard(shards.p, full.p, t, b, s, width, dtype_bytes(full.t));
    return true;
  }
  bool native_sequence_shard(CPtr full, Ptr shards, int64_t t, int64_t b, int64_t s,
                             int64_t width) override {
    if (!one_type({full.t, shards.t})) return false;
    k::sequence_shard(full.p, shards.p, t, b, s, width, dtype_bytes(full.t));
    return true;
  }
  void vocab_embedding_lookup(const int32_t* tokens, const float* table, float* y, int64_t n,
                              int64_t h, int64_t v0, int64_t vl) override {
    k::vocab_embedding_lookup(tokens, table, y, n, h, v0, vl);
  }
  void vocab_embedding_grad(const int32_t* tokens, const float* dy, float* dtable, int64_t n,
                            int64_t h, int64_t v0, int64_t vl) override {
    k::vocab_embedding_grad(tokens, dy, dtable, n, h, v0, vl);
  }
  void add_positions(float* x, const float* pos, int64_t b, int64_t sl, int64_t h,
                     int64_t first) override {
    k::add_positions(x, pos, b, sl, h, first);
  }
  void position_grad(const float* dx, float* dpos, int64_t b, int64_t sl, int64_t h,
                     int64_t first) override {
    k::position_grad(dx, dpos, b, sl, h, first);
  }
  void cross_entropy_stats(const float* logits, const int32_t* targets, float* stats, int64_t n,
                           int64_t vl, int64_t valid, int64_t v0) override {
    k::cross_entropy_stats(logits, targets, stats, n, vl, valid, v0);
  }
  double cross_entropy_finish(const float* stats, int64_t ranks, float* logits, float* lse,
                              int64_t n, int64_t vl, int64_t valid) override {
    return k::cross_entropy_finish(stats, ranks, logits, lse, n, vl, valid);
  }
  void cross_entropy_backward(float* probs, const int32_t* targets, int64_t n, int64_t vl,
                              int64_t v0, double scale) override {
    k::cross_entropy_backward(probs, targets, n, vl, v0, scale);
  }

  void gather_rows(CPtr x, const int64_t* index, const float* weight, Ptr y, int64_t rows,
                   int64_t h) override {
    if (row_moves_bf16({x.t, y.t}))
      k::gather_rows(bits(x), index, weight, rows, h, bits(y));
    else
      k::gather_rows(x.f(), index, weight, rows, h, y.f());
  }
  void gather_add_rows(CPtr y, const int64_t* index, const float* weight, Ptr out, int64_t n,
                       int64_t slots, int64_t h) override {
    if (row_moves_bf16({y.t, out.t}))
      k::gather_add_rows(bits(y), index, weight, n, slots, h, bits(out));
    else
      k::gather_add_rows(y.f(), index, weight, n, slots, h, out.f());
  }
  void row_dots(CPtr a, const int64_t* index, CPtr b, float* dot, int64_t rows,
                int64_t h) override {
    if (row_moves_bf16({a.t, b.t}))
      k::row_dots(bits(a), index, bits(b), rows, h, dot);
    else
      k::row_dots(a.f(), index, b.f(), rows, h, dot);
  }

  double sum_squares(const float* x, int64_t n, double acc) override {
    return k::sum_squares(x, n, acc);
  }
  void adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWSettings& o,
             int64_t step) override {
    k::AdamW a;
    a.lr = o.lr;
    a.beta1 = o.beta1;
    a.beta2 = o.beta2;
    a.eps = o.eps;
    a.weight_decay = o.weight_decay;
    k::adamw_step(param, grad, m, v, n, a, step);
  }

  void* allocate(size_t bytes) override {
    void* p = ::operator new (bytes, std::align_val_t{64});
    std::memset(p, 0, bytes);
    MemoryCounter::allocated(bytes);
    return p;
  }
  void* allocate_for_overwrite(size_t bytes) override {
    void* p = ::operator new (bytes, std::align_val_t{64});
    std::memset(p, 0xFF, bytes);
    MemoryCounter::allocated(bytes);
    return p;
  }
  void poison_bytes(void* p, size_t bytes) override {
    if (bytes > 0) std::memset(p, 0xFF, bytes);
  }
  void deallocate(void* p, size_t bytes) override {
    MemoryCounter::freed(bytes);
    ::operator delete (p, std::align_val_t{64});
  }
  void upload(const void* host, void* device, size_t bytes) override {
    if (bytes > 0) std::memcpy(device, host, bytes);
  }
  void download(const void* device, void* host, size_t bytes) override {
    if (bytes > 0) std::memcpy(host, device, bytes);
  }
  bool host_accessible() const override { return true; }
  // Line by line (64 bytes or more on the CPUs this runs on; a longer line is flushed more
  // than once): a few microseconds a megabyte, where streaming twice the last-level cache
  // through it costs the cache's size in reads (on a VM that reports a 300 MiB L3, 60 ms a
  // time, which made a quick calibration of the test model take a minute).
  bool flush_from_caches(const void* p, size_t bytes) override {
#if defined(__x86_64__) || defined(__aarch64__)
    if (bytes == 0) return true;
    const auto* c = static_cast<const char*>(p);
    for (size_t i = 0; i < bytes + 63; i += 64) {
      const char* line = c + std::min(i, bytes - 1);
#if defined(__x86_64__)
      _mm_clflush(line);
#else
      asm volatile("dc civac, %0" : : "r"(line) : "memory");
#endif
    }
#if defined(__x86_64__)
    _mm_mfence();
#else
    asm volatile("dsb ish" : : : "memory");
#endif
    return true;
#else
    (void)p, (void)bytes;
    return false;
#endif
  }

  void copy_bytes(const void* from, void* to, size_t bytes) override {
    if (bytes > 0) std::memmove(to, from, bytes);
  }
  void zero_bytes(void* p, size_t bytes) override {
    if (bytes > 0) std::memset(p, 0, bytes);
  }
  void convert(const void* from, DType from_type, void* to, DType to_type, int64_t n) override {
    convert_on_host(from, from_type, to, to_type, n);
  }

  void synchronize() override {}
};

// "cpu-staged": the CPU backend with its memory treated as a device's. host_accessible() is
// false and it registers itself as the space of new Buffers, so everything the CUDA backend
// does differently on the host side (communicators staging through host copies, the runtime
// refusing host-side token routing) runs on machines without a GPU, where tests can compare it
// with the plain CPU backend bit for bit.
class StagedCpuBackend final : public CpuBackend {
 public:
  StagedCpuBackend() { set_buffer_space(this); }
  ~StagedCpuBackend() override {
    if (buffer_space() == this) set_buffer_space(nullptr);
  }
  std::string_view name() const override { return "cpu-staged"; }
  // Markers are the host clock when queued (each kernel here has run by the time it returns),
  // so that traced runs take the device timing path of runtime/op_timer.h as a GPU does.
  void* record_mark() override {
    return new std::chrono::steady_clock::time_point(std::chrono::steady_clock::now());
  }
  double mark_seconds(void* from, void* to) override {
    using P = const std::chrono::steady_clock::time_point*;
    return std::chrono::duration<double>(*static_cast<P>(to) - *static_cast<P>(from)).count();
  }
  void release_mark(void* mark) override {
    delete static_cast<std::chrono::steady_clock::time_point*>(mark);
  }
  void* allocate(size_t bytes) override { return track(CpuBackend::allocate(bytes), bytes); }
  void* allocate_for_overwrite(size_t bytes) override {
    return track(CpuBackend::allocate_for_overwrite(bytes), bytes);
  }
  void deallocate(void* p, size_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ranges_.erase(reinterpret_cast<uintptr_t>(p));
    }
    CpuBackend::deallocate(p, bytes);
  }
  bool host_accessible() const override { return false; }
  bool device_pointer(const void* p) const override {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return false;
    --it;
    return a < it->first + std::max<size_t>(it->second, 1);
  }

 private:
  void* track(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    ranges_[reinterpret_cast<uintptr_t>(p)] = bytes;
    return p;
  }
  mutable std::mutex mu_;
  std::map<uintptr_t, size_t> ranges_;  // start -> bytes
};

}  // namespace

bool row_moves_bf16(std::initializer_list<DType> types) {
  if (!one_type(types)) throw std::logic_error("the MoE row moves take rows of one type");
  const DType t = *types.begin();
  if (t != DType::kF32 && t != DType::kBF16)
    throw std::logic_error("the MoE row moves take fp32 or bf16 rows, not " + to_string(t));
  return t == DType::kBF16;
}

std::string cuda_math() {
  const char* math = std::getenv("PTDP_CUDA_MATH");
  const char* tf32 = std::getenv("PTDP_CUDA_TF32");
  const std::string m = math ? math : (tf32 && std::string(tf32) == "1" ? "tf32" : "fp32");
  if (m != "fp32" && m != "tf32" && m != "bf16")
    throw InputError("PTDP_CUDA_MATH", "must be fp32, tf32 or bf16, not '" + m + "'");
  return m;
}

std::string backend_label(std::string_view name) {
  if (name != "cuda") return std::string(name);
  const std::string math = cuda_math();
  return math == "fp32" ? "cuda" : "cuda/" + math;
}

// Host memory as a device's: what a step frees, the next step reuses, as a GPU's caching
// allocator keeps it. glibc would otherwise return each large freed block to the kernel
// (mmap'd blocks, and the heap's top past 128 KiB) and fault every page of it in again: a bf16
// step of the 4-layer test model took 50,000 page faults a rank, 10% of its time, and at
// moments that differ between ranks, which the tensor-parallel all-reduces then wait out.
void keep_freed_host_memory() {
#ifdef __GLIBC__
  static std::once_flag once;
  std::call_once(once, [] {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest: blocks up to 32 MiB from the heap
    mallopt(M_TRIM_THRESHOLD, 1 << 30);   // and the heap not trimmed below 1 GiB of free top
    mallopt(M_TOP_PAD, 64 << 20);
  });
#endif
}

std::unique_ptr<Backend> make_backend(std::string_view name) {
  if (name == "cpu" || name == "cpu-staged") keep_freed_host_memory();
  if (name == "cpu") return std::make_unique<CpuBackend>();
  if (name == "cpu-staged") return std::make_unique<StagedCpuBackend>();
#ifdef PTDP_HAVE_CUDA_BACKEND
  if (name == "cuda") return make_cuda_backend();
  throw InputError("--backend", "unknown backend '" + std::string(name) +
                                    "' (expected cpu, cuda or cpu-staged)");
#else
  if (name == "cuda")
    throw InputError("--backend", "cuda is not available in this build (built without nvcc)");
  throw InputError("--backend",
                   "unknown backend '" + std::string(name) + "' (expected cpu or cpu-staged)");
#endif
}

}  // namespace ptdp
