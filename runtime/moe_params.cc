#include <algorithm>
#include <cmath>

#include "kernels/cpu/hash.h"
#include "kernels/cpu/init.h"
#include "runtime/moe_layer.h"

namespace ptdp {

MoeLayerParams add_moe_parameters(const ModelSpec& m, const ShardLayout& l, bool sp, uint64_t seed,
                                  const std::string& prefix, const AddParameter& add) {
  // The same standard deviations as the dense layers' (runtime/gpt_model.cc).
  const double std_dev = 0.02;
  const double out_std = 0.02 / std::sqrt(2.0 * static_cast<double>(m.num_layers));
  const int64_t h = m.hidden_size;
  auto normal = [seed](std::string name, int64_t rows, int64_t cols, double sd,
                       std::function<int64_t(int64_t, int64_t)> index) {
    return [=, id = fnv1a(name)](float* x) {
      kernels::fill_hashed_normal(x, rows, cols, seed, id, sd, index);
    };
  };
  auto zeros = [](int64_t n) { return [n](float* x) { std::fill(x, x + n, 0.0f); }; };
  MoeLayerParams mx;
  ParamInfo r;
  r.name = prefix + "router.weight";
  r.size = m.num_experts * h;
  r.tp_replicated = true;
  r.sp_partial = sp;
  mx.router = add(r, normal(r.name, m.num_experts, h, std_dev,
                            [=](int64_t row, int64_t c) { return row * h + c; }));
  const MoeDims md = moe_dims(m, l.t, l.ep, l.ep_rank, l.etp, l.etp_rank);
  const int64_t ffe = md.ffe, ffn = m.moe_ffn_hidden(), et = l.etp_rank;
  const bool biases = !m.swiglu;  // as the dense layers: SwiGLU models have no biases
  for (int64_t e = 0; e < md.local_experts; ++e) {
    const std::string ex =
        prefix + "experts." + std::to_string(l.ep_rank * md.local_experts + e) + ".";
    ParamInfo p;  // FC1: rows [gate | up] for SwiGLU
    p.name = ex + "fc1.weight";
    p.size = md.fc1_width() * h;
    p.segment = 2;
    p.expert = true;
    mx.fc1_w.push_back(
        add(p, normal(p.name, md.fc1_width(), h, std_dev, [=](int64_t row, int64_t c) {
              const int64_t part = row / ffe, k = row % ffe;
              return (part * ffn + et * ffe + k) * h + c;
            })));
    ParamInfo b1 = p;
    b1.name = ex + "fc1.bias";
    b1.size = ffe;
    b1.decay = false;
    mx.fc1_b.push_back(biases ? add(b1, zeros(ffe)) : -1);
    ParamInfo p2 = p;
    p2.name = ex + "fc2.weight";
    p2.size = h * ffe;
    mx.fc2_w.push_back(add(p2, normal(p2.name, h, ffe, out_std, [=](int64_t row, int64_t c) {
                             return row * ffn + et * ffe + c;
                           })));
    ParamInfo b2 = p;
    b2.name = ex + "fc2.bias";
    b2.size = h;
    b2.decay = false;
    b2.tp_replicated = true;  // identical on every expert-tensor rank
    mx.fc2_b.push_back(biases ? add(b2, zeros(h)) : -1);
  }
  return mx;
}

}  // namespace ptdp
