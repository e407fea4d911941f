#include "runtime/moe_layer.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "core/error.h"
#include "kernels/cpu/moe.h"

namespace ptdp {
namespace {

using Counts = std::vector<int64_t>;

// Of an A x B matrix of row counts (a-major): the sum of each row a, of each column b, and the
// B x A transpose.
Counts row_sums(const Counts& m, int64_t A, int64_t B) {
  Counts s(static_cast<size_t>(A), 0);
  for (int64_t a = 0; a < A; ++a)
    for (int64_t b = 0; b < B; ++b) s[static_cast<size_t>(a)] += m[static_cast<size_t>(a * B + b)];
  return s;
}
Counts col_sums(const Counts& m, int64_t A, int64_t B) {
  Counts s(static_cast<size_t>(B), 0);
  for (int64_t a = 0; a < A; ++a)
    for (int64_t b = 0; b < B; ++b) s[static_cast<size_t>(b)] += m[static_cast<size_t>(a * B + b)];
  return s;
}
Counts transposed(const Counts& m, int64_t A, int64_t B) {
  Counts t(m.size());
  for (int64_t a = 0; a < A; ++a)
    for (int64_t b = 0; b < B; ++b)
      t[static_cast<size_t>(b * A + a)] = m[static_cast<size_t>(a * B + b)];
  return t;
}
int64_t total(const Counts& c) {
  return std::accumulate(c.begin(), c.end(), int64_t{0});
}

std::vector<size_t> elements(const Counts& rows, int64_t width) {
  std::vector<size_t> n(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) n[i] = static_cast<size_t>(rows[i] * width);
  return n;
}

// `per_peer` counts to every rank of comm (the same block to each when `same`, else block r to
// rank r); returns what each rank sent this one, rank-major.
Counts exchange_counts(Communicator& comm, const Counts& mine, int64_t per_peer, bool same) {
  const auto n = static_cast<size_t>(comm.size());
  Counts send;
  for (size_t r = 0; r < n; ++r)
    send.insert(send.end(), mine.begin() + (same ? 0 : static_cast<int64_t>(r) * per_peer),
                mine.begin() + (same ? 0 : static_cast<int64_t>(r) * per_peer) + per_peer);
  Counts recv(n * static_cast<size_t>(per_peer));
  const std::vector<size_t> c(n, static_cast<size_t>(per_peer));
  comm.all_to_all_v(send.data(), c, recv.data(), c, DType::kI64);
  return recv;
}

// Rows of width h: send_rows[r] consecutive rows of `in` to rank r; out gets recv_rows[r] from r.
// Of the routed type, as `out` is.
void exchange_rows(Communicator& comm, CPtr in, const Counts& send_rows, Buffer& out,
                   const Counts& recv_rows, int64_t h) {
  resize_for_overwrite(out, total(recv_rows) * h);  // every row arrives
  if (out.dtype() != in.t) throw std::logic_error("MoE rows exchanged into another type");
  comm.all_to_all_v(in.p, elements(send_rows, h), out.raw(), elements(recv_rows, h), in.t);
}

// Rows held as blocks (a, b) a-major, `rows` each, in b-major order.
Buffer transpose(Backend& be, const Buffer& in, const Counts& rows, int64_t A, int64_t B,
                 int64_t h) {
  Buffer out(in.dtype());
  resize_for_overwrite(out, total(rows) * h);  // every row gathered
  std::vector<int64_t> index(static_cast<size_t>(total(rows)));
  kernels::transpose_blocks_index(rows.data(), A, B, index.data());
  be.gather_rows(in.ptr(), index.data(), nullptr, out.ptr(), total(rows), h);
  return out;
}

// Rows of this rank's local experts (expert-major, `mine` per expert) gathered from every
// expert-tensor rank (`gathered`: [etp source][local expert]), expert-major again.
void etp_gather(ShardContext& c, MoeContext& mc, const Buffer& in, const Counts& mine,
                const Counts& gathered, Buffer& out) {
  const MoeDims& d = mc.dims();
  const int64_t h = c.dims.h, n = total(mine);
  Buffer repeated(in.dtype());
  resize_for_overwrite(repeated, d.etp * n * h);
  for (int64_t r = 0; r < d.etp; ++r) c.be.copy(in.ptr(), repeated.ptr().at(r * n * h), n * h);
  Buffer got(in.dtype());
  exchange_rows(mc.etp(), repeated.ptr(), Counts(static_cast<size_t>(d.etp), n), got,
                row_sums(gathered, d.etp, d.local_experts), h);
  out = transpose(c.be, got, gathered, d.etp, d.local_experts, h);
  c.collective_done(Collective::kAllGather, static_cast<double>(out.bytes()),
                    CommGroup::kExpertTensor);
}

// The inverse: each expert-tensor rank's rows back to it, the partial sums added.
void etp_reduce_scatter(ShardContext& c, MoeContext& mc, const Buffer& in, const Counts& mine,
                        const Counts& gathered, Buffer& out) {
  const MoeDims& d = mc.dims();
  const int64_t h = c.dims.h, n = total(mine);
  const Buffer by_source =
      transpose(c.be, in, transposed(gathered, d.etp, d.local_experts), d.local_experts, d.etp, h);
  Buffer got(in.dtype());
  exchange_rows(mc.etp(), by_source.ptr(), row_sums(gathered, d.etp, d.local_experts), got,
                Counts(static_cast<size_t>(d.etp), n), h);
  resize(out, n * h);
  c.be.copy(got.ptr(), out.ptr(), n * h);
  for (int64_t r = 1; r < d.etp; ++r) c.be.add(out.ptr(), got.ptr().at(r * n * h), n * h);
  c.collective_done(Collective::kReduceScatter, static_cast<double>(in.bytes()),
                    CommGroup::kExpertTensor);
}

// Bytes of `rows` routed rows of width h in `b`'s type (what an all-to-all moves).
double row_bytes(const Buffer& b, int64_t rows, int64_t h) {
  return static_cast<double>(rows * h * static_cast<int64_t>(dtype_bytes(b.dtype())));
}

// Rows in permuted order (this rank's tokens, grouped by expert) to the experts' ranks; arrive
// expert-major ([local expert][ep source]).
void to_experts(ShardContext& c, MoeContext& mc, const Buffer& in, const MoeActs& A, Buffer& out) {
  const MoeDims& d = mc.dims();
  const int64_t h = c.dims.h;
  Buffer got(in.dtype());
  exchange_rows(mc.ep(), in.ptr(), row_sums(A.counts, d.ep, d.local_experts), got,
                row_sums(A.recv, d.ep, d.local_experts), h);
  out = transpose(c.be, got, A.recv, d.ep, d.local_experts, h);
  c.collective_done(Collective::kAllToAll, row_bytes(in, A.rows, h), CommGroup::kExpert);
}

// The inverse: expert-major rows back to the ranks of their tokens, in permuted order.
void from_experts(ShardContext& c, MoeContext& mc, const Buffer& in, const MoeActs& A,
                  Buffer& out) {
  const MoeDims& d = mc.dims();
  const int64_t h = c.dims.h;
  const Buffer by_source =
      transpose(c.be, in, transposed(A.recv, d.ep, d.local_experts), d.local_experts, d.ep, h);
  exchange_rows(mc.ep(), by_source.ptr(), row_sums(A.recv, d.ep, d.local_experts), out,
                row_sums(A.counts, d.ep, d.local_experts), h);
  c.collective_done(Collective::kAllToAll, row_bytes(in, A.rows, h), CommGroup::kExpert);
}

Counts local_rows(const MoeDims& d, const MoeActs& A) {  // per local expert, after the dispatch
  return col_sums(A.recv, d.ep, d.local_experts);
}
Counts expert_rows(const MoeDims& d, const MoeActs& A) {  // per local expert, what it computes
  return d.etp > 1 ? col_sums(A.gathered, d.etp, d.local_experts) : local_rows(d, A);
}

// An op's input that no later op reads: freed, unless the caller keeps the inputs.
void consumed(const MoeActs& A, Buffer& b) {
  if (!A.keep_inputs) release(b);
}

// A grouped GEMM's rows per expert as the op list records it (core/layer_ops.cc): the rows the
// rank's experts compute over its experts, rounded up (the op list's at a balanced routing);
// the trace records the grouped GEMM as that many GEMMs of the mean row count, in the batch.
int64_t mean_rows(const MoeDims& d, const MoeActs& A, int64_t h) {
  return (elems(A.x) / h + d.local_experts - 1) / d.local_experts;
}

Ptr at(Buffer& b, int64_t row, int64_t width) {
  return b.ptr().at(row * width);
}
// An optional parameter (a bias; -1 when absent) and its gradient.
Ptr opt(ShardContext& c, int64_t off) {
  return off < 0 ? Ptr() : c.P(off);
}
float* opt_grad(ShardContext& c, int64_t off) {
  return off < 0 ? nullptr : c.G(off);
}

// The layer's input (or output gradient) in the routed type t: x itself, or a converted copy in
// `converted`.
CPtr as_type(ShardContext& c, const Buffer& x, DType t, Buffer& converted) {
  if (x.dtype() == t) return x.ptr();
  converted = Buffer(t);
  resize_for_overwrite(converted, elems(x));
  c.be.copy(x.ptr(), converted.ptr(), elems(x));
  return converted.ptr();
}

// Runs `fill` on [count] elements of the routed type `routed` holding y (when `accumulate`;
// zeros otherwise): y itself when it has that type, else a converted copy stored back. A fresh
// y takes `type`.
template <class F>
void into(ShardContext& c, Buffer& y, bool accumulate, int64_t count, DType type, DType routed,
          F fill) {
  if (!accumulate) {
    y = Buffer(type);
    resize(y, count);
  }
  if (y.dtype() == routed) {
    fill(y.ptr());
    return;
  }
  Buffer rows(static_cast<size_t>(count), routed);
  if (accumulate) c.be.copy(y.ptr(), rows.ptr(), count);
  fill(rows.ptr());
  c.be.copy(rows.ptr(), y.ptr(), count);
}

// Calls f(local expert, first row, rows) for each local expert with rows.
template <class F>
void per_expert(const Counts& rows, F f) {
  int64_t first = 0;
  for (size_t e = 0; e < rows.size(); ++e) {
    if (rows[e] > 0) f(e, first, rows[e]);
    first += rows[e];
  }
}

}  // namespace

DType moe_routed_type(DType model) {
  return model == DType::kBF16 ? DType::kBF16 : DType::kF32;
}

int64_t MoeDims::fc1_width() const {
  return ffe * (fc1_gated ? 2 : 1);
}

MoeDims moe_dims(const ModelSpec& m, int64_t t, int64_t ep, int64_t ep_rank, int64_t etp,
                 int64_t etp_rank) {
  MoeDims d;
  d.experts = m.num_experts;
  d.local_experts = m.num_experts / ep;
  d.topk = m.moe_router_topk;
  d.ffe = m.moe_ffn_hidden() / etp;
  d.fc1_gated = m.swiglu;
  d.ep = ep;
  d.ep_rank = ep_rank;
  d.etp = etp;
  d.etp_rank = etp_rank;
  d.capacity_factor = m.moe_capacity_factor;
  d.drop_by_position = m.moe_drop_by_position;
  d.shared = m.moe_shared_expert_ffn_size > 0;
  d.shared_ffl = m.moe_shared_expert_ffn_size / t;
  return d;
}

MoeContext::MoeContext(const ModelSpec&, const MoeDims& dims) : dims_(dims) {
  own_ep_ = make_self_communicator();
  own_etp_ = make_self_communicator();
  if (dims_.ep == 1) ep_ = own_ep_.get();
  if (dims_.etp == 1) etp_ = own_etp_.get();
}

Communicator& MoeContext::ep() {
  if (!ep_) throw std::logic_error("expert parallelism without its group");
  return *ep_;
}
Communicator& MoeContext::etp() {
  if (!etp_) throw std::logic_error("expert tensor parallelism without its group");
  return *etp_;
}

void MoeContext::set_groups(Communicator* ep, Communicator* etp) {
  if (!ep && dims_.ep > 1) throw std::logic_error("expert parallelism without its group");
  if (!etp && dims_.etp > 1) throw std::logic_error("expert tensor parallelism without its group");
  if (ep && ep->size() != dims_.ep) throw std::logic_error("expert-parallel group of wrong size");
  if (etp && etp->size() != dims_.etp) throw std::logic_error("expert-tensor group of wrong size");
  ep_ = ep ? ep : own_ep_.get();
  etp_ = etp ? etp : own_etp_.get();
}

ExpertLoad expert_load_of(const std::vector<int64_t>& counts, int64_t ep, int64_t experts) {
  if (ep < 1 || experts % ep != 0 || static_cast<int64_t>(counts.size()) != ep * experts)
    throw std::logic_error("expert counts of the wrong shape");
  const int64_t per_rank = experts / ep;
  ExpertLoad l;
  double total = 0;
  for (int64_t r = 0; r < ep; ++r) {
    double rows = 0;
    for (int64_t src = 0; src < ep; ++src)
      for (int64_t e = r * per_rank; e < (r + 1) * per_rank; ++e)
        rows += static_cast<double>(counts[static_cast<size_t>(src * experts + e)]);
    l.busiest = std::max(l.busiest, rows);
    total += rows;
  }
  l.mean = total / static_cast<double>(ep);
  return l;
}

void MoeContext::add_load(const ExpertLoad& l) {
  load_sum_.busiest += l.busiest;
  load_sum_.mean += l.mean;
}

double MoeContext::measured_load() const {
  if (dims_.ep == 1) return 1.0;
  return load_sum_.mean > 0 ? load_sum_.busiest / load_sum_.mean : 0.0;
}

void release_routed(MoeActs& A) {
  for (Buffer* b : {&A.logits, &A.permuted, &A.x, &A.fc1, &A.act, &A.y, &A.combined}) release(*b);
}

bool is_moe_op(OpId id) {
  return id >= OpId::kRouter && id <= OpId::kRouterWgrad;
}

namespace {

bool is_mlp_forward(OpId id) {
  return id == OpId::kMlpAllGather || id == OpId::kFc1 || id == OpId::kBiasGelu ||
         id == OpId::kSwiglu || id == OpId::kFc2 || id == OpId::kMlpAllReduce ||
         id == OpId::kMlpReduceScatter;
}
bool is_mlp_backward(OpId id) {
  return id == OpId::kMlpReduceScatterBackward || id == OpId::kFc2Dgrad || id == OpId::kFc2Wgrad ||
         id == OpId::kBiasGeluBackward || id == OpId::kSwigluBackward ||
         id == OpId::kMlpInputRegather || id == OpId::kFc1Dgrad ||
         id == OpId::kFc1InputGradAllReduce || id == OpId::kFc1Wgrad ||
         id == OpId::kMlpAllGatherBackward;
}

// The ops of `listed` whose flag is set, in order.
std::vector<OpId> those_that_run(std::initializer_list<std::pair<OpId, bool>> listed) {
  std::vector<OpId> out;
  for (const auto& [op, runs] : listed)
    if (runs) out.push_back(op);
  return out;
}

std::vector<OpId> substitute(const std::vector<OpId>& dense, bool keep_mlp, bool (*mlp)(OpId),
                             OpId before, const std::vector<OpId>& routed) {
  std::vector<OpId> out;
  for (OpId op : dense) {
    if (op == before) out.insert(out.end(), routed.begin(), routed.end());
    if (keep_mlp || !mlp(op)) out.push_back(op);
  }
  return out;
}

}  // namespace

std::vector<OpId> moe_forward_program(const std::vector<OpId>& dense, const MoeDims& d) {
  using I = OpId;
  // Without expert parallelism the permuted rows are the experts' rows already: no all-to-all
  // (nor one in the op list, core/layer_ops.cc).
  const std::vector<OpId> routed = those_that_run({{I::kRouter, true},
                                                   {I::kRouterTopk, true},
                                                   {I::kMoePermute, true},
                                                   {I::kMoeDispatch, d.ep > 1},
                                                   {I::kMoeDispatchAllGather, d.etp > 1},
                                                   {I::kExpertFc1, true},
                                                   {I::kExpertActivation, true},
                                                   {I::kExpertFc2, true},
                                                   {I::kMoeCombineReduceScatter, d.etp > 1},
                                                   {I::kMoeCombine, d.ep > 1},
                                                   {I::kMoeUnpermute, true}});
  return substitute(dense, d.shared, is_mlp_forward, I::kMlpBiasDropoutAdd, routed);
}

std::vector<OpId> moe_backward_program(const std::vector<OpId>& dense, const MoeDims& d) {
  using I = OpId;
  const std::vector<OpId> routed = those_that_run({{I::kMoeUnpermuteBackward, true},
                                                   {I::kMoeCombineBackward, d.ep > 1},
                                                   {I::kMoeCombineReduceScatterBackward, d.etp > 1},
                                                   {I::kExpertFc2Dgrad, true},
                                                   {I::kExpertFc2Wgrad, true},
                                                   {I::kExpertActivationBackward, true},
                                                   {I::kExpertFc1Dgrad, true},
                                                   {I::kExpertFc1Wgrad, true},
                                                   {I::kMoeDispatchAllGatherBackward, d.etp > 1},
                                                   {I::kMoeDispatchBackward, d.ep > 1},
                                                   {I::kMoePermuteBackward, true},
                                                   {I::kRouterTopkBackward, true},
                                                   {I::kRouterDgrad, true},
                                                   {I::kRouterWgrad, true}});
  return substitute(dense, d.shared, is_mlp_backward, I::kPostAttentionLayernormBackward, routed);
}

void moe_forward_op(ShardContext& c, MoeContext& mc, OpId op, const MoeLayerParams& W,
                    const Buffer& x, Buffer& out, MoeActs& A) {
  // The routed rows take the routed type (fp32, or bf16 in a bf16 model); the router's logits
  // are fp32 (MoeActs).
  const DType model_type = activation_dtype(), R = moe_routed_type(model_type);
  const ActivationDType routed(R);
  const MoeDims& d = mc.dims();
  const int64_t n = c.dims.n_local, h = c.dims.h, E = d.experts, k = d.topk, El = d.local_experts;
  Backend& be = c.be;
  switch (op) {
    case OpId::kRouter:
      resize(A.logits, n * E);
      c.linear(x.ptr(), W.router, -1, A.logits.ptr(), n, h, E);
      break;
    case OpId::kRouterTopk: {
      // On the host, from the downloaded logits (n x E: small beside the rows they route).
      std::vector<float> logits(static_cast<size_t>(n * E));
      download_floats(be, A.logits.ptr(), logits.data(), n * E);
      A.chosen.resize(static_cast<size_t>(n * k));
      A.prob.resize(static_cast<size_t>(n * k));
      kernels::topk_softmax(logits.data(), n, E, k, A.chosen.data(), A.prob.data());
      A.expert = A.chosen;
      if (d.capacity_factor > 0) {
        const auto capacity = static_cast<int64_t>(
            std::ceil(d.capacity_factor * static_cast<double>(n * k) / static_cast<double>(E)));
        kernels::drop_over_capacity(A.expert.data(), A.prob.data(), n, k, E, capacity,
                                    d.drop_by_position, c.dims.b);
      }
      consumed(A, A.logits);
      break;
    }
    case OpId::kMoePermute:
      A.slot_of_row.resize(static_cast<size_t>(n * k));
      A.counts.resize(static_cast<size_t>(E));
      A.rows =
          kernels::permutation(A.expert.data(), n, k, E, A.slot_of_row.data(), A.counts.data());
      A.token_of_row.resize(static_cast<size_t>(A.rows));
      kernels::token_of_rows(A.slot_of_row.data(), A.rows, k, A.token_of_row.data());
      A.row_of.resize(static_cast<size_t>(n * k));
      A.row_prob.resize(static_cast<size_t>(n * k));
      kernels::rows_of_tokens(A.slot_of_row.data(), A.rows, n, k, A.prob.data(), A.row_of.data(),
                              A.row_prob.data());
      {
        // Without expert parallelism, straight into the experts' rows (no dispatch runs).
        Buffer& rows = d.ep > 1 ? A.permuted : A.x;
        resize(rows, A.rows * h);
        Buffer converted;
        be.gather_rows(as_type(c, x, R, converted), A.token_of_row.data(), nullptr, rows.ptr(),
                       A.rows, h);
        if (d.ep == 1) A.recv = A.counts;  // [1 source][local expert]
      }
      break;
    case OpId::kMoeDispatch: {
      // Every rank's counts for every expert: this rank's experts' columns are what it
      // receives, and the sums per rank the group's load.
      const Counts all = exchange_counts(mc.ep(), A.counts, E, true);
      A.recv.assign(static_cast<size_t>(d.ep * El), 0);
      for (int64_t src = 0; src < d.ep; ++src)
        for (int64_t e = 0; e < El; ++e)
          A.recv[static_cast<size_t>(src * El + e)] =
              all[static_cast<size_t>(src * E + d.ep_rank * El + e)];
      if (c.pass() != PassKind::kRecompute) mc.add_load(expert_load_of(all, d.ep, E));
      to_experts(c, mc, A.permuted, A, A.x);
      consumed(A, A.permuted);
      break;
    }
    case OpId::kMoeDispatchAllGather: {
      const Counts mine = local_rows(d, A);
      A.gathered = exchange_counts(mc.etp(), mine, El, true);
      Buffer local;
      local.swap(A.x);
      etp_gather(c, mc, local, mine, A.gathered, A.x);
      break;
    }
    case OpId::kExpertFc1: {
      const int64_t w = d.fc1_width();
      resize(A.fc1, elems(A.x) / h * w);
      per_expert(expert_rows(d, A), [&](size_t e, int64_t r0, int64_t rows) {
        be.linear_forward(at(A.x, r0, h), c.P(W.fc1_w[e]), opt(c, W.fc1_b[e]), at(A.fc1, r0, w),
                          rows, h, w);
      });
      c.gemm_done(mean_rows(d, A, h), w, h, d.local_experts);
      break;
    }
    case OpId::kExpertActivation: {
      const int64_t rows = elems(A.x) / h;
      resize(A.act, rows * d.ffe);
      if (d.fc1_gated)
        be.swiglu(A.fc1.ptr(), A.act.ptr(), rows, d.ffe);
      else
        be.gelu(A.fc1.ptr(), A.act.ptr(), rows * d.ffe);
      break;
    }
    case OpId::kExpertFc2: {
      resize(A.y, elems(A.x));
      // The output bias is added once, by expert-tensor rank 0, before the partial sums meet.
      per_expert(expert_rows(d, A), [&](size_t e, int64_t r0, int64_t rows) {
        be.linear_forward(at(A.act, r0, d.ffe), c.P(W.fc2_w[e]),
                          d.etp_rank == 0 ? opt(c, W.fc2_b[e]) : Ptr(), at(A.y, r0, h), rows, d.ffe,
                          h);
      });
      c.gemm_done(mean_rows(d, A, h), h, d.ffe, d.local_experts);
      break;
    }
    case OpId::kMoeCombineReduceScatter: {
      Buffer partial;
      partial.swap(A.y);
      etp_reduce_scatter(c, mc, partial, local_rows(d, A), A.gathered, A.y);
      break;
    }
    case OpId::kMoeCombine:
      from_experts(c, mc, A.y, A, A.combined);
      consumed(A, A.y);
      break;
    case OpId::kMoeUnpermute:
      // Added to the shared experts' output where there are shared experts.
      into(c, out, d.shared, n * h, model_type, R, [&](Ptr y) {
        be.gather_add_rows(combined_rows(d, A).ptr(), A.row_of.data(), A.row_prob.data(), y, n, k,
                           h);
      });
      break;
    default:
      throw std::logic_error("not a forward op of an MoE layer");
  }
}

void moe_backward_op(ShardContext& c, MoeContext& mc, OpId op, const MoeLayerParams& W,
                     const Buffer& x, const Buffer& d_out, Buffer& d_x, MoeActs& A) {
  const DType model_type = activation_dtype(), R = moe_routed_type(model_type);
  const ActivationDType routed(R);  // as the forward pass
  const MoeDims& d = mc.dims();
  const int64_t n = c.dims.n_local, h = c.dims.h, E = d.experts, k = d.topk;
  Backend& be = c.be;
  const int64_t w = d.fc1_width();
  switch (op) {
    case OpId::kMoeUnpermuteBackward: {
      // d y[r] = prob[slot] d out[token]; d prob[slot] = <d out[token], y[r]>.
      resize(A.d_y, A.rows * h);
      Buffer converted, dots(DType::kF32);
      const CPtr g = as_type(c, d_out, R, converted);
      std::vector<float> weight(static_cast<size_t>(A.rows)), dot(static_cast<size_t>(A.rows));
      for (size_t r = 0; r < weight.size(); ++r)
        weight[r] = A.prob[static_cast<size_t>(A.slot_of_row[r])];
      be.gather_rows(g, A.token_of_row.data(), weight.data(), A.d_y.ptr(), A.rows, h);
      resize(dots, A.rows);
      be.row_dots(g, A.token_of_row.data(), combined_rows(d, A).ptr(), dots.data(), A.rows, h);
      download_floats(be, dots.ptr(), dot.data(), A.rows);
      A.dprob.assign(static_cast<size_t>(n * k), 0.0f);
      for (size_t r = 0; r < dot.size(); ++r)
        A.dprob[static_cast<size_t>(A.slot_of_row[r])] = dot[r];
      consumed(A, combined_rows(d, A));
      break;
    }
    case OpId::kMoeCombineBackward: {
      Buffer permuted;
      permuted.swap(A.d_y);
      to_experts(c, mc, permuted, A, A.d_y);
      break;
    }
    case OpId::kMoeCombineReduceScatterBackward: {
      Buffer local;
      local.swap(A.d_y);
      etp_gather(c, mc, local, local_rows(d, A), A.gathered, A.d_y);
      break;
    }
    case OpId::kExpertFc2Dgrad:
      resize(A.d_act, elems(A.act));
      per_expert(expert_rows(d, A), [&](size_t e, int64_t r0, int64_t rows) {
        be.linear_dgrad(c.P(W.fc2_w[e]), at(A.d_y, r0, h), at(A.d_act, r0, d.ffe), rows, d.ffe, h);
      });
      c.gemm_done(mean_rows(d, A, h), d.ffe, h, d.local_experts);
      break;
    case OpId::kExpertFc2Wgrad:
      per_expert(expert_rows(d, A), [&](size_t e, int64_t r0, int64_t rows) {
        be.linear_wgrad(at(A.act, r0, d.ffe), at(A.d_y, r0, h), c.G(W.fc2_w[e]),
                        opt_grad(c, W.fc2_b[e]), rows, d.ffe, h);
      });
      c.gemm_done(d.ffe, h, mean_rows(d, A, h), d.local_experts);
      c.weight_gradient_done();
      break;
    case OpId::kExpertActivationBackward: {
      const int64_t rows = elems(A.x) / h;
      resize(A.d_pre, rows * w);
      if (d.fc1_gated)
        be.swiglu_backward(A.fc1.ptr(), A.d_act.ptr(), A.d_pre.ptr(), rows, d.ffe);
      else
        be.gelu_backward(A.fc1.ptr(), A.d_act.ptr(), A.d_pre.ptr(), rows * d.ffe);
      consumed(A, A.d_act);
      break;
    }
    case OpId::kExpertFc1Dgrad:
      resize(A.d_x, elems(A.x));
      per_expert(expert_rows(d, A), [&](size_t e, int64_t r0, int64_t rows) {
        be.linear_dgrad(c.P(W.fc1_w[e]), at(A.d_pre, r0, w), at(A.d_x, r0, h), rows, h, w);
      });
      c.gemm_done(mean_rows(d, A, h), h, w, d.local_experts);
      break;
    case OpId::kExpertFc1Wgrad:
      per_expert(expert_rows(d, A), [&](size_t e, int64_t r0, int64_t rows) {
        be.linear_wgrad(at(A.x, r0, h), at(A.d_pre, r0, w), c.G(W.fc1_w[e]),
                        opt_grad(c, W.fc1_b[e]), rows, h, w);
      });
      c.gemm_done(h, w, mean_rows(d, A, h), d.local_experts);
      c.weight_gradient_done();
      break;
    case OpId::kMoeDispatchAllGatherBackward: {
      Buffer full;
      full.swap(A.d_x);
      etp_reduce_scatter(c, mc, full, local_rows(d, A), A.gathered, A.d_x);
      break;
    }
    case OpId::kMoeDispatchBackward: {
      Buffer expert_major;
      expert_major.swap(A.d_x);
      from_experts(c, mc, expert_major, A, A.d_x);
      break;
    }
    case OpId::kMoePermuteBackward:
      // Added to the shared experts' input gradient where there are shared experts.
      into(c, d_x, d.shared, n * h, model_type, R,
           [&](Ptr y) { be.gather_add_rows(A.d_x.ptr(), A.row_of.data(), nullptr, y, n, k, h); });
      consumed(A, A.d_x);
      break;
    case OpId::kRouterTopkBackward: {
      std::vector<float> dlogits(static_cast<size_t>(n * E));
      kernels::topk_softmax_backward(A.prob.data(), A.dprob.data(), A.chosen.data(), n, E, k,
                                     dlogits.data());
      resize(A.dlogits, n * E);
      upload_floats(be, dlogits.data(), A.dlogits.ptr(), n * E);
      break;
    }
    case OpId::kRouterDgrad: {
      Buffer dx(DType::kF32);  // added to d x in fp32, rounded once
      resize(dx, n * h);
      c.linear_dgrad(W.router, A.dlogits.ptr(), dx.ptr(), n, h, E);
      be.add(d_x.ptr(), dx.ptr(), n * h);
      break;
    }
    case OpId::kRouterWgrad:
      c.linear_wgrad(x.ptr(), A.dlogits.ptr(), W.router, -1, n, h, E);
      break;
    default:
      throw std::logic_error("not a backward op of an MoE layer");
  }
}

}  // namespace ptdp
