#include "runtime/embedding_head.h"

#include <algorithm>
#include <stdexcept>

#include "runtime/context_parallel.h"

namespace ptdp {

bool is_embedding_op(OpId id) {
  return id >= OpId::kWordEmbeddingLookup && id <= OpId::kWordEmbeddingGradScatterAdd;
}
bool is_head_forward_op(OpId id) {
  return id >= OpId::kFinalLayernorm && id <= OpId::kCrossEntropyAllGather;
}
bool is_head_backward_op(OpId id) {
  return id >= OpId::kCrossEntropyBackward && id <= OpId::kFinalLayernormBackward;
}

void embedding_op(ShardContext& c, OpId op, const ChunkParams& W, ChunkActs& A, Buffer& x,
                  Buffer* dx) {
  const ShardDims& m = c.dims;
  const int64_t sl = m.sp ? m.s / m.t : m.s;
  const int64_t first_pos = m.sp ? m.tp * sl : 0;
  switch (op) {
    case OpId::kWordEmbeddingLookup:
      resize_for_overwrite(A.emb, m.n_full * m.h);
      c.be.vocab_embedding_lookup(A.inputs.data(), c.P(W.word), A.emb.ptr(), m.n_full, m.h, m.v0,
                                  m.vl);
      break;
    case OpId::kEmbeddingAllReduce:
      c.all_reduce(A.emb);
      break;
    case OpId::kEmbeddingReduceScatter:
      c.scatter_sequence_in_place(A.emb);
      break;
    case OpId::kEmbeddingPositionDropout:
      x.swap(A.emb);
      release(A.emb);
      if (W.pos >= 0) context_positions(c, x.ptr(), W.pos, sl, first_pos, false);
      break;
    case OpId::kEmbeddingDropoutBackward:
      if (W.pos >= 0) context_positions(c, dx->ptr(), W.pos, sl, first_pos, true);
      break;
    case OpId::kEmbeddingGradAllGather: {
      Buffer full;
      c.gather_sequence(*dx, full, m.h);
      dx->swap(full);
      break;
    }
    case OpId::kWordEmbeddingGradScatterAdd:
      c.be.vocab_embedding_grad(A.inputs.data(), dx->ptr(), c.G(W.word), m.n_full, m.h, m.v0, m.vl);
      c.weight_gradient_done();
      break;
    default:
      throw std::logic_error("not an embedding op");
  }
}

double head_forward_op(ShardContext& c, OpId op, const ChunkParams& W, ChunkActs& A) {
  const ShardDims& m = c.dims;
  const Buffer& lnf_full = m.sp ? A.lnf_full : A.lnf;
  const int64_t valid = std::min(m.vl, m.vocab - m.v0);
  // The loss: log-sum-exp over the whole vocabulary from every rank's stats; the logits
  // become probabilities in place, now or in the backward pass (Backend::cross_entropy_loss).
  auto finish = [&](const float* stats, int64_t ranks) {
    resize_for_overwrite(A.lse, m.n_full);
    if (!A.masked) {
      const double sum =
          c.be.cross_entropy_loss(stats, ranks, A.probs.ptr(), A.lse.data(), m.n_full, m.vl, valid);
      return sum / static_cast<double>(m.n_full);
    }
    // Run by run, each run's statistics from every rank packed together ([ranks, count, 3]);
    // the masked rows keep their logits (zeroed in the backward pass).
    double sum = 0;
    Buffer packed(DType::kF32);
    for (const auto& [first, count] : A.loss_rows) {
      const float* run = stats + first * kCrossEntropyStatsPerToken;
      if (ranks > 1) {
        const int64_t w = count * kCrossEntropyStatsPerToken;
        resize_for_overwrite(packed, ranks * w);
        for (int64_t r = 0; r < ranks; ++r)
          c.be.copy(stats + (r * m.n_full + first) * kCrossEntropyStatsPerToken,
                    packed.data() + r * w, w);
        run = packed.data();
      }
      sum += c.be.cross_entropy_loss(run, ranks, A.probs.ptr().at(first * m.vl),
                                     A.lse.data() + first, count, m.vl, valid);
    }
    return sum / A.loss_tokens;
  };
  switch (op) {
    case OpId::kFinalLayernorm:
      c.norm_forward(A.lnf_in, W.lnf_g, W.lnf_b, A.lnf, A.lnf_mean, A.lnf_rstd, m.n_local);
      break;
    case OpId::kLmHeadAllGather:
      c.gather_sequence(A.lnf, A.lnf_full, m.h);
      break;
    case OpId::kLmHead:
      resize_for_overwrite(A.probs, m.n_full * m.vl);  // logits until the loss is finished
      c.linear(lnf_full.ptr(), W.head, -1, A.probs.ptr(), m.n_full, m.h, m.vl);
      break;
    case OpId::kCrossEntropy:
      resize_for_overwrite(A.stats, m.n_full * kCrossEntropyStatsPerToken);
      c.be.cross_entropy_stats(A.probs.ptr(), A.targets.data(), A.stats.data(), m.n_full, m.vl,
                               valid, m.v0);
      if (m.t == 1) return finish(A.stats.data(), 1);
      break;
    case OpId::kCrossEntropyAllGather: {
      Buffer all(DType::kF32);
      resize_for_overwrite(all, m.t * elems(A.stats));
      c.all_gather(A.stats.data(), all.data(), elems(A.stats));
      return finish(all.data(), m.t);
    }
    default:
      throw std::logic_error("not an LM-head forward op");
  }
  return 0;
}

void head_backward_op(ShardContext& c, OpId op, const ChunkParams& W, ChunkActs& A, LayerGrads& D,
                      double loss_scale) {
  const ShardDims& m = c.dims;
  const Buffer& lnf_full = m.sp ? A.lnf_full : A.lnf;
  switch (op) {
    case OpId::kCrossEntropyBackward: {
      const int64_t valid = std::min(m.vl, m.vocab - m.v0);
      if (!A.masked) {
        c.be.cross_entropy_backward_from_lse(A.probs.ptr(), A.lse.data(), A.targets.data(),
                                             m.n_full, m.vl, valid, m.v0, loss_scale);
        break;
      }
      // The kernel divides by the rows it is given: each run's scale is its share of the
      // weighted sum over loss_tokens. Rows outside the runs get no gradient.
      int64_t next = 0;
      auto zero_until = [&](int64_t row) {
        if (row > next) c.be.fill_zero(A.probs.ptr().at(next * m.vl), (row - next) * m.vl);
      };
      for (const auto& [first, count] : A.loss_rows) {
        zero_until(first);
        c.be.cross_entropy_backward_from_lse(
            A.probs.ptr().at(first * m.vl), A.lse.data() + first, A.targets.data() + first, count,
            m.vl, valid, m.v0,
            loss_scale * A.loss_weight * static_cast<double>(count) / A.loss_tokens);
        next = first + count;
      }
      zero_until(m.n_full);
      break;
    }
    case OpId::kLmHeadDgrad:
      resize_for_overwrite(D.d_ln1_full, m.n_full * m.h);
      c.linear_dgrad(W.head, A.probs.ptr(), D.d_ln1_full.ptr(), m.n_full, m.h, m.vl);
      break;
    case OpId::kLmHeadWgrad:
      c.linear_wgrad(lnf_full.ptr(), A.probs.ptr(), W.head, -1, m.n_full, m.h, m.vl);
      // The logits' gradient has no reader left: freed before the layers' backward passes, as
      // autograd frees it (ActivationMemory::logits_beyond_transient counts them so).
      release(A.probs);
      if (m.sp) release(A.lnf_full);
      break;
    case OpId::kLmHeadGradReduceScatter:
      c.scatter_sequence(D.d_ln1_full, D.d_ln1, m.h);
      break;
    case OpId::kLmHeadInputGradAllReduce:
      c.all_reduce(D.d_ln1_full);
      break;
    case OpId::kFinalLayernormBackward:
      c.norm_backward(A.lnf_in, W.lnf_g, W.lnf_b, A.lnf_mean, A.lnf_rstd,
                      m.sp ? D.d_ln1 : D.d_ln1_full, D.d_out, m.n_local);
      for (Buffer* x : {&A.lnf_in, &A.lnf, &A.lnf_mean, &A.lnf_rstd, &D.d_ln1, &D.d_ln1_full})
        release(*x);
      break;
    default:
      throw std::logic_error("not an LM-head backward op");
  }
}

}  // namespace ptdp
