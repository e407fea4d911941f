// The MPI Communicator, run under mpirun with 4 ranks (tests/CMakeLists.txt); on one rank
// (no launcher) the same checks run on a group of one.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/process_groups.h"

namespace ptdp {
namespace {

Communicator& world() {
  static std::unique_ptr<Communicator> w =
      mpi_available() ? make_mpi_world() : make_self_communicator();
  return *w;
}

TEST(MpiCommunicator, AllReduceSums) {
  Communicator& w = world();
  std::vector<float> x = {static_cast<float>(w.rank() + 1), 1.0f};
  w.all_reduce(x.data(), x.size());
  const int n = w.size();
  EXPECT_EQ(x[0], static_cast<float>(n * (n + 1) / 2));
  EXPECT_EQ(x[1], static_cast<float>(n));
}

TEST(MpiCommunicator, AllGatherAndReduceScatter) {
  Communicator& w = world();
  const int n = w.size();
  std::vector<float> mine = {static_cast<float>(w.rank()), static_cast<float>(10 * w.rank())};
  std::vector<float> all(2 * static_cast<size_t>(n));
  w.all_gather(mine.data(), all.data(), 2);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(all[2 * static_cast<size_t>(r)], static_cast<float>(r));
    EXPECT_EQ(all[2 * static_cast<size_t>(r) + 1], static_cast<float>(10 * r));
  }
  // Every rank contributes block b = b + rank; rank r keeps sum over ranks of (r + rank).
  std::vector<float> blocks(static_cast<size_t>(n));
  for (int b = 0; b < n; ++b) blocks[static_cast<size_t>(b)] = static_cast<float>(b + w.rank());
  float out = 0;
  w.reduce_scatter(blocks.data(), &out, 1);
  EXPECT_EQ(out, static_cast<float>(n * w.rank() + n * (n - 1) / 2));
}

TEST(MpiCommunicator, SplitFollowsProcessGroups) {
  Communicator& w = world();
  if (w.size() != 4) GTEST_SKIP() << "needs 4 ranks (mpirun -np 4)";
  const ProcessGroups g(4, 2, 2, 1, w.rank());
  auto tp = w.split(static_cast<int>(g.tensor_color()), static_cast<int>(g.position().tp));
  ASSERT_EQ(tp->size(), 2);
  EXPECT_EQ(tp->rank(), g.position().tp);
  float me = static_cast<float>(w.rank());
  std::vector<float> members(2);
  tp->all_gather(&me, members.data(), 1);
  const auto expected = g.tensor_group();
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(members[i], static_cast<float>(expected[i]));
}

TEST(MpiCommunicator, BatchedSendRecvAroundARing) {
  Communicator& w = world();
  const int n = w.size();
  if (n < 2) GTEST_SKIP() << "needs 2 or more ranks";
  float out = static_cast<float>(w.rank()), from_prev = -1, from_next = -1;
  float out2 = out;
  const int next = (w.rank() + 1) % n, prev = (w.rank() + n - 1) % n;
  const Communicator::P2P ops[] = {{true, &out, 1, next, 1},
                                   {true, &out2, 1, prev, 2},
                                   {false, &from_prev, 1, prev, 1},
                                   {false, &from_next, 1, next, 2}};
  w.batch(ops);
  EXPECT_EQ(from_prev, static_cast<float>(prev));
  EXPECT_EQ(from_next, static_cast<float>(next));
}

}  // namespace
}  // namespace ptdp
