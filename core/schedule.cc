#include "core/schedule.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/plan_rules.h"

namespace ptdp {

std::vector<std::pair<int64_t, int64_t>> interleaved_forward_order(const ScheduleSpec& s) {
  const int64_t m = s.microbatches, v = s.virtual_stages, n = s.group();
  std::vector<std::pair<int64_t, int64_t>> table;
  table.reserve(static_cast<size_t>(m * v));
  for (int64_t first = 0; first < m; first += n) {
    for (int64_t c = 0; c < v; ++c)
      for (int64_t i = first; i < std::min(first + n, m); ++i) table.emplace_back(i, c);
  }
  return table;
}

int64_t interleaved_forward_chunk(const ScheduleSpec& s, int64_t k) {
  const int64_t m = s.microbatches, v = s.virtual_stages, n = s.group();
  const int64_t full = (m / n) * n * v;  // virtual microbatches of the full groups
  if (k < full) return (k % (n * v)) / n;
  return (k - full) / (m % n);  // the last group, of m mod n microbatches
}

double interleaved_peak_in_flight(const ScheduleSpec& s, int64_t r,
                                  const std::vector<double>& chunk_weight) {
  const int64_t total = s.microbatches * s.virtual_stages;
  const int64_t warmup = std::min(warmup_forwards(s, r), total);
  auto w = [&](int64_t k, bool forward) {
    const int64_t c = interleaved_forward_chunk(s, k);
    return chunk_weight.at(static_cast<size_t>(forward ? c : s.virtual_stages - 1 - c));
  };
  double live = 0, peak = 0;
  for (int64_t k = 0; k < warmup; ++k) peak = std::max(peak, live += w(k, true));
  // Steady state: step k adds forward k + warmup and removes backward k. While the forward
  // index stays in the full groups, each period of N v steps adds and removes every chunk N
  // times: what is held repeats, so the periods after the first are skipped.
  const int64_t period = s.group() * s.virtual_stages;
  const int64_t full = (s.microbatches / s.group()) * period;
  const int64_t periodic = std::max<int64_t>(0, full - warmup);  // steps k + warmup < full
  const double after_warmup = live;
  for (int64_t k = 0; k + warmup < total; ++k) {
    if (k == period && periodic >= 2 * period) {
      k = periodic / period * period;  // the same state as at k = 0
      live = after_warmup;
      if (k + warmup >= total) break;
    }
    peak = std::max(peak, live += w(k + warmup, true));
    live -= w(k, false);
  }
  return peak;
}

namespace {

using K = ActionKind;

// Builds one rank's list. Receive actions are emitted without an identity and named afterwards
// (name_receives): a rank receives its inputs in the order it consumes them.
class RankBuilder {
 public:
  explicit RankBuilder(std::vector<PipelineAction>& out) : out_(out) {}

  void compute(K kind, int64_t mb, int64_t chunk, bool combined_with_next = false) {
    out_.push_back(
        {kind, false, static_cast<int32_t>(mb), static_cast<int32_t>(chunk), combined_with_next});
  }
  // One batched p2p call: the ops that are present, posted together.
  void group(std::initializer_list<std::pair<bool, PipelineAction>> ops) {
    const size_t begin = out_.size();
    for (const auto& [present, a] : ops)
      if (present) out_.push_back(a);
    for (size_t i = begin; i + 1 < out_.size(); ++i) out_[i].batched_with_next = true;
  }
  static PipelineAction send(K kind, int64_t mb, int64_t chunk) {
    return {kind, false, static_cast<int32_t>(mb), static_cast<int32_t>(chunk)};
  }
  static PipelineAction recv(K kind) { return {kind, false, -1, -1}; }

 private:
  std::vector<PipelineAction>& out_;
};

void gpipe(const ScheduleSpec& s, int64_t r, RankBuilder& b) {
  const int64_t p = s.pipeline_parallel, m = s.microbatches;
  const bool first = r == 0, last = r == p - 1;
  for (int64_t i = 0; i < m; ++i) {
    b.group({{!first, RankBuilder::recv(K::kRecvForward)}});
    b.compute(K::kForward, i, 0);
    b.group({{!last, RankBuilder::send(K::kSendForward, i, 0)}});
  }
  for (int64_t i = 0; i < m; ++i) {
    b.group({{!last, RankBuilder::recv(K::kRecvBackward)}});
    b.compute(K::kBackward, i, 0);
    b.group({{!first, RankBuilder::send(K::kSendBackward, i, 0)}});
  }
}

// Megatron-LM's forward_backward_pipelining_without_interleaving; with `split`, the ZB-H1
// schedule of Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", Sec. 2.1): the same order
// with each backward split into B (input gradient) and W (weight gradient), rank r deferring
// its W passes by r microbatches so that every rank holds at most p microbatches (the 1F1B
// peak of rank 0), and the deferred W passes filling the cool-down bubbles.
void one_f_one_b(const ScheduleSpec& s, int64_t r, RankBuilder& b, bool split) {
  const int64_t p = s.pipeline_parallel, m = s.microbatches;
  const bool first = r == 0, last = r == p - 1;
  const int64_t warmup = warmup_forwards(s, r), remaining = m - warmup;
  const K backward = split ? K::kBackwardInput : K::kBackward;
  int64_t next_w = 0;                // next microbatch whose weight gradient is pending
  auto weight = [&](int64_t upto) {  // run W passes for microbatches < upto
    for (; split && next_w < upto; ++next_w) b.compute(K::kBackwardWeight, next_w, 0);
  };

  for (int64_t i = 0; i < warmup; ++i) {
    b.group({{!first, RankBuilder::recv(K::kRecvForward)}});
    b.compute(K::kForward, i, 0);
    b.group({{!last, RankBuilder::send(K::kSendForward, i, 0)}});
  }
  if (remaining > 0) b.group({{!first, RankBuilder::recv(K::kRecvForward)}});
  for (int64_t i = 0; i < remaining; ++i) {
    const int64_t f = warmup + i;
    b.compute(K::kForward, f, 0, s.combined_1f1b);  // with the backward below, at p = 1
    b.group({{!last, RankBuilder::send(K::kSendForward, f, 0)},
             {!last, RankBuilder::recv(K::kRecvBackward)}});
    b.compute(backward, i, 0);
    const bool recv_next_input = !first && i != remaining - 1;
    if (split) {
      // Sends do not block here, so the deferred W pass fills the wait for the next input.
      b.group({{!first, RankBuilder::send(K::kSendBackward, i, 0)}});
      weight(i - r + 1);
      b.group({{recv_next_input, RankBuilder::recv(K::kRecvForward)}});
    } else {
      b.group({{!first, RankBuilder::send(K::kSendBackward, i, 0)},
               {recv_next_input, RankBuilder::recv(K::kRecvForward)}});
    }
  }
  for (int64_t i = 0; i < warmup; ++i) {
    const int64_t mb = remaining + i;
    b.group({{!last, RankBuilder::recv(K::kRecvBackward)}});
    b.compute(backward, mb, 0);
    b.group({{!first, RankBuilder::send(K::kSendBackward, mb, 0)}});
    weight(next_w + 1);
  }
  weight(m);
}

int64_t floor_mod(int64_t a, int64_t n) {
  return ((a % n) + n) % n;
}

// Megatron-LM's forward_backward_pipelining_with_interleaving (no overlap of p2p with
// compute). Microbatches go in groups of N (Megatron-Core's microbatch_group_size_per_vp_stage,
// p by default; the last group is the m mod N left, or N): the forward order runs chunk 0 on a
// group's microbatches, then chunk 1 on the same ones, and so on, then the next group; the
// backward order is the same with the chunks reversed. With N = p, virtual microbatch k runs
// chunk (k mod pv) / p on microbatch (k / pv) p + k mod p.
void interleaved(const ScheduleSpec& s, int64_t r, RankBuilder& b) {
  const int64_t p = s.pipeline_parallel, m = s.microbatches, v = s.virtual_stages;
  const int64_t total = m * v;
  const std::vector<std::pair<int64_t, int64_t>> table = interleaved_forward_order(s);
  auto chunk = [&](int64_t k, bool forward) {
    const int64_t c = table[static_cast<size_t>(floor_mod(k, total))].second;
    return forward ? c : v - 1 - c;
  };
  auto mb = [&](int64_t k) { return table[static_cast<size_t>(k)].first; };
  // Megatron-Core's recv_tensor_from_previous_stage: the leading rank of a direction (rank 0
  // forward, rank p - 1 backward) receives at virtual microbatch k what the other end made
  // p - 1 virtual microbatches earlier, unless that was the model's end (kept until used, a
  // group of N > p apart); the other ranks receive for their next pass.
  auto receives = [&](int64_t k, bool forward) {
    if (r != (forward ? 0 : p - 1)) return true;
    return k >= p - 1 && chunk(k - (p - 1), forward) != (forward ? v - 1 : 0);
  };
  auto first_virtual = [&](int64_t c) { return r == 0 && c == 0; };
  auto last_virtual = [&](int64_t c) { return r == p - 1 && c == v - 1; };
  const int64_t warmup = warmup_forwards(s, r);
  const bool all_warmup = warmup >= total;
  const int64_t remaining = total - warmup;

  b.group({{r != 0, RankBuilder::recv(K::kRecvForward)}});
  for (int64_t k = 0; k < warmup; ++k) {
    const int64_t c = chunk(k, true);
    const bool recv_prev = receives(k, true) && k != total - 1;
    b.compute(K::kForward, mb(k), c);
    const bool recv_next = k == warmup - 1 && !all_warmup && r != p - 1;
    b.group({{!last_virtual(c), RankBuilder::send(K::kSendForward, mb(k), c)},
             {recv_prev, RankBuilder::recv(K::kRecvForward)},
             {recv_next, RankBuilder::recv(K::kRecvBackward)}});
  }
  for (int64_t k = 0; k < remaining; ++k) {
    const int64_t fk = k + warmup, bk = k;
    const int64_t fc = chunk(fk, true), bc = chunk(bk, false);
    b.compute(K::kForward, mb(fk), fc, s.combined_1f1b);
    b.compute(K::kBackward, mb(bk), bc);
    const bool recv_prev = receives(fk, true) && k != remaining - 1;
    const bool recv_next = receives(bk, false);
    b.group({{!last_virtual(fc), RankBuilder::send(K::kSendForward, mb(fk), fc)},
             {!first_virtual(bc), RankBuilder::send(K::kSendBackward, mb(bk), bc)},
             {recv_prev, RankBuilder::recv(K::kRecvForward)},
             {recv_next, RankBuilder::recv(K::kRecvBackward)}});
  }
  if (all_warmup) b.group({{r != p - 1, RankBuilder::recv(K::kRecvBackward)}});
  for (int64_t k = remaining; k < total; ++k) {
    const int64_t c = chunk(k, false);
    b.compute(K::kBackward, mb(k), c);
    const bool recv_next = receives(k, false) && k != total - 1;
    b.group({{!first_virtual(c), RankBuilder::send(K::kSendBackward, mb(k), c)},
             {recv_next, RankBuilder::recv(K::kRecvBackward)}});
  }
}

// Names each receive after the input it delivers: the k-th forward receive of a rank carries
// the input of its k-th forward that does not start the model, likewise for gradients.
void name_receives(const PipelineSchedule& s, int64_t r, std::vector<PipelineAction>& list) {
  std::deque<std::pair<int32_t, int32_t>> fwd, bwd;
  for (const PipelineAction& a : list) {
    if (a.kind == K::kForward && !s.first_stage(r, a.chunk))
      fwd.emplace_back(a.microbatch, a.chunk);
    if ((a.kind == K::kBackward || a.kind == K::kBackwardInput) && !s.last_stage(r, a.chunk))
      bwd.emplace_back(a.microbatch, a.chunk);
  }
  for (PipelineAction& a : list) {
    auto& q = a.kind == K::kRecvForward ? fwd : bwd;
    if (a.kind != K::kRecvForward && a.kind != K::kRecvBackward) continue;
    if (q.empty())
      throw std::logic_error("pipeline rank " + std::to_string(r) + " receives more than it uses");
    std::tie(a.microbatch, a.chunk) = q.front();
    q.pop_front();
  }
}

}  // namespace

int64_t warmup_forwards(const ScheduleSpec& s, int64_t r) {
  const int64_t p = s.pipeline_parallel, m = s.microbatches, v = s.virtual_stages;
  const int64_t one_more = s.combined_1f1b ? 1 : 0;
  switch (s.kind) {
    case Schedule::kGPipe:
      return m;
    case Schedule::kInterleaved1F1B:
      // Megatron-Core's rule since core 0.10 (schedules.py, forward_backward_pipelining_with_
      // interleaving): all forward passes first only when this count reaches them all. Its
      // earlier special case, every forward first whenever m = p, made the last stage hold all
      // m v chunks (found by a review against Megatron-Core's source, 2026-11-29).
      if (v > 1) return std::min(2 * (p - r - 1) + (v - 1) * s.group() + one_more, m * v);
      break;
    case Schedule::k1F1B:
    case Schedule::kZeroBubbleH1:
      break;
  }
  return std::min(p - r - 1 + one_more, m);
}

bool combined_step(const PipelineSchedule& s, const std::vector<PipelineAction>& list, size_t i) {
  return s.spec.combined_1f1b && list[i].combined_with_next && i + 1 < list.size() &&
         list[i + 1].kind == K::kBackward;
}

bool is_compute(ActionKind k) {
  return k == K::kForward || k == K::kBackward || k == K::kBackwardInput || k == K::kBackwardWeight;
}
bool is_p2p(ActionKind k) {
  return k == K::kSendForward || k == K::kRecvForward || k == K::kSendBackward ||
         k == K::kRecvBackward;
}
bool is_send(ActionKind k) {
  return k == K::kSendForward || k == K::kSendBackward;
}

ScheduleSpec schedule_spec(const ParallelPlan& p, bool tied_embeddings) {
  ScheduleSpec s;
  s.kind = p.schedule;
  s.pipeline_parallel = p.pipeline_parallel;
  s.microbatches = p.num_microbatches();
  s.virtual_stages = p.virtual_stages;
  s.microbatch_group = p.microbatch_group;
  s.combined_1f1b = p.overlap_moe_ep_comm;
  s.tied_embeddings = tied_embeddings;
  return s;
}

PipelineSchedule make_pipeline_schedule(const ScheduleSpec& spec) {
  const int64_t p = spec.pipeline_parallel, m = spec.microbatches, v = spec.virtual_stages;
  if (p < 1) throw InputError("--pipeline-model-parallel-size", "must be positive");
  if (m < 1) throw InputError("--global-batch-size", "gives no microbatch per pipeline");
  if (v < 1) throw InputError("--num-layers-per-virtual-pipeline-stage", "must be positive");
  if (v > 1 && spec.kind != Schedule::kInterleaved1F1B)
    throw InputError("--pipeline-schedule", to_string(spec.kind) + " has no virtual stages");
  if (v > 1 && !valid_microbatch_group(spec.group(), m, p))
    throw InputError("--microbatch-group-size-per-virtual-pipeline-stage",
                     "the interleaved schedule cannot run " + std::to_string(m) +
                         " microbatches on " + std::to_string(p) + " pipeline ranks in groups of " +
                         std::to_string(spec.group()));
  if (spec.combined_1f1b && !((spec.kind == Schedule::kInterleaved1F1B && v > 1) ||
                              (spec.kind == Schedule::k1F1B && p == 1)))
    throw InputError("--overlap-moe-expert-parallel-comm",
                     "combines passes in the interleaved schedule, or in 1f1b at p = 1");
  PipelineSchedule s;
  s.spec = spec;
  s.synchronous_p2p = spec.kind != Schedule::kZeroBubbleH1;
  s.ranks.resize(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) {
    std::vector<PipelineAction>& list = s.ranks[static_cast<size_t>(r)];
    list.reserve(static_cast<size_t>(m * v * 6 + 4));
    RankBuilder b(list);
    switch (spec.kind) {
      case Schedule::kGPipe:
        gpipe(spec, r, b);
        break;
      case Schedule::k1F1B:
        one_f_one_b(spec, r, b, false);
        break;
      case Schedule::kZeroBubbleH1:
        one_f_one_b(spec, r, b, true);
        break;
      case Schedule::kInterleaved1F1B:
        if (v == 1)
          one_f_one_b(spec, r, b, false);
        else
          interleaved(spec, r, b);
        break;
    }
    name_receives(s, r, list);
    list.push_back({K::kGradSync});
    if (spec.tied_embeddings && p > 1 && (r == 0 || r == p - 1))
      list.push_back({K::kEmbeddingSync});
    list.push_back({K::kOptimizerStep});
  }
  return s;
}

namespace {

// The replay behind check_pipeline_schedule.
class ScheduleChecker {
 public:
  explicit ScheduleChecker(const PipelineSchedule& s)
      : s_(s),
        p_(s.p()),
        pc_(static_cast<size_t>(p_), 0),
        posted_(static_cast<size_t>(p_), 0),
        state_(static_cast<size_t>(p_)) {}

  void run() {
    for (bool progress = true; progress;) {
      progress = false;
      for (int64_t r = 0; r < p_; ++r) progress |= advance(r);
    }
    for (int64_t r = 0; r < p_; ++r)
      if (pc_[static_cast<size_t>(r)] < s_.ranks[static_cast<size_t>(r)].size())
        fail(r, "deadlock: stuck at action " + std::to_string(pc_[static_cast<size_t>(r)]) + " (" +
                    to_string(s_.ranks[static_cast<size_t>(r)][pc_[static_cast<size_t>(r)]]) + ")");
    const int64_t total = s_.spec.microbatches * s_.v();
    for (int64_t r = 0; r < p_; ++r) {
      const auto& st = state_[static_cast<size_t>(r)];
      const size_t expect = static_cast<size_t>(total);
      if (st.forward.size() != expect || st.backward.size() != expect)
        fail(r, "runs " + std::to_string(st.forward.size()) + " forwards and " +
                    std::to_string(st.backward.size()) + " backwards, expected " +
                    std::to_string(total) + " of each");
      if (st.split && st.weight.size() != expect) fail(r, "misses weight-gradient passes");
    }
    for (const auto& [key, q] : channels_)
      if (!q.sends.empty() || !q.recvs.empty()) throw std::logic_error("unmatched p2p at the end");
  }

 private:
  using Item = std::pair<int32_t, int32_t>;  // microbatch, chunk
  struct Channel {  // one direction between two ranks, FIFO as NCCL and MPI order messages
    std::deque<std::pair<Item, int64_t>> sends, recvs;  // identity and posting rank's group id
  };
  struct RankState {
    std::set<Item> forward, backward, weight, received_input, received_grad;
    bool split = false;
  };

  [[noreturn]] void fail(int64_t r, const std::string& what) const {
    throw std::logic_error("schedule " + to_string(s_.spec.kind) + ", pipeline rank " +
                           std::to_string(r) + ": " + what);
  }

  // The peer of a p2p action and the identity the peer sees.
  std::tuple<int64_t, int32_t> peer(int64_t r, const PipelineAction& a) const {
    const int64_t stage = s_.global_stage(r, a.chunk);
    const bool forward = a.kind == K::kSendForward || a.kind == K::kRecvBackward;
    const int64_t other = forward ? stage + 1 : stage - 1;
    if (other < 0 || other >= p_ * s_.v())
      fail(r, "p2p past the ends of the pipeline: " + to_string(a));
    return {other % p_, static_cast<int32_t>(other / p_)};
  }

  // Channel key (src, dst, is_forward_data).
  std::tuple<int64_t, int64_t, bool> channel(int64_t r, const PipelineAction& a) const {
    const auto [other, chunk] = peer(r, a);
    const bool data_forward = a.kind == K::kSendForward || a.kind == K::kRecvForward;
    return is_send(a.kind) ? std::make_tuple(r, other, data_forward)
                           : std::make_tuple(other, r, data_forward);
  }

  bool advance(int64_t r) {
    const auto& list = s_.ranks[static_cast<size_t>(r)];
    size_t& pc = pc_[static_cast<size_t>(r)];
    RankState& st = state_[static_cast<size_t>(r)];
    bool progress = false;
    while (pc < list.size()) {
      const PipelineAction& a = list[pc];
      if (is_p2p(a.kind)) {
        size_t end = pc;
        while (list[end].batched_with_next) ++end;
        if (posted_[static_cast<size_t>(r)] == 0) post(r, pc, end);
        if (!group_done(r, pc, end)) return progress;
        posted_[static_cast<size_t>(r)] = 0;
        pc = end + 1;
        progress = true;
        continue;
      }
      if (is_compute(a.kind)) run_compute(r, a, st);
      ++pc;
      progress = true;
    }
    return progress;
  }

  void run_compute(int64_t r, const PipelineAction& a, RankState& st) {
    const Item it{a.microbatch, a.chunk};
    if (a.chunk < 0 || a.chunk >= s_.v() || a.microbatch < 0 ||
        a.microbatch >= s_.spec.microbatches)
      fail(r, "action out of range: " + to_string(a));
    switch (a.kind) {
      case K::kForward:
        if (!s_.first_stage(r, a.chunk) && !st.received_input.count(it))
          fail(r, to_string(a) + " runs before its input arrived");
        if (!st.forward.insert(it).second) fail(r, to_string(a) + " runs twice");
        break;
      case K::kBackward:
      case K::kBackwardInput:
        if (!st.forward.count(it)) fail(r, to_string(a) + " runs before its forward");
        if (!s_.last_stage(r, a.chunk) && !st.received_grad.count(it))
          fail(r, to_string(a) + " runs before its output gradient arrived");
        if (!st.backward.insert(it).second) fail(r, to_string(a) + " runs twice");
        st.split |= a.kind == K::kBackwardInput;
        break;
      case K::kBackwardWeight:
        if (!st.backward.count(it)) fail(r, to_string(a) + " runs before its input gradient");
        if (!st.weight.insert(it).second) fail(r, to_string(a) + " runs twice");
        break;
      default:
        break;
    }
  }

  void post(int64_t r, size_t begin, size_t end) {
    posted_[static_cast<size_t>(r)] = 1;
    for (size_t i = begin; i <= end; ++i) {
      const PipelineAction& a = s_.ranks[static_cast<size_t>(r)][i];
      const RankState& st = state_[static_cast<size_t>(r)];
      const Item it{a.microbatch, a.chunk};
      if (a.kind == K::kSendForward && !st.forward.count(it))
        fail(r, to_string(a) + " sends an activation not yet computed");
      if (a.kind == K::kSendBackward && !st.backward.count(it))
        fail(r, to_string(a) + " sends a gradient not yet computed");
      Channel& ch = channels_[channel(r, a)];
      const Item seen_by_peer{a.microbatch, std::get<1>(peer(r, a))};
      if (is_send(a.kind))
        ch.sends.emplace_back(seen_by_peer, r);
      else
        ch.recvs.emplace_back(it, r);
    }
    for (size_t i = begin; i <= end; ++i)
      match(channels_[channel(r, s_.ranks[static_cast<size_t>(r)][i])]);
  }

  void match(Channel& ch) {
    while (!ch.sends.empty() && !ch.recvs.empty()) {
      const auto [sent, src] = ch.sends.front();
      const auto [want, dst] = ch.recvs.front();
      // The send's identity is already translated to the receiver's chunk.
      if (sent.first != want.first || sent.second != want.second)
        throw std::logic_error("schedule " + to_string(s_.spec.kind) + ": rank " +
                               std::to_string(src) + " sends microbatch " +
                               std::to_string(sent.first) + " chunk " +
                               std::to_string(sent.second) + " but rank " + std::to_string(dst) +
                               " expects microbatch " + std::to_string(want.first) + " chunk " +
                               std::to_string(want.second));
      ch.sends.pop_front();
      ch.recvs.pop_front();
    }
  }

  // A group is done when its receives (and, if synchronous, its sends) have been matched.
  bool group_done(int64_t r, size_t begin, size_t end) {
    for (size_t i = begin; i <= end; ++i) {
      const PipelineAction& a = s_.ranks[static_cast<size_t>(r)][i];
      if (is_send(a.kind) && !s_.synchronous_p2p) continue;
      if (!matched(r, a)) return false;
    }
    for (size_t i = begin; i <= end; ++i) {
      const PipelineAction& a = s_.ranks[static_cast<size_t>(r)][i];
      RankState& st = state_[static_cast<size_t>(r)];
      if (a.kind == K::kRecvForward) st.received_input.insert({a.microbatch, a.chunk});
      if (a.kind == K::kRecvBackward) st.received_grad.insert({a.microbatch, a.chunk});
    }
    return true;
  }

  // Whether this posted op has found its partner: it is no longer in its channel's queue.
  bool matched(int64_t r, const PipelineAction& a) {
    const Channel& ch = channels_[channel(r, a)];
    const auto& q = is_send(a.kind) ? ch.sends : ch.recvs;
    Item it{a.microbatch, a.chunk};
    if (is_send(a.kind)) it.second = std::get<1>(peer(r, a));
    for (const auto& [item, owner] : q)
      if (owner == r && item == it) return false;
    return true;
  }

  const PipelineSchedule& s_;
  int64_t p_;
  std::vector<size_t> pc_;
  std::vector<int> posted_;
  std::vector<RankState> state_;
  std::map<std::tuple<int64_t, int64_t, bool>, Channel> channels_;
};

}  // namespace

void check_pipeline_schedule(const PipelineSchedule& s) {
  if (static_cast<int64_t>(s.ranks.size()) != s.p())
    throw std::logic_error("schedule has " + std::to_string(s.ranks.size()) + " ranks, expected " +
                           std::to_string(s.p()));
  ScheduleChecker(s).run();
}

int64_t peak_chunks_in_flight(const PipelineSchedule& s, int64_t rank) {
  return static_cast<int64_t>(peak_weight_in_flight(s, rank, {}));
}

double peak_weight_in_flight(const PipelineSchedule& s, int64_t rank,
                             const std::vector<double>& chunk_weight) {
  auto weight = [&](const PipelineAction& a) {
    return chunk_weight.empty() ? 1.0 : chunk_weight.at(static_cast<size_t>(a.chunk));
  };
  double live = 0, peak = 0;
  bool split = false;
  for (const PipelineAction& a : s.ranks[static_cast<size_t>(rank)])
    split |= a.kind == K::kBackwardWeight;
  for (const PipelineAction& a : s.ranks[static_cast<size_t>(rank)]) {
    if (a.kind == K::kForward) peak = std::max(peak, live += weight(a));
    if ((a.kind == K::kBackward || a.kind == K::kBackwardInput) && !split) live -= weight(a);
    if (a.kind == K::kBackwardWeight) live -= weight(a);
  }
  return peak;
}

std::string to_string(const PipelineAction& a) {
  static const char* const kNames[] = {"F",  "B",  "Bi",   "W",   "sF", "rF",
                                       "sB", "rB", "sync", "emb", "opt"};
  std::string out = kNames[static_cast<int>(a.kind)];
  if (a.microbatch >= 0) out += std::to_string(a.microbatch) + "." + std::to_string(a.chunk);
  return out;
}

std::string rank_to_string(const PipelineSchedule& s, int64_t rank) {
  std::ostringstream out;
  bool in_group = false;
  const auto& list = s.ranks[static_cast<size_t>(rank)];
  for (size_t i = 0; i < list.size(); ++i) {
    if (i) out << ' ';
    if (list[i].batched_with_next && !in_group) {
      out << '{';
      in_group = true;
    }
    out << to_string(list[i]);
    if (in_group && !list[i].batched_with_next) {
      out << '}';
      in_group = false;
    }
  }
  return out.str();
}

}  // namespace ptdp
