// Megatron's rank order for (t, p, d): tensor-parallel innermost, then data, then pipeline.
#include "runtime/process_groups.h"

#include <gtest/gtest.h>

#include <set>

#include "core/error.h"

namespace ptdp {
namespace {

TEST(ProcessGroups, MegatronRankOrder) {
  // t = 2, p = 2, d = 2: ranks 0,1 form the first tensor group; 0,2 a data group; 0,4 a pipeline.
  const ProcessGroups g(8, 2, 2, 2, 5);  // tp 1, dp 0, pp 1
  EXPECT_EQ(g.position().tp, 1);
  EXPECT_EQ(g.position().dp, 0);
  EXPECT_EQ(g.position().pp, 1);
  EXPECT_EQ(g.tensor_group(), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(g.data_group(), (std::vector<int64_t>{5, 7}));
  EXPECT_EQ(g.pipeline_group(), (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(g.model_group(), (std::vector<int64_t>{0, 1, 4, 5}));
  EXPECT_EQ(g.embedding_group(), (std::vector<int64_t>{1, 5}));
}

TEST(ProcessGroups, GroupsPartitionTheWorld) {
  for (auto [t, p, d] : {std::tuple{2, 2, 2}, std::tuple{1, 4, 1}, std::tuple{4, 1, 3}}) {
    const int64_t world = t * p * d;
    std::set<std::vector<int64_t>> tensor, data, pipe;
    for (int64_t r = 0; r < world; ++r) {
      const ProcessGroups g(world, t, p, d, r);
      tensor.insert(g.tensor_group());
      data.insert(g.data_group());
      pipe.insert(g.pipeline_group());
      // The colours name the same groups.
      for (int64_t other : g.tensor_group())
        EXPECT_EQ(ProcessGroups(world, t, p, d, other).tensor_color(), g.tensor_color());
      EXPECT_EQ(g.global_rank(g.position().tp, g.position().dp, g.position().pp), r);
    }
    EXPECT_EQ(static_cast<int64_t>(tensor.size()), p * d);
    EXPECT_EQ(static_cast<int64_t>(data.size()), t * p);
    EXPECT_EQ(static_cast<int64_t>(pipe.size()), t * d);
  }
}

TEST(ProcessGroups, WorldSizeMustBeTPD) {
  EXPECT_THROW(ProcessGroups(6, 2, 2, 2, 0), InputError);
  EXPECT_THROW(ProcessGroups(8, 2, 2, 2, 8), InputError);
}

}  // namespace
}  // namespace ptdp
