// The layer op list: FLOPs match the closed forms, tensor parallelism divides the math and adds
// the collectives Megatron-LM issues.
#include "core/layer_ops.h"

#include <gtest/gtest.h>

#include "core/presets.h"

namespace ptdp {
namespace {

double flops(const std::vector<Op>& ops) {
  double f = 0;
  for (const Op& op : ops) f += op.flops();
  return f;
}

int count(const std::vector<Op>& ops, Collective c) {
  int n = 0;
  for (const Op& op : ops) n += op.kind == OpKind::kCollective && op.collective == c;
  return n;
}

TEST(LayerOps, ForwardFlopsMatchSc21) {
  const ModelSpec m = resolve_model("gpt3-175b");
  const double b = 2, s = 2048, h = 12288;
  const PassOps ops = transformer_layer_ops(m, LayerShape{1, 2, false, Recompute::kNone});
  // 24 b s h^2 (1 + s / (6 h)) per layer forward; backward twice that.
  const double fwd = 24 * b * s * h * h * (1 + s / (6 * h));
  EXPECT_NEAR(flops(ops.forward), fwd, fwd * 1e-12);
  EXPECT_NEAR(flops(ops.backward), 2 * fwd, fwd * 1e-12);
  EXPECT_TRUE(ops.recompute.empty());
}

TEST(LayerOps, TensorParallelDividesMathAndAddsAllReduces) {
  const ModelSpec m = resolve_model("gpt3-175b");
  const PassOps one = transformer_layer_ops(m, LayerShape{1, 1, false, Recompute::kFull});
  const PassOps eight = transformer_layer_ops(m, LayerShape{8, 1, false, Recompute::kFull});
  EXPECT_NEAR(flops(eight.forward) * 8, flops(one.forward), flops(one.forward) * 1e-12);
  EXPECT_EQ(count(eight.forward, Collective::kAllReduce), 2);
  EXPECT_EQ(count(eight.backward, Collective::kAllReduce), 2);
  EXPECT_EQ(count(eight.recompute, Collective::kAllReduce), 2);  // full recompute redoes them
  EXPECT_EQ(count(one.forward, Collective::kAllReduce), 0);
}

TEST(LayerOps, SequenceParallelUsesAllGatherAndReduceScatter) {
  const ModelSpec m = resolve_model("gpt3-175b");
  const PassOps sp = transformer_layer_ops(m, LayerShape{8, 1, true, Recompute::kSelective});
  EXPECT_EQ(count(sp.forward, Collective::kAllGather) + count(sp.backward, Collective::kAllGather),
            4);
  EXPECT_EQ(count(sp.forward, Collective::kReduceScatter) +
                count(sp.backward, Collective::kReduceScatter),
            4);
  EXPECT_EQ(count(sp.forward, Collective::kAllReduce) + count(sp.backward, Collective::kAllReduce),
            0);
  // Selective recompute redoes only the attention core: two batched GEMMs, no collective.
  EXPECT_EQ(sp.recompute.size(), 4u);
  EXPECT_EQ(count(sp.recompute, Collective::kAllGather), 0);
}

TEST(LayerOps, LmHeadFlopsAreSixTokensHiddenVocab) {
  const ModelSpec m = resolve_model("gpt3-175b");
  const PassOps head = lm_head_ops(m, LayerShape{4, 1, false, Recompute::kNone});
  const double tokens = 2048, expect = 2 * tokens * 12288.0 * 51200 / 4;
  EXPECT_NEAR(flops(head.forward), expect, expect * 1e-12);
  EXPECT_NEAR(flops(head.backward), 2 * expect, expect * 1e-12);
}

}  // namespace
}  // namespace ptdp
