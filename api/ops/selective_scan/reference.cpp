// Float64 reference for the selective scan: one channel (batch b, channel d) at a time, plain loops
// over time and state, so each line can be read against the recurrence in reference.h.
// The backward recomputes the forward and walks the recurrence backwards with a running adjoint.
#include "selective_scan/reference.h"

#include "common/reference_math.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace kspec::ref {
namespace {

using detail::sigmoid;
using detail::softplus;



void check_size(const std::vector<double>& v, int64_t expected, const char* name, bool optional) {
  detail::check_size(v, expected, "selective_scan", name, optional);
}

void check_args(const ScanShape& s, const ScanInputs& in) {
  if (s.batch < 1 || s.dim < 1 || s.seqlen < 1 || s.dstate < 1 || s.groups < 1 ||
      s.dim % s.groups != 0) {
    throw std::invalid_argument(
        "selective_scan reference: need batch, dim, seqlen, dstate, groups >= 1 and groups | dim, got "
        "batch=" + std::to_string(s.batch) + " dim=" + std::to_string(s.dim) +
        " seqlen=" + std::to_string(s.seqlen) + " dstate=" + std::to_string(s.dstate) +
        " groups=" + std::to_string(s.groups));
  }
  const int64_t bdt = s.batch * s.dim * s.seqlen;
  const int64_t fixed_bc = s.dim * s.dstate;
  const int64_t variable_bc = s.batch * s.groups * s.dstate * s.seqlen;
  check_size(in.u, bdt, "u", false);
  check_size(in.delta, bdt, "delta", false);
  check_size(in.A, s.dim * s.dstate, "A", false);
  check_size(in.B, s.variable_b ? variable_bc : fixed_bc, "B", false);
  check_size(in.C, s.variable_c ? variable_bc : fixed_bc, "C", false);
  check_size(in.D, s.dim, "D", true);
  check_size(in.z, bdt, "z", true);
  check_size(in.delta_bias, s.dim, "delta_bias", true);
  check_size(in.h0, s.batch * s.dim * s.dstate, "h0", true);
}

// Index of B or C for (b, d, n, t) in its fixed or variable layout.
int64_t bc_index(const ScanShape& s, bool variable, int64_t b, int64_t d, int64_t n, int64_t t) {
  if (!variable) return d * s.dstate + n;
  const int64_t g = d / (s.dim / s.groups);
  return ((b * s.groups + g) * s.dstate + n) * s.seqlen + t;
}

// The time step after bias and softplus, for channel (b, d); pre keeps the value before softplus,
// whose sigmoid is the softplus derivative the backward needs.
void channel_dt(const ScanShape& s, const ScanInputs& in, int64_t b, int64_t d,
                std::vector<double>& pre, std::vector<double>& dt) {
  const int64_t row = (b * s.dim + d) * s.seqlen;
  const double bias = in.delta_bias.empty() ? 0.0 : in.delta_bias[d];
  for (int64_t t = 0; t < s.seqlen; ++t) {
    pre[t] = in.delta[row + t] + bias;
    dt[t] = in.delta_softplus ? softplus(pre[t]) : pre[t];
  }
}

// One time step of the state update for channel (b, d), in place: x <- exp(dt A) x + dt B u; returns
// y = C . x for the new state.
double step(const ScanShape& s, const ScanInputs& in, int64_t b, int64_t d, int64_t t, double dt,
            double* x) {
  const double u = in.u[(b * s.dim + d) * s.seqlen + t];
  double y = 0.0;
  for (int64_t n = 0; n < s.dstate; ++n) {
    const double a = std::exp(dt * in.A[d * s.dstate + n]);
    x[n] = a * x[n] + dt * in.B[bc_index(s, s.variable_b, b, d, n, t)] * u;
    y += in.C[bc_index(s, s.variable_c, b, d, n, t)] * x[n];
  }
  return y;
}

void load_h0(const ScanShape& s, const ScanInputs& in, int64_t b, int64_t d, double* x) {
  for (int64_t n = 0; n < s.dstate; ++n) {
    x[n] = in.h0.empty() ? 0.0 : in.h0[(b * s.dim + d) * s.dstate + n];
  }
}

}  // namespace

ScanOutputs selective_scan_fwd_ref(const ScanShape& s, const ScanInputs& in, int64_t state_stride) {
  check_args(s, in);
  if (state_stride < 0) throw std::invalid_argument("selective_scan_fwd_ref: state_stride must be >= 0");
  ScanOutputs res;
  res.out.assign(static_cast<size_t>(s.batch * s.dim * s.seqlen), 0.0);
  res.last_state.assign(static_cast<size_t>(s.batch * s.dim * s.dstate), 0.0);
  const int64_t nst = state_stride > 0 ? (s.seqlen + state_stride - 1) / state_stride : 0;
  res.states.assign(static_cast<size_t>(s.batch * s.dim * nst * s.dstate), 0.0);
  std::vector<double> pre(s.seqlen), dt(s.seqlen), x(s.dstate);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t d = 0; d < s.dim; ++d) {
      channel_dt(s, in, b, d, pre, dt);
      load_h0(s, in, b, d, x.data());
      const int64_t row = (b * s.dim + d) * s.seqlen;
      for (int64_t t = 0; t < s.seqlen; ++t) {
        if (nst > 0 && t % state_stride == 0)
          for (int64_t n = 0; n < s.dstate; ++n)
            res.states[((b * s.dim + d) * nst + t / state_stride) * s.dstate + n] = x[n];
        double o = step(s, in, b, d, t, dt[t], x.data());
        if (!in.D.empty()) o += in.D[d] * in.u[row + t];
        if (!in.z.empty()) o *= in.z[row + t] * sigmoid(in.z[row + t]);
        res.out[row + t] = o;
      }
      for (int64_t n = 0; n < s.dstate; ++n) res.last_state[(b * s.dim + d) * s.dstate + n] = x[n];
    }
  }
  return res;
}

ScanGrads selective_scan_bwd_ref(const ScanShape& s, const ScanInputs& in,
                                 const std::vector<double>& dout,
                                 const std::vector<double>* dlast_state) {
  check_args(s, in);
  check_size(dout, s.batch * s.dim * s.seqlen, "dout", false);
  if (dlast_state) check_size(*dlast_state, s.batch * s.dim * s.dstate, "dlast_state", false);

  const int64_t T = s.seqlen, N = s.dstate;
  const size_t bdt = static_cast<size_t>(s.batch * s.dim * T);
  ScanGrads g;
  g.du.assign(bdt, 0.0);
  g.ddelta.assign(bdt, 0.0);
  g.dA.assign(in.A.size(), 0.0);
  g.dB.assign(in.B.size(), 0.0);
  g.dC.assign(in.C.size(), 0.0);
  if (!in.D.empty()) g.dD.assign(in.D.size(), 0.0);
  if (!in.z.empty()) g.dz.assign(bdt, 0.0);
  if (!in.delta_bias.empty()) g.ddelta_bias.assign(in.delta_bias.size(), 0.0);
  if (!in.h0.empty()) g.dh0.assign(in.h0.size(), 0.0);

  // states row t + 1 holds x_t; row 0 holds x_{-1} = h0. y keeps C . x_t for the z gradient.
  std::vector<double> pre(T), dt(T), y(T), states(static_cast<size_t>((T + 1) * N)), hx(N);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t d = 0; d < s.dim; ++d) {
      const int64_t row = (b * s.dim + d) * T;
      channel_dt(s, in, b, d, pre, dt);
      load_h0(s, in, b, d, states.data());
      for (int64_t t = 0; t < T; ++t) {
        const double* x_prev = states.data() + t * N;
        double* x = states.data() + (t + 1) * N;
        for (int64_t n = 0; n < N; ++n) x[n] = x_prev[n];
        y[t] = step(s, in, b, d, t, dt[t], x);
      }

      // hx is the adjoint of x_t: the gradient of the loss through x_t and everything after it.
      for (int64_t n = 0; n < N; ++n) hx[n] = dlast_state ? (*dlast_state)[(b * s.dim + d) * N + n] : 0.0;
      for (int64_t t = T - 1; t >= 0; --t) {
        const double u = in.u[row + t];
        double gy = dout[row + t];
        if (!in.z.empty()) {
          const double z = in.z[row + t];
          const double sg = sigmoid(z);
          const double pre_gate = y[t] + (in.D.empty() ? 0.0 : in.D[d] * u);
          g.dz[row + t] = gy * pre_gate * sg * (1.0 + z * (1.0 - sg));
          gy *= z * sg;
        }
        if (!in.D.empty()) {
          g.dD[d] += gy * u;
          g.du[row + t] += gy * in.D[d];
        }
        const double* x_cur = states.data() + (t + 1) * N;
        const double* x_prev = states.data() + t * N;
        double ddt = 0.0;
        for (int64_t n = 0; n < N; ++n) {
          const int64_t ib = bc_index(s, s.variable_b, b, d, n, t);
          const int64_t ic = bc_index(s, s.variable_c, b, d, n, t);
          const double A = in.A[d * N + n];
          const double a = std::exp(dt[t] * A);
          hx[n] += gy * in.C[ic];
          g.dC[ic] += gy * x_cur[n];
          ddt += hx[n] * (A * a * x_prev[n] + in.B[ib] * u);
          g.dA[d * N + n] += hx[n] * dt[t] * a * x_prev[n];
          g.dB[ib] += hx[n] * dt[t] * u;
          g.du[row + t] += hx[n] * dt[t] * in.B[ib];
          hx[n] *= a;  // now the adjoint of x_{t-1}
        }
        const double dpre = in.delta_softplus ? ddt * sigmoid(pre[t]) : ddt;
        g.ddelta[row + t] = dpre;
        if (!in.delta_bias.empty()) g.ddelta_bias[d] += dpre;
      }
      if (!in.h0.empty()) {
        for (int64_t n = 0; n < N; ++n) g.dh0[(b * s.dim + d) * N + n] = hx[n];
      }
    }
  }
  return g;
}

}  // namespace kspec::ref
