// Float64 reference for mHC: plain loops, one token at a time, written to be read against the formulas
// in reference.h; speed does not matter here.
#include "mhc/reference.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "common/reference_math.h"

namespace kspec::ref {
namespace {

using detail::check_size;
using detail::sigmoid;

constexpr const char* kOp = "mhc";

void check_shape(const MhcShape& s) {
  if (s.T < 0 || s.n < 1 || s.D < 1)
    throw std::invalid_argument("mhc reference: need T >= 0, n >= 1, D >= 1, got T=" + std::to_string(s.T) +
                                " n=" + std::to_string(s.n) + " D=" + std::to_string(s.D));
}

void check_sinkhorn(int64_t T, int64_t n, int t_max, double eps) {
  if (T < 0 || n < 1) throw std::invalid_argument("mhc reference: need T >= 0 and n >= 1");
  if (t_max < 1) throw std::invalid_argument("mhc reference: t_max must be >= 1, got " + std::to_string(t_max));
  if (!(eps >= 0.0)) throw std::invalid_argument("mhc reference: eps_sk must be >= 0");
}

void check_eps(const MhcEps& e) {
  if (!(e.rms >= 0.0)) throw std::invalid_argument("mhc reference: eps_rms must be >= 0");
  if (!(e.pre >= 0.0)) throw std::invalid_argument("mhc reference: eps_pre must be >= 0");
}

void check_pre_inputs(const MhcShape& s, const MhcEps& e, const MhcPreInputs& in) {
  check_shape(s);
  check_eps(e);
  check_sinkhorn(s.T, s.n, e.t_max, e.sk);
  const int64_t nd = s.n * s.D, m = mhc_proj_rows(s.n, s.pre_only);
  check_size(in.x, s.T * nd, kOp, "x", false);
  check_size(in.phi, m * nd, kOp, "phi", false);
  check_size(in.alpha, mhc_alpha_size(s.pre_only), kOp, "alpha", false);
  check_size(in.bias, m, kOp, "bias", false);
  check_size(in.gamma, nd, kOp, "gamma", true);
}

// Which alpha scales row r of h: 0 for H_pre's rows, 1 for H_post's, 2 for R's.
int alpha_index(int64_t r, int64_t n) { return r < n ? 0 : r < 2 * n ? 1 : 2; }

// The iterates of one n x n Sinkhorn-Knopp run: iter[0] = softmax_k(Z) (before + eps), then the
// 2 t_max - 1 normalized matrices, the last one R; sums[s] holds step s's divisors (sum + eps).
struct SinkhornTrace {
  std::vector<std::vector<double>> iter;
  std::vector<std::vector<double>> sums;
};

// Step s (1-based) of the normalizations: odd steps divide columns (sum over j), even ones rows.
bool step_is_column(size_t s) { return s % 2 == 1; }

SinkhornTrace sinkhorn_trace(const double* z, int64_t n, int t_max, double eps) {
  SinkhornTrace tr;
  std::vector<double> p(static_cast<size_t>(n * n));
  for (int64_t j = 0; j < n; ++j) {
    double mx = z[j * n];
    for (int64_t k = 1; k < n; ++k) mx = std::max(mx, z[j * n + k]);
    double sum = 0.0;
    for (int64_t k = 0; k < n; ++k) sum += (p[j * n + k] = std::exp(z[j * n + k] - mx));
    for (int64_t k = 0; k < n; ++k) p[j * n + k] /= sum;
  }
  tr.iter.push_back(p);
  std::vector<double> a = p;
  for (double& e : a) e += eps;
  const size_t steps = static_cast<size_t>(2 * t_max - 1);
  for (size_t s = 1; s <= steps; ++s) {
    std::vector<double> div(static_cast<size_t>(n), eps);
    const bool col = step_is_column(s);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t k = 0; k < n; ++k) div[col ? k : j] += a[j * n + k];
    for (int64_t j = 0; j < n; ++j)
      for (int64_t k = 0; k < n; ++k) a[j * n + k] /= div[col ? k : j];
    tr.sums.push_back(div);
    tr.iter.push_back(a);
  }
  return tr;
}

// dZ of one matrix from dR, walking the trace backwards.
void sinkhorn_backward(const double* z, const double* dr, int64_t n, int t_max, double eps, double* dz) {
  const SinkhornTrace tr = sinkhorn_trace(z, n, t_max, eps);
  std::vector<double> g(dr, dr + n * n);
  for (size_t s = tr.sums.size(); s >= 1; --s) {
    const std::vector<double>& y = tr.iter[s];
    const std::vector<double>& div = tr.sums[s - 1];
    const bool col = step_is_column(s);
    std::vector<double> dot(static_cast<size_t>(n), 0.0);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t k = 0; k < n; ++k) dot[col ? k : j] += g[j * n + k] * y[j * n + k];
    for (int64_t j = 0; j < n; ++j)
      for (int64_t k = 0; k < n; ++k) {
        const int64_t a = col ? k : j;
        g[j * n + k] = (g[j * n + k] - dot[a]) / div[a];
      }
  }
  // A = P + eps passes g through; then the softmax along k.
  const std::vector<double>& p = tr.iter[0];
  for (int64_t j = 0; j < n; ++j) {
    double dot = 0.0;
    for (int64_t k = 0; k < n; ++k) dot += g[j * n + k] * p[j * n + k];
    for (int64_t k = 0; k < n; ++k) dz[j * n + k] = p[j * n + k] * (g[j * n + k] - dot);
  }
}

// The projection of one token: h (M) and inv, from v (nD).
double project(const MhcShape& s, const MhcEps& e, const MhcPreInputs& in, const double* v, double* m_out,
               double* h) {
  const int64_t nd = s.n * s.D, rows = mhc_proj_rows(s.n, s.pre_only);
  double sq = 0.0;
  for (int64_t i = 0; i < nd; ++i) sq += v[i] * v[i];
  const double inv = 1.0 / std::sqrt(sq / static_cast<double>(nd) + e.rms);
  for (int64_t r = 0; r < rows; ++r) {
    double acc = 0.0;
    for (int64_t i = 0; i < nd; ++i) acc += v[i] * (in.gamma.empty() ? 1.0 : in.gamma[i]) * in.phi[r * nd + i];
    m_out[r] = acc;
    h[r] = inv * in.alpha[alpha_index(r, s.n)] * acc + in.bias[r];
  }
  return inv;
}

}  // namespace

int64_t mhc_proj_rows(int64_t n, bool pre_only) { return pre_only ? n : n * n + 2 * n; }
int64_t mhc_alpha_size(bool pre_only) { return pre_only ? 1 : 3; }

std::vector<double> mhc_sinkhorn_fwd_ref(const std::vector<double>& logits, int64_t T, int64_t n, int t_max,
                                         double eps) {
  check_sinkhorn(T, n, t_max, eps);
  check_size(logits, T * n * n, kOp, "logits", false);
  std::vector<double> r(logits.size());
  for (int64_t t = 0; t < T; ++t) {
    const SinkhornTrace tr = sinkhorn_trace(logits.data() + t * n * n, n, t_max, eps);
    std::copy(tr.iter.back().begin(), tr.iter.back().end(), r.begin() + t * n * n);
  }
  return r;
}

std::vector<double> mhc_sinkhorn_bwd_ref(const std::vector<double>& logits, const std::vector<double>& dR,
                                         int64_t T, int64_t n, int t_max, double eps) {
  check_sinkhorn(T, n, t_max, eps);
  check_size(logits, T * n * n, kOp, "logits", false);
  check_size(dR, T * n * n, kOp, "dR", false);
  std::vector<double> dz(logits.size());
  for (int64_t t = 0; t < T; ++t)
    sinkhorn_backward(logits.data() + t * n * n, dR.data() + t * n * n, n, t_max, eps, dz.data() + t * n * n);
  return dz;
}

MhcPreOutputs mhc_pre_fwd_ref(const MhcShape& s, const MhcEps& e, const MhcPreInputs& in) {
  check_pre_inputs(s, e, in);
  const int64_t n = s.n, D = s.D, nd = n * D, rows = mhc_proj_rows(n, s.pre_only);
  MhcPreOutputs o;
  o.y.assign(static_cast<size_t>(s.T * D), 0.0);
  o.h_pre.resize(static_cast<size_t>(s.T * n));
  o.inv.resize(static_cast<size_t>(s.T));
  o.h.resize(static_cast<size_t>(s.T * rows));
  if (!s.pre_only) {
    o.h_post.resize(static_cast<size_t>(s.T * n));
    o.r.resize(static_cast<size_t>(s.T * n * n));
  }
  std::vector<double> m(static_cast<size_t>(rows));
  for (int64_t t = 0; t < s.T; ++t) {
    const double* v = in.x.data() + t * nd;
    double* h = o.h.data() + t * rows;
    o.inv[t] = project(s, e, in, v, m.data(), h);
    for (int64_t i = 0; i < n; ++i) {
      o.h_pre[t * n + i] = sigmoid(h[i]) + e.pre;
      for (int64_t d = 0; d < D; ++d) o.y[t * D + d] += o.h_pre[t * n + i] * v[i * D + d];
    }
    if (s.pre_only) continue;
    for (int64_t i = 0; i < n; ++i) o.h_post[t * n + i] = 2.0 * sigmoid(h[n + i]);
    const SinkhornTrace tr = sinkhorn_trace(h + 2 * n, n, e.t_max, e.sk);
    std::copy(tr.iter.back().begin(), tr.iter.back().end(), o.r.begin() + t * n * n);
  }
  return o;
}

MhcPreGrads mhc_pre_bwd_ref(const MhcShape& s, const MhcEps& e, const MhcPreInputs& in, const MhcPreUpstream& up) {
  check_pre_inputs(s, e, in);
  const int64_t n = s.n, D = s.D, nd = n * D, rows = mhc_proj_rows(n, s.pre_only);
  check_size(up.dy, s.T * D, kOp, "dy", false);
  check_size(up.dh_pre, s.T * n, kOp, "dh_pre", true);
  check_size(up.dh_post, s.pre_only ? 0 : s.T * n, kOp, "dh_post", true);
  check_size(up.dr, s.pre_only ? 0 : s.T * n * n, kOp, "dr", true);
  check_size(up.dx_post, s.T * nd, kOp, "dx_post", true);
  const bool has_gamma = !in.gamma.empty();
  MhcPreGrads g;
  g.dx.assign(static_cast<size_t>(s.T * nd), 0.0);
  g.dphi.assign(static_cast<size_t>(rows * nd), 0.0);
  g.dalpha.assign(static_cast<size_t>(mhc_alpha_size(s.pre_only)), 0.0);
  g.dbias.assign(static_cast<size_t>(rows), 0.0);
  if (has_gamma) g.dgamma.assign(static_cast<size_t>(nd), 0.0);
  std::vector<double> m(static_cast<size_t>(rows)), h(static_cast<size_t>(rows)), gh(static_cast<size_t>(rows));
  std::vector<double> du(static_cast<size_t>(nd));
  for (int64_t t = 0; t < s.T; ++t) {
    const double* v = in.x.data() + t * nd;
    const double* dy = up.dy.data() + t * D;
    const double inv = project(s, e, in, v, m.data(), h.data());
    // g = dL/dh, block by block.
    for (int64_t i = 0; i < n; ++i) {
      double dh_pre = up.dh_pre.empty() ? 0.0 : up.dh_pre[t * n + i];
      for (int64_t d = 0; d < D; ++d) dh_pre += dy[d] * v[i * D + d];
      const double sg = sigmoid(h[i]);
      gh[i] = dh_pre * sg * (1.0 - sg);
    }
    if (!s.pre_only) {
      for (int64_t i = 0; i < n; ++i) {
        const double sg = sigmoid(h[n + i]);
        gh[n + i] = up.dh_post.empty() ? 0.0 : 2.0 * up.dh_post[t * n + i] * sg * (1.0 - sg);
      }
      if (up.dr.empty()) {
        std::fill(gh.begin() + 2 * n, gh.end(), 0.0);
      } else {
        sinkhorn_backward(h.data() + 2 * n, up.dr.data() + t * n * n, n, e.t_max, e.sk, gh.data() + 2 * n);
      }
    }
    // Through h = inv * alpha_s * m + bias and m = (v * gamma) phi^T.
    double dinv = 0.0;
    std::fill(du.begin(), du.end(), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const int a = alpha_index(r, n);
      const double dm = inv * in.alpha[a] * gh[r];
      dinv += in.alpha[a] * gh[r] * m[r];
      g.dalpha[a] += inv * gh[r] * m[r];
      g.dbias[r] += gh[r];
      for (int64_t i = 0; i < nd; ++i) {
        const double gam = has_gamma ? in.gamma[i] : 1.0;
        g.dphi[r * nd + i] += dm * v[i] * gam;
        du[i] += dm * in.phi[r * nd + i];
      }
    }
    // inv = (mean(v^2) + eps)^(-1/2): d inv / dv = -inv^3 v / (nD).
    const double inv3 = inv * inv * inv / static_cast<double>(nd);
    for (int64_t i = 0; i < nd; ++i) {
      if (has_gamma) g.dgamma[i] += du[i] * v[i];
      const double gam = has_gamma ? in.gamma[i] : 1.0;
      double dv = du[i] * gam - dinv * inv3 * v[i] + (sigmoid(h[i / D]) + e.pre) * dy[i % D];
      if (!up.dx_post.empty()) dv += up.dx_post[t * nd + i];
      g.dx[t * nd + i] = dv;
    }
  }
  return g;
}

std::vector<double> mhc_post_fwd_ref(const MhcShape& s, const std::vector<double>& x, const std::vector<double>& f,
                                     const std::vector<double>& h_post, const std::vector<double>& r) {
  check_shape(s);
  const int64_t n = s.n, D = s.D, nd = n * D;
  check_size(x, s.T * nd, kOp, "x", false);
  check_size(f, s.T * D, kOp, "f", false);
  check_size(h_post, s.T * n, kOp, "h_post", false);
  check_size(r, s.T * n * n, kOp, "h_res", false);
  std::vector<double> out(static_cast<size_t>(s.T * nd), 0.0);
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t k = 0; k < n; ++k)
      for (int64_t d = 0; d < D; ++d) {
        double acc = h_post[t * n + k] * f[t * D + d];
        for (int64_t j = 0; j < n; ++j) acc += r[(t * n + j) * n + k] * x[t * nd + j * D + d];
        out[t * nd + k * D + d] = acc;
      }
  return out;
}

MhcPostGrads mhc_post_bwd_ref(const MhcShape& s, const std::vector<double>& x, const std::vector<double>& f,
                              const std::vector<double>& h_post, const std::vector<double>& r,
                              const std::vector<double>& dout) {
  check_shape(s);
  const int64_t n = s.n, D = s.D, nd = n * D;
  check_size(x, s.T * nd, kOp, "x", false);
  check_size(f, s.T * D, kOp, "f", false);
  check_size(h_post, s.T * n, kOp, "h_post", false);
  check_size(r, s.T * n * n, kOp, "h_res", false);
  check_size(dout, s.T * nd, kOp, "dout", false);
  MhcPostGrads g;
  g.dx.assign(static_cast<size_t>(s.T * nd), 0.0);
  g.df.assign(static_cast<size_t>(s.T * D), 0.0);
  g.dh_post.assign(static_cast<size_t>(s.T * n), 0.0);
  g.dr.assign(static_cast<size_t>(s.T * n * n), 0.0);
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t k = 0; k < n; ++k)
      for (int64_t d = 0; d < D; ++d) {
        const double go = dout[t * nd + k * D + d];
        g.df[t * D + d] += h_post[t * n + k] * go;
        g.dh_post[t * n + k] += go * f[t * D + d];
        for (int64_t j = 0; j < n; ++j) {
          g.dr[(t * n + j) * n + k] += go * x[t * nd + j * D + d];
          g.dx[t * nd + j * D + d] += r[(t * n + j) * n + k] * go;
        }
      }
  return g;
}

}  // namespace kspec::ref
