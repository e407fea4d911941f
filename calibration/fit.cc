#include "calibration/fit.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace ptdp {

FitResiduals residuals_of(const std::vector<double>& model, const std::vector<double>& measured) {
  FitResiduals r;
  double sq = 0;
  for (size_t i = 0; i < model.size(); ++i) {
    if (!(measured[i] > 0)) continue;
    const double e = (model[i] - measured[i]) / measured[i];
    sq += e * e;
    r.max_relative = std::max(r.max_relative, std::abs(e));
    ++r.points;
  }
  r.rms_relative = r.points > 0 ? std::sqrt(sq / static_cast<double>(r.points)) : 0.0;
  return r;
}

nlohmann::json to_json(const FitResiduals& r) {
  return {{"points", r.points}, {"rms_relative", r.rms_relative}, {"max_relative", r.max_relative}};
}

namespace {

// log efficiency of the curve with log amplitude a and halves h.
double log_curve(const GemmSample& s, double a, const double h[3]) {
  const double x[3] = {s.batch * s.m, s.n, s.k};
  double v = a;
  for (int j = 0; j < 3; ++j) v -= std::log1p(h[j] / x[j]);
  return v;
}

double cost(const std::vector<GemmSample>& s, double a, const double h[3]) {
  double c = 0;
  for (const GemmSample& g : s) {
    const double r = log_curve(g, a, h) - std::log(g.efficiency);
    c += r * r;
  }
  return c;
}

// The best amplitude for fixed halves: the mean log residual.
double best_amplitude(const std::vector<GemmSample>& s, const double h[3]) {
  double sum = 0;
  for (const GemmSample& g : s) sum += std::log(g.efficiency) - log_curve(g, 0, h);
  return sum / static_cast<double>(s.size());
}

}  // namespace

GemmCurveFit fit_gemm_curve(const std::vector<GemmSample>& samples) {
  if (samples.empty()) throw std::invalid_argument("fit_gemm_curve: no samples");
  for (const GemmSample& g : samples)
    if (!(g.efficiency > 0) || !(g.m > 0 && g.n > 0 && g.k > 0 && g.batch > 0))
      throw std::invalid_argument("fit_gemm_curve: non-positive sample");
  // Coarse grid over the halves (0 and 1 .. 4096 in factors of 4).
  const double grid[] = {0, 1, 4, 16, 64, 256, 1024, 4096};
  double best[3] = {0, 0, 0}, best_a = 0, best_c = INFINITY;
  for (double hm : grid)
    for (double hn : grid)
      for (double hk : grid) {
        const double h[3] = {hm, hn, hk};
        const double a = best_amplitude(samples, h);
        const double c = cost(samples, a, h);
        if (c < best_c) best_c = c, best_a = a, std::copy(h, h + 3, best);
      }
  // Levenberg-Marquardt on (a, log h) from the grid's best (halves of 0 start at 0.5).
  Eigen::Vector4d p(best_a, std::log(std::max(best[0], 0.5)), std::log(std::max(best[1], 0.5)),
                    std::log(std::max(best[2], 0.5)));
  auto halves = [](const Eigen::Vector4d& q, double h[3]) {
    for (int j = 0; j < 3; ++j) h[j] = std::exp(q[j + 1]);
  };
  double h[3];
  halves(p, h);
  double c = cost(samples, p[0], h);
  double lambda = 1e-3;
  const Eigen::Index n = static_cast<Eigen::Index>(samples.size());
  for (int it = 0; it < 100; ++it) {
    Eigen::MatrixXd J(n, 4);
    Eigen::VectorXd r(n);
    for (Eigen::Index i = 0; i < n; ++i) {
      const GemmSample& g = samples[static_cast<size_t>(i)];
      const double x[3] = {g.batch * g.m, g.n, g.k};
      r[i] = log_curve(g, p[0], h) - std::log(g.efficiency);
      J(i, 0) = 1;
      for (int j = 0; j < 3; ++j) J(i, j + 1) = -h[j] / (x[j] + h[j]);  // d/d log h
    }
    const Eigen::Matrix4d A = J.transpose() * J;
    const Eigen::Vector4d g = J.transpose() * r;
    Eigen::Matrix4d D = A;
    D.diagonal() += lambda * (A.diagonal().array() + 1e-9).matrix();
    const Eigen::Vector4d step = D.ldlt().solve(-g);
    Eigen::Vector4d q = p + step;
    for (int j = 1; j < 4; ++j) q[j] = std::clamp(q[j], -10.0, 12.0);  // halves in [5e-5, 2e5]
    double hq[3];
    halves(q, hq);
    const double cq = cost(samples, q[0], hq);
    if (cq < c) {
      p = q, c = cq, std::copy(hq, hq + 3, h);
      lambda = std::max(lambda / 4, 1e-9);
      if (step.norm() < 1e-9) break;
    } else {
      lambda *= 8;
      if (lambda > 1e9) break;
    }
  }
  GemmCurveFit out;
  out.max_efficiency = std::exp(p[0]);
  out.m_half = h[0], out.n_half = h[1], out.k_half = h[2];
  std::vector<double> model, measured;
  for (const GemmSample& g : samples) {
    model.push_back(std::exp(log_curve(g, p[0], h)));
    measured.push_back(g.efficiency);
  }
  out.residuals = residuals_of(model, measured);
  return out;
}

LinearFit fit_latency_bandwidth(const std::vector<double>& x, const std::vector<double>& t) {
  if (x.size() != t.size() || x.empty())
    throw std::invalid_argument("fit_latency_bandwidth: no samples");
  const Eigen::Index n = static_cast<Eigen::Index>(x.size());
  // Rows divided by the measured time: relative error.
  Eigen::MatrixXd A(n, 2);
  Eigen::VectorXd b = Eigen::VectorXd::Ones(n);
  for (Eigen::Index i = 0; i < n; ++i) {
    A(i, 0) = 1.0 / t[static_cast<size_t>(i)];
    A(i, 1) = x[static_cast<size_t>(i)] / t[static_cast<size_t>(i)];
  }
  Eigen::Vector2d s = A.colPivHouseholderQr().solve(b);
  LinearFit f;
  if (n < 2 || s[0] < 0 || !(s[1] > 0)) {
    // No latency (or too few points, or a time that does not grow with the size, which only
    // noise makes): the bandwidth alone, through the origin.
    const Eigen::VectorXd col = A.col(1);
    s = Eigen::Vector2d(0, col.squaredNorm() > 0 ? col.dot(b) / col.squaredNorm() : 1e-30);
  }
  f.latency_s = s[0];
  f.seconds_per_unit = s[1];
  std::vector<double> model;
  for (size_t i = 0; i < x.size(); ++i) model.push_back(s[0] + s[1] * x[i]);
  f.residuals = residuals_of(model, t);
  return f;
}

MemoryFit fit_memory_kernels(const std::vector<int>& family, const std::vector<double>& bytes,
                             const std::vector<double>& t, int families) {
  const Eigen::Index n = static_cast<Eigen::Index>(t.size());
  if (n == 0 || family.size() != t.size() || bytes.size() != t.size())
    throw std::invalid_argument("fit_memory_kernels: no samples");
  // Non-negative least squares by elimination: solve, drop the most negative coefficient's
  // column (fix it at 0), solve again, until none is negative. Column 0 is the gap.
  const Eigen::Index cols = families + 1;
  std::vector<bool> active(static_cast<size_t>(cols), true);
  Eigen::VectorXd s = Eigen::VectorXd::Zero(cols);
  for (Eigen::Index round = 0; round <= cols; ++round) {
    Eigen::MatrixXd A = Eigen::MatrixXd::Zero(n, cols);
    const Eigen::VectorXd b = Eigen::VectorXd::Ones(n);
    for (Eigen::Index i = 0; i < n; ++i) {
      const size_t k = static_cast<size_t>(i);
      if (active[0]) A(i, 0) = 1.0 / t[k];
      if (active[static_cast<size_t>(1 + family[k])]) A(i, 1 + family[k]) = bytes[k] / t[k];
    }
    // Columns without samples (or fixed at 0) are zero: the minimum-norm solution leaves them 0.
    s = A.completeOrthogonalDecomposition().solve(b);
    Eigen::Index worst = -1;
    for (Eigen::Index c = 0; c < cols; ++c)
      if (s[c] < 0 && (worst < 0 || s[c] < s[worst])) worst = c;
    if (worst < 0) break;
    active[static_cast<size_t>(worst)] = false;
  }
  for (Eigen::Index c = 0; c < cols; ++c) s[c] = std::max(0.0, s[c]);
  MemoryFit out;
  out.gap_s = s[0];
  std::vector<std::vector<double>> model(static_cast<size_t>(families)),
      measured(static_cast<size_t>(families));
  std::vector<double> all_model, all_measured;
  for (int f = 0; f < families; ++f) out.seconds_per_byte.push_back(std::max(0.0, s[1 + f]));
  for (size_t k = 0; k < t.size(); ++k) {
    const double m = out.gap_s + bytes[k] * out.seconds_per_byte[static_cast<size_t>(family[k])];
    model[static_cast<size_t>(family[k])].push_back(m);
    measured[static_cast<size_t>(family[k])].push_back(t[k]);
    all_model.push_back(m);
    all_measured.push_back(t[k]);
  }
  for (int f = 0; f < families; ++f)
    out.residuals.push_back(
        residuals_of(model[static_cast<size_t>(f)], measured[static_cast<size_t>(f)]));
  out.all = residuals_of(all_model, all_measured);
  return out;
}

}  // namespace ptdp
