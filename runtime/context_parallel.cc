#include "runtime/context_parallel.h"

#include <algorithm>
#include <stdexcept>

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

void context_rope(ShardContext& c, Buffer& x, int64_t heads, bool inverse) {
  const ShardDims& m = c.dims;
  const int64_t width = heads * m.d;
  Buffer full;
  resize(full, m.b * m.s_attn * width);
  c.be.fill_zero(full.ptr(), elems(full));
  context_rows_to_global(c.be, x.ptr(), full.ptr(), m.b, m.s_attn, m.cp, m.cpr, width);
  c.be.rope(full.ptr(), m.b, m.s_attn, heads, m.d, m.rotary_base, inverse);
  context_rows_from_global(c.be, full.ptr(), x.ptr(), m.b, m.s_attn, m.cp, m.cpr, width);
}

namespace {

// Keys seen by each of rank r's two chunks: positions [0, (r + 1) c) and [0, (2 cp - r) c).
int64_t chunk_keys(const ShardDims& m, int64_t chunk) {
  const int64_t c = m.s_attn / (2 * m.cp);
  return (chunk == 0 ? m.cpr + 1 : 2 * m.cp - m.cpr) * c;
}

// A.k and A.v back to this rank's rows.
void keep_local_kv(ShardContext& c, LayerActs& A) {
  const ShardDims& m = c.dims;
  const int64_t width = m.gl * m.d;
  for (Buffer* x : {&A.k, &A.v}) {
    Buffer local;
    resize_for_overwrite(local, m.b * m.s * width);
    context_rows_from_global(c.be, x->ptr(), local.ptr(), m.b, m.s_attn, m.cp, m.cpr, width);
    x->swap(local);
  }
}

}  // namespace

void context_exchange_kv(ShardContext& c, LayerActs& A, PassKind pass) {
  const ShardDims& m = c.dims;
  const int64_t cp = m.cp, r = m.cpr, width = m.gl * m.d;
  const int64_t kv = m.b * m.s * width, n = 2 * kv;  // one block: this rank's K, then its V
  if (elems(A.k) != kv || elems(A.v) != kv)
    throw std::logic_error("context parallelism: K and V are not the local block");
  Buffer blocks;
  resize_for_overwrite(blocks, cp * n);
  c.be.copy(A.k.ptr(), blocks.ptr().at(r * n), kv);
  c.be.copy(A.v.ptr(), blocks.ptr().at(r * n + kv), kv);
  // Ring all-gather: at step i rank r passes on block r - i and receives block r - i - 1.
  const OpId id = pass == PassKind::kBackward ? OpId::kCpKvExchangeBackward : OpId::kCpKvExchange;
  for (int64_t i = 0; i + 1 < cp; ++i) {
    const int64_t send = (r - i + cp) % cp, recv = (r - i - 1 + 2 * cp) % cp;
    c.ring_step(id, blocks.ptr().at(send * n), blocks.ptr().at(recv * n), n, pass);
  }
  Buffer k, v;
  resize_for_overwrite(k, m.b * m.s_attn * width);
  resize_for_overwrite(v, m.b * m.s_attn * width);
  for (int64_t q = 0; q < cp; ++q) {  // every row of k and v is some block's
    context_rows_to_global(c.be, blocks.ptr().at(q * n), k.ptr(), m.b, m.s_attn, cp, q, width);
    context_rows_to_global(c.be, blocks.ptr().at(q * n + kv), v.ptr(), m.b, m.s_attn, cp, q, width);
  }
  A.k.swap(k);
  A.v.swap(v);
}

namespace {

// The buffers of Ulysses' all-to-all of nh heads: cp blocks each way of n = rows x w elements,
// rows = b s / cp (the rank's tokens), w = (nh / cp) d (one heads block of a row).
struct HeadsBlocks {
  int64_t cp, rows, w, n;
  Buffer send, recv;
  HeadsBlocks(const ShardDims& m, int64_t nh)
      : cp(m.cp), rows(m.b * m.s), w(nh / m.cp * m.d), n(rows * w) {
    resize_for_overwrite(send, cp * n);
    resize_for_overwrite(recv, cp * n);
  }
};

// Ulysses (--cp-comm-type a2a): this rank's rows [b, s / cp, nh, d] (local order) become heads
// block cpr of every rank's rows, [b, s, nh / cp, d] in global order: one all-to-all of the
// context-parallel group, recorded as op `id` of pass `pass`.
void to_heads(ShardContext& c, CPtr local, Buffer& full, int64_t nh, OpId id, PassKind pass) {
  const ShardDims& m = c.dims;
  HeadsBlocks x(m, nh);
  // Block j: heads j nh / cp .. of every local row ([rows, cp, w] -> [cp, rows, w], the
  // sequence-parallel reorder of "sequences" of cp pieces).
  c.be.sequence_shard(local, x.send.ptr(), x.cp, x.rows, x.cp, x.w);
  c.context_all_to_all(id, x.send.ptr(), x.recv.ptr(), x.n, pass);
  resize_for_overwrite(full, m.b * m.s_attn * x.w);
  for (int64_t i = 0; i < x.cp; ++i)  // rank i's rows, at their global places
    context_rows_to_global(c.be, x.recv.ptr().at(i * x.n), full.ptr(), m.b, m.s_attn, x.cp, i, x.w);
}

// The inverse: [b, s, nh / cp, d] (global order, heads block cpr) back to this rank's rows
// [b, s / cp, nh, d] of all its heads.
void from_heads(ShardContext& c, CPtr full, Buffer& local, int64_t nh, OpId id, PassKind pass) {
  const ShardDims& m = c.dims;
  HeadsBlocks x(m, nh);
  for (int64_t i = 0; i < x.cp; ++i)  // rank i's rows
    context_rows_from_global(c.be, full, x.send.ptr().at(i * x.n), m.b, m.s_attn, x.cp, i, x.w);
  c.context_all_to_all(id, x.send.ptr(), x.recv.ptr(), x.n, pass);
  resize_for_overwrite(local, x.rows * nh * m.d);
  c.be.sequence_unshard(x.recv.ptr(), local.ptr(), x.cp, x.rows, x.cp, x.w);
}

// Causal attention of the whole sequence for this rank's heads block: Q, K and V in from every
// rank, the output left in A.ctx in the heads layout (context_output_to_local returns it).
void ulysses_forward(ShardContext& c, LayerActs& A) {
  const ShardDims& m = c.dims;
  const PassKind pass = c.pass();
  const int64_t hq = m.hl / m.cp, gq = m.gl / m.cp;
  Buffer q, k, v;
  to_heads(c, A.q.ptr(), q, m.hl, OpId::kCpKvExchange, pass);
  to_heads(c, A.k.ptr(), k, m.gl, OpId::kCpKvExchange, pass);
  to_heads(c, A.v.ptr(), v, m.gl, OpId::kCpKvExchange, pass);
  c.begin(OpId::kAttnScores, pass);
  resize_for_overwrite(A.ctx, m.b * m.s_attn * hq * m.d);
  resize_for_overwrite(A.lse, m.b * hq * m.s_attn);
  c.be.flash_attention_forward(q.ptr(), k.ptr(), v.ptr(), A.ctx.ptr(), A.lse.data(), m.b, m.s_attn,
                               m.s_attn, hq, gq, m.d);
}

// Its backward pass: Q, K, V and the output in again (as kCpKvExchangeBackward), the output's
// gradient (kCpOutAllToAllBackward); D.dq, D.dk and D.dv stay in the heads layout until
// context_return_dkv returns them.
void ulysses_backward(ShardContext& c, LayerActs& A, LayerGrads& D) {
  const ShardDims& m = c.dims;
  const PassKind op_pass = c.pass(), pass = PassKind::kBackward;
  const int64_t hq = m.hl / m.cp, gq = m.gl / m.cp;
  Buffer q, k, v, out, d_out;
  to_heads(c, A.q.ptr(), q, m.hl, OpId::kCpKvExchangeBackward, pass);
  to_heads(c, A.k.ptr(), k, m.gl, OpId::kCpKvExchangeBackward, pass);
  to_heads(c, A.v.ptr(), v, m.gl, OpId::kCpKvExchangeBackward, pass);
  to_heads(c, A.ctx.ptr(), out, m.hl, OpId::kCpKvExchangeBackward, pass);
  to_heads(c, D.d_ctx.ptr(), d_out, m.hl, OpId::kCpOutAllToAllBackward, pass);
  c.begin(OpId::kAttnScoresRecompute, op_pass);  // the kernel's record, as the op began it
  resize_for_overwrite(D.dq, elems(q));
  resize_for_overwrite(D.dk, elems(k));
  resize_for_overwrite(D.dv, elems(v));
  c.be.flash_attention_backward(q.ptr(), k.ptr(), v.ptr(), out.ptr(), A.lse.data(), d_out.ptr(),
                                D.dq.ptr(), D.dk.ptr(), D.dv.ptr(), m.b, m.s_attn, m.s_attn, hq, gq,
                                m.d);
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

void context_attention_forward(ShardContext& c, LayerActs& A) {
  const ShardDims& m = c.dims;
  if (m.cp_a2a) {
    ulysses_forward(c, A);
    return;
  }
  gather_kv_within(c, A, OpId::kAttnScores, c.pass());
  const int64_t chunk = m.s_attn / (2 * m.cp), qrow = m.hl * m.d, krow = m.gl * m.d;
  resize_for_overwrite(A.ctx, m.b * m.s * qrow);
  resize_for_overwrite(A.lse, m.b * m.hl * m.s);
  for (int64_t bi = 0; bi < m.b; ++bi)
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t rows = (bi * m.s + h * chunk) * qrow, keys = bi * m.s_attn * krow;
      c.be.flash_attention_forward(A.q.ptr().at(rows), A.k.ptr().at(keys), A.v.ptr().at(keys),
                                   A.ctx.ptr().at(rows), A.lse.data() + (bi * 2 + h) * m.hl * chunk,
                                   1, chunk, chunk_keys(m, h), m.hl, m.gl, m.d);
    }
  keep_local_kv(c, A);
}

void context_output_to_local(ShardContext& c, LayerActs& A) {
  Buffer local;
  from_heads(c, A.ctx.ptr(), local, c.dims.hl, OpId::kCpOutAllToAll, c.pass());
  A.ctx.swap(local);
}

void context_attention_backward(ShardContext& c, LayerActs& A, LayerGrads& D) {
  const ShardDims& m = c.dims;
  if (m.cp_a2a) {
    ulysses_backward(c, A, D);
    return;
  }
  gather_kv_within(c, A, OpId::kAttnScoresRecompute, PassKind::kBackward);
  const int64_t chunk = m.s_attn / (2 * m.cp), qrow = m.hl * m.d, krow = m.gl * m.d;
  resize_for_overwrite(D.dq, m.b * m.s * qrow);
  resize_for_overwrite(D.dk, m.b * m.s_attn * krow);
  resize_for_overwrite(D.dv, m.b * m.s_attn * krow);
  Buffer dk0, dv0;  // the first chunk's part, added to the second chunk's
  resize_for_overwrite(dk0, chunk_keys(m, 0) * krow);
  resize_for_overwrite(dv0, chunk_keys(m, 0) * krow);
  const int64_t seen = chunk_keys(m, 1);  // the second chunk sees every key the first sees
  for (int64_t bi = 0; bi < m.b; ++bi) {
    const int64_t keys = bi * m.s_attn * krow;
    for (int64_t h = 1; h >= 0; --h) {
      const int64_t rows = (bi * m.s + h * chunk) * qrow;
      c.be.flash_attention_backward(
          A.q.ptr().at(rows), A.k.ptr().at(keys), A.v.ptr().at(keys), A.ctx.ptr().at(rows),
          A.lse.data() + (bi * 2 + h) * m.hl * chunk, D.d_ctx.ptr().at(rows), D.dq.ptr().at(rows),
          h == 1 ? D.dk.ptr().at(keys) : dk0.ptr(), h == 1 ? D.dv.ptr().at(keys) : dv0.ptr(), 1,
          chunk, chunk_keys(m, h), m.hl, m.gl, m.d);
    }
    c.be.add(D.dk.ptr().at(keys), dk0.ptr(), elems(dk0));
    c.be.add(D.dv.ptr().at(keys), dv0.ptr(), elems(dv0));
    const int64_t rest = (m.s_attn - seen) * krow;  // keys after every local query
    if (rest > 0) {
      c.be.fill_zero(D.dk.ptr().at(keys + seen * krow), rest);
      c.be.fill_zero(D.dv.ptr().at(keys + seen * krow), rest);
    }
  }
  keep_local_kv(c, A);
}

void context_return_dkv(ShardContext& c, LayerGrads& D) {
  const ShardDims& m = c.dims;
  if (m.cp_a2a) {  // dQ, dK and dV back to their tokens' ranks, all heads
    for (auto [x, nh] : {std::pair{&D.dq, m.hl}, {&D.dk, m.gl}, {&D.dv, m.gl}}) {
      Buffer local;
      from_heads(c, x->ptr(), local, nh, OpId::kCpKvExchangeBackward, PassKind::kBackward);
      x->swap(local);
    }
    return;
  }
  const int64_t cp = m.cp, r = m.cpr, width = m.gl * m.d;
  const int64_t kv = m.b * m.s * width, n = 2 * kv;
  Buffer part, incoming;
  resize(part, cp * n);
  resize(incoming, n);
  for (int64_t q = 0; q < cp; ++q) {  // this rank's share of every block's dK and dV
    context_rows_from_global(c.be, D.dk.ptr(), part.ptr().at(q * n), m.b, m.s_attn, cp, q, width);
    context_rows_from_global(c.be, D.dv.ptr(), part.ptr().at(q * n + kv), m.b, m.s_attn, cp, q,
                             width);
  }
  // Ring reduce-scatter: at step i rank r passes on its running sum of block r - 1 - i and adds
  // its share to the received block r - 2 - i; after cp - 1 steps block r is whole on rank r.
  for (int64_t i = 0; i + 1 < cp; ++i) {
    const int64_t send = (r - 1 - i + 2 * cp) % cp, recv = (r - 2 - i + 3 * cp) % cp;
    c.ring_step(OpId::kCpKvExchangeBackward, part.ptr().at(send * n), incoming.ptr(), n,
                PassKind::kBackward);
    c.be.add(part.ptr().at(recv * n), incoming.ptr(), n);
  }
  release(D.dk);  // the whole sequence's: the scratch keeps only the local block's capacity
  release(D.dv);
  resize_for_overwrite(D.dk, kv);
  resize_for_overwrite(D.dv, kv);
  c.be.copy(part.ptr().at(r * n), D.dk.ptr(), kv);
  c.be.copy(part.ptr().at(r * n + kv), D.dv.ptr(), kv);
}

}  // namespace ptdp
