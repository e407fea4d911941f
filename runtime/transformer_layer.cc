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

// y [rows, k w] = each row of x [rows, w] repeated k times (k >= 1): MLA's rotated key, shared by
// every head. By doublings: one concatenation per bit of k.
void repeat_columns(Backend& be, const Buffer& x, Buffer& y, int64_t rows, int64_t w, int64_t k) {
  int bit = 62;
  while (bit > 0 && ((k >> bit) & 1) == 0) --bit;
  Buffer next;
  resize_for_overwrite(y, rows * w);
  be.copy(x.ptr(), y.ptr(), rows * w);
  int64_t a = 1;  // y holds a copies
  for (--bit; bit >= 0; --bit) {
    const bool one = (k >> bit) & 1;
    resize_for_overwrite(next, rows * (2 * a + (one ? 1 : 0)) * w);
    be.concat_columns3(y.ptr(), y.ptr(), x.ptr(), next.ptr(), rows, a * w, a * w, one ? w : 0);
    a = 2 * a + (one ? 1 : 0);
    y.swap(next);
  }
}

// y [rows, w] = the sum of x [rows, k w]'s k column blocks (the gradient of repeat_columns), by
// halvings, an odd block carried to the next round: x is consumed.
void sum_column_blocks(Backend& be, Buffer& x, Buffer& y, int64_t rows, int64_t w, int64_t k) {
  Buffer lo, hi, odd;
  while (k > 1) {
    const int64_t half = k / 2, rest = k - 2 * half;  // [half | half | rest]
    resize_for_overwrite(lo, rows * half * w);
    resize_for_overwrite(hi, rows * half * w);
    resize_for_overwrite(odd, rows * rest * w);
    be.split_columns3(x.ptr(), lo.ptr(), hi.ptr(), rest > 0 ? odd.ptr() : lo.ptr(), rows, half * w,
                      half * w, rest * w);
    be.add(lo.ptr(), hi.ptr(), rows * half * w);
    if (rest > 0) {
      resize_for_overwrite(x, rows * (half + 1) * w);
      be.concat_columns3(lo.ptr(), odd.ptr(), lo.ptr(), x.ptr(), rows, half * w, w, 0);
    } else {
      x.swap(lo);
    }
    k = half + rest;
  }
  y.swap(x);
}

// [rows, a + b] from its two column blocks, and back (MLA's heads: unrotated and rotated
// channels; keys' and values' parts).
void join_columns(Backend& be, const Buffer& x0, const Buffer& x1, Buffer& y, int64_t rows,
                  int64_t a, int64_t b) {
  resize_for_overwrite(y, rows * (a + b));
  be.concat_columns3(x0.ptr(), x1.ptr(), x0.ptr(), y.ptr(), rows, a, b, 0);
}
void part_columns(Backend& be, const Buffer& x, Buffer& y0, Buffer& y1, int64_t rows, int64_t a,
                  int64_t b) {
  resize_for_overwrite(y0, rows * a);
  resize_for_overwrite(y1, rows * b);
  be.split_columns3(x.ptr(), y0.ptr(), y1.ptr(), y0.ptr(), rows, a, b, 0);
}

// The rotary embedding (inverse: its backward) of x [b, s, heads, d] in place, at the tokens'
// global positions with context parallelism.
void rope_rows(ShardContext& c, Buffer& x, int64_t heads, int64_t d, bool inverse) {
  const ShardDims& m = c.dims;
  if (m.cp > 1)
    context_rope(c, x, heads, d, inverse);
  else
    c.be.rope(x.ptr(), m.b, m.s, heads, d, m.rotary_base, inverse);
}

// MLA's rotated channels of the queries (or of dQ): each local head's last dr, in place.
void mla_rope_queries(ShardContext& c, Buffer& q, bool inverse) {
  const ShardDims& m = c.dims;
  Buffer nope, pe;
  part_columns(c.be, q, nope, pe, m.n_full * m.hl, m.dn, m.dr);
  rope_rows(c, pe, m.hl, m.dr, inverse);
  join_columns(c.be, nope, pe, q, m.n_full * m.hl, m.dn, m.dr);
}

// The fused attention of the whole sequence (no context parallelism), V narrower than Q with
// MLA (ShardContext::flash_forward pads it).
void flash_forward(ShardContext& c, LayerActs& A) {
  const ShardDims& m = c.dims;
  const int64_t sa = m.s_attn;
  resize_for_overwrite(A.lse, m.b * m.hl * sa);
  resize_for_overwrite(A.ctx, m.b * sa * m.hl * m.dv);
  c.flash_forward(A.q.ptr(), A.k.ptr(), A.v.ptr(), A.ctx.ptr(), A.lse.data(), m.b, sa, sa, m.hl,
                  m.gl, m.dv);
}

void flash_backward(ShardContext& c, LayerActs& A, LayerGrads& D) {
  const ShardDims& m = c.dims;
  const int64_t sa = m.s_attn;
  resize_for_overwrite(D.dq, elems(A.q));
  resize_for_overwrite(D.dk, elems(A.k));
  resize_for_overwrite(D.dv, elems(A.v));
  c.flash_backward(A.q.ptr(), A.k.ptr(), A.v.ptr(), A.ctx.ptr(), A.lse.data(), D.d_ctx.ptr(),
                   D.dq.ptr(), D.dk.ptr(), D.dv.ptr(), m.b, sa, sa, m.hl, m.gl, m.dv);
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
      if (m.mla) {  // the normalised latents and the rotated key (the hidden state without a
                    // query latent)
        if (m.ql > 0)
          c.gather_sequence(A.q_lat, A.q_lat_full, m.ql);
        else
          c.gather_sequence(A.ln1, A.ln1_full, m.h);
        c.gather_sequence(A.kv_lat, A.kv_lat_full, m.kvl);
        c.gather_sequence(A.k_pe, A.k_pe_full, m.dr);
        break;  // (the rank's latents stay, to be gathered again for the weight gradients)
      }
      c.gather_sequence(A.ln1, A.ln1_full, m.h);
      break;
    case OpId::kQkv: {
      Buffer qkv;
      resize_for_overwrite(qkv, m.n_full * m.qkv_width());
      c.linear(ln1_full.ptr(), W.qkv_w, W.qkv_b, qkv.ptr(), m.n_full, m.h, m.qkv_width());
      if (m.sp) release(A.ln1_full);  // the rank's rows are kept, gathered again backward
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
    case OpId::kQDownProj: {  // (with --qk-layernorm the latent before its norm)
      Buffer& lat = m.qk_norm ? A.q_lat_in : A.q_lat;
      resize_for_overwrite(lat, m.n_local * m.ql);
      c.linear(A.ln1.ptr(), W.q_down_w, -1, lat.ptr(), m.n_local, m.h, m.ql);
      break;
    }
    case OpId::kKvDownProj: {
      Buffer kvc;
      resize_for_overwrite(kvc, m.n_local * m.kv_latent_width());
      c.linear(A.ln1.ptr(), W.kv_down_w, -1, kvc.ptr(), m.n_local, m.h, m.kv_latent_width());
      part_columns(be, kvc, m.qk_norm ? A.kv_lat_in : A.kv_lat, A.k_pe, m.n_local, m.kvl, m.dr);
      break;
    }
    case OpId::kLatentLayernorm:
      if (m.ql > 0)
        c.norm_forward(A.q_lat_in, W.qlat_g, -1, A.q_lat, A.qlat_mean, A.qlat_rstd, m.n_local,
                       m.ql);
      c.norm_forward(A.kv_lat_in, W.kvlat_g, -1, A.kv_lat, A.kvlat_mean, A.kvlat_rstd, m.n_local,
                     m.kvl);
      break;
    case OpId::kQUpProj: {
      const Buffer& in = m.ql > 0 ? (m.sp ? A.q_lat_full : A.q_lat) : ln1_full;
      resize_for_overwrite(A.q, m.n_full * m.hl * m.d);
      c.linear(in.ptr(), W.q_up_w, -1, A.q.ptr(), m.n_full, m.ql > 0 ? m.ql : m.h, m.hl * m.d);
      if (m.sp) release(m.ql > 0 ? A.q_lat_full : A.ln1_full);  // gathered again backward
      break;
    }
    case OpId::kKvUpProj: {
      Buffer kvu;
      resize_for_overwrite(kvu, m.n_full * m.kv_up_width());
      c.linear((m.sp ? A.kv_lat_full : A.kv_lat).ptr(), W.kv_up_w, -1, kvu.ptr(), m.n_full, m.kvl,
               m.kv_up_width());
      if (m.sp) release(A.kv_lat_full);  // gathered again backward
      part_columns(be, kvu, A.k_nope, A.v, m.n_full * m.hl, m.dn, m.dv);
      break;
    }
    case OpId::kRotaryEmbedding:
      if (m.mla) {  // the queries' rotated channels; each head's key from its unrotated part and
                    // the one rotated key
        mla_rope_queries(c, A.q, false);
        Buffer pe(m.sp ? A.k_pe_full : A.k_pe), pe_heads;
        rope_rows(c, pe, 1, m.dr, false);
        repeat_columns(be, pe, pe_heads, m.n_full, m.dr, m.hl);
        join_columns(be, A.k_nope, pe_heads, A.k, m.n_full * m.hl, m.dn, m.dr);
        for (Buffer* x : {&A.k_nope, &A.k_pe_full}) release(*x);  // (A.k_pe: for mla_up_proj)
        if (cp && m.cp_a2a_size == 1) context_exchange_kv(c, A, c.pass());
        break;
      }
      if (cp) {
        context_rope(c, A.q, m.hl, m.d, false);
        context_rope(c, A.k, m.gl, m.d, false);
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
        flash_forward(c, A);
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
        c.gemm_done(fused_queries(m), m.dv, fused_keys(m), fused_batch(m));
        if (m.cp_a2a_size > 1) context_output_to_local(c, A);  // the output back to its tokens
        break;
      }
      resize_for_overwrite(A.ctx, m.b * sa * m.hl * m.dv);
      be.attention_context(A.probs.ptr(), A.v.ptr(), A.ctx.ptr(), m.b, sa, m.hl, m.gl, m.dv);
      c.gemm_done(sa, m.dv, sa, m.b * m.hl);
      break;
    case OpId::kAttnProj:
      resize_for_overwrite(A.proj, m.n_full * m.h);
      c.linear(A.ctx.ptr(), W.proj_w, -1, A.proj.ptr(), m.n_full, m.hl * m.dv, m.h);
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
      // The bias in the GEMM (cuBLASLt's epilogue on a GPU), not in a pass of its own over
      // the layer's widest activation.
      c.linear(ln2_full.ptr(), W.fc1_w, W.fc1_b, A.fc1.ptr(), m.n_full, m.h, m.fc1_width());
      if (m.sp) release(A.ln2_full);  // the rank's rows are kept, gathered again backward
      break;
    case OpId::kBiasGelu:  // (FC1 added the bias)
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
      c.residual_add_backward(D.d_out, D.d_h1, D.d_fc2, W.fc2_b);
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
      be.gelu_backward_bias_grad(A.fc1.ptr(), D.d_act.ptr(), D.d_pre.ptr(),
                                 W.fc1_b >= 0 ? c.G(W.fc1_b) : nullptr, elems(A.fc1) / m.ffl,
                                 m.ffl);
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
    case OpId::kMlpInputRegather:
      c.gather_sequence(A.ln2, A.ln2_full, m.h);
      c.weight_gradient_done();  // for FC1's weight gradient alone
      break;
    case OpId::kFc1Wgrad:
      c.linear_wgrad(ln2_full.ptr(), D.d_pre.ptr(), W.fc1_w, -1, m.n_full, m.h, m.fc1_width());
      release(D.d_pre);
      if (m.sp) release(A.ln2_full);
      break;
    case OpId::kMlpAllGatherBackward:
      c.scatter_sequence(D.d_ln2_full, D.d_ln2, m.h);
      break;
    case OpId::kPostAttentionLayernormBackward:
      c.norm_backward_add(A.h1, W.ln2_g, W.ln2_b, A.ln2_mean, A.ln2_rstd,
                          m.sp ? D.d_ln2 : D.d_ln2_full, D.d_h1, m.n_local);
      for (Buffer* x : {&D.d_ln2, &D.d_ln2_full}) release(*x);
      break;
    case OpId::kAttnBiasDropoutAddBackward:
      c.residual_add_backward(D.d_h1, D.d_x, D.d_proj, W.proj_b);
      break;
    case OpId::kAttnReduceScatterBackward:
      c.gather_sequence(D.d_h1, D.d_proj, m.h);
      break;
    case OpId::kAttnProjDgrad:
      resize_for_overwrite(D.d_ctx, m.n_full * m.hl * m.dv);
      c.linear_dgrad(W.proj_w, D.d_proj.ptr(), D.d_ctx.ptr(), m.n_full, m.hl * m.dv, m.h);
      release(D.d_h1);  // its last reader was the bias-dropout-add's (or all-gather's) backward
      break;
    case OpId::kAttnProjWgrad:
      c.linear_wgrad(A.ctx.ptr(), D.d_proj.ptr(), W.proj_w, -1, m.n_full, m.hl * m.dv, m.h);
      release(D.d_proj);
      break;
    case OpId::kAttnScoresRecompute:  // flash attention's backward, which recomputes the scores
      if (!m.flash) throw std::logic_error("attention scores in the backward list without flash");
      if (cp) {
        context_attention_backward(c, A, D);
        release(D.d_ctx);
      } else {
        flash_backward(c, A, D);
        release(D.d_ctx);
      }
      c.gemm_done(fused_queries(m), fused_keys(m), m.d, fused_batch(m));
      break;
    case OpId::kAttnContextDprobs:
      if (m.flash) {  // the GEMMs of the fused backward ran with the recomputed scores
        c.gemm_done(fused_queries(m), fused_keys(m), m.dv, fused_batch(m));
        break;
      }
      resize_for_overwrite(D.d_probs, elems(A.probs));
      be.attention_context_backward(A.probs.ptr(), A.v.ptr(), D.d_ctx.ptr(), D.d_probs.ptr(),
                                    nullptr, m.b, sa, m.hl, m.gl, m.dv);
      c.gemm_done(sa, sa, m.dv, m.b * m.hl);
      break;
    case OpId::kAttnContextDv:
      if (m.flash) {
        c.gemm_done(fused_keys(m), m.dv, fused_queries(m), fused_batch(m));
        break;
      }
      resize_for_overwrite(D.dv, elems(A.v));
      be.attention_context_backward(A.probs.ptr(), A.v.ptr(), D.d_ctx.ptr(), nullptr, D.dv.ptr(),
                                    m.b, sa, m.hl, m.gl, m.dv);
      c.gemm_done(sa, m.dv, sa, m.b * m.hl);
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
      if (m.mla) {  // dK's rotated part summed over the heads into the shared key's gradient
        mla_rope_queries(c, D.dq, true);
        Buffer pe_heads;
        part_columns(be, D.dk, D.dk_nope, pe_heads, m.n_full * m.hl, m.dn, m.dr);
        release(D.dk);
        sum_column_blocks(be, pe_heads, D.dk_pe, m.n_full, m.dr, m.hl);
        rope_rows(c, D.dk_pe, 1, m.dr, true);
        break;
      }
      if (cp) {
        context_rope(c, D.dq, m.hl, m.d, true);
        context_rope(c, D.dk, m.gl, m.d, true);
        break;
      }
      be.rope(D.dq.ptr(), m.b, m.s, m.hl, m.d, m.rotary_base, true);
      be.rope(D.dk.ptr(), m.b, m.s, m.gl, m.d, m.rotary_base, true);
      break;
    case OpId::kKvUpProjDgrad: {  // then the latent's gradient beside the rotated key's
      join_columns(be, D.dk_nope, D.dv, D.d_kvu, m.n_full * m.hl, m.dn, m.dv);
      for (Buffer* x : {&D.dk_nope, &D.dv}) release(*x);
      Buffer d_lat;
      resize_for_overwrite(d_lat, m.n_full * m.kvl);
      c.linear_dgrad(W.kv_up_w, D.d_kvu.ptr(), d_lat.ptr(), m.n_full, m.kvl, m.kv_up_width());
      join_columns(be, d_lat, D.dk_pe, D.d_kvc, m.n_full, m.kvl, m.dr);
      release(D.dk_pe);
      break;
    }
    case OpId::kKvUpProjWgrad:
      c.linear_wgrad((m.sp ? A.kv_lat_full : A.kv_lat).ptr(), D.d_kvu.ptr(), W.kv_up_w, -1,
                     m.n_full, m.kvl, m.kv_up_width());
      release(D.d_kvu);
      if (m.sp) release(A.kv_lat_full);
      break;
    case OpId::kQUpProjDgrad: {  // without a query latent, the input norm's gradient (as QKV's)
      Buffer& d_in = m.ql > 0 ? D.d_q_in : D.d_ln1_full;
      resize_for_overwrite(d_in, m.n_full * (m.ql > 0 ? m.ql : m.h));
      c.linear_dgrad(W.q_up_w, D.dq.ptr(), d_in.ptr(), m.n_full, m.ql > 0 ? m.ql : m.h, m.hl * m.d);
      break;
    }
    case OpId::kQUpProjWgrad: {
      const Buffer& in = m.ql > 0 ? (m.sp ? A.q_lat_full : A.q_lat) : ln1_full;
      c.linear_wgrad(in.ptr(), D.dq.ptr(), W.q_up_w, -1, m.n_full, m.ql > 0 ? m.ql : m.h,
                     m.hl * m.d);
      release(D.dq);
      if (m.sp) release(m.ql > 0 ? A.q_lat_full : A.ln1_full);
      break;
    }
    case OpId::kLatentInputGradAllReduce:  // each rank's heads' part of the latents' gradients
      c.all_reduce(m.ql > 0 ? D.d_q_in : D.d_ln1_full);
      c.all_reduce(D.d_kvc);
      break;
    case OpId::kLatentLayernormBackward: {  // on the rank's tokens
      Buffer d_lat, d_pe, d_lat_in;
      part_columns(be, D.d_kvc, d_lat, d_pe, m.n_local, m.kvl, m.dr);
      c.norm_backward(A.kv_lat_in, W.kvlat_g, -1, A.kvlat_mean, A.kvlat_rstd, d_lat, d_lat_in,
                      m.n_local, m.kvl);
      join_columns(be, d_lat_in, d_pe, D.d_kvc, m.n_local, m.kvl, m.dr);
      if (m.ql > 0) {
        c.norm_backward(A.q_lat_in, W.qlat_g, -1, A.qlat_mean, A.qlat_rstd, D.d_q_in, D.d_q_lat_in,
                        m.n_local, m.ql);
        release(D.d_q_in);
      }
      break;
    }
    case OpId::kKvDownProjDgrad:
    case OpId::kQDownProjDgrad: {  // added into the input norm's output gradient
      const bool kv = op == OpId::kKvDownProjDgrad;
      const int64_t out = kv ? m.kv_latent_width() : m.ql;
      Buffer& d_ln1 = m.sp ? D.d_ln1 : D.d_ln1_full;
      Buffer& dx = elems(d_ln1) == 0 ? d_ln1 : D.tmp;
      resize_for_overwrite(dx, m.n_local * m.h);
      c.linear_dgrad(kv ? W.kv_down_w : W.q_down_w,
                     (kv          ? D.d_kvc
                      : m.qk_norm ? D.d_q_lat_in
                                  : D.d_q_in)
                         .ptr(),
                     dx.ptr(), m.n_local, m.h, out);
      if (&dx == &D.tmp) {
        be.add(d_ln1.ptr(), D.tmp.ptr(), m.n_local * m.h);
        release(D.tmp);
      }
      break;
    }
    case OpId::kKvDownProjWgrad:
      c.linear_wgrad(A.ln1.ptr(), D.d_kvc.ptr(), W.kv_down_w, -1, m.n_local, m.h,
                     m.kv_latent_width());
      release(D.d_kvc);
      break;
    case OpId::kQDownProjWgrad: {
      Buffer& d_lat = m.qk_norm ? D.d_q_lat_in : D.d_q_in;
      c.linear_wgrad(A.ln1.ptr(), d_lat.ptr(), W.q_down_w, -1, m.n_local, m.h, m.ql);
      release(d_lat);
      break;
    }
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
    case OpId::kAttnInputRegather:  // QKV's input, or MLA's up projections' inputs
      if (m.mla && m.ql > 0)
        c.gather_sequence(A.q_lat, A.q_lat_full, m.ql);
      else
        c.gather_sequence(A.ln1, A.ln1_full, m.h);
      if (m.mla) c.gather_sequence(A.kv_lat, A.kv_lat_full, m.kvl);
      c.weight_gradient_done();  // for the weight gradients alone
      break;
    case OpId::kQkvWgrad:
      c.linear_wgrad(ln1_full.ptr(), D.d_qkv.ptr(), W.qkv_w, W.qkv_b, m.n_full, m.h, m.qkv_width());
      release(D.d_qkv);
      if (m.sp) release(A.ln1_full);
      break;
    case OpId::kAttnAllGatherBackward:
      if (m.mla) {  // the gathered latents' gradients back to the rank's tokens, summed
        Buffer local;
        if (m.ql > 0) {
          c.scatter_sequence(D.d_q_in, local, m.ql);
          D.d_q_in.swap(local);
        } else {
          c.scatter_sequence(D.d_ln1_full, D.d_ln1, m.h);
          release(D.d_ln1_full);
        }
        c.scatter_sequence(D.d_kvc, local, m.kv_latent_width());
        D.d_kvc.swap(local);
        break;
      }
      c.scatter_sequence(D.d_ln1_full, D.d_ln1, m.h);
      break;
    case OpId::kInputLayernormBackward:
      c.norm_backward_add(A.x, W.ln1_g, W.ln1_b, A.ln1_mean, A.ln1_rstd,
                          m.sp ? D.d_ln1 : D.d_ln1_full, D.d_x, m.n_local);
      for (Buffer* x : {&D.d_ln1, &D.d_ln1_full}) release(*x);
      break;
    default:
      throw std::logic_error("not a backward op of a transformer layer");
  }
}

void drop_recomputed(LayerActs& A, Recompute r, unsigned modules) {
  // MLA: the up projections' backward reads their inputs on the rank's rows (with sequence
  // parallelism gathered again for the weight gradients, kAttnInputRegather: the forward pass
  // frees its gathered copies), which stay; the rotated key stays only for mla_up_proj's rerun.
  if (!(r == Recompute::kSelective && (modules & kRecomputeMlaUpProj)) && r != Recompute::kFull)
    release(A.k_pe);
  if (r == Recompute::kNone) return;
  if (r == Recompute::kSelective) {
    if (modules & kRecomputeCoreAttn) {  // the attention core is recomputed
      release(A.probs);
      release(A.lse);
      for (Buffer* x : {&A.q_heads, &A.k_heads, &A.v_heads, &A.ctx_heads}) release(*x);
    }
    if (modules & kRecomputeMlp)  // the MLP from its input (A.ln2)
      for (Buffer* x : {&A.ln2_full, &A.fc1, &A.act}) release(*x);
    if (modules & kRecomputeMlaUpProj)  // MLA's Q, K and V, rerun from the latents
      for (Buffer* x : {&A.q, &A.k, &A.v}) release(*x);
    // The pre-MLP layernorm's output, rerun from A.h1 (`modules` is the layer's:
    // layer_recompute_modules; the input layernorm's output is the QKV projection's, kept).
    if (modules & kRecomputeLayernorm)
      for (Buffer* x : {&A.ln2, &A.ln2_full}) release(*x);
    return;
  }
  release(A.probs);
  release(A.lse);
  for (Buffer* x : {&A.q_heads, &A.k_heads, &A.v_heads, &A.ctx_heads}) release(*x);
  for (Buffer* x :
       {&A.ln1, &A.ln1_mean, &A.ln1_rstd, &A.ln1_full, &A.q,        &A.k,        &A.v,
        &A.ctx, &A.h1,       &A.ln2,      &A.ln2_mean, &A.ln2_rstd, &A.ln2_full, &A.fc1,
        &A.act, &A.q_in,     &A.k_in,     &A.qn_mean,  &A.qn_rstd,  &A.kn_mean,  &A.kn_rstd})
    release(*x);
  for (Buffer* x : {&A.q_lat_in, &A.q_lat, &A.q_lat_full, &A.kv_lat_in, &A.kv_lat, &A.kv_lat_full,
                    &A.k_pe, &A.qlat_mean, &A.qlat_rstd, &A.kvlat_mean, &A.kvlat_rstd})
    release(*x);
}

}  // namespace ptdp
