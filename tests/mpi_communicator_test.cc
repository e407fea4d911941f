// The MPI Communicator and ControlPlane, run under mpirun with 4 ranks (tests/CMakeLists.txt); on
// one rank (no launcher) the same checks run on a group of one. Expected values are computed
// from rank numbers and are exact in every element type (small integers and quarter steps).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <ostream>
#include <thread>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/float16.h"
#include "runtime/process_groups.h"
#include "runtime/watchdog.h"

namespace ptdp {
namespace {

Communicator& world() {
  static std::unique_ptr<Communicator> w =
      mpi_available() ? make_mpi_world() : make_self_communicator();
  return *w;
}

ControlPlane& control() {
  world();  // MPI starts here, in the same order on every rank
  static std::unique_ptr<ControlPlane> c =
      mpi_available() ? make_mpi_control_plane() : make_self_control_plane();
  return *c;
}

constexpr DType kAllTypes[] = {DType::kF32, DType::kBF16, DType::kF16,
                               DType::kI32, DType::kI64,  DType::kF64};

// A buffer of `n` elements of type t, written and read as doubles.
class Buf {
 public:
  Buf(DType t, size_t n) : t_(t), bytes_(n * dtype_bytes(t)) {}
  Buf(DType t, std::initializer_list<double> v) : Buf(t, v.size()) {
    size_t i = 0;
    for (double x : v) set(i++, x);
  }
  void* data() { return bytes_.data(); }
  size_t size() const { return bytes_.size() / dtype_bytes(t_); }
  void set(size_t i, double x) {
    uint8_t* p = bytes_.data() + i * dtype_bytes(t_);
    switch (t_) {
      case DType::kF32: {
        const auto v = static_cast<float>(x);
        std::memcpy(p, &v, sizeof v);
        break;
      }
      case DType::kBF16: {
        const uint16_t v = float_to_bf16(static_cast<float>(x));
        std::memcpy(p, &v, sizeof v);
        break;
      }
      case DType::kF16: {
        const uint16_t v = float_to_fp16(static_cast<float>(x));
        std::memcpy(p, &v, sizeof v);
        break;
      }
      case DType::kI32: {
        const auto v = static_cast<int32_t>(x);
        std::memcpy(p, &v, sizeof v);
        break;
      }
      case DType::kI64: {
        const auto v = static_cast<int64_t>(x);
        std::memcpy(p, &v, sizeof v);
        break;
      }
      case DType::kF64:
        std::memcpy(p, &x, sizeof x);
        break;
    }
  }
  double get(size_t i) const {
    const uint8_t* p = bytes_.data() + i * dtype_bytes(t_);
    switch (t_) {
      case DType::kF32: {
        float v;
        std::memcpy(&v, p, sizeof v);
        return v;
      }
      case DType::kBF16: {
        uint16_t v;
        std::memcpy(&v, p, sizeof v);
        return bf16_to_float(v);
      }
      case DType::kF16: {
        uint16_t v;
        std::memcpy(&v, p, sizeof v);
        return fp16_to_float(v);
      }
      case DType::kI32: {
        int32_t v;
        std::memcpy(&v, p, sizeof v);
        return v;
      }
      case DType::kI64: {
        int64_t v;
        std::memcpy(&v, p, sizeof v);
        return static_cast<double>(v);
      }
      case DType::kF64: {
        double v;
        std::memcpy(&v, p, sizeof v);
        return v;
      }
    }
    return std::nan("");
  }

 private:
  DType t_;
  std::vector<uint8_t> bytes_;
};

class Typed : public ::testing::TestWithParam<DType> {};

}  // namespace

void PrintTo(DType t, std::ostream* os) {  // gtest's name for a parameter in failure messages
  *os << to_string(t);
}

namespace {

INSTANTIATE_TEST_SUITE_P(AllTypes, Typed, ::testing::ValuesIn(kAllTypes),
                         [](const auto& info) { return to_string(info.param); });

TEST_P(Typed, AllReduceSums) {
  Communicator& w = world();
  const DType t = GetParam();
  const double r = w.rank(), n = w.size();
  Buf x(t, {r + 1, -2 * r, 1, 0.25 * (r + 1) * (t == DType::kI32 || t == DType::kI64 ? 4 : 1)});
  w.all_reduce(x.data(), x.size(), t);
  const double tri = n * (n + 1) / 2;
  EXPECT_EQ(x.get(0), tri);
  EXPECT_EQ(x.get(1), -2 * (tri - n));
  EXPECT_EQ(x.get(2), n);
  EXPECT_EQ(x.get(3), 0.25 * tri * (t == DType::kI32 || t == DType::kI64 ? 4 : 1));
  // Long enough for MPI to reduce in segments.
  Buf big(t, 50000);
  for (size_t i = 0; i < big.size(); ++i) big.set(i, static_cast<double>(i % 7) + r);
  w.all_reduce(big.data(), big.size(), t);
  for (size_t i = 0; i < big.size(); ++i)
    ASSERT_EQ(big.get(i), n * static_cast<double>(i % 7) + (tri - n)) << i;
}

TEST_P(Typed, AllGatherIsRankMajor) {
  Communicator& w = world();
  const DType t = GetParam();
  const int n = w.size();
  Buf mine(t, {static_cast<double>(w.rank()), 10.0 * w.rank() + 1});
  Buf all(t, 2 * static_cast<size_t>(n));
  w.all_gather(mine.data(), all.data(), 2, t);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(all.get(2 * static_cast<size_t>(r)), r);
    EXPECT_EQ(all.get(2 * static_cast<size_t>(r) + 1), 10.0 * r + 1);
  }
}

// Rank s sends rank d (d + s) % 3 elements of value 8 s + d (zero of them is allowed).
TEST_P(Typed, AllToAllWithVariableCounts) {
  Communicator& w = world();
  const DType t = GetParam();
  const int n = w.size(), me = w.rank();
  auto rows = [](int from, int to) { return static_cast<size_t>((from + to) % 3); };
  std::vector<size_t> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
  std::vector<double> out_values;
  for (int r = 0; r < n; ++r) {
    send[static_cast<size_t>(r)] = rows(me, r);
    recv[static_cast<size_t>(r)] = rows(r, me);
    for (size_t i = 0; i < rows(me, r); ++i) out_values.push_back(8.0 * me + r);
  }
  const size_t total_in = std::accumulate(recv.begin(), recv.end(), size_t{0});
  Buf in(t, out_values.size()), out(t, total_in);
  for (size_t i = 0; i < out_values.size(); ++i) in.set(i, out_values[i]);
  w.all_to_all_v(in.data(), send, out.data(), recv, t);
  size_t at = 0;
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < rows(r, me); ++i) EXPECT_EQ(out.get(at++), 8.0 * r + me) << r;
}

TEST_P(Typed, ReduceScatterKeepsThisRanksBlock) {
  Communicator& w = world();
  const DType t = GetParam();
  const int n = w.size(), me = w.rank();
  // Block b, element j is b + rank + j: rank r keeps n * (r + j) + n(n-1)/2.
  Buf blocks(t, 3 * static_cast<size_t>(n));
  for (int b = 0; b < n; ++b)
    for (int j = 0; j < 3; ++j) blocks.set(static_cast<size_t>(3 * b + j), b + me + j);
  Buf out(t, 3);
  w.reduce_scatter(blocks.data(), out.data(), 3, t);
  for (int j = 0; j < 3; ++j)
    EXPECT_EQ(out.get(static_cast<size_t>(j)), n * (me + j) + n * (n - 1) / 2);
  // In place: the result lands in the first block.
  w.reduce_scatter(blocks.data(), blocks.data(), 3, t);
  for (int j = 0; j < 3; ++j)
    EXPECT_EQ(blocks.get(static_cast<size_t>(j)), n * (me + j) + n * (n - 1) / 2);
}

// Rank r's block in the uneven collectives: (r + 1) % 3 elements (rank 2's none).
std::vector<size_t> uneven_counts(int ranks) {
  std::vector<size_t> counts;
  for (int r = 0; r < ranks; ++r) counts.push_back(static_cast<size_t>((r + 1) % 3));
  return counts;
}

// Uneven blocks, one of them empty: rank r's block has (r + 1) % 3 elements (rank 2's none), and
// element j of block b on rank q is 10 b + q + j, so rank r gets n (10 r + j) + n(n-1)/2.
TEST_P(Typed, UnevenReduceScatterHandsEachRankItsBlock) {
  Communicator& w = world();
  const DType t = GetParam();
  const int n = w.size(), me = w.rank();
  const std::vector<size_t> counts = uneven_counts(n);
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  Buf in(t, total), out(t, std::max<size_t>(1, counts[static_cast<size_t>(me)]));
  size_t at = 0;
  for (int b = 0; b < n; ++b)
    for (size_t j = 0; j < counts[static_cast<size_t>(b)]; ++j)
      in.set(at++, 10.0 * b + me + static_cast<double>(j));
  out.set(0, -7);
  w.reduce_scatter_v(in.data(), out.data(), counts, t);
  for (size_t j = 0; j < counts[static_cast<size_t>(me)]; ++j)
    EXPECT_EQ(out.get(j), n * (10.0 * me + static_cast<double>(j)) + n * (n - 1) / 2) << j;
  if (counts[static_cast<size_t>(me)] == 0) {
    EXPECT_EQ(out.get(0), -7);  // an empty block: untouched
  }
  // In place (the distributed optimizer's gradient shards): the block's sum lands where the
  // block is, after the blocks of the ranks before it.
  size_t own = 0;
  for (int b = 0; b < me; ++b) own += counts[static_cast<size_t>(b)];
  w.reduce_scatter_v(in.data(), in.data(), counts, t);
  for (size_t j = 0; j < counts[static_cast<size_t>(me)]; ++j)
    EXPECT_EQ(in.get(own + j), n * (10.0 * me + static_cast<double>(j)) + n * (n - 1) / 2)
        << "in place, " << j;
  // Wrong number of counts: refused, not sent.
  const std::vector<size_t> short_counts(static_cast<size_t>(n) + 1, 0);
  EXPECT_THROW(w.reduce_scatter_v(in.data(), out.data(), short_counts, t), std::invalid_argument);
}

// The inverse: rank r contributes (r + 1) % 3 elements (rank 2 none), element j being 10 r + j;
// every rank gets all blocks in rank order, from a separate buffer and in place.
TEST_P(Typed, UnevenAllGatherPutsTheBlocksInRankOrder) {
  Communicator& w = world();
  const DType t = GetParam();
  const int n = w.size(), me = w.rank();
  const std::vector<size_t> counts = uneven_counts(n);
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  const size_t mine = counts[static_cast<size_t>(me)];
  size_t own = 0;  // where this rank's block starts
  for (int r = 0; r < me; ++r) own += counts[static_cast<size_t>(r)];
  Buf in(t, std::max<size_t>(1, mine)), out(t, total), whole(t, total);
  for (size_t j = 0; j < mine; ++j) {
    in.set(j, 10.0 * me + static_cast<double>(j));
    whole.set(own + j, 10.0 * me + static_cast<double>(j));
  }
  w.all_gather_v(in.data(), out.data(), counts, t);
  // In place: this rank's block already sits in the output.
  void* own_block = static_cast<char*>(whole.data()) + own * dtype_bytes(t);
  w.all_gather_v(own_block, whole.data(), counts, t);
  size_t at = 0;
  for (int r = 0; r < n; ++r)
    for (size_t j = 0; j < counts[static_cast<size_t>(r)]; ++j, ++at) {
      EXPECT_EQ(out.get(at), 10.0 * r + static_cast<double>(j)) << r << " " << j;
      EXPECT_EQ(whole.get(at), 10.0 * r + static_cast<double>(j)) << r << " " << j;
    }
}

TEST_P(Typed, BroadcastFromTheLastRank) {
  Communicator& w = world();
  const DType t = GetParam();
  const int root = w.size() - 1;
  Buf x(t, 3);
  if (w.rank() == root) {
    x.set(0, 7);
    x.set(1, -3);
    x.set(2, root);
  }
  w.broadcast(x.data(), 3, t, root);
  EXPECT_EQ(x.get(0), 7);
  EXPECT_EQ(x.get(1), -3);
  EXPECT_EQ(x.get(2), root);
}

TEST_P(Typed, SendRecvAroundARing) {
  Communicator& w = world();
  const int n = w.size();
  if (n < 2) GTEST_SKIP() << "needs 2 or more ranks";
  const DType t = GetParam();
  const int me = w.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  Buf out(t, {static_cast<double>(me), me + 100.0}), back(t, {-1.0 * me}), from_prev(t, 2),
      from_next(t, 1);
  const Communicator::P2P ops[] = {{true, out.data(), 2, next, 1, t},
                                   {true, back.data(), 1, prev, 2, t},
                                   {false, from_prev.data(), 2, prev, 1, t},
                                   {false, from_next.data(), 1, next, 2, t}};
  w.batch(ops);
  EXPECT_EQ(from_prev.get(0), prev);
  EXPECT_EQ(from_prev.get(1), prev + 100.0);
  EXPECT_EQ(from_next.get(0), -1.0 * next);
}

TEST_P(Typed, AsyncFormsOverlapAndComplete) {
  Communicator& w = world();
  const DType t = GetParam();
  const int n = w.size(), me = w.rank(), root = 0;
  Buf sum(t, {me + 1.0}), mine(t, {me * 2.0}), all(t, static_cast<size_t>(n)),
      blocks(t, static_cast<size_t>(n)), block(t, 1), bcast(t, {me == root ? 42.0 : 0.0});
  for (int b = 0; b < n; ++b) blocks.set(static_cast<size_t>(b), b * 3 + me);
  // Four collectives in flight at once, posted in the same order on every rank.
  auto a = w.all_reduce_async(sum.data(), 1, t);
  auto g = w.all_gather_async(mine.data(), all.data(), 1, t);
  auto rs = w.reduce_scatter_async(blocks.data(), block.data(), 1, t);
  auto bc = w.broadcast_async(bcast.data(), 1, t, root);
  std::unique_ptr<Work> p;
  Buf from_prev(t, 1), out(t, {me + 0.5 * (t == DType::kI32 || t == DType::kI64 ? 0 : 1)});
  if (n >= 2) {
    const Communicator::P2P ops[] = {{true, out.data(), 1, (me + 1) % n, 5, t},
                                     {false, from_prev.data(), 1, (me + n - 1) % n, 5, t}};
    p = w.batch_async(ops);
  }
  // Completed out of order; test() polls until the broadcast is done.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!bc->test()) ASSERT_LT(std::chrono::steady_clock::now(), deadline);
  EXPECT_TRUE(bc->test());
  EXPECT_EQ(bcast.get(0), 42);
  rs->wait();
  EXPECT_EQ(block.get(0), n * me * 3 + n * (n - 1) / 2);
  g->wait();
  for (int r = 0; r < n; ++r) EXPECT_EQ(all.get(static_cast<size_t>(r)), 2.0 * r);
  a->wait();
  EXPECT_EQ(sum.get(0), n * (n + 1) / 2);
  a->wait();  // waiting again on a completed Work returns at once
  if (p) {
    p->wait();
    const int prev = (me + n - 1) % n;
    EXPECT_EQ(from_prev.get(0), prev + 0.5 * (t == DType::kI32 || t == DType::kI64 ? 0 : 1));
  }
}

TEST(Float16, ConversionsRoundToNearestEven) {
  // bf16 keeps 8 significant bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 and goes to even.
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 0x1p-8f)), 1.0f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 0x1p-7f + 0x1p-8f)), 1.0f + 0x1p-6f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 0x1p-8f + 0x1p-12f)), 1.0f + 0x1p-7f);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  // fp16 keeps 11 significant bits, tops out at 65504, and has subnormals down to 2^-24.
  EXPECT_EQ(fp16_to_float(float_to_fp16(1.0f + 0x1p-11f)), 1.0f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(1.0f + 0x1p-10f + 0x1p-11f)), 1.0f + 0x1p-9f);
  EXPECT_EQ(float_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_fp16(-2.0f), 0xc000);
  EXPECT_EQ(fp16_to_float(float_to_fp16(65504.0f)), 65504.0f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(65519.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(fp16_to_float(float_to_fp16(65520.0f))));
  EXPECT_EQ(fp16_to_float(float_to_fp16(0x1p-24f)), 0x1p-24f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(3 * 0x1p-24f)), 3 * 0x1p-24f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(0x1p-25f)), 0.0f);  // a tie with 0: even
  EXPECT_EQ(fp16_to_float(float_to_fp16(0x1p-14f)), 0x1p-14f);
  EXPECT_EQ(float_to_fp16(0x1p-14f), 0x0400);
  EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(std::nanf("")))));
  for (uint32_t h = 0; h < 0x7c00; ++h)  // every finite fp16 survives the round trip
    ASSERT_EQ(float_to_fp16(fp16_to_float(static_cast<uint16_t>(h))), static_cast<uint16_t>(h));
}

TEST(SixteenBitSums, AreFloatingPointSumsNotWordSums) {
  Communicator& w = world();
  const int n = w.size(), me = w.rank();
  // Summing the 16-bit patterns as integers would be wrong for each of these.
  uint16_t b[3] = {float_to_bf16(0.25f * static_cast<float>(me + 1)), float_to_bf16(-1.5f),
                   float_to_bf16(1024.0f)};
  w.all_reduce(b, 3, DType::kBF16);
  EXPECT_EQ(bf16_to_float(b[0]), 0.25f * static_cast<float>(n * (n + 1) / 2));
  EXPECT_EQ(bf16_to_float(b[1]), -1.5f * static_cast<float>(n));
  EXPECT_EQ(bf16_to_float(b[2]), 1024.0f * static_cast<float>(n));
  uint16_t h[3] = {float_to_fp16(0.25f * static_cast<float>(me + 1)), float_to_fp16(-1.5f),
                   float_to_fp16(0x1p-20f)};  // a subnormal
  w.all_reduce(h, 3, DType::kF16);
  EXPECT_EQ(fp16_to_float(h[0]), 0.25f * static_cast<float>(n * (n + 1) / 2));
  EXPECT_EQ(fp16_to_float(h[1]), -1.5f * static_cast<float>(n));
  EXPECT_EQ(fp16_to_float(h[2]), 0x1p-20f * static_cast<float>(n));
  // fp16 overflows to infinity past 65504.
  uint16_t big = float_to_fp16(40000.0f);
  w.all_reduce(&big, 1, DType::kF16);
  if (n > 1) {
    EXPECT_TRUE(std::isinf(fp16_to_float(big)));
  }
}

TEST(FloatShorthands, StillWork) {
  Communicator& w = world();
  const int n = w.size();
  std::vector<float> x = {static_cast<float>(w.rank() + 1), 1.0f};
  w.all_reduce(x.data(), x.size());
  EXPECT_EQ(x[0], static_cast<float>(n * (n + 1) / 2));
  EXPECT_EQ(x[1], static_cast<float>(n));
  std::vector<float> all(static_cast<size_t>(n));
  const float me = static_cast<float>(w.rank());
  w.all_gather(&me, all.data(), 1);
  for (int r = 0; r < n; ++r) EXPECT_EQ(all[static_cast<size_t>(r)], static_cast<float>(r));
  float b = w.rank() == 0 ? 9.0f : 0.0f;
  w.broadcast(&b, 1, 0);
  EXPECT_EQ(b, 9.0f);
  w.barrier();
}

TEST(MpiCommunicator, DroppedWorkCompletesBeforeItGoes) {
  Communicator& w = world();
  const int n = w.size();
  int32_t x[2] = {w.rank(), 1};
  { auto dropped = w.all_reduce_async(x, 2, DType::kI32); }  // never waited on
  EXPECT_EQ(x[0], n * (n - 1) / 2);
  EXPECT_EQ(x[1], n);
}

TEST(MpiCommunicator, SplitFollowsProcessGroups) {
  Communicator& w = world();
  if (w.size() != 4) GTEST_SKIP() << "needs 4 ranks (mpirun -np 4)";
  const ProcessGroups g(4, 2, 2, 1, w.rank());
  auto tp = w.split(static_cast<int>(g.tensor_color()), static_cast<int>(g.position().tp), "tp");
  ASSERT_EQ(tp->size(), 2);
  EXPECT_EQ(tp->rank(), g.position().tp);
  EXPECT_EQ(tp->name(), "tp");
  EXPECT_EQ(tp->timeout().count(), w.timeout().count());
  int64_t me = w.rank();
  std::vector<int64_t> members(2);
  tp->all_gather(&me, members.data(), 1, DType::kI64);
  EXPECT_EQ(members, g.tensor_group());
  auto unnamed = w.split(7, w.rank());
  EXPECT_EQ(unnamed->name(), w.name() + "/7");
}

TEST(SelfCommunicator, CopiesTypedBuffersAndRefusesPeers) {
  auto s = make_self_communicator();
  const int64_t in[2] = {1LL << 40, -5};
  int64_t out[2] = {0, 0};
  s->all_gather(in, out, 2, DType::kI64);
  EXPECT_EQ(out[0], 1LL << 40);
  EXPECT_EQ(out[1], -5);
  uint16_t h[2] = {0, 0};
  const uint16_t src[2] = {0x3c00, 0xc000};
  EXPECT_TRUE(s->reduce_scatter_async(src, h, 2, DType::kF16)->test());
  EXPECT_EQ(h[1], 0xc000);
  int64_t uneven = 0;
  const size_t one[] = {1};
  s->reduce_scatter_v(in + 1, &uneven, one, DType::kI64);
  EXPECT_EQ(uneven, -5);
  int64_t gathered = 0;
  s->all_gather_v(in, &gathered, one, DType::kI64);
  EXPECT_EQ(gathered, int64_t{1} << 40);
  float f = 1;
  const Communicator::P2P op{true, &f, 1, 0, 0};
  EXPECT_THROW(s->batch({&op, 1}), std::logic_error);
  auto cp = make_self_control_plane();
  EXPECT_EQ(cp->agree(false), -1);
  EXPECT_EQ(cp->agree(true), 0);
  EXPECT_EQ(cp->sum(int64_t{1} << 50), int64_t{1} << 50);
  EXPECT_EQ(cp->all_gather_bytes({1, 2, 3}), (std::vector<std::vector<uint8_t>>{{1, 2, 3}}));
}

TEST(ControlPlane, AgreesOnTheFirstFailingRank) {
  ControlPlane& c = control();
  const int n = c.size(), me = c.rank();
  EXPECT_EQ(c.agree(false), -1);
  // Odd ranks fail: rank 1 is the first (none with one rank).
  EXPECT_EQ(c.agree(me % 2 == 1), n > 1 ? 1 : -1);
  EXPECT_EQ(c.agree(me == n - 1), n - 1);
  const std::vector<bool> flags = c.all_gather_flags(me % 3 == 0);
  ASSERT_EQ(flags.size(), static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) EXPECT_EQ(flags[static_cast<size_t>(r)], r % 3 == 0) << r;
}

TEST(ControlPlane, SumsAndMaxima) {
  ControlPlane& c = control();
  const int64_t n = c.size(), me = c.rank();
  // Above 2^24 (where float stops counting exactly) and above 2^53 (where double does).
  EXPECT_EQ(c.sum((int64_t{1} << 24) + 1 + me), n * ((int64_t{1} << 24) + 1) + n * (n - 1) / 2);
  EXPECT_EQ(c.sum((int64_t{1} << 55) + 3 * me + 1),
            n * (int64_t{1} << 55) + 3 * n * (n - 1) / 2 + n);
  EXPECT_EQ(c.max(7 * me - 3), 7 * (n - 1) - 3);
  EXPECT_EQ(c.max(-me), int64_t{0});
  // Doubles: summed in rank order, so the same bits as this loop on every rank.
  double expected = 0;
  for (int64_t r = 0; r < n; ++r) expected += 0.1 * static_cast<double>(r + 1);
  EXPECT_EQ(c.sum(0.1 * static_cast<double>(me + 1)), expected);
  EXPECT_EQ(c.max(1.5 * static_cast<double>(me) - 0.25), 1.5 * static_cast<double>(n - 1) - 0.25);
  c.barrier();
}

TEST(ControlPlane, GathersBytesOfDifferentSizes) {
  ControlPlane& c = control();
  const int n = c.size(), me = c.rank();
  auto bytes_of = [](int r) {
    // Rank 0 sends nothing, rank 1 a long run, the others 3r bytes.
    const size_t len = r == 1 ? 100000 : 3 * static_cast<size_t>(r);
    std::vector<uint8_t> v(len);
    for (size_t i = 0; i < len; ++i) v[i] = static_cast<uint8_t>(16 * r + static_cast<int>(i));
    return v;
  };
  const auto all = c.all_gather_bytes(bytes_of(me));
  ASSERT_EQ(all.size(), static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) EXPECT_EQ(all[static_cast<size_t>(r)], bytes_of(r)) << r;
}

TEST(ControlPlane, SplitsIntoSubgroups) {
  ControlPlane& c = control();
  const int me = c.rank(), n = c.size();
  auto half = c.split(me % 2, me, "parity");
  EXPECT_EQ(half->name(), "parity");
  EXPECT_EQ(half->size(), (n + 1 - me % 2) / 2);
  EXPECT_EQ(half->rank(), me / 2);
  int64_t expected = 0;
  for (int r = me % 2; r < n; r += 2) expected += r;
  EXPECT_EQ(half->sum(static_cast<int64_t>(me)), expected);
}

TEST(CommTimeoutSetting, ComesFromTheEnvironment) {
  const char* saved = std::getenv("PTDP_COMM_TIMEOUT_S");
  const std::string keep = saved ? saved : "";
  unsetenv("PTDP_COMM_TIMEOUT_S");
  EXPECT_EQ(default_comm_timeout().count(), 300.0);
  setenv("PTDP_COMM_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(default_comm_timeout().count(), 2.5);
  EXPECT_EQ(make_self_communicator()->timeout().count(), 2.5);
  setenv("PTDP_COMM_TIMEOUT_S", "soon", 1);
  EXPECT_THROW(default_comm_timeout(), std::invalid_argument);
  setenv("PTDP_COMM_TIMEOUT_S", "-1", 1);
  EXPECT_THROW(default_comm_timeout(), std::invalid_argument);
  if (saved)
    setenv("PTDP_COMM_TIMEOUT_S", keep.c_str(), 1);
  else
    unsetenv("PTDP_COMM_TIMEOUT_S");
}

// The bounded waits run on their own split communicators and end with the world in step, so MPI
// stays usable for whatever runs after them.
TEST(BoundedWait, ReceiveFromASilentPeerTimesOut) {
  Communicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 or more ranks";
  auto c = w.split(0, w.rank(), "silent-peer");
  c->set_timeout(CommDuration(1.0));
  int32_t got[2] = {-1, -1};
  if (c->rank() == 1) {  // sends tag 98 and never tag 99
    int32_t v = 5;
    const Communicator::P2P op{true, &v, 1, 0, 98, DType::kI32};
    c->batch({&op, 1});
  }
  if (c->rank() == 0) {
    const Communicator::P2P ops[] = {{false, &got[0], 1, 1, 98, DType::kI32},
                                     {false, &got[1], 1, 1, 99, DType::kI32}};
    auto work = c->batch_async(ops);
    EXPECT_FALSE(work->test());
    const auto start = std::chrono::steady_clock::now();
    try {
      work->wait();
      ADD_FAILURE() << "a receive nobody sends completed";
    } catch (const CommTimeout& e) {
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_GE(waited, 0.99);
      EXPECT_LT(waited, 30.0);
      EXPECT_EQ(e.group(), "silent-peer");
      EXPECT_EQ(e.missing_ranks(), std::vector<int>{1});
      const std::string what = e.what();
      RecordProperty("message", what);
      EXPECT_NE(what.find("timed out after 1 s"), std::string::npos) << what;
      EXPECT_NE(what.find("group 'silent-peer'"), std::string::npos) << what;
      EXPECT_NE(what.find("not heard from: rank 1"), std::string::npos) << what;
      EXPECT_NE(what.find("recv of 1 int32 from rank 1"), std::string::npos) << what;
      EXPECT_NE(what.find("tag 99"), std::string::npos) << what;
      EXPECT_EQ(what.find("tag 98"), std::string::npos) << what;  // that one arrived
    }
    EXPECT_EQ(got[0], 5);
    EXPECT_EQ(got[1], -1);
  }  // the Work goes: its receive is cancelled
  w.barrier();
  int64_t one = 1;
  c->all_reduce(&one, 1, DType::kI64);  // the group still works
  EXPECT_EQ(one, c->size());
}

TEST(BoundedWait, CollectiveWithALateRankTimesOutThenCompletes) {
  Communicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 or more ranks";
  auto c = w.split(0, w.rank(), "late-rank");
  c->set_timeout(CommDuration(1.0));
  const int n = c->size();
  int64_t x = (int64_t{1} << 40) + c->rank();
  if (c->rank() == 0) {
    w.barrier();  // joins only after the others have timed out
    c->all_reduce(&x, 1, DType::kI64);
  } else {
    auto work = c->all_reduce_async(&x, 1, DType::kI64);
    try {
      work->wait();
      ADD_FAILURE() << "an all-reduce missing rank 0 completed";
    } catch (const CommTimeout& e) {
      EXPECT_EQ(e.group(), "late-rank");
      EXPECT_EQ(e.operation(), "all-reduce of 1 int64");
      EXPECT_TRUE(e.missing_ranks().empty());  // MPI cannot say who
      const std::string what = e.what();
      RecordProperty("message", what);
      EXPECT_NE(what.find("all-reduce of 1 int64 in group 'late-rank'"), std::string::npos) << what;
    }
    EXPECT_FALSE(work->test());
    w.barrier();
    work->wait(CommDuration(60.0));  // still pending after the timeout: completes now
  }
  EXPECT_EQ(x, n * (int64_t{1} << 40) + n * (n - 1) / 2);
  w.barrier();
}

// A slow peer is not a lost one: a wait that passes the stall timeout makes the watchdog ping
// every rank; the late rank's watchdog thread answers while its main thread sleeps, so the wait
// goes on and completes (the job is not aborted).
TEST(Watchdog, ASlowPeerIsNotTakenForALostOne) {
  Communicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 or more ranks";
  ASSERT_TRUE(watchdog_active()) << "MPI without MPI_THREAD_MULTIPLE?";
  setenv("PTDP_STALL_TIMEOUT_S", "0.3", 1);
  EXPECT_EQ(stall_timeout().count(), 0.3);
  auto c = w.split(0, w.rank(), "slow-peer");
  const int64_t checks = watchdog_checks();
  const auto start = std::chrono::steady_clock::now();
  if (c->rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  int64_t one = 1;
  c->all_reduce(&one, 1, DType::kI64);  // the others wait past the stall timeout several times
  EXPECT_EQ(one, c->size());
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(waited, 2.4);
  if (c->rank() != 1) {
    EXPECT_GE(watchdog_checks() - checks, 2);  // it did ping, and went on
  }
  unsetenv("PTDP_STALL_TIMEOUT_S");
  EXPECT_EQ(stall_timeout().count(), 30.0);
  w.barrier();
}

}  // namespace
}  // namespace ptdp
