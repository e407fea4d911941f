#include "runtime/schedule_executor.h"

#include <algorithm>
#include <stdexcept>
#include <tuple>

namespace ptdp {

ScheduleExecutor::ScheduleExecutor(GptShard& shard, Communicator& pipeline,
                                   DataParallelOptimizer& optimizer,
                                   std::vector<PipelineAction> actions, int64_t pp, int64_t p,
                                   int64_t dp, int64_t microbatches)
    : shard_(shard),
      pipeline_(pipeline),
      optimizer_(optimizer),
      actions_(std::move(actions)),
      pp_(pp),
      p_(p),
      dp_(dp),
      m_(microbatches) {
  last_backward_.assign(static_cast<size_t>(shard_.num_chunks()), -1);
  for (size_t i = 0; i < actions_.size(); ++i)
    if (actions_[i].kind == ActionKind::kBackward ||
        actions_[i].kind == ActionKind::kBackwardWeight)
      last_backward_.at(static_cast<size_t>(actions_[i].chunk)) = static_cast<int64_t>(i);
}

void ScheduleExecutor::time_ops(std::vector<TimedOp>* sink, Clock::time_point t0) {
  timer_ = sink ? std::make_unique<OpTimer>(shard_.backend(), t0, sink) : nullptr;
  shard_.time_ops(timer_.get());
}

void ScheduleExecutor::flush_timing(std::vector<TimelineEvent>* events) {
  if (!timer_) return;
  timer_->flush();
  if (events)
    for (const auto& [event, pass] : device_passes_)
      std::tie((*events)[event].start, (*events)[event].end) = timer_->pass_span(pass);
  device_passes_.clear();
}

void ScheduleExecutor::flush_p2p() {
  const bool sends_only = std::all_of(batch_.begin(), batch_.end(),
                                      [](const Communicator::P2P& op) { return op.send; });
  if (async_sends_ && sends_only) {
    // Posted, not waited for: the buffers (moved, so their memory stays where the batch points)
    // live until the batch completes.
    Sending s;
    s.work = pipeline_.batch_async(batch_);
    for (const Key& k : sent_fwd_) s.buffers.push_back(std::move(act_out_.at(k)));
    for (const Key& k : sent_bwd_) s.buffers.push_back(std::move(grad_out_.at(k)));
    sending_.push_back(std::move(s));
  } else {
    pipeline_.batch(batch_);
  }
  // Scatter/gather: each received slice joins the other tensor-parallel ranks' slices.
  for (Buffer* b : gather_after_) {
    const size_t slice = b->size() / static_cast<size_t>(sg_->size());
    Buffer full(b->size(), b->dtype());
    sg_->all_gather(b->ptr().at(static_cast<int64_t>(static_cast<size_t>(sg_rank_) * slice)).p,
                    full.raw(), slice, b->dtype());
    b->swap(full);
  }
  gather_after_.clear();
  batch_.clear();
  for (const Key& k : sent_fwd_) act_out_.erase(k);
  for (const Key& k : sent_bwd_) grad_out_.erase(k);
  sent_fwd_.clear();
  sent_bwd_.clear();
}

Communicator::P2P ScheduleExecutor::transfer(bool send, Buffer& b, int64_t peer, int tag) const {
  Communicator::P2P op{send, b.raw(), b.size(), static_cast<int>(peer), tag, b.dtype()};
  if (sg_) {
    op.n = b.size() / static_cast<size_t>(sg_->size());
    op.data = b.ptr().at(static_cast<int64_t>(static_cast<size_t>(sg_rank_) * op.n)).p;
  }
  return op;
}

void ScheduleExecutor::test_sends() {
  std::erase_if(sending_, [](Sending& s) { return s.work->test(); });
}

double ScheduleExecutor::run(const StepContext& step, double* grad_norm,
                             std::vector<TimelineEvent>* events, Clock::time_point t0) {
  Backend& be = shard_.backend();
  be.fill_zero(shard_.grads().data<float>(), shard_.grads().size());
  const int64_t v = shard_.num_chunks();
  const int64_t next = (pp_ + 1) % p_, prev = (pp_ + p_ - 1) % p_;
  auto tag = [v](int dir, int64_t mb, int64_t chunk) {
    return static_cast<int>(((mb * v + chunk) * 2 + dir) % 32768);
  };
  std::vector<int32_t> tokens;
  double loss_sum = 0;
  double group_start = -1;
  const size_t group_first_event = events ? events->size() : 0;
  auto now = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  // Each part of a chunk's last backward pass hands its gradients to a bucket.
  const GptShard::PartHook start_bucket = [this](int64_t lo, int64_t hi) {
    optimizer_.reduce_bucket(lo, hi);
    optimizer_.progress();
  };
  // --overlap-param-gather: each part waits for its parameters before its first forward pass.
  const GptShard::PartHook wait_params = [this](int64_t lo, int64_t hi) {
    optimizer_.wait_params(lo, hi);
  };
  const bool gathers = optimizer_.gathers_pending() > 0;
  for (size_t i = 0; i < actions_.size(); ++i) {
    const PipelineAction& a = actions_[i];
    const double start = now();
    size_t device_pass = OpTimer::kNoPass;  // a pass timed on the device (OpTimer::close)
    const Key key{a.microbatch, a.chunk};
    // A chunk's last backward (or weight) pass of the step hands each part to a bucket.
    const bool last_pass =
        a.chunk >= 0 && last_backward_[static_cast<size_t>(a.chunk)] == static_cast<int64_t>(i);
    const GptShard::PartHook* ready = overlap_ && last_pass ? &start_bucket : nullptr;
    switch (a.kind) {
      case ActionKind::kForward: {
        const bool first = shard_.first_stage(a.chunk), last = shard_.last_stage(a.chunk);
        if (first || last) step.tokens(a.microbatch, tokens);
        Buffer out;
        const Buffer* in = first ? nullptr : &act_in_.at(key);
        if (timer_) timer_->pass(a.chunk, a.microbatch);
        loss_sum += shard_.forward(a.chunk, a.microbatch, tokens.data(), in, &out,
                                   gathers ? &wait_params : nullptr);
        if (timer_) device_pass = timer_->close();
        if (!first) act_in_.erase(key);
        if (!last) act_out_[key] = std::move(out);
        break;
      }
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: {
        const bool first = shard_.first_stage(a.chunk), last = shard_.last_stage(a.chunk);
        Buffer gin;
        const Buffer* gout = last ? nullptr : &grad_in_.at(key);
        if (timer_) timer_->pass(a.chunk, a.microbatch);
        const double scale = step.loss_scale / static_cast<double>(m_);
        if (a.kind == ActionKind::kBackwardInput)
          shard_.backward_input(a.chunk, a.microbatch, gout, &gin, scale);
        else
          shard_.backward(a.chunk, a.microbatch, gout, &gin, scale, ready);
        if (timer_) device_pass = timer_->close();
        if (!last) grad_in_.erase(key);
        if (!first) grad_out_[key] = std::move(gin);
        break;
      }
      case ActionKind::kSendForward: {
        const int64_t rc = pp_ == p_ - 1 ? a.chunk + 1 : a.chunk;
        batch_.push_back(transfer(true, act_out_.at(key), next, tag(0, a.microbatch, rc)));
        sent_fwd_.push_back(key);
        break;
      }
      case ActionKind::kRecvForward: {
        Buffer& b = act_in_.try_emplace(key, shard_.layout().dtype).first->second;
        b.resize(static_cast<size_t>(shard_.boundary_elements()));
        batch_.push_back(transfer(false, b, prev, tag(0, a.microbatch, a.chunk)));
        if (sg_) gather_after_.push_back(&b);
        break;
      }
      case ActionKind::kSendBackward: {
        const int64_t rc = pp_ == 0 ? a.chunk - 1 : a.chunk;
        batch_.push_back(transfer(true, grad_out_.at(key), prev, tag(1, a.microbatch, rc)));
        sent_bwd_.push_back(key);
        break;
      }
      case ActionKind::kRecvBackward: {
        Buffer& b = grad_in_.try_emplace(key, shard_.layout().dtype).first->second;
        b.resize(static_cast<size_t>(shard_.boundary_elements()));
        batch_.push_back(transfer(false, b, next, tag(1, a.microbatch, a.chunk)));
        if (sg_) gather_after_.push_back(&b);
        break;
      }
      case ActionKind::kGradSync:
        optimizer_.reduce_gradients();
        break;
      case ActionKind::kEmbeddingSync:
        optimizer_.sync_embedding();
        break;
      case ActionKind::kOptimizerStep:
        *grad_norm = optimizer_.step(step.step, step.lr, step.optimizer);
        // Traced, the action ends when its kernels (AdamW's, queued after the norm) have run.
        if (events) shard_.backend().synchronize();
        break;
      case ActionKind::kBackwardWeight: {
        if (timer_) timer_->pass(a.chunk, a.microbatch);
        shard_.backward_weight(a.chunk, a.microbatch, ready);
        if (timer_) device_pass = timer_->close();
        break;
      }
    }
    const bool p2p = is_p2p(a.kind);
    if (p2p && group_start < 0) group_start = start;
    if (p2p && !a.batched_with_next) flush_p2p();
    if (events) {
      const double end = now();
      events->push_back({static_cast<int32_t>(pp_), static_cast<int32_t>(dp_), a.kind, a.microbatch,
                         a.chunk, p2p ? group_start : start, end});
      if (device_pass != OpTimer::kNoPass)
        device_passes_.push_back({events->size() - 1, device_pass});
      if (p2p && !a.batched_with_next) {
        // Every action of a batched call spans the call.
        for (size_t k = events->size(); k-- > group_first_event;) {
          TimelineEvent& e = (*events)[k];
          if (!is_p2p(e.kind) || e.start != group_start) break;
          e.end = end;
        }
      }
    }
    if (p2p && !a.batched_with_next) group_start = -1;
    if (overlap_ || gathers) optimizer_.progress();
    if (!sending_.empty()) test_sends();
  }
  for (Sending& sent : sending_) sent.work->wait();  // bounded, as every wait
  sending_.clear();
  if (!batch_.empty()) throw std::logic_error("schedule ends inside a batched transfer");
  return loss_sum;
}

}  // namespace ptdp
