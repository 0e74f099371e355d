// Float64 reference for gemm (see reference.h): plain triple loops, accumulation in double.
#include "gemm/reference.h"

#include <cmath>
#include <stdexcept>

#include "common/reference_math.h"

namespace kspec::ref {

namespace {
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluCubic = 0.044715;

double act_of(int act, double h) {
  if (act == 1) return h > 0 ? h : 0.0;
  if (act == 2) return gelu_tanh(h);
  return h;
}

double act_grad(int act, double h) {
  if (act == 1) return h > 0 ? 1.0 : 0.0;
  if (act == 2) return gelu_tanh_grad(h);
  return 1.0;
}

void check_codes(int64_t batch, int64_t wbatch, int act) {
  if (wbatch != 1 && wbatch != batch) throw std::invalid_argument("gemm reference: wbatch must be 1 or batch");
  if (act < 0 || act > 2) throw std::invalid_argument("gemm reference: act code must be 0, 1 or 2");
}
}  // namespace

double gelu_tanh(double h) { return 0.5 * h * (1.0 + std::tanh(kSqrt2OverPi * (h + kGeluCubic * h * h * h))); }

double gelu_tanh_grad(double h) {
  double t = std::tanh(kSqrt2OverPi * (h + kGeluCubic * h * h * h));
  return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kGeluCubic * h * h);
}

GemmRefFwd gemm_fwd_ref(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>* b,
                        int64_t batch, int64_t wbatch, int64_t m, int64_t n, int64_t k, int act) {
  check_codes(batch, wbatch, act);
  detail::check_size(x, batch * m * k, "gemm", "x", false);
  detail::check_size(w, wbatch * n * k, "gemm", "w", false);
  if (b) detail::check_size(*b, n, "gemm", "b", false);
  GemmRefFwd r;
  r.y.resize(batch * m * n);
  r.pre.resize(batch * m * n);
  for (int64_t bi = 0; bi < batch; ++bi) {
    const double* xb = x.data() + bi * m * k;
    const double* wb = w.data() + (wbatch == 1 ? 0 : bi) * n * k;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = b ? (*b)[j] : 0.0;
        for (int64_t l = 0; l < k; ++l) s += xb[i * k + l] * wb[j * k + l];
        int64_t o = (bi * m + i) * n + j;
        r.pre[o] = s;
        r.y[o] = act_of(act, s);
      }
  }
  return r;
}

GemmRefBwd gemm_bwd_ref(const std::vector<double>& dy, const std::vector<double>& x, const std::vector<double>& w,
                        const std::vector<double>& pre, int64_t batch, int64_t wbatch, int64_t m, int64_t n,
                        int64_t k, int act) {
  check_codes(batch, wbatch, act);
  detail::check_size(dy, batch * m * n, "gemm.bwd", "dy", false);
  detail::check_size(x, batch * m * k, "gemm.bwd", "x", false);
  detail::check_size(w, wbatch * n * k, "gemm.bwd", "w", false);
  detail::check_size(pre, batch * m * n, "gemm.bwd", "pre", act == 0);
  std::vector<double> dpre(dy.size());
  for (size_t i = 0; i < dy.size(); ++i) dpre[i] = dy[i] * (act == 0 ? 1.0 : act_grad(act, pre[i]));
  GemmRefBwd r;
  r.dx.assign(batch * m * k, 0.0);
  r.dw.assign(wbatch * n * k, 0.0);
  r.db.assign(n, 0.0);
  for (int64_t bi = 0; bi < batch; ++bi) {
    const double* g = dpre.data() + bi * m * n;
    const double* xb = x.data() + bi * m * k;
    const double* wb = w.data() + (wbatch == 1 ? 0 : bi) * n * k;
    double* dwb = r.dw.data() + (wbatch == 1 ? 0 : bi) * n * k;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double gij = g[i * n + j];
        r.db[j] += gij;
        for (int64_t l = 0; l < k; ++l) {
          r.dx[(bi * m + i) * k + l] += gij * wb[j * k + l];
          dwb[j * k + l] += gij * xb[i * k + l];
        }
      }
  }
  return r;
}

}  // namespace kspec::ref
