// Float64 reference for adamw (see reference.h).
#include "adamw/reference.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kspec::ref {

AdamwRefResult adamw_ref(std::vector<std::vector<double>>& params, const std::vector<std::vector<double>>& grads,
                         std::vector<std::vector<double>>& exp_avg, std::vector<std::vector<double>>& exp_avg_sq,
                         std::vector<std::vector<double>>* max_exp_avg_sq, const AdamwRefOptions& o) {
  const size_t n = params.size();
  if (grads.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n || (max_exp_avg_sq && max_exp_avg_sq->size() != n))
    throw std::invalid_argument("adamw reference: lists differ in length");
  double total = 0;
  for (const auto& g : grads)
    for (double x : g) total += (x / o.grad_scale) * (x / o.grad_scale);
  AdamwRefResult r;
  r.found_inf = !std::isfinite(total);
  r.grad_norm = std::sqrt(total);
  if (r.found_inf) return r;
  const double coef = o.max_norm > 0 ? std::min(1.0, o.max_norm / (r.grad_norm + 1e-6)) : 1.0;
  const double bc1 = o.bias_correction ? 1.0 - std::pow(o.beta1, static_cast<double>(o.step)) : 1.0;
  const double bc2 = o.bias_correction ? 1.0 - std::pow(o.beta2, static_cast<double>(o.step)) : 1.0;
  for (size_t t = 0; t < n; ++t) {
    if (grads[t].size() != params[t].size() || exp_avg[t].size() != params[t].size() ||
        exp_avg_sq[t].size() != params[t].size())
      throw std::invalid_argument("adamw reference: tensor sizes differ across the lists");
    for (size_t i = 0; i < params[t].size(); ++i) {
      double g = grads[t][i] / o.grad_scale * coef;
      if (o.maximize) g = -g;
      double& p = params[t][i];
      double& m = exp_avg[t][i];
      double& v = exp_avg_sq[t][i];
      p *= 1.0 - o.lr * o.weight_decay;
      m += (1.0 - o.beta1) * (g - m);
      v = o.beta2 * v + (1.0 - o.beta2) * g * g;
      double vv = v;
      if (max_exp_avg_sq) vv = (*max_exp_avg_sq)[t][i] = std::max((*max_exp_avg_sq)[t][i], v);
      p -= o.lr / bc1 * m / (std::sqrt(vv) / std::sqrt(bc2) + o.eps);
    }
  }
  return r;
}

}  // namespace kspec::ref
