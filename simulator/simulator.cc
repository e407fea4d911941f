#include "simulator/simulator.h"

#include <algorithm>
#include <cmath>
#include <queue>
#include <stdexcept>
#include <unordered_map>

#include "core/error.h"
#include "simulator/flow_network.h"
#include "simulator/topology.h"

namespace ptdp {

Picos to_picos(double seconds) {
  return static_cast<Picos>(std::llround(seconds * kPicosPerSecond));
}

namespace {

using K = ActionKind;

struct Event {
  Picos time;
  uint64_t seq;
  int32_t type;
  int32_t id;
  bool operator>(const Event& o) const { return time != o.time ? time > o.time : seq > o.seq; }
};
enum EventType : int32_t { kResume, kFlowBytesDone, kTransferDone, kGroupPhase, kPhaseDone };

void summarise(SimulationResult& out);

bool forward_data(ActionKind k) {
  return k == K::kSendForward || k == K::kRecvForward;
}

// Megatron-Core's interleaved schedule with overlapped p2p posts, in its steady state, the
// forward direction's transfers (send this output, receive the next input) right after the
// forward pass and the backward direction's right after the backward pass. The schedule lists
// the non-overlapped order (one batched call after both passes); this moves the forward
// direction's ops of such a call between the two passes. Elsewhere the order is the same, and
// so it is everywhere with `combined` (the combined 1F1B of --overlap-moe-expert-parallel-comm):
// Megatron-Core's combined step awaits both its inputs when it starts and posts both its sends
// when it ends (model_chunk_schedule_plan.py), so its transfers are posted after both passes.
std::vector<PipelineAction> overlapped_order(const std::vector<PipelineAction>& list,
                                             bool combined) {
  std::vector<PipelineAction> out;
  out.reserve(list.size());
  for (size_t i = 0; i < list.size();) {
    if (!is_p2p(list[i].kind)) {
      out.push_back(list[i++]);
      continue;
    }
    size_t end = i;
    while (list[end].batched_with_next) ++end;
    std::vector<PipelineAction> fwd, bwd;
    for (size_t j = i; j <= end; ++j) {
      PipelineAction a = list[j];
      a.batched_with_next = true;
      (forward_data(a.kind) ? fwd : bwd).push_back(a);
    }
    for (auto* part : {&fwd, &bwd})
      if (!part->empty()) part->back().batched_with_next = false;
    const size_t n = out.size();
    const bool after_both =
        !combined && n >= 2 && out[n - 2].kind == K::kForward && out[n - 1].kind == K::kBackward;
    out.insert(after_both ? out.end() - 1 : out.end(), fwd.begin(), fwd.end());
    out.insert(out.end(), bwd.begin(), bwd.end());
    i = end + 1;
  }
  return out;
}

// Everything one iteration of the schedule needs, for one fixed number of microbatches.
class Engine {
 public:
  Engine(const SimulationInput& in, const PipelineSchedule& s, Topology& topo)
      : in_(in),
        s_(s),
        p_(s_.p()),
        replicas_(in.full ? in.data_parallel : 1),
        topo_(topo),
        net_(topo.links()),
        overlap_(in.overlap_p2p && s.spec.kind == Schedule::kInterleaved1F1B && s.v() > 1) {
    if (overlap_)
      for (const auto& list : s_.ranks)
        reordered_.push_back(overlapped_order(list, s_.spec.combined_1f1b));
    const int64_t entities = replicas_ * p_;
    ranks_.resize(static_cast<size_t>(entities));
    pending_group_.resize(static_cast<size_t>(entities));
    for (int64_t e = 0; e < entities; ++e) {
      RankState& st = ranks_[static_cast<size_t>(e)];
      st.stats.rank = e % p_;
      for (int64_t i = 0; i < in.tensor_parallel; ++i) {
        auto it = in.slowdown.find(gpu(i, e / p_, e % p_));
        if (it != in.slowdown.end()) st.factor = std::max(st.factor, it->second);
      }
    }
    // The action after which each chunk's weight gradients are complete (overlap buckets).
    last_grad_action_.resize(static_cast<size_t>(p_));
    for (int64_t r = 0; r < p_; ++r) {
      auto& last = last_grad_action_[static_cast<size_t>(r)];
      last.assign(static_cast<size_t>(s_.v()), -1);
      const auto& list = actions(r);
      for (size_t i = 0; i < list.size(); ++i)
        if (list[i].kind == K::kBackward || list[i].kind == K::kBackwardWeight)
          last[static_cast<size_t>(list[i].chunk)] = static_cast<int64_t>(i);
    }
  }

  SimulationResult run() {
    for (size_t e = 0; e < ranks_.size(); ++e) advance(static_cast<int32_t>(e));
    while (!queue_.empty()) {
      const Event ev = queue_.top();
      queue_.pop();
      now_ = ev.time;
      ++events_;
      switch (ev.type) {
        case kResume:
          advance(ev.id);
          break;
        case kFlowBytesDone: {
          // Flows due at this instant end as one batch: those adjacent in the queue (flows
          // scheduled by one re-rating are; an event of another kind between splits the batch).
          finishing_.clear();
          auto due_now = [&](int32_t f) { return net_.active(f) && net_.due(f) == now_; };
          if (due_now(ev.id)) finishing_.push_back(ev.id);
          while (!queue_.empty() && queue_.top().time == now_ &&
                 queue_.top().type == kFlowBytesDone) {
            if (due_now(queue_.top().id)) finishing_.push_back(queue_.top().id);
            queue_.pop();
            ++events_;
          }
          if (finishing_.empty()) break;  // re-rated since
          due_.clear();
          net_.finish(now_, &finishing_, &due_);
          for (const auto& [t, f] : due_) push(t, kFlowBytesDone, f);
          for (int32_t f : finishing_) {  // each once, in queue order; tags outlive a flow
            const int64_t tag = net_.tag(f);
            if (tag < 0) {  // a flow of a rank's context (even) or expert (odd) phase
              group_flow_done(static_cast<int32_t>((-tag - 1) / 2),
                              static_cast<int>((-tag - 1) % 2));
              continue;
            }
            const auto transfer = static_cast<int32_t>(tag);
            push(now_ + transfers_[static_cast<size_t>(transfer)].tail, kTransferDone, transfer);
          }
          break;
        }
        case kTransferDone:
          transfer_done(ev.id);
          break;
        case kGroupPhase:
          group_phase(ev.id);
          break;
        case kPhaseDone:
          phase_done(ev.id);
          break;
      }
    }
    return result();
  }

 private:
  struct RankState {
    size_t pc = 0;
    int waiting = 0;  // ops of the current p2p group or collective still outstanding
    Picos posted = 0;
    Picos longest = 0;  // longest transfer this rank waited on in its current group
    // Overlapped p2p: sends posted and not yet through, and what the rank waits for (-1:
    // nothing, -2: its sends, else the transfer bringing the input of its next pass).
    int sends = 0;
    int32_t awaiting = -1;
    double factor = 1;
    Picos dp_free = 0;  // the data-parallel stream is busy until then
    Picos finish = -1;
    StageStats stats;
    // The context (phase 0) and expert (phase 1) parts of the current pass.
    const PassCost* pass = nullptr;
    PipelineAction action;
    int phase = 0;
    int flows[2] = {0, 0};  // of each phase, still in flight
    // A combined step (core/schedule.h combined_step): its two passes' costs together, the
    // all-to-alls' flows started with the kernels.
    PassCost combined;
    bool ep_flows_started = false;
    bool combined_second = false;  // the next compute action is a combined step's backward
    bool in_phase = false;         // the pass's kernels are over and a phase waits for its end
    Picos phase_start = 0;         // when its flows started (the timeline span's start)
    Picos phase_entered = 0, phase_floor = 0;
  };
  struct Transfer {
    int32_t src = -1, dst = -1;
    Picos start = 0;
    bool sender_waits = false;
    bool done = false;
    uint64_t key = 0;  // transfer_key
    Picos tail = 0;    // fixed latency after the bytes are through
  };
  struct Rendezvous {
    std::vector<std::pair<int32_t, Picos>> arrived;
  };

  int64_t gpu(int64_t tp, int64_t replica, int64_t rank) const {
    return megatron_global_rank(in_.tensor_parallel, in_.data_parallel, tp, replica, rank);
  }
  void push(Picos t, int32_t type, int32_t id) { queue_.push({t, seq_++, type, id}); }
  void record(int32_t e, Stream stream, const PipelineAction& a, Picos start, Picos end) {
    if (!in_.record_timeline || end <= start) return;
    timeline_.push_back({static_cast<int32_t>(e / p_), static_cast<int32_t>(e % p_), stream, a.kind,
                         a.microbatch, a.chunk, start, end});
  }

  const PassCost& pass(int64_t r, const PipelineAction& a) const {
    const ChunkCost& c = in_.cost[static_cast<size_t>(r)][static_cast<size_t>(a.chunk)];
    switch (a.kind) {
      case K::kForward:
        return c.forward;
      case K::kBackward:
        return c.backward;
      case K::kBackwardInput:
        return c.backward_input;
      default:
        return c.backward_weight;
    }
  }

  // Rank r's actions: the schedule's, or with overlapped p2p in Megatron-Core's order.
  const std::vector<PipelineAction>& actions(int64_t r) const {
    return overlap_ ? reordered_[static_cast<size_t>(r)] : s_.ranks[static_cast<size_t>(r)];
  }

  // A transfer's identity: who receives it, activation or gradient, the receiver's chunk and
  // the microbatch.
  static uint64_t transfer_key(int32_t receiver, bool data_forward, int64_t chunk,
                               int32_t microbatch) {
    return (static_cast<uint64_t>(receiver) << 40) ^ (static_cast<uint64_t>(data_forward) << 39) ^
           (static_cast<uint64_t>(chunk) << 32) ^
           static_cast<uint64_t>(static_cast<uint32_t>(microbatch));
  }

  // Overlapped p2p: whether rank e must wait before action `a`: a pass for the transfer that
  // brings its input, the end of the iteration for the rank's sends.
  bool must_wait(int32_t e, const PipelineAction& a) {
    if (!overlap_) return false;
    RankState& st = ranks_[static_cast<size_t>(e)];
    PipelineAction wait = a;
    if (is_compute(a.kind)) {
      const bool forward = a.kind == K::kForward;
      auto it = inputs_.find(transfer_key(e, forward, a.chunk, a.microbatch));
      if (it == inputs_.end()) return false;  // the first or last stage: no input to wait for
      const int32_t id = it->second;
      if (transfers_[static_cast<size_t>(id)].done) {
        inputs_.erase(it);
        return false;
      }
      st.awaiting = id;
      wait.kind = forward ? K::kRecvForward : K::kRecvBackward;
    } else {
      if (st.sends == 0) return false;
      st.awaiting = -2;
    }
    st.posted = now_;
    st.longest = 0;
    pending_group_[static_cast<size_t>(e)] = wait;
    return true;
  }

  // Runs rank e's actions from its program counter until it has to wait.
  void advance(int32_t e) {
    RankState& st = ranks_[static_cast<size_t>(e)];
    const int64_t r = e % p_;
    const auto& list = actions(r);
    while (st.pc < list.size()) {
      const PipelineAction& a = list[st.pc];
      if (is_compute(a.kind)) {
        // A combined step (Megatron-Core's combined 1F1B): a forward and the backward of
        // another microbatch run as one step, both inputs awaited first: the forward's kernels,
        // then the backward's, then the step's context and expert phases; both passes'
        // all-to-alls start with the forward (combine()).
        const bool second = st.combined_second;
        const size_t b = !second && combined_step(s_, list, st.pc) ? st.pc + 1 : 0;
        if (!second) {
          // With overlap, a pass waits here for the transfer that brings its input.
          if (must_wait(e, a)) return;
          if (b > 0 && must_wait(e, list[b])) return;
        }
        const PassCost& own = pass(r, a);
        const Picos compute =
            static_cast<Picos>(std::llround(static_cast<double>(own.compute) * st.factor));
        record(e, Stream::kCompute, a, now_, now_ + compute);
        record(e, Stream::kTensor, a, now_ + compute, now_ + compute + own.tp_comm);
        record(e, Stream::kData, a, now_ + compute + own.tp_comm,
               now_ + compute + own.tp_comm + own.dp_comm);
        st.stats.compute += compute;
        st.stats.tp_comm += own.tp_comm;
        st.stats.dp_comm += own.dp_comm;
        const Picos end = now_ + compute + own.tp_comm + own.dp_comm;
        if (b > 0) {  // the step's first half: its all-to-alls start, no phase yet
          st.pass = &combine(st, r, a, list[b]);
          start_flows(e, false);
          st.ep_flows_started = true;
          st.combined_second = true;
          ++st.pc;
          push(end, kResume, e);
          return;
        }
        st.combined_second = false;
        const PassCost& c = second ? st.combined : own;
        const bool groups = c.cp_comm > 0 || c.ep_comm > 0 || c.cp_bytes > 0 || c.ep_bytes > 0;
        if (in_.overlap_grad_reduce &&
            last_grad_action_[static_cast<size_t>(r)][static_cast<size_t>(a.chunk)] ==
                static_cast<int64_t>(st.pc))
          start_bucket(e, a, now_, end + c.cp_comm + c.ep_comm);
        ++st.pc;
        if (groups) {
          st.pass = &c;
          st.action = a;
          st.phase = 0;
          st.phase_start = now_;
          if (ring_under_kernels()) start_flows(e, true);
          push(end, kGroupPhase, e);
        } else {
          st.ep_flows_started = false;
          push(end, kResume, e);
        }
        return;
      }
      if (is_p2p(a.kind)) {
        st.posted = now_;
        st.longest = 0;
        st.waiting = 0;
        size_t i = st.pc;
        for (;; ++i) {
          post(e, list[i]);
          if (!list[i].batched_with_next) break;
        }
        st.pc = i + 1;
        if (!overlap_ && st.waiting > 0) {
          pending_group_[static_cast<size_t>(e)] = list[i];
          return;
        }
        continue;
      }
      if (must_wait(e, a)) return;
      ++st.pc;
      if (!collective(e, a)) return;
    }
    st.finish = now_;
  }

  // Tensor-parallel rank 0's slice stands for the group: the t slices travel on parallel rails.
  void post(int32_t e, const PipelineAction& a) {
    RankState& st = ranks_[static_cast<size_t>(e)];
    const int64_t r = e % p_, replica = e / p_;
    const int64_t stage = s_.global_stage(r, a.chunk);
    const bool downstream = a.kind == K::kSendForward || a.kind == K::kRecvBackward;
    const int64_t other_stage = downstream ? stage + 1 : stage - 1;
    const int32_t other = static_cast<int32_t>(replica * p_ + other_stage % p_);
    const bool data_forward = a.kind == K::kSendForward || a.kind == K::kRecvForward;
    const int32_t receiver = is_send(a.kind) ? other : e;
    const int64_t recv_chunk = is_send(a.kind) ? other_stage / p_ : a.chunk;
    const uint64_t key = transfer_key(receiver, data_forward, recv_chunk, a.microbatch);
    auto [it, fresh] = open_.try_emplace(key, -1);
    if (fresh) {
      it->second = static_cast<int32_t>(transfers_.size());
      transfers_.emplace_back();
    }
    Transfer& tr = transfers_[static_cast<size_t>(it->second)];
    tr.key = key;
    if (overlap_) {  // nothing to wait for now: the receiver's pass waits for its input
      if (is_send(a.kind)) {
        tr.src = e;
        tr.sender_waits = true;
        ++st.sends;
      } else {
        tr.dst = e;
        inputs_.emplace(key, it->second);
      }
    } else if (is_send(a.kind)) {
      tr.src = e;
      tr.sender_waits = s_.synchronous_p2p;
      if (s_.synchronous_p2p) ++st.waiting;
    } else {
      tr.dst = e;
      ++st.waiting;
    }
    if (tr.src >= 0 && tr.dst >= 0) {
      const int32_t id = it->second;
      open_.erase(it);
      start_transfer(id);
    }
  }

  void start_transfer(int32_t id) {
    Transfer& tr = transfers_[static_cast<size_t>(id)];
    tr.start = now_;
    const int64_t src_r = tr.src % p_, dst_r = tr.dst % p_;
    const int64_t src_gpu = gpu(0, tr.src / p_, src_r), dst_gpu = gpu(0, tr.dst / p_, dst_r);
    const std::vector<int32_t>& path = topo_.path(src_gpu, dst_gpu);
    tr.tail = in_.p2p_latency + to_picos(topo_.path_latency_s(path)) + in_.p2p_gather;
    if (path.empty() || in_.p2p_bytes <= 0) {
      push(now_ + tr.tail, kTransferDone, id);
      return;
    }
    due_.clear();
    net_.start(now_, &path, in_.p2p_bytes, id, &due_);
    for (const auto& [t, f] : due_) push(t, kFlowBytesDone, f);
  }

  void transfer_done(int32_t id) {
    // Copied: releasing a rank lets it post new transfers, which may grow transfers_.
    transfers_[static_cast<size_t>(id)].done = true;
    const Transfer tr = transfers_[static_cast<size_t>(id)];
    auto release = [&](int32_t e) {
      RankState& st = ranks_[static_cast<size_t>(e)];
      if (overlap_) {
        if (e == tr.src) --st.sends;
        const bool waited = e == tr.src ? st.awaiting == -2 && st.sends == 0 : st.awaiting == id;
        if (!waited) return;
        if (e == tr.dst) inputs_.erase(tr.key);
        st.awaiting = -1;
      }
      // The part of the transfer in flight while the rank waited (an overlapped one may have
      // started earlier, under a pass).
      st.longest = std::max(st.longest, now_ - std::max(tr.start, st.posted));
      if (!overlap_ && --st.waiting > 0) return;
      const Picos wait = now_ - st.posted;
      const Picos comm = std::min(wait, st.longest);
      st.stats.pp_comm += comm;
      st.stats.idle += wait - comm;
      record(e, Stream::kPipeline, pending_group_[static_cast<size_t>(e)], st.posted, now_);
      advance(e);
    };
    if (tr.sender_waits) release(tr.src);
    release(tr.dst);
  }

  // The context and expert parts of a pass. The ring steps' flows (p2p) start with the pass and
  // run under its kernels (the ring overlaps attention); an all-gather's or all-to-all's start
  // with the context phase (TE runs them before and after the attention); the context phase after
  // the kernels lasts the cost model's exposed time (its floor) or until the flows are through,
  // when shared links hold them back. The all-to-alls are not overlapped: their phase starts after
  // the context phase, its flows with it, and lasts the exposed time or until they are through.
  void group_phase(int32_t e) {
    RankState& st = ranks_[static_cast<size_t>(e)];
    for (; st.phase < 2; ++st.phase) {
      const bool cp = st.phase == 0;
      const Picos time = cp ? st.pass->cp_comm : st.pass->ep_comm;
      const double bytes = cp ? st.pass->cp_bytes : st.pass->ep_bytes;
      if (time <= 0 && bytes <= 0) continue;
      st.phase_entered = now_;
      st.phase_floor = now_ + time;
      const bool under_kernels = cp && ring_under_kernels();
      if (!under_kernels || bytes <= 0) st.phase_start = now_;
      if (cp && !under_kernels) start_flows(e, true);
      if (!cp && !st.ep_flows_started) start_flows(e, false);
      st.in_phase = true;
      if (st.flows[st.phase] == 0) push(st.phase_floor, kPhaseDone, e);
      return;
    }
    st.pass = nullptr;
    st.ep_flows_started = false;
    advance(e);
  }

  // Whether a pass's context-parallel flows run under its kernels (the p2p ring's steps overlap
  // attention) rather than in the context phase after them (an all-gather's, all-to-alls').
  bool ring_under_kernels() const {
    return in_.cp_comm == CpComm::kP2P || in_.cp_comm == CpComm::kA2AP2P;
  }

  // Starts rank e's ring-step (cp) or all-to-all flows of its current pass.
  void start_flows(int32_t e, bool cp) {
    RankState& st = ranks_[static_cast<size_t>(e)];
    const int phase = cp ? 0 : 1;
    st.flows[phase] = 0;
    const double bytes = cp ? st.pass->cp_bytes : st.pass->ep_bytes;
    if (bytes <= 0) return;
    std::vector<std::pair<int64_t, int64_t>> pairs;
    double each = bytes;
    if (!cp) {
      pairs = all_to_all_pairs(e);
      each = bytes / static_cast<double>(in_.expert_parallel);
    } else if (ring_under_kernels()) {
      pairs = ring_pairs(e);
    } else if (in_.cp_comm == CpComm::kAllGather) {
      int64_t channels = 1;
      pairs = gather_channel_pairs(e, &channels);
      each = bytes / static_cast<double>(channels);
    } else {
      pairs = context_all_to_all_pairs(e);
      each = bytes / static_cast<double>(in_.context_parallel - 1);
    }
    specs_.clear();
    for (const auto& [src, dst] : pairs) {
      const std::vector<int32_t>& path = topo_.path(src, dst);
      if (!path.empty())
        specs_.push_back({&path, each, -(2 * static_cast<int64_t>(e) + phase) - 1});
    }
    started_.clear();
    due_.clear();
    net_.start(now_, specs_, &started_, &due_);
    for (const auto& [t, f] : due_) push(t, kFlowBytesDone, f);
    st.flows[phase] = static_cast<int>(specs_.size());
  }

  void group_flow_done(int32_t e, int phase) {
    RankState& st = ranks_[static_cast<size_t>(e)];
    if (--st.flows[phase] == 0 && st.in_phase && st.phase == phase)
      push(std::max(now_, st.phase_floor), kPhaseDone, e);
  }

  // The costs of a combined step (forward f, then backward b of another microbatch): kernels,
  // collectives and the ring's exposed steps add up; the all-to-alls run on their own stream
  // behind the other pass's kernels, so what shows is their excess over the step's kernels
  // (as CostModel::predict counts it), or what their flows take when links hold them back.
  const PassCost& combine(RankState& st, int64_t r, const PipelineAction& f,
                          const PipelineAction& b) const {
    const PassCost &x = pass(r, f), &y = pass(r, b);
    PassCost& c = st.combined;
    c.compute = x.compute + y.compute;
    c.tp_comm = x.tp_comm + y.tp_comm;
    c.cp_comm = x.cp_comm + y.cp_comm;
    c.cp_bytes = x.cp_bytes + y.cp_bytes;
    const auto kernels =
        static_cast<Picos>(std::llround(static_cast<double>(c.compute) * st.factor));
    c.ep_comm = std::max<Picos>(0, x.ep_comm + y.ep_comm - kernels - c.tp_comm);
    c.ep_bytes = x.ep_bytes + y.ep_bytes;
    return c;
  }

  void phase_done(int32_t e) {
    RankState& st = ranks_[static_cast<size_t>(e)];
    const bool cp = st.phase == 0;
    (cp ? st.stats.cp_comm : st.stats.ep_comm) += now_ - st.phase_entered;
    record(e, cp ? Stream::kContext : Stream::kExpert, st.action, st.phase_start, now_);
    st.in_phase = false;
    ++st.phase;
    group_phase(e);
  }

  // A stage's GPU at local index `local` (tensor rank fastest, then the d * cp replicas).
  int64_t stage_gpu(int64_t local, int64_t r) const {
    return local + in_.tensor_parallel * in_.data_parallel * r;
  }

  // Context-parallel ring steps of tensor rank 0: each rank sends to the next of its ring. The
  // representative pipeline (replica 0) moves its whole ring's bytes, since those ranks are
  // not simulated; with `full` every replica sends its own.
  std::vector<std::pair<int64_t, int64_t>> ring_pairs(int32_t e) const {
    const int64_t r = e % p_, replica = e / p_, cp = in_.context_parallel;
    std::vector<std::pair<int64_t, int64_t>> out;
    if (cp <= 1) return out;
    // a2a+p2p: a ring per place in the all-to-all groups, over the groups (stride A).
    const int64_t a = in_.cp_comm == CpComm::kA2AP2P ? std::max<int64_t>(1, in_.cp_a2a_size) : 1;
    const int64_t base = replica - replica % cp;
    for (int64_t c = 0; c < cp; ++c) {
      if (in_.full && base + c != replica) continue;
      const int64_t next = c % a + (c / a + 1) % (cp / a) * a;
      if (next != c) out.emplace_back(gpu(0, base + c, r), gpu(0, base + next, r));
    }
    return out;
  }

  // A context-parallel all-gather of tensor rank 0 as NCCL runs one: rings, one channel per
  // member in a node, each visiting the nodes in turn and each node's members from a different
  // one, so that each channel leaves a node through another member's NIC; each channel moves
  // 1/channels of the data. Representative: every ring edge; full: this rank's.
  std::vector<std::pair<int64_t, int64_t>> gather_channel_pairs(int32_t e,
                                                                int64_t* channels) const {
    const int64_t r = e % p_, replica = e / p_, cp = in_.context_parallel;
    const int64_t base = replica - replica % cp;
    std::vector<std::vector<int64_t>> nodes;  // members by node, in rank order
    for (int64_t c = 0; c < cp; ++c) {
      const int64_t g = gpu(0, base + c, r);
      if (nodes.empty() || !topo_.same_node(nodes.back().front(), g)) nodes.emplace_back();
      nodes.back().push_back(g);
    }
    *channels = static_cast<int64_t>(nodes.front().size());
    std::vector<std::pair<int64_t, int64_t>> out;
    const int64_t self = gpu(0, replica, r);
    for (int64_t k = 0; k < *channels; ++k) {
      std::vector<int64_t> ring;
      for (const auto& local : nodes)
        for (size_t i = 0; i < local.size(); ++i)
          ring.push_back(local[(i + static_cast<size_t>(k)) % local.size()]);
      for (size_t i = 0; i < ring.size(); ++i) {
        if (in_.full && ring[i] != self) continue;
        out.emplace_back(ring[i], ring[(i + 1) % ring.size()]);
      }
    }
    return out;
  }

  // Context parallelism's all-to-alls of tensor rank 0: every member of its cp group to every
  // other (representative), or this rank to the others (full).
  std::vector<std::pair<int64_t, int64_t>> context_all_to_all_pairs(int32_t e) const {
    const int64_t r = e % p_, replica = e / p_, cp = in_.context_parallel;
    std::vector<std::pair<int64_t, int64_t>> out;
    const int64_t base = replica - replica % cp;
    for (int64_t i = 0; i < cp; ++i) {
      if (in_.full && base + i != replica) continue;
      for (int64_t j = 0; j < cp; ++j)
        if (j != i) out.emplace_back(gpu(0, base + i, r), gpu(0, base + j, r));
    }
    return out;
  }

  // An all-to-all of the expert group of tensor rank 0: its ep members sit at a stride of etp
  // among the stage's t * d * cp ranks. Representative: every member to every other; full:
  // this rank to the others (members that are not tensor rank 0 are not simulated).
  std::vector<std::pair<int64_t, int64_t>> all_to_all_pairs(int32_t e) const {
    const int64_t r = e % p_, replica = e / p_;
    const int64_t ep = in_.expert_parallel, etp = in_.expert_tensor_parallel;
    std::vector<std::pair<int64_t, int64_t>> out;
    if (ep <= 1) return out;
    const int64_t local = in_.tensor_parallel * replica;
    const int64_t base = local - ((local / etp) % ep) * etp;
    for (int64_t i = 0; i < ep; ++i) {
      const int64_t src = base + i * etp;
      if (in_.full && src != local) continue;
      for (int64_t j = 0; j < ep; ++j)
        if (j != i) out.emplace_back(stage_gpu(src, r), stage_gpu(base + j * etp, r));
    }
    return out;
  }

  // Overlapped gradient reduction of one chunk: buckets fill while its last backward runs; the
  // last bucket can only go once that backward is over.
  void start_bucket(int32_t e, const PipelineAction& a, Picos begin, Picos end) {
    RankState& st = ranks_[static_cast<size_t>(e)];
    const int64_t r = e % p_;
    const auto& share = in_.dp_chunk_share;
    const Picos whole =
        share.empty()
            ? in_.dp_sync[static_cast<size_t>(r)] / s_.v()
            : static_cast<Picos>(static_cast<double>(in_.dp_sync[static_cast<size_t>(r)]) *
                                 share[static_cast<size_t>(r)].at(static_cast<size_t>(a.chunk)));
    const Picos last = in_.dp_last_bucket[static_cast<size_t>(r)];
    const Picos start = std::max(st.dp_free, begin);
    const Picos finish = std::max(start + whole, end + last);
    record(e, Stream::kData, a, start, finish);
    st.dp_free = finish;
  }

  // End-of-iteration collectives. Returns true when the rank may go on at once.
  bool collective(int32_t e, const PipelineAction& a) {
    const int64_t r = e % p_, replica = e / p_;
    int64_t key, size;
    switch (a.kind) {
      case K::kGradSync:
        key = r;
        size = replicas_;
        break;
      case K::kEmbeddingSync:
        key = p_ + replica;
        size = 2;
        break;
      default:  // kOptimizerStep: the gradient-norm all-reduce spans the pipeline
        key = p_ + replicas_ + replica;
        size = p_;
        break;
    }
    Rendezvous& rv = rendezvous_[key];
    rv.arrived.emplace_back(e, now_);
    if (static_cast<int64_t>(rv.arrived.size()) < size) return false;
    // Everyone is here: each member finishes after the collective's own time.
    bool self_continues = false;
    Picos all_buckets = 0;
    for (const auto& [m, t] : rv.arrived)
      all_buckets = std::max(all_buckets, ranks_[static_cast<size_t>(m)].dp_free);
    for (const auto& [m, arrival] : rv.arrived) {
      RankState& st = ranks_[static_cast<size_t>(m)];
      const int64_t mr = m % p_;
      st.stats.idle += now_ - arrival;
      Picos took = 0;
      if (a.kind == K::kGradSync) {
        took = in_.overlap_grad_reduce ? std::max<Picos>(0, all_buckets - now_)
                                       : in_.dp_sync[static_cast<size_t>(mr)];
        st.stats.dp_comm += took;
        // Overlapped buckets are on the timeline already; this is only the wait for them.
        if (!in_.overlap_grad_reduce) record(m, Stream::kData, a, now_, now_ + took);
      } else if (a.kind == K::kEmbeddingSync) {
        took = in_.embedding_sync;
        st.stats.dp_comm += took;
        record(m, Stream::kData, a, now_, now_ + took);
      } else {
        took = in_.optimizer[static_cast<size_t>(mr)];
        st.stats.optimizer += took;
        record(m, Stream::kCompute, a, now_, now_ + took);
      }
      if (m == e && took == 0)
        self_continues = true;
      else
        push(now_ + took, kResume, m);
    }
    rendezvous_.erase(key);
    return self_continues;
  }

  SimulationResult result() {
    SimulationResult out;
    for (const RankState& st : ranks_)
      if (st.finish < 0)
        throw std::logic_error("simulation deadlocked: pipeline rank " +
                               std::to_string(st.stats.rank) + " stopped at action " +
                               std::to_string(st.pc));
    Picos end = 0;
    for (const RankState& st : ranks_) end = std::max(end, st.finish);
    out.iteration = end;
    // Report the replica holding the slowest GPU.
    int64_t replica = 0;
    double worst = 1;
    for (size_t e = 0; e < ranks_.size(); ++e)
      if (ranks_[e].factor > worst) {
        worst = ranks_[e].factor;
        replica = static_cast<int64_t>(e) / p_;
      }
    for (int64_t r = 0; r < p_; ++r) {
      StageStats s = ranks_[static_cast<size_t>(replica * p_ + r)].stats;
      s.idle += end - ranks_[static_cast<size_t>(replica * p_ + r)].finish;
      out.stages.push_back(s);
    }
    summarise(out);
    out.events = events_;
    out.simulated_microbatches = s_.spec.microbatches;
    out.timeline = std::move(timeline_);
    return out;
  }

  const SimulationInput& in_;
  const PipelineSchedule& s_;
  const int64_t p_, replicas_;
  Topology& topo_;
  FlowNetwork net_;
  std::vector<FlowNetwork::Spec> specs_;      // scratch: flows started together
  std::vector<int32_t> started_, finishing_;  // scratch: their ids; flows ending together
  const bool overlap_;
  std::vector<std::vector<PipelineAction>> reordered_;  // [rank], with overlap
  std::vector<RankState> ranks_;
  std::vector<std::vector<int64_t>> last_grad_action_;
  std::unordered_map<uint64_t, int32_t> open_;    // transfers posted by one side only
  std::unordered_map<uint64_t, int32_t> inputs_;  // overlapped: receives posted, not yet used
  std::vector<Transfer> transfers_;
  std::unordered_map<int64_t, Rendezvous> rendezvous_;
  std::vector<PipelineAction> pending_group_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> queue_;
  std::vector<std::pair<Picos, int32_t>> due_;
  std::vector<Span> timeline_;
  Picos now_ = 0;
  uint64_t seq_ = 0;
  int64_t events_ = 0;
};

void check_input(const SimulationInput& in) {
  const int64_t p = in.schedule.pipeline_parallel, v = in.schedule.virtual_stages;
  auto per_rank = [&](size_t n, const char* what) {
    if (static_cast<int64_t>(n) != p)
      throw InputError(what, "has " + std::to_string(n) +
                                 " entries, expected one per pipeline rank (" + std::to_string(p) +
                                 ")");
  };
  per_rank(in.cost.size(), "cost");
  for (const auto& c : in.cost)
    if (static_cast<int64_t>(c.size()) != v)
      throw InputError("cost", "needs one entry per model chunk (" + std::to_string(v) + ")");
  per_rank(in.dp_sync.size(), "dp_sync");
  per_rank(in.dp_last_bucket.size(), "dp_last_bucket");
  if (!in.dp_chunk_share.empty()) {
    per_rank(in.dp_chunk_share.size(), "dp_chunk_share");
    for (const auto& shares : in.dp_chunk_share)
      if (static_cast<int64_t>(shares.size()) != v)
        throw InputError("dp_chunk_share",
                         "needs one entry per model chunk (" + std::to_string(v) + ")");
  }
  per_rank(in.optimizer.size(), "optimizer");
  if (in.tensor_parallel < 1 || in.data_parallel < 1)
    throw InputError("tensor_parallel", "tensor- and data-parallel sizes must be positive");
  if (in.context_parallel < 1 || in.data_parallel % in.context_parallel != 0)
    throw InputError("context_parallel", "must be positive and divide data_parallel (d * cp)");
  if (in.expert_parallel < 1 || in.expert_tensor_parallel < 1 ||
      (in.tensor_parallel * in.data_parallel) % (in.expert_parallel * in.expert_tensor_parallel))
    throw InputError("expert_parallel", "ep * etp must divide a stage's t * d * cp ranks");
  for (const auto& [gpu, factor] : in.slowdown) {
    if (gpu < 0 || gpu >= in.tensor_parallel * in.data_parallel * p)
      throw InputError("--slow-rank", "rank " + std::to_string(gpu) + " is not in the job");
    if (!(factor > 0)) throw InputError("--slow-rank", "the factor must be positive");
    if (!in.full) throw InputError("--slow-rank", "needs --full (every GPU simulated)");
  }
}

SimulationResult run_once(const SimulationInput& in, int64_t microbatches, Topology& topo) {
  ScheduleSpec spec = in.schedule;
  spec.microbatches = microbatches;
  const PipelineSchedule s = make_pipeline_schedule(spec);
  return Engine(in, s, topo).run();
}

// a + k (b - a), field by field.
Picos extend(Picos a, Picos b, int64_t k) {
  return a + k * (b - a);
}

bool periodic(const SimulationResult& a, const SimulationResult& b, const SimulationResult& c) {
  auto same_step = [](Picos x, Picos y, Picos z) { return y - x == z - y; };
  if (!same_step(a.iteration, b.iteration, c.iteration)) return false;
  for (size_t r = 0; r < a.stages.size(); ++r) {
    const StageStats &x = a.stages[r], &y = b.stages[r], &z = c.stages[r];
    if (!same_step(x.compute, y.compute, z.compute) ||
        !same_step(x.tp_comm, y.tp_comm, z.tp_comm) ||
        !same_step(x.cp_comm, y.cp_comm, z.cp_comm) ||
        !same_step(x.ep_comm, y.ep_comm, z.ep_comm) ||
        !same_step(x.pp_comm, y.pp_comm, z.pp_comm) ||
        !same_step(x.dp_comm, y.dp_comm, z.dp_comm) ||
        !same_step(x.optimizer, y.optimizer, z.optimizer) || !same_step(x.idle, y.idle, z.idle))
      return false;
  }
  return true;
}

void summarise(SimulationResult& out) {
  out.critical_stage = 0;
  for (size_t r = 0; r < out.stages.size(); ++r)
    if (out.stages[r].busy() > out.stages[static_cast<size_t>(out.critical_stage)].busy())
      out.critical_stage = static_cast<int64_t>(r);
  const StageStats& c = out.stages[static_cast<size_t>(out.critical_stage)];
  out.bubble_fraction =
      c.busy() > 0 ? static_cast<double>(c.idle) / static_cast<double>(c.busy()) : 0;
  out.exposed_tp = c.tp_comm;
  out.exposed_cp = c.cp_comm;
  out.exposed_ep = c.ep_comm;
  out.exposed_pp = c.pp_comm;
  out.exposed_dp = c.dp_comm;
}

}  // namespace

SimulationResult simulate(const SimulationInput& in, const ClusterSpec& cluster,
                          const HardwareProfile& profile) {
  check_input(in);
  Topology topo(cluster, profile);
  if (topo.num_gpus() < in.tensor_parallel * in.data_parallel * in.schedule.pipeline_parallel)
    throw InputError("--num-gpus", "the cluster has fewer GPUs than t * p * d");
  // Long iterations repeat a period of p microbatches (the interleaved schedule's: its
  // microbatch group, N): three short runs with the same remainder give the rest exactly.
  const int64_t m = in.schedule.microbatches;
  const int64_t step = in.schedule.virtual_stages > 1 && in.schedule.microbatch_group > 0
                           ? in.schedule.microbatch_group
                           : in.schedule.pipeline_parallel;
  if (in.record_timeline || m <= 16 * step) return run_once(in, m, topo);
  const int64_t m1 = 8 * step + m % step;
  const SimulationResult a = run_once(in, m1, topo);
  const SimulationResult b = run_once(in, m1 + step, topo);
  const SimulationResult c = run_once(in, m1 + 2 * step, topo);
  if (!periodic(a, b, c)) return run_once(in, m, topo);
  const int64_t k = (m - m1) / step;
  SimulationResult out = a;
  out.iteration = extend(a.iteration, b.iteration, k);
  for (size_t r = 0; r < out.stages.size(); ++r) {
    StageStats& s = out.stages[r];
    const StageStats& y = b.stages[r];
    s.compute = extend(s.compute, y.compute, k);
    s.tp_comm = extend(s.tp_comm, y.tp_comm, k);
    s.cp_comm = extend(s.cp_comm, y.cp_comm, k);
    s.ep_comm = extend(s.ep_comm, y.ep_comm, k);
    s.pp_comm = extend(s.pp_comm, y.pp_comm, k);
    s.dp_comm = extend(s.dp_comm, y.dp_comm, k);
    s.optimizer = extend(s.optimizer, y.optimizer, k);
    s.idle = extend(s.idle, y.idle, k);
  }
  summarise(out);
  out.events = a.events + b.events + c.events;
  out.simulated_microbatches = m1 + 2 * step;
  return out;
}

}  // namespace ptdp
