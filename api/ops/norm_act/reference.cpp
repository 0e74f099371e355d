// Float64 reference for norm+activation: straightforward loops with no fusion or tricks, so that it
// can be read against the formulas; speed does not matter here.
#include "norm_act/reference.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace kspec::ref {
namespace {

constexpr int kNormLayer = 0;
constexpr int kNormRms = 1;
constexpr int kActIdentity = 0;
constexpr int kActSilu = 1;
constexpr int kActGeluTanh = 2;
constexpr int kActGeluErf = 3;

constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluTanhCubic = 0.044715;
constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

double act_value(int act, double h) {
  switch (act) {
    case kActSilu:
      return h / (1.0 + std::exp(-h));
    case kActGeluTanh:
      return 0.5 * h * (1.0 + std::tanh(kSqrt2OverPi * (h + kGeluTanhCubic * h * h * h)));
    case kActGeluErf:
      return 0.5 * h * (1.0 + std::erf(h * kInvSqrt2));
    default:
      return h;
  }
}

double act_derivative(int act, double h) {
  switch (act) {
    case kActSilu: {
      const double s = 1.0 / (1.0 + std::exp(-h));
      return s * (1.0 + h * (1.0 - s));
    }
    case kActGeluTanh: {
      const double t = std::tanh(kSqrt2OverPi * (h + kGeluTanhCubic * h * h * h));
      const double du = kSqrt2OverPi * (1.0 + 3.0 * kGeluTanhCubic * h * h);
      return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * du;
    }
    case kActGeluErf:
      return 0.5 * (1.0 + std::erf(h * kInvSqrt2)) + h * kInvSqrt2Pi * std::exp(-0.5 * h * h);
    default:
      return 1.0;
  }
}

void check_args(const std::vector<double>& x, const std::vector<double>& w,
                const std::vector<double>* b, int64_t rows, int64_t hidden, int norm, int act) {
  if (rows < 0 || hidden < 1) {
    throw std::invalid_argument("norm_act reference: need rows >= 0 and hidden >= 1, got rows=" +
                                std::to_string(rows) + " hidden=" + std::to_string(hidden));
  }
  if (static_cast<int64_t>(x.size()) != rows * hidden) {
    throw std::invalid_argument("norm_act reference: x has " + std::to_string(x.size()) +
                                " elements, expected rows*hidden=" + std::to_string(rows * hidden));
  }
  if (static_cast<int64_t>(w.size()) != hidden || (b && static_cast<int64_t>(b->size()) != hidden)) {
    throw std::invalid_argument("norm_act reference: weight and bias must have hidden=" +
                                std::to_string(hidden) + " elements");
  }
  if (norm != kNormLayer && norm != kNormRms) {
    throw std::invalid_argument("norm_act reference: unknown norm code " + std::to_string(norm));
  }
  if (act < kActIdentity || act > kActGeluErf) {
    throw std::invalid_argument("norm_act reference: unknown act code " + std::to_string(act));
  }
}

// Row statistics in the same form the kernels use: mean first, then the centred second moment.
void row_stats(const double* xr, int64_t hidden, int norm, double eps, double* mean, double* rstd) {
  double mu = 0.0;
  if (norm == kNormLayer) {
    for (int64_t j = 0; j < hidden; ++j) mu += xr[j];
    mu /= static_cast<double>(hidden);
  }
  double sq = 0.0;
  for (int64_t j = 0; j < hidden; ++j) sq += (xr[j] - mu) * (xr[j] - mu);
  *mean = mu;
  *rstd = 1.0 / std::sqrt(sq / static_cast<double>(hidden) + eps);
}

}  // namespace

NormActRefFwd norm_act_fwd_ref(const std::vector<double>& x, const std::vector<double>& w,
                               const std::vector<double>* b, int64_t rows, int64_t hidden,
                               int norm, int act, double eps) {
  check_args(x, w, b, rows, hidden, norm, act);
  NormActRefFwd out;
  out.y.resize(x.size());
  out.mean.resize(static_cast<size_t>(rows));
  out.rstd.resize(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = x.data() + r * hidden;
    double mu = 0.0;
    double rs = 0.0;
    row_stats(xr, hidden, norm, eps, &mu, &rs);
    out.mean[r] = mu;
    out.rstd[r] = rs;
    for (int64_t j = 0; j < hidden; ++j) {
      const double h = (xr[j] - mu) * rs * w[j] + (b ? (*b)[j] : 0.0);
      out.y[r * hidden + j] = act_value(act, h);
    }
  }
  return out;
}

NormActRefBwd norm_act_bwd_ref(const std::vector<double>& dy, const std::vector<double>& x,
                               const std::vector<double>& w, const std::vector<double>* b,
                               int64_t rows, int64_t hidden, int norm, int act, double eps) {
  check_args(x, w, b, rows, hidden, norm, act);
  if (dy.size() != x.size()) {
    throw std::invalid_argument("norm_act reference: dy and x must have the same size");
  }
  NormActRefBwd out;
  out.dx.resize(x.size());
  out.dw.assign(static_cast<size_t>(hidden), 0.0);
  if (b) out.db.assign(static_cast<size_t>(hidden), 0.0);
  std::vector<double> xhat(static_cast<size_t>(hidden));
  std::vector<double> dxhat(static_cast<size_t>(hidden));
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = x.data() + r * hidden;
    const double* dyr = dy.data() + r * hidden;
    double mu = 0.0;
    double rs = 0.0;
    row_stats(xr, hidden, norm, eps, &mu, &rs);
    double sum_dxhat = 0.0;
    double sum_dxhat_xhat = 0.0;
    for (int64_t j = 0; j < hidden; ++j) {
      xhat[j] = (xr[j] - mu) * rs;
      const double h = xhat[j] * w[j] + (b ? (*b)[j] : 0.0);
      const double g = dyr[j] * act_derivative(act, h);
      out.dw[j] += g * xhat[j];
      if (b) out.db[j] += g;
      dxhat[j] = g * w[j];
      sum_dxhat += dxhat[j];
      sum_dxhat_xhat += dxhat[j] * xhat[j];
    }
    const double n = static_cast<double>(hidden);
    // The mean's own gradient only exists for LayerNorm; RMSNorm does not centre.
    const double mean_dxhat = norm == kNormLayer ? sum_dxhat / n : 0.0;
    const double mean_dxhat_xhat = sum_dxhat_xhat / n;
    for (int64_t j = 0; j < hidden; ++j) {
      out.dx[r * hidden + j] = rs * (dxhat[j] - mean_dxhat - xhat[j] * mean_dxhat_xhat);
    }
  }
  return out;
}

}  // namespace kspec::ref
