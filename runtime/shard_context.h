// ShardContext: what the pieces of a GptShard share (runtime/transformer_layer.cc,
// runtime/embedding_head.cc, runtime/gpt_model.cc): this rank's dimensions, the backend its
// kernels run on, the tensor-parallel group with the sequence-parallel data movement around
// its collectives, the flat parameter and gradient buffers, and the record of executed ops.
//
// Every kernel and collective a piece runs goes through the methods below, which also record
// what ran (kind, collective and bytes, GEMM shape) when a trace is attached, so that the trace
// says what was executed independently of the op list it is compared with.
#pragma once

#include <cstdint>
#include <vector>

#include "core/layer_ops.h"
#include "runtime/backend.h"
#include "runtime/communicator.h"
#include "runtime/flat_map.h"
#include "runtime/gpt_model.h"
#include "runtime/op_timer.h"
#include "runtime/tensor.h"

namespace ptdp {

// Pass being executed, for the role the trace records.
enum class PassKind { kForward, kBackward, kRecompute };

struct ShardDims {
  int64_t b, s, h, heads, groups, d, hl, gl, ffl, vocab, vl, v0, t, tp;
  bool sp, biases, swiglu;
  bool rotary;
  bool qk_norm = false;   // --qk-layernorm
  bool qkv_bias = false;  // biases on QKV: GPT's, or a gated model's with --add-qkv-bias
  // Multi-head latent attention: d is a query's and key's width (dn unrotated + dr rotated
  // channels), dv a value's (d without MLA); ql the query latent (0: one query projection), kvl
  // the key-value latent.
  bool mla = false;
  int64_t dv = 0, dn = 0, dr = 0, ql = 0, kvl = 0;
  double rotary_base;
  int64_t n_full, n_local;  // tokens of a microbatch; tokens held outside TP blocks
  // Context parallelism (runtime/context_parallel.h): cp ranks, this rank's index, and the
  // whole sequence (s is the s / cp tokens held here, s_attn the length attention spans).
  int64_t cp = 1, cpr = 0, s_attn = 0;
  // The ranks of a heads all-to-all (ShardLayout::cp_a2a_size; 1 when cp = 1): Ulysses' cp,
  // a2a+p2p's A; the ring goes round the cp / cp_a2a_size others.
  int64_t cp_a2a_size = 1;
  // Flash attention (--use-flash-attn, and always with context parallelism, as Megatron-Core
  // runs it): the attention core runs fused, keeping lse rather than the s x s probabilities.
  bool flash = false;
  int64_t qkv_width() const { return (hl + 2 * gl) * d; }
  int64_t kv_latent_width() const { return kvl + dr; }  // MLA: the latent and the rotated key
  int64_t kv_up_width() const { return hl * (dn + dv); }
  int64_t fc1_width() const { return swiglu ? 2 * ffl : ffl; }
};

// This rank's dimensions for a model and layout.
ShardDims shard_dims(const ModelSpec& m, const ShardLayout& l);

class ShardContext {
 public:
  ShardContext(Backend& backend, Communicator* tensor_group, const ShardDims& dims)
      : be(backend), tp(tensor_group), dims(dims) {}

  Backend& be;
  Communicator* tp;
  Communicator* cp = nullptr;  // the context-parallel group (cp > 1)
  // Its heads all-to-all's and its ring's ranks: the whole group, but with a2a+p2p the groups
  // of A adjacent ranks and the rings over them (GptShard::set_context_group).
  Communicator* cp_heads = nullptr;
  Communicator* cp_ring = nullptr;
  ShardDims dims;
  // Where the flat parameter array (fp32, or bf16 with mixed precision) and its fp32 gradients
  // are held (runtime/flat_map.h).
  const FlatMap* params = nullptr;
  const FlatMap* grads = nullptr;
  std::vector<ExecutedOp>* trace = nullptr;
  OpTimer* timer = nullptr;  // times each op (runtime/op_timer.h) when set

  Ptr P(int64_t off) const { return params->at(off); }
  float* G(int64_t off) const { return grads->at(off).f(); }

  // Starts the record of one op (when tracing).
  void begin(OpId id, PassKind pass);
  // The pass of the op begun last (an op that runs other recorded ops inside it, the
  // context-parallel ring, begins itself again afterwards).
  PassKind pass() const { return pass_; }
  // Ends the timed op before bookkeeping between ops (freeing a layer's or a microbatch's
  // activations), so that it counts as the pass's overhead, not as the last op's time.
  void end_op();

  // Tensor-parallel collectives (recorded). Sequence-parallel movement between [b, s/t, width]
  // slices and the full [b, s, width].
  void gather_sequence(const Buffer& local, Buffer& full, int64_t width);
  void scatter_sequence(const Buffer& full, Buffer& local, int64_t width);
  void scatter_sequence_in_place(Buffer& x);
  void all_reduce(Buffer& x);
  void all_gather(CPtr in, Ptr out, int64_t n);
  void reduce_scatter(CPtr in, Ptr out, int64_t n);
  // One step of the context-parallel ring (cp_ring), recorded as op `id` of pass `pass`: sends
  // n elements to the next rank and receives n from the previous one (one P2P batch).
  void ring_step(OpId id, CPtr send, Ptr recv, int64_t n, PassKind pass);
  // An all-to-all of the heads group (cp_heads), recorded as op `id` of pass `pass`: n elements
  // to each of its ranks from `send` (blocks in rank order), n from each into `recv`.
  void context_all_to_all(OpId id, CPtr send, Ptr recv, int64_t n, PassKind pass);

  // GEMMs (recorded in the op list's convention: C[m x n] = A[m x k] B[k x n], batch).
  void linear(CPtr x, int64_t w, int64_t bias, Ptr y, int64_t n, int64_t in, int64_t out);
  void linear_dgrad(int64_t w, CPtr dy, Ptr dx, int64_t n, int64_t in, int64_t out);
  void linear_wgrad(CPtr x, CPtr dy, int64_t w, int64_t bias, int64_t n, int64_t in, int64_t out);
  void gemm_done(int64_t m, int64_t n, int64_t k, int64_t batch);
  // Marks the op as computing a weight gradient (the table gradient of the embedding), or as
  // serving one alone (sequence parallelism's input gathered again for QKV's and FC1's).
  void weight_gradient_done();
  // Records a collective run on another group than the tensor-parallel one (runtime/moe_layer.cc).
  void collective_done(Collective c, double bytes, CommGroup group);

  // Layernorm, or RMSNorm for models without biases (Llama); `beta` < 0 when absent. n rows of
  // `width` (0: the hidden size; --qk-layernorm's norms are a head wide).
  void norm_forward(const Buffer& x, int64_t g, int64_t beta, Buffer& y, Buffer& mean, Buffer& rstd,
                    int64_t n, int64_t width = 0);
  void norm_backward(const Buffer& x, int64_t g, int64_t beta, const Buffer& mean,
                     const Buffer& rstd, const Buffer& dy, Buffer& dx, int64_t n,
                     int64_t width = 0);
  // The same with the input gradient added to dacc (Backend::norm_backward_add).
  void norm_backward_add(const Buffer& x, int64_t g, int64_t beta, const Buffer& mean,
                         const Buffer& rstd, const Buffer& dy, Buffer& dacc, int64_t n,
                         int64_t width = 0);
  // The fused attention (Backend::flash_attention_*) with values vd wide, at most the queries'
  // dims.d (multi-head latent attention's): V, the output and its gradient are padded with zero
  // channels to d for the kernel's call only, which leaves the output, dQ and dK unchanged (the
  // padded channels of dV are zero, and dropped).
  void flash_forward(CPtr q, CPtr k, CPtr v, Ptr out, float* lse, int64_t b, int64_t sq, int64_t sk,
                     int64_t hq, int64_t hk, int64_t vd);
  void flash_backward(CPtr q, CPtr k, CPtr v, CPtr out, const float* lse, CPtr dout, Ptr dq, Ptr dk,
                      Ptr dv, int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk,
                      int64_t vd);
  // out = residual + partial (+ bias): the bias-dropout-add closing each half of a layer.
  void residual_add(Buffer& out, const Buffer& residual, const Buffer& partial, int64_t bias);
  // Its backward: dout to d_residual and d_partial, and the bias's gradient.
  void residual_add_backward(const Buffer& dout, Buffer& d_residual, Buffer& d_partial,
                             int64_t bias);
  void copy(const Buffer& from, Buffer& to);

 private:
  ExecutedOp* current();
  void collective_done(Collective c, double bytes) {
    collective_done(c, bytes, CommGroup::kTensor);
  }
  PassKind pass_ = PassKind::kForward;
  Buffer scratch_;
};

}  // namespace ptdp
