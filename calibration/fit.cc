#include "calibration/fit.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>
#include <stdexcept>
#include <utility>

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

// The least-squares solution of the `rows` x `cols` system `a` x = `b` (`a` row-major), by
// Householder QR with column pivoting (Golub and Van Loan, "Matrix Computations", 4th ed.,
// section 5.4.2). Columns left once the largest remaining norm falls below 1e-12 of the first
// pivot's (zero columns, or ones dependent on those chosen) get 0: a basic solution, which for
// zero columns is also the minimum-norm one. The systems here have a few columns and tens of
// rows; Eigen's decompositions for them were most of this file's compile time (about 40 s of
// 45 with GCC at -O3 on a 2-vCPU VM; docs/reliability.md, "Cost in CI").
std::vector<double> least_squares(std::vector<double> a, std::vector<double> b, size_t rows,
                                  size_t cols) {
  std::vector<size_t> perm(cols);
  std::iota(perm.begin(), perm.end(), size_t{0});
  auto at = [&](size_t i, size_t j) -> double& { return a[i * cols + j]; };
  auto tail_norm = [&](size_t k, size_t j) {
    double s = 0;
    for (size_t i = k; i < rows; ++i) s += at(i, j) * at(i, j);
    return std::sqrt(s);
  };
  size_t rank = 0;
  double first = 0;
  for (size_t k = 0; k < std::min(rows, cols); ++k) {
    size_t p = k;
    double norm = tail_norm(k, k);
    for (size_t j = k + 1; j < cols; ++j)
      if (const double nj = tail_norm(k, j); nj > norm) p = j, norm = nj;
    if (k == 0) first = norm;
    if (!(norm > 1e-12 * first)) break;  // also a zero first column
    if (p != k) {
      for (size_t i = 0; i < rows; ++i) std::swap(at(i, k), at(i, p));
      std::swap(perm[k], perm[p]);
    }
    // The reflection I - v v^T / (v^T v) with v = x - alpha e_k maps column k's tail x onto
    // alpha e_k; alpha takes the sign opposite x_k's, so that v_k does not cancel.
    const double alpha = at(k, k) > 0 ? -norm : norm;
    std::vector<double> v(rows - k);
    for (size_t i = k; i < rows; ++i) v[i - k] = at(i, k);
    v[0] -= alpha;
    double vv = 0;
    for (double x : v) vv += x * x;
    auto reflect = [&](auto&& elem) {
      double d = 0;
      for (size_t i = k; i < rows; ++i) d += v[i - k] * elem(i);
      const double f = 2 * d / vv;
      for (size_t i = k; i < rows; ++i) elem(i) -= f * v[i - k];
    };
    for (size_t j = k + 1; j < cols; ++j) reflect([&](size_t i) -> double& { return at(i, j); });
    reflect([&](size_t i) -> double& { return b[i]; });
    at(k, k) = alpha;
    for (size_t i = k + 1; i < rows; ++i) at(i, k) = 0;
    rank = k + 1;
  }
  // R x = Q^T b over the first `rank` pivoted columns, by back substitution.
  std::vector<double> y(cols, 0.0), x(cols, 0.0);
  for (size_t k = rank; k-- > 0;) {
    double s = b[k];
    for (size_t j = k + 1; j < rank; ++j) s -= at(k, j) * y[j];
    y[k] = s / at(k, k);
  }
  for (size_t k = 0; k < cols; ++k) x[perm[k]] = y[k];
  return x;
}

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
  // Levenberg-Marquardt on (a, log h) from the grid's best (halves of 0 start at 0.5). Each
  // step solves (J^T J + lambda diag(J^T J + 1e-9)) step = -J^T r as the least-squares problem
  // [J; sqrt(lambda diag(...))] step = [-r; 0].
  std::array<double, 4> p = {best_a, std::log(std::max(best[0], 0.5)),
                             std::log(std::max(best[1], 0.5)), std::log(std::max(best[2], 0.5))};
  auto halves = [](const std::array<double, 4>& q, double h[3]) {
    for (int j = 0; j < 3; ++j) h[j] = std::exp(q[static_cast<size_t>(j) + 1]);
  };
  double h[3];
  halves(p, h);
  double c = cost(samples, p[0], h);
  double lambda = 1e-3;
  const size_t n = samples.size();
  for (int it = 0; it < 100; ++it) {
    std::vector<double> J((n + 4) * 4, 0.0), rhs(n + 4, 0.0);
    double diag[4] = {0, 0, 0, 0};
    for (size_t i = 0; i < n; ++i) {
      const GemmSample& g = samples[i];
      const double x[3] = {g.batch * g.m, g.n, g.k};
      rhs[i] = -(log_curve(g, p[0], h) - std::log(g.efficiency));
      J[i * 4] = 1;
      for (size_t j = 0; j < 3; ++j) J[i * 4 + j + 1] = -h[j] / (x[j] + h[j]);  // d/d log h
      for (size_t j = 0; j < 4; ++j) diag[j] += J[i * 4 + j] * J[i * 4 + j];
    }
    for (size_t j = 0; j < 4; ++j) J[(n + j) * 4 + j] = std::sqrt(lambda * (diag[j] + 1e-9));
    const std::vector<double> step = least_squares(std::move(J), std::move(rhs), n + 4, 4);
    std::array<double, 4> q;
    double step_norm = 0;
    for (size_t j = 0; j < 4; ++j) q[j] = p[j] + step[j], step_norm += step[j] * step[j];
    for (size_t j = 1; j < 4; ++j) q[j] = std::clamp(q[j], -10.0, 12.0);  // halves in [5e-5, 2e5]
    double hq[3];
    halves(q, hq);
    const double cq = cost(samples, q[0], hq);
    if (cq < c) {
      p = q, c = cq, std::copy(hq, hq + 3, h);
      lambda = std::max(lambda / 4, 1e-9);
      if (std::sqrt(step_norm) < 1e-9) break;
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
  const size_t n = x.size();
  // Rows divided by the measured time: relative error.
  std::vector<double> a(n * 2);
  for (size_t i = 0; i < n; ++i) a[i * 2] = 1.0 / t[i], a[i * 2 + 1] = x[i] / t[i];
  std::vector<double> s = least_squares(a, std::vector<double>(n, 1.0), n, 2);
  LinearFit f;
  if (n < 2 || s[0] < 0 || !(s[1] > 0)) {
    // No latency (or too few points, or a time that does not grow with the size, which only
    // noise makes): the bandwidth alone, through the origin.
    double dot = 0, sq = 0;
    for (size_t i = 0; i < n; ++i) dot += a[i * 2 + 1], sq += a[i * 2 + 1] * a[i * 2 + 1];
    s = {0, sq > 0 ? dot / sq : 1e-30};
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
  const size_t n = t.size();
  if (n == 0 || family.size() != t.size() || bytes.size() != t.size())
    throw std::invalid_argument("fit_memory_kernels: no samples");
  for (int f : family)
    if (f < 0 || f >= families) throw std::invalid_argument("fit_memory_kernels: bad family");
  // Non-negative least squares by elimination: solve, drop the most negative coefficient's
  // column (fix it at 0), solve again, until none is negative. Column 0 is the gap.
  const size_t cols = static_cast<size_t>(families) + 1;
  std::vector<bool> active(cols, true);
  std::vector<double> s(cols, 0.0);
  for (size_t round = 0; round <= cols; ++round) {
    std::vector<double> a(n * cols, 0.0);
    for (size_t k = 0; k < n; ++k) {
      const size_t col = 1 + static_cast<size_t>(family[k]);
      if (active[0]) a[k * cols] = 1.0 / t[k];
      if (active[col]) a[k * cols + col] = bytes[k] / t[k];
    }
    // Columns without samples (or fixed at 0) are zero and stay 0 in the solution.
    s = least_squares(std::move(a), std::vector<double>(n, 1.0), n, cols);
    size_t worst = cols;
    for (size_t c = 0; c < cols; ++c)
      if (s[c] < 0 && (worst == cols || s[c] < s[worst])) worst = c;
    if (worst == cols) break;
    active[worst] = false;
  }
  for (size_t c = 0; c < cols; ++c) s[c] = std::max(0.0, s[c]);
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
