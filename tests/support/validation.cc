#include "tests/support/validation.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/presets.h"

namespace ptdp {
namespace {

using nlohmann::json;

ModelSpec gpt(int64_t layers, int64_t hidden, int64_t heads, const json& common) {
  ModelSpec m;
  m.name = "gpt-l" + std::to_string(layers) + "-h" + std::to_string(hidden);
  m.num_layers = layers;
  m.hidden_size = hidden;
  m.num_attention_heads = heads;
  m.seq_length = common.at("seq_length").get<int64_t>();
  m.vocab_size = common.at("vocab_size").get<int64_t>();
  return m;
}

// The paper's runs: fp16 mixed precision (gradients reduced in 16 bits), full recomputation,
// scatter/gather pipeline transfers, no overlap of the gradient all-reduce, gradients
// accumulated across microbatches by a separate pass.
ParallelPlan sc21_plan(int64_t t, int64_t p, int64_t gpus, int64_t batch, int64_t micro,
                       int64_t v) {
  ParallelPlan plan;
  plan.tensor_parallel = t;
  plan.pipeline_parallel = p;
  plan.data_parallel = gpus / (t * p);
  plan.global_batch_size = batch;
  plan.micro_batch_size = micro;
  plan.virtual_stages = v;
  plan.schedule = v > 1 ? Schedule::kInterleaved1F1B : Schedule::k1F1B;
  plan.recompute = Recompute::kFull;
  plan.fp32_grad_reduce = false;
  plan.gradient_accumulation_fusion = false;  // added to Megatron-LM after the paper
  plan.scatter_gather_p2p = true;
  return plan;
}

ValidationCase make_case(std::string label, ModelSpec m, ParallelPlan plan, double tflops) {
  ValidationCase c;
  c.label = std::move(label);
  c.model = std::move(m);
  c.plan = std::move(plan);
  c.measured_tflops_per_gpu = tflops;
  c.measured_iteration_s =
      sc21_equation3_flops(c.model, static_cast<double>(c.plan.global_batch_size)) /
      (static_cast<double>(c.plan.num_gpus()) * tflops * 1e12);
  return c;
}

}  // namespace

double sc21_equation3_flops(const ModelSpec& m, double B) {
  const double s = static_cast<double>(m.seq_length), l = static_cast<double>(m.num_layers);
  const double h = static_cast<double>(m.hidden_size), V = static_cast<double>(m.vocab_size);
  return 96.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h));
}

std::vector<ValidationCase> load_sc21_cases(const std::string& path) {
  const json j = read_json_file(path, "validation");
  std::vector<ValidationCase> cases;
  try {
    const json& common = j.at("common_settings");
    for (const json& r : j.at("table1_weak_scaling").at("rows")) {
      const ModelSpec m =
          gpt(r[3].get<int64_t>(), r[2].get<int64_t>(), r[1].get<int64_t>(), common);
      cases.push_back(make_case("table1 " + r[0].dump() + "B", m,
                                sc21_plan(r[4], r[5], r[6], r[7], r[8], r[9]),
                                r[10].get<double>()));
    }
    const json& f11 = j.at("figure11_pipeline_weak_scaling");
    for (const auto& [batch_key, points] : f11.at("tflops_per_gpu").items()) {
      const int64_t batch = std::stoll(batch_key.substr(batch_key.rfind('_') + 1));
      for (const auto& [pkey, tflops] : points.items()) {
        const int64_t p = std::stoll(pkey.substr(1));
        const ModelSpec m = gpt(3 * p, f11["model"]["hidden"], f11["model"]["heads"], common);
        cases.push_back(make_case("fig11 p=" + std::to_string(p) + " B=" + std::to_string(batch), m,
                                  sc21_plan(8, p, 8 * p, batch, 1, 1), tflops.get<double>()));
      }
    }
    const json& f12 = j.at("figure12_interleaved_vs_default");
    const ModelSpec m12 =
        gpt(f12["model"]["layers"], f12["model"]["hidden"], f12["model"]["heads"], common);
    const json& y12 = f12.at("tflops_per_gpu");
    for (size_t i = 0; i < y12.at("global_batch").size(); ++i) {
      const int64_t batch = y12["global_batch"][i];
      cases.push_back(make_case("fig12 1f1b B=" + std::to_string(batch), m12,
                                sc21_plan(8, 12, 96, batch, 1, 1),
                                y12["default_1f1b"][i].get<double>()));
      cases.push_back(make_case("fig12 interleaved B=" + std::to_string(batch), m12,
                                sc21_plan(8, 12, 96, batch, 1, f12["interleaved_virtual_stages"]),
                                y12["interleaved"][i].get<double>()));
    }
    const json& f16 = j.at("figure16_microbatch_size");
    const ModelSpec m16 =
        gpt(f16["model"]["layers"], f16["model"]["hidden"], f16["model"]["heads"], common);
    const json& y16 = f16.at("tflops_per_gpu");
    for (const char* key : {"global_batch_128", "global_batch_512"}) {
      const int64_t batch = std::stoll(std::string(key).substr(13));
      for (size_t i = 0; i < y16.at("micro_batch").size(); ++i) {
        const int64_t b = y16["micro_batch"][i];
        cases.push_back(make_case("fig16 b=" + std::to_string(b) + " B=" + std::to_string(batch),
                                  m16, sc21_plan(8, 8, 64, batch, b, 1),
                                  y16[key][i].get<double>()));
      }
    }
  } catch (const json::exception& e) {
    throw InputError("validation", path + ": " + e.what());
  }
  return cases;
}

}  // namespace ptdp
