// The schedule generator: Megatron-LM's orders (golden files), the checker's guarantees on a
// sweep of sizes, warm-up counts and activation memory in flight.
#include "core/schedule.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <stdexcept>

#include "core/error.h"
#include "core/plan_rules.h"
#include "planner/cost_model.h"

namespace ptdp {
namespace {

PipelineSchedule make(Schedule kind, int64_t p, int64_t m, int64_t v = 1, bool tied = true,
                      int64_t group = 0, bool combined = false) {
  ScheduleSpec s;
  s.combined_1f1b = combined;
  s.kind = kind;
  s.pipeline_parallel = p;
  s.microbatches = m;
  s.virtual_stages = v;
  s.tied_embeddings = tied;
  s.microbatch_group = group;
  return make_pipeline_schedule(s);
}

std::string golden(const std::string& name) {
  std::ifstream in(std::string(PTDP_SOURCE_DIR) + "/tests/golden/" + name);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string all_ranks(const PipelineSchedule& s) {
  std::string out;
  for (int64_t r = 0; r < s.p(); ++r)
    out += "rank " + std::to_string(r) + ": " + rank_to_string(s, r) + "\n";
  return out;
}

// Forward passes before the first backward pass on rank r.
int64_t forwards_before_first_backward(const PipelineSchedule& s, int64_t r) {
  int64_t n = 0;
  for (const PipelineAction& a : s.ranks[static_cast<size_t>(r)]) {
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) break;
    n += a.kind == ActionKind::kForward;
  }
  return n;
}

// An interleaved plan of m microbatches (b = 1, d = 1) in groups of n, with the combined 1F1B
// or not: what the memory model and the combined step count price for the schedule above.
ParallelPlan interleaved_plan(int64_t p, int64_t v, int64_t m, int64_t n, bool combined) {
  ParallelPlan plan;
  plan.pipeline_parallel = p;
  plan.virtual_stages = v;
  plan.schedule = Schedule::kInterleaved1F1B;
  plan.global_batch_size = m;
  plan.microbatch_group = n;
  plan.overlap_moe_ep_comm = combined;
  return plan;
}

// The golden files were checked by hand against Megatron-LM's
// forward_backward_pipelining_without_interleaving / _with_interleaving: warm-up counts
// min(p-r-1, m) and 2(p-r-1)+(v-1)p, virtual microbatch k on chunk (k mod pv)/p forward and
// v-1 minus that backward, microbatch (k / pv) p + k mod p, the batched send/recv calls of
// each step, and the last stage's outputs wrapping to rank 0's next chunk.
TEST(Schedule, OneFOneBMatchesMegatronRankByRank) {
  EXPECT_EQ(all_ranks(make(Schedule::k1F1B, 4, 8)), golden("schedule_1f1b_p4_m8_v1.txt"));
}

TEST(Schedule, InterleavedMatchesMegatronRankByRank) {
  EXPECT_EQ(all_ranks(make(Schedule::kInterleaved1F1B, 4, 8, 2)),
            golden("schedule_interleaved_p4_m8_v2.txt"));
}

TEST(Schedule, EveryScheduleIsConsistentAndDeadlockFree) {
  int checked = 0;
  for (int64_t p = 1; p <= 8; ++p) {
    for (int64_t m = 1; m <= 3 * p + 1; ++m) {
      for (Schedule k : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kZeroBubbleH1}) {
        EXPECT_NO_THROW(check_pipeline_schedule(make(k, p, m)))
            << to_string(k) << " p" << p << " m" << m;
        ++checked;
      }
      if (p > 1 && m % p == 0) {
        for (int64_t v = 2; v <= 4; ++v) {
          EXPECT_NO_THROW(check_pipeline_schedule(make(Schedule::kInterleaved1F1B, p, m, v)))
              << "p" << p << " m" << m << " v" << v;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 400);
}

// Megatron-Core's microbatch groups (microbatch_group_size_per_vp_stage N): every count of
// microbatches from p up runs in some group, and each valid group gives lists that replay
// without deadlock, run each chunk on a group's microbatches in a row, warm up with
// 2 (p - r - 1) + (v - 1) N forwards and hold what the memory model counts.
TEST(Schedule, MicrobatchGroupsRunEveryCountFromP) {
  int checked = 0;
  for (int64_t p = 2; p <= 5; ++p) {
    for (int64_t m = p; m <= 3 * p + 1; ++m) {
      ASSERT_GE(smallest_microbatch_group(m, p), p);
      for (int64_t n = p; n <= m; ++n) {
        for (int64_t v = 2; v <= 3; ++v) {
          const std::string what = "p" + std::to_string(p) + " m" + std::to_string(m) + " v" +
                                   std::to_string(v) + " N" + std::to_string(n);
          if (!valid_microbatch_group(n, m, p)) {
            EXPECT_THROW(make(Schedule::kInterleaved1F1B, p, m, v, true, n), InputError) << what;
            continue;
          }
          const PipelineSchedule s = make(Schedule::kInterleaved1F1B, p, m, v, true, n);
          EXPECT_NO_THROW(check_pipeline_schedule(s)) << what;
          ++checked;
          for (int64_t r = 0; r < p; ++r) {
            // The forward order: groups of N (the last one the rest), each chunk in turn.
            std::vector<std::pair<int64_t, int64_t>> want, got;
            for (int64_t first = 0; first < m; first += n)
              for (int64_t c = 0; c < v; ++c)
                for (int64_t i = first; i < std::min(first + n, m); ++i) want.emplace_back(i, c);
            for (const PipelineAction& a : s.ranks[static_cast<size_t>(r)])
              if (a.kind == ActionKind::kForward) got.emplace_back(a.microbatch, a.chunk);
            EXPECT_EQ(got, want) << what << " rank " << r;
            EXPECT_EQ(interleaved_forward_order(s.spec), want) << what;
            for (size_t k = 0; k < want.size(); ++k)
              EXPECT_EQ(interleaved_forward_chunk(s.spec, static_cast<int64_t>(k)), want[k].second)
                  << what << " k " << k;
            // Megatron-Core's warm-up (no special case for m = p since core 0.10).
            const int64_t warm = std::min(2 * (p - r - 1) + (v - 1) * n, m * v);
            EXPECT_EQ(forwards_before_first_backward(s, r), warm + (warm < m * v ? 1 : 0)) << what;
            const ParallelPlan plan = interleaved_plan(p, v, m, n, false);
            // One layer per chunk: the memory model's in-flight layers are chunks.
            EXPECT_EQ(peak_chunks_in_flight(s, r),
                      static_cast<int64_t>(inflight_layer_activations(plan, r, v)))
                << what << " rank " << r;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 150);
  // Fewer microbatches than pipeline ranks fit no group.
  EXPECT_EQ(smallest_microbatch_group(3, 4), 0);
  EXPECT_THROW(make(Schedule::kInterleaved1F1B, 4, 3, 2), InputError);
  // N = p is Megatron's default: the same lists as leaving it unset.
  EXPECT_EQ(all_ranks(make(Schedule::kInterleaved1F1B, 4, 8, 2, true, 4)),
            all_ranks(make(Schedule::kInterleaved1F1B, 4, 8, 2)));
  EXPECT_EQ(smallest_microbatch_group(8, 4), 4);
  EXPECT_EQ(smallest_microbatch_group(6, 4), 6);  // 4 and 5 leave 2 and 1 behind
  EXPECT_EQ(smallest_microbatch_group(9, 4), 5);  // groups of 5 and 4
}

// Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm): one more warm-up
// forward, after which every forward is followed by a backward of another microbatch (the two
// run as one step); at p = 1, F0, then F(i + 1) with B(i), then the last B. The lists replay
// without deadlock and hold one chunk more in flight, as the memory model counts.
TEST(Schedule, CombinedStepsPairEverySteadyForwardWithABackward) {
  for (int64_t m = 1; m <= 5; ++m) {
    const PipelineSchedule s = make(Schedule::k1F1B, 1, m, 1, true, 0, true);
    EXPECT_NO_THROW(check_pipeline_schedule(s));
    std::string order;
    for (const PipelineAction& a : s.ranks[0])
      if (is_compute(a.kind)) order += to_string(a) + " ";
    std::string want = "F0.0 ";
    for (int64_t i = 0; i + 1 < m; ++i)
      want += "F" + std::to_string(i + 1) + ".0 B" + std::to_string(i) + ".0 ";
    want += "B" + std::to_string(m - 1) + ".0 ";
    EXPECT_EQ(order, want);
    int steps = 0;
    for (size_t i = 0; i < s.ranks[0].size(); ++i) steps += combined_step(s, s.ranks[0], i);
    EXPECT_EQ(steps, m - 1);
  }
  int checked = 0;
  for (int64_t p = 2; p <= 4; ++p) {
    for (int64_t v = 2; v <= 3; ++v) {
      for (int64_t m = p; m <= 3 * p; ++m) {
        const int64_t n = smallest_microbatch_group(m, p);
        const PipelineSchedule s = make(Schedule::kInterleaved1F1B, p, m, v, true, n, true);
        EXPECT_NO_THROW(check_pipeline_schedule(s)) << p << " " << v << " " << m;
        const ParallelPlan plan = interleaved_plan(p, v, m, n, true);
        for (int64_t r = 0; r < p; ++r) {
          const auto& list = s.ranks[static_cast<size_t>(r)];
          int64_t steps = 0;
          for (size_t i = 0; i < list.size(); ++i) steps += combined_step(s, list, i);
          EXPECT_EQ(steps, static_cast<int64_t>(combined_steps(plan, r)))
              << p << " " << v << " " << m << " rank " << r;
          EXPECT_EQ(peak_chunks_in_flight(s, r),
                    static_cast<int64_t>(inflight_layer_activations(plan, r, v)))
              << p << " " << v << " " << m << " rank " << r;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 50);
  // Megatron-Core combines passes only in the interleaved schedule, or at p = 1.
  EXPECT_THROW(make(Schedule::k1F1B, 2, 4, 1, true, 0, true), InputError);
  EXPECT_THROW(make(Schedule::kZeroBubbleH1, 1, 4, 1, true, 0, true), InputError);
}

// A pipeline layout's chunks hold different layers: the most layers a rank holds at once,
// worked out from the forward order and the warm-up alone (what the memory model prices), is
// what replaying the built lists finds, over groups, combined steps and uneven weights, zero
// included; and the memory model's in-flight layers for a layout plan are that.
TEST(Schedule, WeightedChunksInFlightFollowTheLists) {
  int checked = 0;
  for (int64_t p = 2; p <= 4; ++p) {
    for (int64_t v = 2; v <= 4; ++v) {
      for (int64_t m = p; m <= 5 * p; m += 2) {
        for (bool combined : {false, true}) {
          const int64_t n = smallest_microbatch_group(m, p);
          const PipelineSchedule s = make(Schedule::kInterleaved1F1B, p, m, v, true, n, combined);
          ParallelPlan plan = interleaved_plan(p, v, m, n, combined);
          // Chunk c of rank r holds (3 c + 2 r + 1) mod 5 layers: uneven, some none.
          for (int64_t g = 0; g < p * v; ++g)
            plan.layers_per_chunk.push_back((3 * (g / p) + 2 * (g % p) + 1) % 5);
          for (int64_t r = 0; r < p; ++r) {
            std::vector<double> weight;
            for (int64_t c = 0; c < v; ++c)
              weight.push_back(static_cast<double>(plan.layers_per_chunk[c * p + r]));
            const std::string what = "p" + std::to_string(p) + " v" + std::to_string(v) + " m" +
                                     std::to_string(m) + (combined ? " combined" : "") + " rank " +
                                     std::to_string(r);
            const double listed = peak_weight_in_flight(s, r, weight);
            EXPECT_DOUBLE_EQ(interleaved_peak_in_flight(s.spec, r, weight), listed) << what;
            EXPECT_DOUBLE_EQ(inflight_layer_activations(plan, r, 0), listed) << what;
            // Equal weights: the chunk count.
            EXPECT_DOUBLE_EQ(interleaved_peak_in_flight(s.spec, r, std::vector<double>(v, 1.0)),
                             static_cast<double>(peak_chunks_in_flight(s, r)))
                << what;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(Schedule, WarmupCountsFollowMegatron) {
  for (int64_t p : {2, 4, 8}) {
    for (int64_t m : {p, 2 * p, 4 * p}) {
      const auto one = make(Schedule::k1F1B, p, m);
      for (int64_t r = 0; r < p; ++r) {
        // The warm-up forwards plus the first steady-state forward precede the first backward.
        EXPECT_EQ(forwards_before_first_backward(one, r),
                  std::min(p - r - 1, m) + (m > p - r - 1 ? 1 : 0));
      }
      for (int64_t v : {2, 4}) {
        const auto il = make(Schedule::kInterleaved1F1B, p, m, v);
        for (int64_t r = 0; r < p; ++r) {
          const int64_t warm = std::min(2 * (p - r - 1) + (v - 1) * p, m * v);
          EXPECT_EQ(forwards_before_first_backward(il, r), warm + (warm < m * v ? 1 : 0))
              << p << " " << m << " " << v;
        }
      }
    }
  }
}

TEST(Schedule, ActivationsInFlight) {
  const int64_t p = 4, m = 8;
  for (int64_t r = 0; r < p; ++r) {
    EXPECT_EQ(peak_chunks_in_flight(make(Schedule::kGPipe, p, m), r), m);
    EXPECT_EQ(peak_chunks_in_flight(make(Schedule::k1F1B, p, m), r), p - r);
    EXPECT_EQ(peak_chunks_in_flight(make(Schedule::kInterleaved1F1B, p, m, 2), r),
              2 * (p - r - 1) + p + 1);
    // ZB-H1 holds p microbatches on every rank: the 1F1B peak of rank 0.
    EXPECT_EQ(peak_chunks_in_flight(make(Schedule::kZeroBubbleH1, p, m), r), p);
  }
}

TEST(Schedule, ZeroBubbleSplitsEveryBackward) {
  const auto s = make(Schedule::kZeroBubbleH1, 4, 8);
  EXPECT_FALSE(s.synchronous_p2p);
  for (const auto& list : s.ranks) {
    int bi = 0, w = 0, b = 0;
    for (const PipelineAction& a : list) {
      bi += a.kind == ActionKind::kBackwardInput;
      w += a.kind == ActionKind::kBackwardWeight;
      b += a.kind == ActionKind::kBackward;
    }
    EXPECT_EQ(bi, 8);
    EXPECT_EQ(w, 8);
    EXPECT_EQ(b, 0);
  }
}

TEST(Schedule, EndsWithGradientSyncAndOptimizerStep) {
  const auto s = make(Schedule::k1F1B, 4, 8, 1, /*tied=*/true);
  for (int64_t r = 0; r < 4; ++r) {
    const auto& list = s.ranks[static_cast<size_t>(r)];
    EXPECT_EQ(list.back().kind, ActionKind::kOptimizerStep);
    const bool emb = r == 0 || r == 3;
    EXPECT_EQ(list[list.size() - 2].kind, emb ? ActionKind::kEmbeddingSync : ActionKind::kGradSync);
  }
}

TEST(Schedule, CheckerRejectsBrokenLists) {
  // A backward moved before its forward.
  auto s = make(Schedule::k1F1B, 2, 4);
  auto& r1 = s.ranks[1];
  std::swap(r1[1], r1[2]);  // rank 1: rF0 F0 B0 ... -> rF0 B0 F0
  EXPECT_THROW(check_pipeline_schedule(s), std::logic_error);
  // A dropped receive: the sender's message is never taken, the receiver never gets its input.
  s = make(Schedule::k1F1B, 2, 4);
  s.ranks[1].erase(s.ranks[1].begin());
  EXPECT_THROW(check_pipeline_schedule(s), std::logic_error);
  // Receives in the wrong order (microbatch 1 expected before 0).
  s = make(Schedule::kGPipe, 2, 2);
  for (PipelineAction& a : s.ranks[1])
    if (a.kind == ActionKind::kRecvForward) a.microbatch = 1 - a.microbatch;
  EXPECT_THROW(check_pipeline_schedule(s), std::logic_error);
  // Two ranks that both wait to receive first: deadlock under synchronous p2p.
  s = make(Schedule::k1F1B, 2, 2);
  auto& r0 = s.ranks[0];
  r0.insert(r0.begin(), PipelineAction{ActionKind::kRecvBackward, false, 0, 0});
  EXPECT_THROW(check_pipeline_schedule(s), std::logic_error);
}

TEST(Schedule, RejectsImpossibleSpecs) {
  EXPECT_THROW(make(Schedule::kInterleaved1F1B, 4, 6, 2), InputError);
  EXPECT_THROW(make(Schedule::k1F1B, 4, 8, 2), InputError);
  EXPECT_THROW(make(Schedule::k1F1B, 0, 8), InputError);
  EXPECT_THROW(make(Schedule::k1F1B, 4, 0), InputError);
}

}  // namespace
}  // namespace ptdp
