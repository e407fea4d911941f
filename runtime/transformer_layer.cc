#include "runtime/transformer_layer.h"

#include <algorithm>
#include <stdexcept>

#include "runtime/context_parallel.h"

namespace ptdp {

bool is_layer_forward_op(OpId id) {
  return id >= OpId::kInputLayernorm && id <= OpId::kMlpBiasDropoutAdd;
}
bool is_layer_backward_op(OpId id) {
  return id >= OpId::kMlpBiasDropoutAddBackward && id <= OpId::kInputLayernormBackward;
}

namespace {

// Keys per query row the op list prices a fused attention's GEMMs at: the causal half
// (core/layer_ops.cc, attention_core).
int64_t fused_keys(const ShardDims& m) {
  return std::max<int64_t>(1, m.s_attn / 2);
}
// Query rows and heads of a fused attention's GEMMs: the rank's tokens of its heads, or after a
// heads all-to-all its group's tokens (Ulysses: all s) of its heads block.
int64_t fused_queries(const ShardDims& m) {
  return m.s * m.cp_a2a_size;
}
int64_t fused_batch(const ShardDims& m) {
  return m.b * m.hl / m.cp_a2a_size;
}

}  // namespace

void layer_forward_op(ShardContext& c, OpId op, const LayerParams& W, LayerActs& A) {
  const ShardDims& m = c.dims;
  Backend& be = c.be;
  // Attention spans the whole sequence; with context parallelism K and V come round the ring
  // once they are final (after QKV, or after the rotary embedding) and the local queries attend
  // to them (runtime/context_parallel.h).
  const int64_t sa = m.s_attn;
  const bool cp = m.cp > 1;
  const Buffer& ln1_full = m.sp ? A.ln1_full : A.ln1;
  const Buffer& ln2_full = m.sp ? A.ln2_full : A.ln2;
  switch (op) {
    case OpId::kInputLayernorm:
      c.norm_forward(A.x, W.ln1_g, W.ln1_b, A.ln1, A.ln1_mean, A.ln1_rstd, m.n_local);
      break;
    case OpId::kAttnAllGather:
      c.gather_sequence(A.ln1, A.ln1_full, m.h);
      break;
    case OpId::kQkv: {
      Buffer qkv;
      resize_for_overwrite(qkv, m.n_full * m.qkv_width());
      c.linear(ln1_full.ptr(), W.qkv_w, W.qkv_b, qkv.ptr(), m.n_full, m.h, m.qkv_width());
      resize_for_overwrite(A.q, m.n_full * m.hl * m.d);
      resize_for_overwrite(A.k, m.n_full * m.gl * m.d);
      resize_for_overwrite(A.v, m.n_full * m.gl * m.d);
      be.split_columns3(qkv.ptr(), A.q.ptr(), A.k.ptr(), A.v.ptr(), m.n_full, m.hl * m.d,
                        m.gl * m.d, m.gl * m.d);
      if (cp && !m.rotary && !m.qk_norm && m.cp_a2a_size == 1) context_exchange_kv(c, A, c.pass());
      break;
    }
    case OpId::kQkLayernorm:  // each head's query and key over its d channels
      std::swap(A.q, A.q_in);
      std::swap(A.k, A.k_in);
      c.norm_forward(A.q_in, W.qn_g, W.qn_b, A.q, A.qn_mean, A.qn_rstd, m.n_full * m.hl, m.d);
      c.norm_forward(A.k_in, W.kn_g, W.kn_b, A.k, A.kn_mean, A.kn_rstd, m.n_full * m.gl, m.d);
      if (cp && !m.rotary && m.cp_a2a_size == 1) context_exchange_kv(c, A, c.pass());
      break;
    case OpId::kRotaryEmbedding:
      if (cp) {
        context_rope(c, A.q, m.hl, false);
        context_rope(c, A.k, m.gl, false);
        if (m.cp_a2a_size == 1) context_exchange_kv(c, A, c.pass());
        break;
      }
      be.rope(A.q.ptr(), m.b, m.s, m.hl, m.d, m.rotary_base, false);
      be.rope(A.k.ptr(), m.b, m.s, m.gl, m.d, m.rotary_base, false);
      break;
    case OpId::kAttnScores:
      if (cp) {  // gathers K and V first where a selective recomputation starts here
        context_attention_forward(c, A);
        c.gemm_done(fused_queries(m), fused_keys(m), m.d, fused_batch(m));
        break;
      }
      if (m.flash) {  // the whole attention core, in one fused kernel
        resize_for_overwrite(A.ctx, m.b * sa * m.hl * m.d);
        resize_for_overwrite(A.lse, m.b * m.hl * sa);
        be.flash_attention_forward(A.q.ptr(), A.k.ptr(), A.v.ptr(), A.ctx.ptr(), A.lse.data(), m.b,
                                   sa, sa, m.hl, m.gl, m.d);
        c.gemm_done(sa, fused_keys(m), m.d, m.b * m.hl);
        break;
      }
      resize_for_overwrite(A.probs, m.b * m.hl * sa * sa);
      be.attention_scores(A.q.ptr(), A.k.ptr(), A.probs.ptr(), m.b, sa, m.hl, m.gl, m.d);
      c.gemm_done(sa, sa, m.d, m.b * m.hl);
      break;
    case OpId::kAttnSoftmax:
      if (m.flash) break;  // inside flash_attention_forward
      be.causal_softmax(A.probs.ptr(), m.b * m.hl, sa);
      break;
    case OpId::kAttnDropout:  // no dropout in ptdp run (deterministic training)
      break;
    case OpId::kAttnContext:
      if (m.flash) {  // computed with the scores
        c.gemm_done(fused_queries(m), m.d, fused_keys(m), fused_batch(m));
        if (m.cp_a2a_size > 1) context_output_to_local(c, A);  // the output back to its tokens
        break;
      }
      resize_for_overwrite(A.ctx, m.b * sa * m.hl * m.d);
      be.attention_context(A.probs.ptr(), A.v.ptr(), A.ctx.ptr(), m.b, sa, m.hl, m.gl, m.d);
      c.gemm_done(sa, m.d, sa, m.b * m.hl);
      break;
    case OpId::kAttnProj:
      resize_for_overwrite(A.proj, m.n_full * m.h);
      c.linear(A.ctx.ptr(), W.proj_w, -1, A.proj.ptr(), m.n_full, m.hl * m.d, m.h);
      break;
    case OpId::kAttnAllReduce:
      c.all_reduce(A.proj);
      break;
    case OpId::kAttnReduceScatter:
      c.scatter_sequence_in_place(A.proj);
      break;
    case OpId::kAttnBiasDropoutAdd:
      c.residual_add(A.h1, A.x, A.proj, W.proj_b);
      release(A.proj);
      break;
    case OpId::kPostAttentionLayernorm:
      c.norm_forward(A.h1, W.ln2_g, W.ln2_b, A.ln2, A.ln2_mean, A.ln2_rstd, m.n_local);
      break;
    case OpId::kMlpAllGather:
      c.gather_sequence(A.ln2, A.ln2_full, m.h);
      break;
    case OpId::kFc1:
      resize_for_overwrite(A.fc1, m.n_full * m.fc1_width());
      c.linear(ln2_full.ptr(), W.fc1_w, -1, A.fc1.ptr(), m.n_full, m.h, m.fc1_width());
      break;
    case OpId::kBiasGelu:
      c.add_bias(A.fc1, W.fc1_b, m.ffl);
      resize_for_overwrite(A.act, elems(A.fc1));
      be.gelu(A.fc1.ptr(), A.act.ptr(), elems(A.fc1));
      break;
    case OpId::kSwiglu:
      resize_for_overwrite(A.act, m.n_full * m.ffl);
      be.swiglu(A.fc1.ptr(), A.act.ptr(), m.n_full, m.ffl);
      break;
    case OpId::kFc2:
      resize_for_overwrite(A.fc2, m.n_full * m.h);
      c.linear(A.act.ptr(), W.fc2_w, -1, A.fc2.ptr(), m.n_full, m.ffl, m.h);
      break;
    case OpId::kMlpAllReduce:
      c.all_reduce(A.fc2);
      break;
    case OpId::kMlpReduceScatter:
      c.scatter_sequence_in_place(A.fc2);
      break;
    case OpId::kMlpBiasDropoutAdd:
      c.residual_add(A.out, A.h1, A.fc2, W.fc2_b);
      release(A.fc2);
      break;
    default:
      throw std::logic_error("not a forward op of a transformer layer");
  }
}

void layer_backward_op(ShardContext& c, OpId op, const LayerParams& W, LayerActs& A,
                       LayerGrads& D) {
  const ShardDims& m = c.dims;
  Backend& be = c.be;
  const int64_t sa = m.s_attn;
  const bool cp = m.cp > 1;
  const Buffer& ln1_full = m.sp ? A.ln1_full : A.ln1;
  const Buffer& ln2_full = m.sp ? A.ln2_full : A.ln2;
  // Without sequence parallelism (or with t = 1) the reduce-scatter/all-gather pairs are
  // absent and the gradient of a row-parallel output is the layer's incoming gradient.
  switch (op) {
    case OpId::kMlpBiasDropoutAddBackward:
      c.bias_grad(D.d_out, W.fc2_b, m.h);
      c.copy(D.d_out, D.d_h1);
      c.copy(D.d_out, D.d_fc2);
      break;
    case OpId::kMlpReduceScatterBackward:
      c.gather_sequence(D.d_out, D.d_fc2, m.h);
      break;
    case OpId::kFc2Dgrad:
      resize_for_overwrite(D.d_act, m.n_full * m.ffl);
      c.linear_dgrad(W.fc2_w, D.d_fc2.ptr(), D.d_act.ptr(), m.n_full, m.ffl, m.h);
      break;
    case OpId::kFc2Wgrad:
      c.linear_wgrad(A.act.ptr(), D.d_fc2.ptr(), W.fc2_w, -1, m.n_full, m.ffl, m.h);
      release(D.d_fc2);
      break;
    case OpId::kBiasGeluBackward:
      resize_for_overwrite(D.d_pre, elems(A.fc1));
      be.gelu_backward(A.fc1.ptr(), D.d_act.ptr(), D.d_pre.ptr(), elems(A.fc1));
      c.bias_grad(D.d_pre, W.fc1_b, m.ffl);
      release(D.d_act);
      break;
    case OpId::kSwigluBackward:
      resize_for_overwrite(D.d_pre, elems(A.fc1));
      be.swiglu_backward(A.fc1.ptr(), D.d_act.ptr(), D.d_pre.ptr(), m.n_full, m.ffl);
      release(D.d_act);
      break;
    case OpId::kFc1Dgrad:
      resize_for_overwrite(D.d_ln2_full, m.n_full * m.h);
      c.linear_dgrad(W.fc1_w, D.d_pre.ptr(), D.d_ln2_full.ptr(), m.n_full, m.h, m.fc1_width());
      break;
    case OpId::kFc1InputGradAllReduce:
      c.all_reduce(D.d_ln2_full);
      break;
    case OpId::kFc1Wgrad:
      c.linear_wgrad(ln2_full.ptr(), D.d_pre.ptr(), W.fc1_w, -1, m.n_full, m.h, m.fc1_width());
      release(D.d_pre);
      break;
    case OpId::kMlpAllGatherBackward:
      c.scatter_sequence(D.d_ln2_full, D.d_ln2, m.h);
      break;
    case OpId::kPostAttentionLayernormBackward:
      c.norm_backward(A.h1, W.ln2_g, W.ln2_b, A.ln2_mean, A.ln2_rstd, m.sp ? D.d_ln2 : D.d_ln2_full,
                      D.tmp, m.n_local);
      be.add(D.d_h1.ptr(), D.tmp.ptr(), elems(D.d_h1));
      for (Buffer* x : {&D.tmp, &D.d_ln2, &D.d_ln2_full}) release(*x);
      break;
    case OpId::kAttnBiasDropoutAddBackward:
      c.bias_grad(D.d_h1, W.proj_b, m.h);
      c.copy(D.d_h1, D.d_x);
      c.copy(D.d_h1, D.d_proj);
      break;
    case OpId::kAttnReduceScatterBackward:
      c.gather_sequence(D.d_h1, D.d_proj, m.h);
      break;
    case OpId::kAttnProjDgrad:
      resize_for_overwrite(D.d_ctx, m.n_full * m.hl * m.d);
      c.linear_dgrad(W.proj_w, D.d_proj.ptr(), D.d_ctx.ptr(), m.n_full, m.hl * m.d, m.h);
      release(D.d_h1);  // its last reader was the bias-dropout-add's (or all-gather's) backward
      break;
    case OpId::kAttnProjWgrad:
      c.linear_wgrad(A.ctx.ptr(), D.d_proj.ptr(), W.proj_w, -1, m.n_full, m.hl * m.d, m.h);
      release(D.d_proj);
      break;
    case OpId::kAttnScoresRecompute:  // flash attention's backward, which recomputes the scores
      if (!m.flash) throw std::logic_error("attention scores in the backward list without flash");
      if (cp) {
        context_attention_backward(c, A, D);
        release(D.d_ctx);
      } else {
        resize_for_overwrite(D.dq, elems(A.q));
        resize_for_overwrite(D.dk, elems(A.k));
        resize_for_overwrite(D.dv, elems(A.v));
        be.flash_attention_backward(A.q.ptr(), A.k.ptr(), A.v.ptr(), A.ctx.ptr(), A.lse.data(),
                                    D.d_ctx.ptr(), D.dq.ptr(), D.dk.ptr(), D.dv.ptr(), m.b, sa, sa,
                                    m.hl, m.gl, m.d);
        release(D.d_ctx);
      }
      c.gemm_done(fused_queries(m), fused_keys(m), m.d, fused_batch(m));
      break;
    case OpId::kAttnContextDprobs:
      if (m.flash) {  // the GEMMs of the fused backward ran with the recomputed scores
        c.gemm_done(fused_queries(m), fused_keys(m), m.d, fused_batch(m));
        break;
      }
      resize_for_overwrite(D.d_probs, elems(A.probs));
      be.attention_context_backward(A.probs.ptr(), A.v.ptr(), D.d_ctx.ptr(), D.d_probs.ptr(),
                                    nullptr, m.b, sa, m.hl, m.gl, m.d);
      c.gemm_done(sa, sa, m.d, m.b * m.hl);
      break;
    case OpId::kAttnContextDv:
      if (m.flash) {
        c.gemm_done(fused_keys(m), m.d, fused_queries(m), fused_batch(m));
        break;
      }
      resize_for_overwrite(D.dv, elems(A.v));
      be.attention_context_backward(A.probs.ptr(), A.v.ptr(), D.d_ctx.ptr(), nullptr, D.dv.ptr(),
                                    m.b, sa, m.hl, m.gl, m.d);
      c.gemm_done(sa, m.d, sa, m.b * m.hl);
      release(D.d_ctx);
      break;
    case OpId::kAttnDropoutBackward:
      break;
    case OpId::kAttnSoftmaxBackward:
      if (m.flash) break;
      be.causal_softmax_backward(A.probs.ptr(), D.d_probs.ptr(), D.d_probs.ptr(), m.b * m.hl, sa);
      break;
    case OpId::kAttnScoresDq:
      if (m.flash) {
        c.gemm_done(fused_queries(m), m.d, fused_keys(m), fused_batch(m));
        break;
      }
      resize_for_overwrite(D.dq, elems(A.q));
      be.attention_scores_backward(A.q.ptr(), A.k.ptr(), D.d_probs.ptr(), D.dq.ptr(), nullptr, m.b,
                                   sa, m.hl, m.gl, m.d);
      c.gemm_done(sa, m.d, sa, m.b * m.hl);
      break;
    case OpId::kAttnScoresDk:
      if (m.flash) {
        c.gemm_done(m.d, fused_keys(m), fused_queries(m), fused_batch(m));
        if (cp) context_return_dkv(c, D);  // dK and dV become local
        break;
      }
      resize_for_overwrite(D.dk, elems(A.k));
      be.attention_scores_backward(A.q.ptr(), A.k.ptr(), D.d_probs.ptr(), nullptr, D.dk.ptr(), m.b,
                                   sa, m.hl, m.gl, m.d);
      c.gemm_done(m.d, sa, sa, m.b * m.hl);
      release(D.d_probs);
      break;
    case OpId::kRotaryEmbeddingBackward:
      if (cp) {
        context_rope(c, D.dq, m.hl, true);
        context_rope(c, D.dk, m.gl, true);
        break;
      }
      be.rope(D.dq.ptr(), m.b, m.s, m.hl, m.d, m.rotary_base, true);
      be.rope(D.dk.ptr(), m.b, m.s, m.gl, m.d, m.rotary_base, true);
      break;
    case OpId::kQkLayernormBackward:  // dQ and dK through the norms (their weights' gradients
                                      // partial over the rank's heads: ParamInfo::tp_partial)
      c.norm_backward(A.q_in, W.qn_g, W.qn_b, A.qn_mean, A.qn_rstd, D.dq, D.tmp, m.n_full * m.hl,
                      m.d);
      std::swap(D.dq, D.tmp);
      release(D.tmp);
      c.norm_backward(A.k_in, W.kn_g, W.kn_b, A.kn_mean, A.kn_rstd, D.dk, D.tmp, m.n_full * m.gl,
                      m.d);
      std::swap(D.dk, D.tmp);
      release(D.tmp);
      break;
    case OpId::kQkvDgrad:
      resize_for_overwrite(D.d_qkv, m.n_full * m.qkv_width());
      be.concat_columns3(D.dq.ptr(), D.dk.ptr(), D.dv.ptr(), D.d_qkv.ptr(), m.n_full, m.hl * m.d,
                         m.gl * m.d, m.gl * m.d);
      for (Buffer* x : {&D.dq, &D.dk, &D.dv}) release(*x);
      resize_for_overwrite(D.d_ln1_full, m.n_full * m.h);
      c.linear_dgrad(W.qkv_w, D.d_qkv.ptr(), D.d_ln1_full.ptr(), m.n_full, m.h, m.qkv_width());
      break;
    case OpId::kQkvInputGradAllReduce:
      c.all_reduce(D.d_ln1_full);
      break;
    case OpId::kQkvWgrad:
      c.linear_wgrad(ln1_full.ptr(), D.d_qkv.ptr(), W.qkv_w, W.qkv_b, m.n_full, m.h, m.qkv_width());
      release(D.d_qkv);
      break;
    case OpId::kAttnAllGatherBackward:
      c.scatter_sequence(D.d_ln1_full, D.d_ln1, m.h);
      break;
    case OpId::kInputLayernormBackward:
      c.norm_backward(A.x, W.ln1_g, W.ln1_b, A.ln1_mean, A.ln1_rstd, m.sp ? D.d_ln1 : D.d_ln1_full,
                      D.tmp, m.n_local);
      be.add(D.d_x.ptr(), D.tmp.ptr(), elems(D.d_x));
      for (Buffer* x : {&D.tmp, &D.d_ln1, &D.d_ln1_full}) release(*x);
      break;
    default:
      throw std::logic_error("not a backward op of a transformer layer");
  }
}

void drop_recomputed(LayerActs& A, Recompute r, unsigned modules) {
  if (r == Recompute::kNone) return;
  if (r == Recompute::kSelective) {
    if (modules & kRecomputeCoreAttn) {  // the attention core is recomputed
      release(A.probs);
      release(A.lse);
    }
    if (modules & kRecomputeMlp)  // the MLP from its input (A.ln2)
      for (Buffer* x : {&A.ln2_full, &A.fc1, &A.act}) release(*x);
    // The pre-MLP layernorm's output, rerun from A.h1 (`modules` is the layer's:
    // layer_recompute_modules; the input layernorm's output is the QKV projection's, kept).
    if (modules & kRecomputeLayernorm)
      for (Buffer* x : {&A.ln2, &A.ln2_full}) release(*x);
    return;
  }
  release(A.probs);
  release(A.lse);
  for (Buffer* x :
       {&A.ln1, &A.ln1_mean, &A.ln1_rstd, &A.ln1_full, &A.q,        &A.k,        &A.v,
        &A.ctx, &A.h1,       &A.ln2,      &A.ln2_mean, &A.ln2_rstd, &A.ln2_full, &A.fc1,
        &A.act, &A.q_in,     &A.k_in,     &A.qn_mean,  &A.qn_rstd,  &A.kn_mean,  &A.kn_rstd})
    release(*x);
}

}  // namespace ptdp
