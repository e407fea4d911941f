// Just enough of CUDA to run the project's kernel source on the host (PTDP_CUDA_EMULATION), so
// that the GPU tests check the kernels on a machine with no GPU (the *_emulated test programs,
// tests/cuda/CMakeLists.txt; docs/gpu.md). Device memory is host memory
// (tests/cuda/emulated_cuda_runtime.cc gives the runtime calls the kernels and tests make), a
// stream runs its work at once, and a launch (PTDP_KERNEL_LAUNCH, kernels/cuda/common.cuh) runs
// the grid's blocks in order. Every thread of a block is a fiber on the calling
// thread, switched only at barriers, so a block runs deterministically: __syncthreads waits for
// the block's live threads, __syncwarp and the warp shuffles for the warp's (warps: 32
// consecutive linear thread indices). mma.sync.m16n8k16 (bf16 in, fp32 accumulate) is computed
// from the fragment layout of the PTX ISA ("Matrix Fragments for mma.m16n8k16"), written here
// as the inverse map: which lane and register hold element (row, col) of A, B and C;
// ldmatrix.x4 (plain and .trans) from its fragment layout, and cp.async with its groups (a copy
// lands at the wait, or at once in reverse order: the two extremes of a GPU's timing).
// __shared__ variables become static storage (one block runs at a time); dynamic shared memory
// is a per-block buffer. Threads run in index order between barriers, or in reverse order
// (PTDP_EMULATION_ORDER=reverse; the tests run both), which exposes most missing barriers. After
// a warp barrier one warp at a time runs on to its next block barrier, so warps that race
// through shared memory without a block barrier are caught too.
//
// A barrier that some live thread never reaches (a divergent __syncthreads or shuffle) stops the
// run with an exception instead of hanging.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ucontext.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

// Under AddressSanitizer (scripts/emulated-asan.sh; docs/gpu.md, "Tests") every switch
// between stacks is announced to it, so that it knows which stack is live, and the pool of fiber
// stacks is unpoisoned before reuse (a fiber abandoned mid-call leaves its frames' red zones).
#include "tests/cuda/emulated_asan.h"

#undef __global__
#undef __device__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#undef __trap
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define threadIdx (::emu::thread_index())
#define blockIdx (::emu::block_index())
#define blockDim (::emu::block_dim())
#define __syncthreads() ::emu::sync_block()
#define __syncwarp() ::emu::sync_warp()
#define gridDim (::emu::grid_dim())
#define __shfl_xor_sync(mask, v, lane_mask) ::emu::shfl_xor((v), (lane_mask))
#define __shfl_up_sync(mask, v, delta) ::emu::shfl_up((v), (delta))
#define __trap() std::abort()
#define __expf(x) std::exp(x)
#define __fdividef(a, b) ((a) / (b))
#define __fmul_rn(a, b) ((a) * (b))
#define __sincosf(x, s, c) ::sincosf((x), (s), (c))

using std::max;
using std::min;
// cuda_runtime.h's C++ forms that it declares for nvcc only.
template <typename T>
cudaError_t cudaFuncSetAttribute(T* entry, cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(entry), attr, value);
}
// ld.global.ca: a plain load here.
template <typename T>
T __ldca(const T* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// Device math functions the host library lacks.
inline float rsqrtf(float x) {
  return 1.0f / std::sqrt(x);
}

namespace ptdp::kernels::cuda {
using bf16 = __nv_bfloat16;
}

namespace emu {

struct Dim {
  unsigned x = 1, y = 1, z = 1;
  Dim() = default;
  Dim(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}  // NOLINT: as dim3
  Dim(dim3 d) : x(d.x), y(d.y), z(d.z) {}                                // NOLINT
};

enum class Wait { kRunnable, kWarp, kBlock, kDone };
constexpr size_t kStackBytes = 64 * 1024;

// A fiber's saved state. On x86-64 its stack pointer, with the callee-saved registers pushed
// on that stack (ptdp_emu_switch, tests/cuda/emulated_cuda_runtime.cc: no system call per
// switch, unlike swapcontext's signal mask); elsewhere a ucontext. Under ASan also its stack's
// bounds (the calling thread's: learned at a fiber's first switch back).
#if defined(__x86_64__)
extern "C" void ptdp_emu_switch(void** save_sp, void* load_sp);
struct Context {
  void* sp = nullptr;
  const void* stack_bottom = nullptr;
  size_t stack_bytes = 0;
};
inline void raw_switch(Context& from, Context& to) {
  ptdp_emu_switch(&from.sp, to.sp);
}
inline void init_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  const auto top = reinterpret_cast<std::uintptr_t>(stack + bytes) & ~std::uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                              // entry's return address: it never returns
  *--sp = reinterpret_cast<void*>(entry);       // where the first switch's ret goes
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp, rbx, r12-r15
  c.sp = sp;
  c.stack_bottom = stack;
  c.stack_bytes = bytes;
}
#else
struct Context {
  ucontext_t uc{};
  const void* stack_bottom = nullptr;
  size_t stack_bytes = 0;
};
inline void raw_switch(Context& from, Context& to) {
  swapcontext(&from.uc, &to.uc);
}
// Out of line: getcontext returns twice, which would make the caller's variables suspect.
[[gnu::noinline]] inline void init_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
  c.stack_bottom = stack;
  c.stack_bytes = bytes;
}
#endif
// `last`: the fiber switching away has ended and is never resumed.
inline void switch_to(Context& from, Context& to, bool last = false) {
#ifdef PTDP_EMU_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(last ? nullptr : &fake_stack, to.stack_bottom, to.stack_bytes);
  raw_switch(from, to);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  (void)last;
  raw_switch(from, to);
#endif
}

struct Fiber {
  Context ctx;
  Wait wait = Wait::kRunnable;
};

// One cp.async of 16 bytes: `src_bytes` of them copied, the rest of the 16 zeroed.
struct AsyncCopy {
  unsigned char* dst;
  const unsigned char* src;
  int src_bytes;
};
// A thread's cp.async copies: those not yet committed, then the committed groups, oldest first.
// They land only when the thread waits for them, so a kernel that reads what it staged before
// cp.async.wait_group (and a barrier) reads stale shared memory, as a GPU may.
struct AsyncCopies {
  std::vector<AsyncCopy> open;
  std::deque<std::vector<AsyncCopy>> committed;
};

struct Block {
  Dim idx, dim, grid;
  std::vector<Fiber> fibers;
  Context main;
  int cur = 0;
  std::vector<unsigned char> smem;
  std::vector<float> shfl;
  std::vector<uint64_t> shfl_up;  // __shfl_up_sync's values, a thread each, of up to 8 bytes
  std::vector<uint32_t> frag_a, frag_b;
  std::vector<const unsigned char*> rows;  // ldmatrix row addresses, a lane each
  std::vector<AsyncCopies> async;          // cp.async copies, a thread each
  bool copies_left = false;                // a thread ended with copies it never waited for
  std::vector<AsyncCopy> landing;          // waited for, visible at the next block barrier
  const std::function<void()>* body = nullptr;
};

inline Block*& current() {
  static Block* block = nullptr;
  return block;
}
inline Dim thread_index() {
  const Block* b = current();
  const unsigned t = static_cast<unsigned>(b->cur);
  return {t % b->dim.x, t / b->dim.x % b->dim.y, t / (b->dim.x * b->dim.y)};
}
inline Dim grid_dim() {
  return current()->grid;
}
inline Dim block_index() {
  return current()->idx;
}
inline Dim block_dim() {
  return current()->dim;
}
inline unsigned char* dynamic_smem() {
  return current()->smem.data();
}

inline void wait(Wait kind) {
  Block* b = current();
  Fiber& f = b->fibers[b->cur];
  f.wait = kind;
  switch_to(f.ctx, b->main);
}
inline void sync_block() {
  wait(Wait::kBlock);
}
inline void sync_warp() {
  wait(Wait::kWarp);
}

inline float shfl_xor(float v, int lane_mask) {
  Block* b = current();
  const int t = b->cur;
  b->shfl[t] = v;
  sync_warp();
  const float r = b->shfl[(t & ~31) | ((t & 31) ^ lane_mask)];
  sync_warp();
  return r;
}

// __shfl_up_sync: lane l gets lane l - delta's value, the first delta lanes their own.
template <typename T>
T shfl_up(T v, unsigned delta) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shfl_up: at most 8 bytes");
  Block* b = current();
  const int t = b->cur;
  std::memcpy(&b->shfl_up[t], &v, sizeof v);
  sync_warp();
  T r = v;
  if ((t & 31) >= static_cast<int>(delta)) std::memcpy(&r, &b->shfl_up[t - delta], sizeof r);
  sync_warp();
  return r;
}

inline float bf16_bits(uint32_t word, int high) {
  const uint32_t bits = (high ? word >> 16 : word & 0xffffu) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// c += A B for the warp, each lane giving its fragments (layout: kernels/cuda/attention_mma.cu).
inline void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Block* bl = current();
  const int t = bl->cur, base = t & ~31, lane = t & 31;
  for (int i = 0; i < 4; ++i) bl->frag_a[t * 4 + i] = a[i];
  bl->frag_b[t * 2] = b0;
  bl->frag_b[t * 2 + 1] = b1;
  sync_warp();
  // A (row r, col k) is held by lane 4 (r % 8) + (k % 8) / 2, register (r >= 8) + 2 (k >= 8),
  // the high half for odd k; B (k, n) by lane 4 n + (k % 8) / 2, register (k >= 8).
  auto A = [&](int r, int k) {
    const int owner = base + 4 * (r % 8) + (k % 8) / 2, reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return bf16_bits(bl->frag_a[owner * 4 + reg], k % 2);
  };
  auto B = [&](int k, int n) {
    const int owner = base + 4 * n + (k % 8) / 2, reg = k >= 8 ? 1 : 0;
    return bf16_bits(bl->frag_b[owner * 2 + reg], k % 2);
  };
  const int g = lane / 4, tt = lane % 4;
  float out[4];
  for (int e = 0; e < 4; ++e) {  // C (row g or g + 8, col 2 tt or 2 tt + 1)
    const int row = g + (e >= 2 ? 8 : 0), col = 2 * tt + (e & 1);
    float acc = c[e];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[e] = acc;
  }
  sync_warp();  // every lane has read the fragments before any lane writes new ones
  for (int e = 0; e < 4; ++e) c[e] = out[e];
}

// Between two barriers the threads of a block run one after the other, in index order or, with
// PTDP_EMULATION_ORDER=reverse, the other way round: a kernel that reads what another thread
// writes without a barrier between them gives different results in the two orders.
inline bool reverse_order() {
  static const bool reverse = [] {
    const char* v = std::getenv("PTDP_EMULATION_ORDER");
    return v && std::strcmp(v, "reverse") == 0;
  }();
  return reverse;
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8 i .. 8 i + 7 give the addresses of
// rows 0..7 of 8 x 8 matrix i (16 bytes each, 16-byte aligned), and lane 4 g + t receives in
// register i the elements (g, 2 t) and (g, 2 t + 1) of matrix i, or with trans (2 t, g) and
// (2 t + 1, g), the lower column (row) in the low half (PTX ISA, "Warp-level matrix load
// instruction: ldmatrix").
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  Block* bl = current();
  const int t = bl->cur, base = t & ~31, lane = t & 31;
  if (reinterpret_cast<std::uintptr_t>(row) % 16 != 0) {
    std::fprintf(stderr, "emulated ldmatrix: row address not 16-byte aligned\n");
    std::abort();
  }
  bl->rows[t] = static_cast<const unsigned char*>(row);
  sync_warp();
  const int g = lane / 4, tt = lane % 4;
  auto elem = [&](int matrix, int rr, int cc) {
    uint16_t v;
    std::memcpy(&v, bl->rows[base + 8 * matrix + rr] + 2 * cc, sizeof v);
    return static_cast<uint32_t>(v);
  };
  for (int i = 0; i < 4; ++i)
    r[i] = trans ? elem(i, 2 * tt, g) | (elem(i, 2 * tt + 1, g) << 16)
                 : elem(i, g, 2 * tt) | (elem(i, g, 2 * tt + 1) << 16);
  sync_warp();  // every lane has read the addresses before any lane gives new ones
}

// cp.async.cg.shared.global [dst], [src], 16, src_bytes; cp.async.commit_group;
// cp.async.wait_group n (at most n committed groups, the newest, still pending). On a GPU a copy
// lands at some time between the two; the emulation takes the two extremes: in index order it
// lands at the first block barrier after the wait (a read before the wait, or a read by other
// threads with no barrier after it, sees stale data; stricter than PTX, where the waiting
// thread itself sees its copies at once), in reverse order at once (a copy into a buffer that
// other threads still read, with no barrier between, corrupts their reads).
inline void land(const AsyncCopy& c) {
  std::memcpy(c.dst, c.src, static_cast<size_t>(c.src_bytes));
  std::memset(c.dst + c.src_bytes, 0, static_cast<size_t>(16 - c.src_bytes));
}
inline void cp_async16(void* dst, const void* src, int src_bytes) {
  if (reinterpret_cast<std::uintptr_t>(dst) % 16 != 0 ||
      (src_bytes > 0 && reinterpret_cast<std::uintptr_t>(src) % 16 != 0)) {
    std::fprintf(stderr, "emulated cp.async: address not 16-byte aligned\n");
    std::abort();
  }
  if (reverse_order()) {
    land({static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), src_bytes});
    return;
  }
  Block* bl = current();
  bl->async[bl->cur].open.push_back(
      {static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), src_bytes});
}
inline void cp_async_commit() {
  AsyncCopies& a = current()->async[current()->cur];
  a.committed.push_back(std::move(a.open));
  a.open.clear();
}
inline void cp_async_wait(int pending) {
  Block* bl = current();
  AsyncCopies& a = bl->async[bl->cur];
  while (static_cast<int>(a.committed.size()) > pending) {
    for (const AsyncCopy& c : a.committed.front()) bl->landing.push_back(c);
    a.committed.pop_front();
  }
}

// Fiber stacks, reused by every block: at most 1024 threads of 64 KiB.
inline char* stacks() {
  static std::unique_ptr<char[]> pool(new char[size_t{1024} * kStackBytes]);
  return pool.get();
}

inline void fiber_main() {
  Block* b = current();
#ifdef PTDP_EMU_ASAN  // the first switch here came from the block's calling thread
  __sanitizer_finish_switch_fiber(nullptr, &b->main.stack_bottom, &b->main.stack_bytes);
#endif
  (*b->body)();
  const AsyncCopies& a = b->async[b->cur];
  bool left = !a.open.empty();
  for (const auto& group : a.committed) left = left || !group.empty();
  b->copies_left = b->copies_left || left;
  Fiber& f = b->fibers[b->cur];
  f.wait = Wait::kDone;
  switch_to(f.ctx, b->main, true);  // never resumed
}
inline void init_fiber(Fiber& f, int index) {
  char* stack = stacks() + static_cast<size_t>(index) * kStackBytes;
#ifdef PTDP_EMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(stack, kStackBytes);
#endif
  init_context(f.ctx, stack, kStackBytes, fiber_main);
}

// Runs `body` as every thread of block `idx` of a `grid` of blocks of `dim` threads.
inline void run_block(Dim grid, Dim idx, Dim dim, size_t dynamic_smem_bytes,
                      const std::function<void()>& body) {
  const int threads = static_cast<int>(dim.x * dim.y * dim.z);
  if (threads <= 0 || threads > 1024) throw std::invalid_argument("emulated launch: block size");
  Block b;
  b.idx = idx;
  b.dim = dim;
  b.grid = grid;
  b.fibers.resize(static_cast<size_t>(threads));
  b.smem.assign(dynamic_smem_bytes + 16, 0);
  b.shfl.assign(static_cast<size_t>(threads), 0.0f);
  b.shfl_up.assign(static_cast<size_t>(threads), 0);
  b.frag_a.assign(static_cast<size_t>(threads) * 4, 0u);
  b.frag_b.assign(static_cast<size_t>(threads) * 2, 0u);
  b.rows.assign(static_cast<size_t>(threads), nullptr);
  b.async.assign(static_cast<size_t>(threads), AsyncCopies{});
  b.body = &body;
  Block* saved = current();
  current() = &b;
  const bool reverse = reverse_order();
  for (int i = 0; i < threads; ++i) init_fiber(b.fibers[i], i);
  const int warps = (threads + 31) / 32;
  int run_first = 0, run_count = threads;  // the threads a release made runnable
  for (;;) {
    for (int k = 0; k < run_count; ++k) {
      const int i = run_first + (reverse ? run_count - 1 - k : k);
      if (b.fibers[i].wait == Wait::kRunnable) {
        b.cur = i;
        switch_to(b.main, b.fibers[i].ctx);
      }
    }
    // Everyone is now waiting or done: release the barriers that every live thread reached.
    bool all_done = true, block_ready = true, released = false;
    for (const Fiber& f : b.fibers) {
      all_done = all_done && f.wait == Wait::kDone;
      block_ready = block_ready && (f.wait == Wait::kBlock || f.wait == Wait::kDone);
    }
    if (all_done) {
      if (b.copies_left) {
        current() = saved;
        throw std::logic_error(
            "emulated kernel: a thread ended with cp.async copies never waited for");
      }
      break;
    }
    if (block_ready) {
      for (const AsyncCopy& c : b.landing) land(c);
      b.landing.clear();
      for (Fiber& f : b.fibers)
        if (f.wait == Wait::kBlock) f.wait = Wait::kRunnable;
      run_first = 0;
      run_count = threads;
      continue;
    }
    // One warp at a time (the first in the run order whose lanes all wait at a warp barrier):
    // it runs on to its next block barrier before another warp moves, so warps that race on
    // shared memory without a block barrier between them are caught in one order or the other.
    for (int k = 0; k < warps && !released; ++k) {
      const int w = reverse ? warps - 1 - k : k;
      const int first = w * 32, last = std::min(threads, first + 32);
      bool ready = true, any = false;
      for (int l = first; l < last; ++l) {
        const Wait s = b.fibers[l].wait;
        ready = ready && (s == Wait::kWarp || s == Wait::kDone);
        any = any || s == Wait::kWarp;
      }
      if (ready && any) {
        for (int l = first; l < last; ++l)
          if (b.fibers[l].wait == Wait::kWarp) b.fibers[l].wait = Wait::kRunnable;
        released = true;
        run_first = first;
        run_count = last - first;
      }
    }
    if (!released) {
      current() = saved;
      throw std::logic_error("emulated kernel: threads wait at different barriers");
    }
  }
  current() = saved;
}

// Every block of a grid in order. A grid past CUDA's limits (x below 2^31, y and z at most
// 65535), which a GPU refuses to launch, is refused here too.
inline void launch(Dim grid, Dim block, size_t dynamic_smem_bytes,
                   const std::function<void()>& body) {
  if (grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
    throw std::invalid_argument(
        "emulated launch: grid beyond CUDA's limits (invalid configuration)");
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x)
        run_block(grid, {x, y, z}, block, dynamic_smem_bytes, body);
}

// PTDP_KERNEL_LAUNCH(kernel, grid, block, shared bytes, stream)(args): the launch's arguments
// kept, the kernel called with `args` by every thread.
template <typename F>
struct Launcher {
  Dim grid, block;
  size_t smem;
  F call;
  template <typename... A>
  void operator()(A&&... args) {
    launch(grid, block, smem, [&] { call(args...); });
  }
};
template <typename F>
Launcher<F> launcher(Dim grid, Dim block, size_t smem, cudaStream_t, F call) {
  return {grid, block, smem, call};
}

}  // namespace emu
