#include "runtime/context_parallel.h"

#include <algorithm>
#include <stdexcept>
#include <tuple>
#include <utility>

namespace ptdp {

std::vector<PositionRun> context_runs(int64_t s, int64_t cp, int64_t r, int64_t begin,
                                      int64_t len) {
  if (cp == 1) return {{begin, begin, len}};
  const int64_t c = s / (2 * cp);
  const int64_t starts[2] = {r * c, (2 * cp - 1 - r) * c};  // chunks r and 2 cp - 1 - r
  std::vector<PositionRun> runs;
  for (int64_t k = 0; k < 2; ++k) {
    const int64_t lo = std::max(begin, k * c), hi = std::min(begin + len, (k + 1) * c);
    if (lo >= hi) continue;
    const int64_t g = starts[k] + lo - k * c;
    if (!runs.empty() && runs.back().global + runs.back().len == g)
      runs.back().len += hi - lo;  // chunks r and r + 1 meet in the middle (r = cp - 1)
    else
      runs.push_back({lo, g, hi - lo});
  }
  return runs;
}

void context_token_window(const int32_t* sequences, int32_t* out, int64_t b, int64_t s, int64_t cp,
                          int64_t r, int64_t shift) {
  const int64_t sl = s / cp;
  for (int64_t bi = 0; bi < b; ++bi)
    for (const PositionRun& run : context_runs(s, cp, r, 0, sl))
      std::copy_n(sequences + bi * (s + 1) + shift + run.global, run.len,
                  out + bi * sl + run.local);
}

void context_rows_to_global(Backend& be, CPtr local, Ptr full, int64_t b, int64_t s, int64_t cp,
                            int64_t r, int64_t width) {
  const int64_t sl = s / cp;
  for (int64_t bi = 0; bi < b; ++bi)
    for (const PositionRun& run : context_runs(s, cp, r, 0, sl))
      be.copy(local.at((bi * sl + run.local) * width), full.at((bi * s + run.global) * width),
              run.len * width);
}

void context_rows_from_global(Backend& be, CPtr full, Ptr local, int64_t b, int64_t s, int64_t cp,
                              int64_t r, int64_t width) {
  const int64_t sl = s / cp;
  for (int64_t bi = 0; bi < b; ++bi)
    for (const PositionRun& run : context_runs(s, cp, r, 0, sl))
      be.copy(full.at((bi * s + run.global) * width), local.at((bi * sl + run.local) * width),
              run.len * width);
}

void context_positions(ShardContext& c, Ptr x, int64_t table, int64_t sl, int64_t first,
                       bool grad) {
  const ShardDims& m = c.dims;
  if (m.cp == 1) {
    if (grad)
      c.be.position_grad(x, c.G(table), m.b, sl, m.h, first);
    else
      c.be.add_positions(x, c.P(table), m.b, sl, m.h, first);
    return;
  }
  for (int64_t bi = 0; bi < m.b; ++bi)
    for (const PositionRun& run : context_runs(m.s_attn, m.cp, m.cpr, first, sl)) {
      const Ptr rows = x.at((bi * sl + run.local - first) * m.h);
      if (grad)
        c.be.position_grad(rows, c.G(table), 1, run.len, m.h, run.global);
      else
        c.be.add_positions(rows, c.P(table), 1, run.len, m.h, run.global);
    }
}

void context_rope(ShardContext& c, Buffer& x, int64_t heads, int64_t d, bool inverse) {
  const ShardDims& m = c.dims;
  const int64_t width = heads * d;
  Buffer full;
  resize(full, m.b * m.s_attn * width);
  c.be.fill_zero(full.ptr(), elems(full));
  context_rows_to_global(c.be, x.ptr(), full.ptr(), m.b, m.s_attn, m.cp, m.cpr, width);
  c.be.rope(full.ptr(), m.b, m.s_attn, heads, d, m.rotary_base, inverse);
  context_rows_from_global(c.be, full.ptr(), x.ptr(), m.b, m.s_attn, m.cp, m.cpr, width);
}

namespace {

// The ring of K and V blocks: its ranks and this rank's place (the whole context-parallel group,
// or with a2a+p2p the cp / A groups of A ranks, this rank's the cpr / A-th), the tokens of each
// sequence a rank holds in it (causally balanced over the ring's ranks: s / cp, or with a2a+p2p
// its group's s A / cp), and the query and K/V heads (hl and gl, or hl / A and gl / A after the
// heads all-to-all).
struct Ring {
  int64_t n, r, rows, hq, gq;
};

Ring ring_of(const ShardDims& m) {
  const int64_t a = m.cp_a2a_size, n = m.cp / a;
  return {n, m.cpr / a, m.s_attn / n, m.hl / a, m.gl / a};
}

// Keys seen by each of ring rank r's two chunks: positions [0, (r + 1) c) and [0, (2 n - r) c).
int64_t chunk_keys(const ShardDims& m, const Ring& g, int64_t chunk) {
  const int64_t c = m.s_attn / (2 * g.n);
  return (chunk == 0 ? g.r + 1 : 2 * g.n - g.r) * c;
}

// Ring all-gather: k and v (this ring rank's rows [b, g.rows, gq d] and [b, g.rows, gq dv])
// become the whole sequence's ([b, s, gq d], [b, s, gq dv], global order), as g.n - 1 steps of
// op `id` of pass `pass`.
void ring_gather(ShardContext& c, const Ring& g, Buffer& k, Buffer& v, OpId id, PassKind pass) {
  const ShardDims& m = c.dims;
  const int64_t kw = g.gq * m.d, vw = g.gq * m.dv;
  const int64_t kn = m.b * g.rows * kw, vn = m.b * g.rows * vw, n = kn + vn;
  if (elems(k) != kn || elems(v) != vn)
    throw std::logic_error("context parallelism: K and V are not the local block");
  Buffer blocks;
  resize_for_overwrite(blocks, g.n * n);
  c.be.copy(k.ptr(), blocks.ptr().at(g.r * n), kn);
  c.be.copy(v.ptr(), blocks.ptr().at(g.r * n + kn), vn);
  // At step i rank r passes on block r - i and receives block r - i - 1.
  for (int64_t i = 0; i + 1 < g.n; ++i) {
    const int64_t send = (g.r - i + g.n) % g.n, recv = (g.r - i - 1 + 2 * g.n) % g.n;
    c.ring_step(id, blocks.ptr().at(send * n), blocks.ptr().at(recv * n), n, pass);
  }
  Buffer kf, vf;
  resize_for_overwrite(kf, m.b * m.s_attn * kw);
  resize_for_overwrite(vf, m.b * m.s_attn * vw);
  for (int64_t q = 0; q < g.n; ++q) {  // every row of kf and vf is some block's
    context_rows_to_global(c.be, blocks.ptr().at(q * n), kf.ptr(), m.b, m.s_attn, g.n, q, kw);
    context_rows_to_global(c.be, blocks.ptr().at(q * n + kn), vf.ptr(), m.b, m.s_attn, g.n, q, vw);
  }
  k.swap(kf);
  v.swap(vf);
}

// k and v of the whole sequence back to this ring rank's rows.
void keep_ring_rows(ShardContext& c, const Ring& g, Buffer& k, Buffer& v) {
  const ShardDims& m = c.dims;
  for (auto [x, width] : {std::pair{&k, g.gq * m.d}, {&v, g.gq * m.dv}}) {
    Buffer local;
    resize_for_overwrite(local, m.b * g.rows * width);
    context_rows_from_global(c.be, x->ptr(), local.ptr(), m.b, m.s_attn, g.n, g.r, width);
    x->swap(local);
  }
}

// The causal attention of this ring rank's queries q ([b, g.rows, hq d], two chunks per
// sequence) over the whole sequence's k and v: two flash calls per sequence, each chunk's
// queries the last of the keys it sees. ctx [b, g.rows, hq dv]; lse [b][2][hq][chunk].
void ring_attention_forward(ShardContext& c, const Ring& g, CPtr q, CPtr k, CPtr v, Buffer& ctx,
                            Buffer& lse) {
  const ShardDims& m = c.dims;
  const int64_t chunk = g.rows / 2, qrow = g.hq * m.d, krow = g.gq * m.d;
  const int64_t vrow = g.gq * m.dv, orow = g.hq * m.dv;
  resize_for_overwrite(ctx, m.b * g.rows * orow);
  resize_for_overwrite(lse, m.b * g.hq * g.rows);
  for (int64_t bi = 0; bi < m.b; ++bi)
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t rows = bi * g.rows + h * chunk, keys = bi * m.s_attn;
      c.flash_forward(q.at(rows * qrow), k.at(keys * krow), v.at(keys * vrow),
                      ctx.ptr().at(rows * orow), lse.data() + (bi * 2 + h) * g.hq * chunk, 1, chunk,
                      chunk_keys(m, g, h), g.hq, g.gq, m.dv);
    }
}

// Its backward pass: dq like q, dk and dv of the whole sequence (this rank's queries' part;
// zero after the last key they see).
void ring_attention_backward(ShardContext& c, const Ring& g, CPtr q, CPtr k, CPtr v, CPtr out,
                             const Buffer& lse, CPtr d_out, Buffer& dq, Buffer& dk, Buffer& dv) {
  const ShardDims& m = c.dims;
  const int64_t chunk = g.rows / 2, qrow = g.hq * m.d, krow = g.gq * m.d;
  const int64_t vrow = g.gq * m.dv, orow = g.hq * m.dv;
  resize_for_overwrite(dq, m.b * g.rows * qrow);
  resize_for_overwrite(dk, m.b * m.s_attn * krow);
  resize_for_overwrite(dv, m.b * m.s_attn * vrow);
  Buffer dk0, dv0;  // the first chunk's part, added to the second chunk's
  resize_for_overwrite(dk0, chunk_keys(m, g, 0) * krow);
  resize_for_overwrite(dv0, chunk_keys(m, g, 0) * vrow);
  const int64_t seen = chunk_keys(m, g, 1);  // the second chunk sees every key the first sees
  for (int64_t bi = 0; bi < m.b; ++bi) {
    const int64_t keys = bi * m.s_attn;
    for (int64_t h = 1; h >= 0; --h) {
      const int64_t rows = bi * g.rows + h * chunk;
      c.flash_backward(q.at(rows * qrow), k.at(keys * krow), v.at(keys * vrow), out.at(rows * orow),
                       lse.data() + (bi * 2 + h) * g.hq * chunk, d_out.at(rows * orow),
                       dq.ptr().at(rows * qrow), h == 1 ? dk.ptr().at(keys * krow) : dk0.ptr(),
                       h == 1 ? dv.ptr().at(keys * vrow) : dv0.ptr(), 1, chunk, chunk_keys(m, g, h),
                       g.hq, g.gq, m.dv);
    }
    c.be.add(dk.ptr().at(keys * krow), dk0.ptr(), elems(dk0));
    c.be.add(dv.ptr().at(keys * vrow), dv0.ptr(), elems(dv0));
    const int64_t rest = m.s_attn - seen;  // keys after every local query
    if (rest > 0) {
      c.be.fill_zero(dk.ptr().at((keys + seen) * krow), rest * krow);
      c.be.fill_zero(dv.ptr().at((keys + seen) * vrow), rest * vrow);
    }
  }
}

// Ring reduce-scatter: dk and dv of the whole sequence (this rank's queries' part) are summed
// over the ring into each block's owner and become this ring rank's rows.
void ring_return(ShardContext& c, const Ring& g, Buffer& dk, Buffer& dv) {
  const ShardDims& m = c.dims;
  const int64_t kw = g.gq * m.d, vw = g.gq * m.dv;
  const int64_t kn = m.b * g.rows * kw, vn = m.b * g.rows * vw, n = kn + vn;
  Buffer part, incoming;
  resize(part, g.n * n);
  resize(incoming, n);
  for (int64_t q = 0; q < g.n; ++q) {  // this rank's share of every block's dK and dV
    context_rows_from_global(c.be, dk.ptr(), part.ptr().at(q * n), m.b, m.s_attn, g.n, q, kw);
    context_rows_from_global(c.be, dv.ptr(), part.ptr().at(q * n + kn), m.b, m.s_attn, g.n, q, vw);
  }
  // At step i rank r passes on its running sum of block r - 1 - i and adds its share to the
  // received block r - 2 - i; after n - 1 steps block r is whole on rank r.
  for (int64_t i = 0; i + 1 < g.n; ++i) {
    const int64_t send = (g.r - 1 - i + 2 * g.n) % g.n, recv = (g.r - 2 - i + 3 * g.n) % g.n;
    c.ring_step(OpId::kCpKvExchangeBackward, part.ptr().at(send * n), incoming.ptr(), n,
                PassKind::kBackward);
    c.be.add(part.ptr().at(recv * n), incoming.ptr(), n);
  }
  release(dk);  // the whole sequence's: the scratch keeps only the local block's capacity
  release(dv);
  resize_for_overwrite(dk, kn);
  resize_for_overwrite(dv, vn);
  c.be.copy(part.ptr().at(g.r * n), dk.ptr(), kn);
  c.be.copy(part.ptr().at(g.r * n + kn), dv.ptr(), vn);
}

// Where the token at global position `pos` (one of ring rank g.r's) sits among its rows.
int64_t ring_row(const ShardDims& m, const Ring& g, int64_t pos) {
  if (g.n == 1) return pos;
  const int64_t c = m.s_attn / (2 * g.n);
  return pos < (g.r + 1) * c ? pos - g.r * c : c + pos - (2 * g.n - 1 - g.r) * c;
}

// Rows [b, s / cp, w] of context-parallel rank q (its local order; a member of this rank's heads
// group) to their places among this ring rank's rows [b, g.rows, w] (to_ring), or back. A run of
// q's positions lies in one of the ring rank's chunks, or in both where they meet, contiguous.
void member_rows(ShardContext& c, const Ring& g, int64_t q, CPtr from, Ptr to, int64_t w,
                 bool to_ring) {
  const ShardDims& m = c.dims;
  for (int64_t bi = 0; bi < m.b; ++bi)
    for (const PositionRun& run : context_runs(m.s_attn, m.cp, q, 0, m.s)) {
      const int64_t member = (bi * m.s + run.local) * w;
      const int64_t ring = (bi * g.rows + ring_row(m, g, run.global)) * w;
      c.be.copy(from.at(to_ring ? member : ring), to.at(to_ring ? ring : member), run.len * w);
    }
}

// The buffers of a heads all-to-all of nh heads of d channels: A blocks each way of n = rows x w
// elements, rows = b s / cp (the rank's tokens), w = (nh / A) d (one heads block of a row).
struct HeadsBlocks {
  int64_t a, rows, w, n;
  Buffer send, recv;
  HeadsBlocks(const ShardDims& m, int64_t nh, int64_t d)
      : a(m.cp_a2a_size), rows(m.b * m.s), w(nh / m.cp_a2a_size * d), n(rows * w) {
    resize_for_overwrite(send, a * n);
    resize_for_overwrite(recv, a * n);
  }
};

// The heads all-to-all (Ulysses' over the cp group, a2a+p2p's over the A adjacent ranks of this
// rank's group): this rank's rows [b, s / cp, nh, d] (local order) become heads block cpr % A
// of its group's rows, [b, g.rows, nh / A, d] in the ring rank's order (global order when there
// is no ring): one all-to-all, recorded as op `id` of pass `pass`.
void to_heads(ShardContext& c, CPtr local, Buffer& out, int64_t nh, int64_t d, OpId id,
              PassKind pass) {
  const ShardDims& m = c.dims;
  const Ring g = ring_of(m);
  HeadsBlocks x(m, nh, d);
  // Block j: heads j nh / A .. of every local row ([rows, A, w] -> [A, rows, w], the
  // sequence-parallel reorder of "sequences" of A pieces).
  c.be.sequence_shard(local, x.send.ptr(), x.a, x.rows, x.a, x.w);
  c.context_all_to_all(id, x.send.ptr(), x.recv.ptr(), x.n, pass);
  resize_for_overwrite(out, m.b * g.rows * x.w);
  const int64_t first = m.cpr - m.cpr % x.a;  // the group's first context-parallel rank
  for (int64_t j = 0; j < x.a; ++j)
    member_rows(c, g, first + j, x.recv.ptr().at(j * x.n), out.ptr(), x.w, true);
}

// The inverse: [b, g.rows, nh / A, d] (the ring rank's order, heads block cpr % A) back to this
// rank's rows [b, s / cp, nh, d] of all its heads.
void from_heads(ShardContext& c, CPtr in, Buffer& local, int64_t nh, int64_t d, OpId id,
                PassKind pass) {
  const ShardDims& m = c.dims;
  const Ring g = ring_of(m);
  HeadsBlocks x(m, nh, d);
  const int64_t first = m.cpr - m.cpr % x.a;
  for (int64_t j = 0; j < x.a; ++j)  // member j's rows
    member_rows(c, g, first + j, in, x.send.ptr().at(j * x.n), x.w, false);
  c.context_all_to_all(id, x.send.ptr(), x.recv.ptr(), x.n, pass);
  resize_for_overwrite(local, x.rows * nh * d);
  c.be.sequence_unshard(x.recv.ptr(), local.ptr(), x.a, x.rows, x.a, x.w);
}

// With a heads all-to-all (Ulysses, a2a+p2p): Q, K and V in from the group's ranks, K and V
// round the ring of groups (if any), the causal attention of the group's tokens for this rank's
// heads block; the output stays in A.ctx in that layout (context_output_to_local returns it).
// The moved Q, K and V stay in A.q_heads, A.k_heads and A.v_heads (K and V back to the group's
// rows after the ring) for the backward pass, and the rank's own are dropped unless a selective
// recomputation of the attention core will move them again.
void heads_forward(ShardContext& c, LayerActs& A) {
  const ShardDims& m = c.dims;
  const Ring g = ring_of(m);
  const PassKind pass = c.pass();
  to_heads(c, A.q.ptr(), A.q_heads, m.hl, m.d, OpId::kCpKvExchange, pass);
  to_heads(c, A.k.ptr(), A.k_heads, m.gl, m.d, OpId::kCpKvExchange, pass);
  to_heads(c, A.v.ptr(), A.v_heads, m.gl, m.dv, OpId::kCpKvExchange, pass);
  if (!(A.rerun_attention && pass == PassKind::kForward))
    for (Buffer* x : {&A.q, &A.k, &A.v}) release(*x);
  if (g.n > 1) ring_gather(c, g, A.k_heads, A.v_heads, OpId::kCpKvExchange, pass);
  c.begin(OpId::kAttnScores, pass);
  if (g.n > 1) {
    ring_attention_forward(c, g, A.q_heads.ptr(), A.k_heads.ptr(), A.v_heads.ptr(), A.ctx, A.lse);
    keep_ring_rows(c, g, A.k_heads, A.v_heads);
    return;
  }
  resize_for_overwrite(A.ctx, m.b * m.s_attn * g.hq * m.dv);
  resize_for_overwrite(A.lse, m.b * g.hq * m.s_attn);
  c.flash_forward(A.q_heads.ptr(), A.k_heads.ptr(), A.v_heads.ptr(), A.ctx.ptr(), A.lse.data(), m.b,
                  m.s_attn, m.s_attn, g.hq, g.gq, m.dv);
}

// Its backward pass, from what the forward pass (or its recomputation) kept: the output's
// gradient in (kCpOutAllToAllBackward), K and V round the ring again (a2a+p2p); D.dq (the
// group's tokens) and D.dk, D.dv (the whole sequence's with a ring, else the group's) stay in the
// heads layout until context_return_dkv returns them. Only gradients cross the all-to-alls, as
// with Transformer Engine and as the op list prices.
void heads_backward(ShardContext& c, LayerActs& A, LayerGrads& D) {
  const ShardDims& m = c.dims;
  const Ring g = ring_of(m);
  const PassKind op_pass = c.pass(), pass = PassKind::kBackward;
  if (A.q_heads.empty() || A.ctx_heads.empty())
    throw std::logic_error("context parallelism: the attention's moved inputs were not kept");
  Buffer d_out;
  to_heads(c, D.d_ctx.ptr(), d_out, m.hl, m.dv, OpId::kCpOutAllToAllBackward, pass);
  if (g.n > 1) ring_gather(c, g, A.k_heads, A.v_heads, OpId::kCpKvExchangeBackward, pass);
  c.begin(OpId::kAttnScoresRecompute, op_pass);  // the kernel's record, as the op began it
  if (g.n > 1) {
    ring_attention_backward(c, g, A.q_heads.ptr(), A.k_heads.ptr(), A.v_heads.ptr(),
                            A.ctx_heads.ptr(), A.lse, d_out.ptr(), D.dq, D.dk, D.dv);
  } else {
    resize_for_overwrite(D.dq, elems(A.q_heads));
    resize_for_overwrite(D.dk, elems(A.k_heads));
    resize_for_overwrite(D.dv, elems(A.v_heads));
    c.flash_backward(A.q_heads.ptr(), A.k_heads.ptr(), A.v_heads.ptr(), A.ctx_heads.ptr(),
                     A.lse.data(), d_out.ptr(), D.dq.ptr(), D.dk.ptr(), D.dv.ptr(), m.b, m.s_attn,
                     m.s_attn, g.hq, g.gq, m.dv);
  }
  // (A.q, A.k and A.v, where mla_up_proj's recomputation made them again, have no reader left.)
  for (Buffer* x : {&A.q_heads, &A.k_heads, &A.v_heads, &A.ctx_heads, &A.q, &A.k, &A.v})
    release(*x);
}

// Whether A.k and A.v hold the whole sequence.
bool kv_gathered(const ShardContext& c, const LayerActs& A) {
  const ShardDims& m = c.dims;
  return elems(A.k) == m.b * m.s_attn * m.gl * m.d;
}

// Inside op `op`: K and V round the ring (as pass `ring`'s exchanges) unless they are whole
// already, then op's record goes on in its own pass.
void gather_kv_within(ShardContext& c, LayerActs& A, OpId op, PassKind ring) {
  if (kv_gathered(c, A)) return;
  const PassKind pass = c.pass();
  context_exchange_kv(c, A, ring);
  c.begin(op, pass);
}

}  // namespace

void context_exchange_kv(ShardContext& c, LayerActs& A, PassKind pass) {
  const OpId id = pass == PassKind::kBackward ? OpId::kCpKvExchangeBackward : OpId::kCpKvExchange;
  ring_gather(c, ring_of(c.dims), A.k, A.v, id, pass);
}

void context_attention_forward(ShardContext& c, LayerActs& A) {
  if (c.dims.cp_a2a_size > 1) {
    heads_forward(c, A);
    return;
  }
  const Ring g = ring_of(c.dims);
  gather_kv_within(c, A, OpId::kAttnScores, c.pass());
  ring_attention_forward(c, g, A.q.ptr(), A.k.ptr(), A.v.ptr(), A.ctx, A.lse);
  keep_ring_rows(c, g, A.k, A.v);
}

void context_output_to_local(ShardContext& c, LayerActs& A) {
  A.ctx_heads.swap(A.ctx);  // kept for the backward pass
  from_heads(c, A.ctx_heads.ptr(), A.ctx, c.dims.hl, c.dims.dv, OpId::kCpOutAllToAll, c.pass());
}

void context_attention_backward(ShardContext& c, LayerActs& A, LayerGrads& D) {
  if (c.dims.cp_a2a_size > 1) {
    heads_backward(c, A, D);
    return;
  }
  const Ring g = ring_of(c.dims);
  gather_kv_within(c, A, OpId::kAttnScoresRecompute, PassKind::kBackward);
  ring_attention_backward(c, g, A.q.ptr(), A.k.ptr(), A.v.ptr(), A.ctx.ptr(), A.lse, D.d_ctx.ptr(),
                          D.dq, D.dk, D.dv);
  keep_ring_rows(c, g, A.k, A.v);
}

void context_return_dkv(ShardContext& c, LayerGrads& D) {
  const ShardDims& m = c.dims;
  const Ring g = ring_of(m);
  if (g.n > 1) ring_return(c, g, D.dk, D.dv);
  if (m.cp_a2a_size == 1) return;
  // dQ, dK and dV back to their tokens' ranks, all heads
  for (auto [x, nh, d] : {std::tuple{&D.dq, m.hl, m.d}, {&D.dk, m.gl, m.d}, {&D.dv, m.gl, m.dv}}) {
    Buffer local;
    from_heads(c, x->ptr(), local, nh, d, OpId::kCpKvExchangeBackward, PassKind::kBackward);
    x->swap(local);
  }
}

}  // namespace ptdp
