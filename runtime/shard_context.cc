#include "runtime/shard_context.h"

#include <stdexcept>
#include <vector>

namespace ptdp {
namespace {

int64_t bytes(DType t) {
  return static_cast<int64_t>(dtype_bytes(t));
}

}  // namespace

ShardDims shard_dims(const ModelSpec& m, const ShardLayout& l) {
  ShardDims d;
  d.t = l.t;
  d.tp = l.tp;
  d.swiglu = m.swiglu;
  d.b = l.micro_batch;
  d.cp = l.cp;
  d.cpr = l.cp_rank;
  d.cp_a2a_size = l.cp > 1 ? l.cp_a2a_size : 1;
  d.s_attn = m.seq_length;
  d.s = m.seq_length / l.cp;
  d.flash = m.flash_attention || l.cp > 1;
  d.h = m.hidden_size;
  d.heads = m.num_attention_heads;
  d.groups = m.query_groups();
  d.d = m.head_dim();
  d.hl = d.heads / d.t;
  d.gl = d.groups / d.t;
  d.ffl = m.ffn_hidden() / d.t;
  d.vocab = m.vocab_size;
  d.vl = (m.vocab_size + d.t - 1) / d.t;  // the vocabulary padded to a multiple of t
  d.v0 = l.tp * d.vl;
  d.sp = l.sequence_parallel && d.t > 1;
  d.biases = !m.swiglu;  // as ModelSpec counts them: Llama-style models have no biases
  d.rotary = !m.learned_position_embeddings;
  d.qk_norm = m.qk_layernorm;
  d.qkv_bias = m.has_qkv_bias();
  d.mla = m.multi_latent_attention;
  d.dv = m.value_dim();
  if (d.mla) {
    d.dn = m.qk_head_dim;
    d.dr = m.qk_pos_emb_head_dim;
    d.ql = m.q_lora_rank;
    d.kvl = m.kv_lora_rank;
  }
  d.rotary_base = m.rotary_base;
  d.n_full = d.b * d.s;
  d.n_local = d.sp ? d.n_full / d.t : d.n_full;
  return d;
}

ExecutedOp* ShardContext::current() {
  return trace && !trace->empty() ? &trace->back() : nullptr;
}

void ShardContext::begin(OpId id, PassKind pass) {
  pass_ = pass;
  if (!trace && !timer) return;
  const OpRole role = pass == PassKind::kForward     ? OpRole::kForward
                      : pass == PassKind::kRecompute ? OpRole::kRecompute
                                                     : OpRole::kInputGrad;
  if (timer) timer->begin(id, role);
  if (!trace) return;
  ExecutedOp e;
  e.id = id;
  e.role = role;
  trace->push_back(e);
}

void ShardContext::end_op() {
  if (timer) timer->end_op();
}

void ShardContext::collective_done(Collective c, double bytes, CommGroup group) {
  if (ExecutedOp* e = current()) {
    e->kind = OpKind::kCollective;
    e->collective = c;
    e->group = group;
    e->bytes += bytes;
  }
}

void ShardContext::gemm_done(int64_t m, int64_t n, int64_t k, int64_t batch) {
  if (ExecutedOp* e = current()) {
    e->kind = OpKind::kGemm;
    e->m = m;
    e->n = n;
    e->k = k;
    e->batch = batch;
  }
}

void ShardContext::weight_gradient_done() {
  if (pass_ != PassKind::kBackward) return;
  if (ExecutedOp* e = current()) e->role = OpRole::kWeightGrad;
  if (timer) timer->weight_gradient();
}

void ShardContext::gather_sequence(const Buffer& local, Buffer& full, int64_t width) {
  const int64_t t = dims.t, n = dims.n_local * width;
  resize(full, dims.n_full * width);
  resize(scratch_, t * n);
  all_gather(local.ptr(), scratch_.ptr(), n);
  be.sequence_unshard(scratch_.ptr(), full.ptr(), t, dims.b, dims.s, width);
}

void ShardContext::scatter_sequence(const Buffer& full, Buffer& local, int64_t width) {
  const int64_t t = dims.t, n = dims.n_local * width;
  resize(scratch_, t * n);
  be.sequence_shard(full.ptr(), scratch_.ptr(), t, dims.b, dims.s, width);
  resize(local, n);
  reduce_scatter(scratch_.ptr(), local.ptr(), n);
}

void ShardContext::scatter_sequence_in_place(Buffer& x) {
  Buffer local;
  scatter_sequence(x, local, dims.h);
  x.swap(local);
}

void ShardContext::all_reduce(Buffer& x) {
  tp->all_reduce(x.raw(), x.size(), x.dtype());
  collective_done(Collective::kAllReduce, static_cast<double>(x.bytes()));
}

void ShardContext::all_gather(CPtr in, Ptr out, int64_t n) {
  if (in.t != out.t) throw std::logic_error("all_gather between element types");
  tp->all_gather(in.p, out.p, static_cast<size_t>(n), in.t);
  collective_done(Collective::kAllGather, static_cast<double>(dims.t * n * bytes(in.t)));
}

void ShardContext::reduce_scatter(CPtr in, Ptr out, int64_t n) {
  if (in.t != out.t) throw std::logic_error("reduce_scatter between element types");
  tp->reduce_scatter(in.p, out.p, static_cast<size_t>(n), in.t);
  collective_done(Collective::kReduceScatter, static_cast<double>(dims.t * n * bytes(in.t)));
}

void ShardContext::ring_step(OpId id, CPtr send, Ptr recv, int64_t n, PassKind pass) {
  begin(id, pass);
  Communicator* const ring = cp_ring ? cp_ring : cp;
  const int size = ring->size(), r = ring->rank();
  const Communicator::P2P ops[2] = {
      {true, const_cast<void*>(send.p), static_cast<size_t>(n), (r + 1) % size, 0, send.t},
      {false, recv.p, static_cast<size_t>(n), (r + size - 1) % size, 0, recv.t}};
  ring->batch(ops);
  collective_done(Collective::kSendRecv, static_cast<double>(n * bytes(send.t)),
                  CommGroup::kContext);
}

void ShardContext::context_all_to_all(OpId id, CPtr send, Ptr recv, int64_t n, PassKind pass) {
  begin(id, pass);
  Communicator* const group = cp_heads ? cp_heads : cp;
  const std::vector<size_t> counts(static_cast<size_t>(group->size()), static_cast<size_t>(n));
  group->all_to_all_v(send.p, counts, recv.p, counts, send.t);
  collective_done(Collective::kAllToAll, static_cast<double>(group->size() * n * bytes(send.t)),
                  CommGroup::kContext);
}

void ShardContext::linear(CPtr x, int64_t w, int64_t bias, Ptr y, int64_t n, int64_t in,
                          int64_t out) {
  be.linear_forward(x, P(w), bias >= 0 ? P(bias) : nullptr, y, n, in, out);
  gemm_done(n, out, in, 1);
}

void ShardContext::linear_dgrad(int64_t w, CPtr dy, Ptr dx, int64_t n, int64_t in, int64_t out) {
  be.linear_dgrad(P(w), dy, dx, n, in, out);
  gemm_done(n, in, out, 1);
}

void ShardContext::linear_wgrad(CPtr x, CPtr dy, int64_t w, int64_t bias, int64_t n, int64_t in,
                                int64_t out) {
  be.linear_wgrad(x, dy, G(w), bias >= 0 ? G(bias) : nullptr, n, in, out);
  gemm_done(in, out, n, 1);
  weight_gradient_done();
}

namespace {

// y [rows, to] = x [rows, w] with to - w zero columns after each row's; and back.
void pad_columns(Backend& be, CPtr x, Buffer& y, int64_t rows, int64_t w, int64_t to) {
  Buffer zeros;
  resize(zeros, rows * (to - w));
  be.fill_zero(zeros.ptr(), rows * (to - w));
  resize_for_overwrite(y, rows * to);
  be.concat_columns3(x, zeros.ptr(), x, y.ptr(), rows, w, to - w, 0);
}
void unpad_columns(Backend& be, CPtr x, Ptr y, int64_t rows, int64_t w, int64_t from) {
  Buffer rest;
  resize_for_overwrite(rest, rows * (from - w));
  be.split_columns3(x, y, rest.ptr(), y, rows, w, from - w, 0);
}

}  // namespace

void ShardContext::flash_forward(CPtr q, CPtr k, CPtr v, Ptr out, float* lse, int64_t b, int64_t sq,
                                 int64_t sk, int64_t hq, int64_t hk, int64_t vd) {
  const int64_t d = dims.d;
  if (vd == d) {
    be.flash_attention_forward(q, k, v, out, lse, b, sq, sk, hq, hk, d);
    return;
  }
  Buffer vp, op;
  pad_columns(be, v, vp, b * sk * hk, vd, d);
  resize_for_overwrite(op, b * sq * hq * d);
  be.flash_attention_forward(q, k, vp.ptr(), op.ptr(), lse, b, sq, sk, hq, hk, d);
  unpad_columns(be, op.ptr(), out, b * sq * hq, vd, d);
}

void ShardContext::flash_backward(CPtr q, CPtr k, CPtr v, CPtr out, const float* lse, CPtr dout,
                                  Ptr dq, Ptr dk, Ptr dv, int64_t b, int64_t sq, int64_t sk,
                                  int64_t hq, int64_t hk, int64_t vd) {
  const int64_t d = dims.d;
  if (vd == d) {
    be.flash_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, b, sq, sk, hq, hk, d);
    return;
  }
  Buffer vp, op, dop, dvp;
  pad_columns(be, v, vp, b * sk * hk, vd, d);
  pad_columns(be, out, op, b * sq * hq, vd, d);
  pad_columns(be, dout, dop, b * sq * hq, vd, d);
  resize_for_overwrite(dvp, b * sk * hk * d);
  be.flash_attention_backward(q, k, vp.ptr(), op.ptr(), lse, dop.ptr(), dq, dk, dvp.ptr(), b, sq,
                              sk, hq, hk, d);
  unpad_columns(be, dvp.ptr(), dv, b * sk * hk, vd, d);
}

void ShardContext::norm_forward(const Buffer& x, int64_t g, int64_t beta, Buffer& y, Buffer& mean,
                                Buffer& rstd, int64_t n, int64_t width) {
  if (width == 0) width = dims.h;
  // Every element of y, mean and rstd is written by the kernel: no memset before it.
  resize_for_overwrite(y, n * width);
  resize_for_overwrite(rstd, n);
  if (beta >= 0) resize_for_overwrite(mean, n);
  be.norm_forward(x.ptr(), P(g), beta >= 0 ? P(beta) : nullptr, y.ptr(),
                  beta >= 0 ? mean.data() : nullptr, rstd.data(), n, width);
}

void ShardContext::norm_backward(const Buffer& x, int64_t g, int64_t beta, const Buffer& mean,
                                 const Buffer& rstd, const Buffer& dy, Buffer& dx, int64_t n,
                                 int64_t width) {
  if (width == 0) width = dims.h;
  resize_for_overwrite(dx, n * width);  // written, not accumulated
  be.norm_backward(x.ptr(), P(g), beta >= 0, beta >= 0 ? mean.data() : nullptr, rstd.data(),
                   dy.ptr(), dx.ptr(), G(g), beta >= 0 ? G(beta) : nullptr, n, width);
}

void ShardContext::norm_backward_add(const Buffer& x, int64_t g, int64_t beta, const Buffer& mean,
                                     const Buffer& rstd, const Buffer& dy, Buffer& dacc, int64_t n,
                                     int64_t width) {
  if (width == 0) width = dims.h;
  be.norm_backward_add(x.ptr(), P(g), beta >= 0, beta >= 0 ? mean.data() : nullptr, rstd.data(),
                       dy.ptr(), dacc.ptr(), G(g), beta >= 0 ? G(beta) : nullptr, n, width);
}

void ShardContext::residual_add(Buffer& out, const Buffer& residual, const Buffer& partial,
                                int64_t bias) {
  const int64_t n = elems(residual);
  if (&out != &residual && &out != &partial) resize_for_overwrite(out, n);
  be.residual_add(out.ptr(), residual.ptr(), partial.ptr(), bias >= 0 ? CPtr(P(bias)) : CPtr(),
                  n / dims.h, dims.h);
}

void ShardContext::residual_add_backward(const Buffer& dout, Buffer& d_residual, Buffer& d_partial,
                                         int64_t bias) {
  const int64_t n = elems(dout);
  resize_for_overwrite(d_residual, n);
  resize_for_overwrite(d_partial, n);
  be.residual_add_backward(dout.ptr(), d_residual.ptr(), d_partial.ptr(),
                           bias >= 0 ? G(bias) : nullptr, n / dims.h, dims.h);
}

void ShardContext::copy(const Buffer& from, Buffer& to) {
  resize_for_overwrite(to, elems(from));
  be.copy(from.ptr(), to.ptr(), elems(from));
}

}  // namespace ptdp
