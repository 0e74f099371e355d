// Float64 CPU reference for the fused norm+activation op, y = act(norm(x) * w + b): the spec that
// the GPU kernels and the Python twin (python/kspec/reference/norm_act.py) are tested against.
// Codes: norm 0 = LayerNorm, 1 = RMSNorm; act 0 = identity, 1 = SiLU, 2 = GELU (tanh), 3 = GELU (erf).
#pragma once

#include <cstdint>
#include <vector>

namespace kspec::ref {

// x: [rows, hidden] row-major; w, b: [hidden]; b may be null (no bias).
// mean, rstd: [rows]; LayerNorm: rstd = 1/sqrt(mean((x - mean)^2) + eps);
// RMSNorm: mean = 0, rstd = 1/sqrt(mean(x^2) + eps). Throws std::invalid_argument on bad sizes/codes.
struct NormActRefFwd {
  std::vector<double> y, mean, rstd;
};
NormActRefFwd norm_act_fwd_ref(const std::vector<double>& x, const std::vector<double>& w,
                               const std::vector<double>* b, int64_t rows, int64_t hidden,
                               int norm, int act, double eps);

// Gradients of sum(dy * y) for the forward above; the statistics are recomputed from x in float64.
// dx: [rows, hidden]; dw, db: [hidden] (db empty when b is null).
struct NormActRefBwd {
  std::vector<double> dx, dw, db;
};
NormActRefBwd norm_act_bwd_ref(const std::vector<double>& dy, const std::vector<double>& x,
                               const std::vector<double>& w, const std::vector<double>* b,
                               int64_t rows, int64_t hidden, int norm, int act, double eps);

}  // namespace kspec::ref
