// Float64 reference for the E79 cell: one batch element at a time, plain loops over the n x n states,
// so each line can be read against the recurrence in reference.h. The backward recomputes the forward,
// keeps every state, and walks the steps backwards carrying the adjoints of S and M.
#include "e79/reference.h"

#include "common/reference_math.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace kspec::ref {
namespace {

using detail::sigmoid;

constexpr double kNormEps = 1e-6;

void check_size(const std::vector<double>& v, int64_t expected, const char* name, bool optional) {
  detail::check_size(v, expected, "e79", name, optional);
}

void check_args(const E79Shape& s, const E79Inputs& in) {
  if (s.T < 1 || s.B < 1 || s.n < 1) {
    throw std::invalid_argument("e79 reference: need T, B, n >= 1, got T=" + std::to_string(s.T) +
                                " B=" + std::to_string(s.B) + " n=" + std::to_string(s.n));
  }
  const int64_t tbn = s.T * s.B * s.n;
  check_size(in.k, tbn, "k", false);
  check_size(in.v, tbn, "v", false);
  check_size(in.q, tbn, "q", false);
  check_size(in.m, tbn, "m", false);
  switch (s.bias_mode) {
    case kE79BiasNone:
      check_size(in.b_s, 0, "b_s (bias mode none)", false);
      check_size(in.b_m, 0, "b_m (bias mode none)", false);
      break;
    case kE79BiasFixed:
      check_size(in.b_s, s.n, "b_s", false);
      check_size(in.b_m, s.n, "b_m", false);
      break;
    case kE79BiasInput:
      check_size(in.b_s, tbn, "b_s", false);
      check_size(in.b_m, tbn, "b_m", false);
      break;
    default:
      throw std::invalid_argument("e79 reference: unknown bias_mode " + std::to_string(s.bias_mode));
  }
  check_size(in.S0, s.B * s.n * s.n, "S0", true);
  check_size(in.M0, s.B * s.n * s.n, "M0", true);
}

// Offset of the bias row for (t, b), or -1 without biases.
int64_t bias_offset(const E79Shape& s, int64_t t, int64_t b) {
  if (s.bias_mode == kE79BiasFixed) return 0;
  if (s.bias_mode == kE79BiasInput) return (t * s.B + b) * s.n;
  return -1;
}

// The vectors of one step that the backward needs besides the states themselves.
struct StepCache {
  std::vector<double> kh, mh, s_row, s_col, s_delta, m_row, m_col, m_delta, sq;
  double k_norm = 0.0, m_norm = 0.0;
  explicit StepCache(int64_t n)
      : kh(n), mh(n), s_row(n), s_col(n), s_delta(n), m_row(n), m_col(n), m_delta(n), sq(n) {}
};

// x / (|x| + eps) into xh; returns |x|.
double normalize(int64_t n, const double* x, double* xh) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double norm = std::sqrt(ss);
  for (int64_t i = 0; i < n; ++i) xh[i] = x[i] / (norm + kNormEps);
  return norm;
}

// One step (S_prev, M_prev) -> (S, M) and out_t; the four state pointers must be distinct. b_s, b_m
// point at this step's bias row or are null.
void step_forward(int64_t n, const double* S_prev, const double* M_prev, const double* k,
                  const double* v, const double* q, const double* m, const double* b_s,
                  const double* b_m, double* S, double* M, double* out, StepCache& c) {
  c.k_norm = normalize(n, k, c.kh.data());
  c.m_norm = normalize(n, m, c.mh.data());
  for (int64_t i = 0; i < n; ++i) {
    double row = 0.0, col = 0.0, sk = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      row += M_prev[i * n + j] * c.kh[j];
      col += M_prev[j * n + i] * c.kh[j];
      sk += S_prev[i * n + j] * c.kh[j];
    }
    const double bias = b_s ? b_s[i] : 0.0;
    c.s_row[i] = sigmoid(row + bias);
    c.s_col[i] = sigmoid(col + bias);
    c.s_delta[i] = v[i] - sk;
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      S[i * n + j] = c.s_row[i] * S_prev[i * n + j] * c.s_col[j] + c.s_delta[i] * c.kh[j];
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    double row = 0.0, col = 0.0, mm = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      row += S[i * n + j] * c.mh[j];
      col += S[j * n + i] * c.mh[j];
      mm += M_prev[i * n + j] * c.mh[j];
    }
    const double bias = b_m ? b_m[i] : 0.0;
    c.m_row[i] = sigmoid(row + bias);
    c.m_col[i] = sigmoid(col + bias);
    c.m_delta[i] = c.s_delta[i] - mm;
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      M[i * n + j] = c.m_row[i] * M_prev[i * n + j] * c.m_col[j] + c.m_delta[i] * c.mh[j];
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    double sq = 0.0;
    for (int64_t j = 0; j < n; ++j) sq += S[i * n + j] * q[j];
    c.sq[i] = sq;
    out[i] = sq * sq * sigmoid(sq);
  }
}

// Gradient of x through xh = x / (|x| + eps): J = I / (r + eps) - x x^T / (r (r + eps)^2). At x = 0
// the norm has no derivative; the first term alone is the one-sided limit along any direction.
void normalize_backward(int64_t n, const double* x, double norm, const double* dxh, double* dx) {
  const double inv = 1.0 / (norm + kNormEps);
  double x_dot = 0.0;
  for (int64_t i = 0; i < n; ++i) x_dot += x[i] * dxh[i];
  const double radial = norm > 0.0 ? x_dot * inv * inv / norm : 0.0;
  for (int64_t i = 0; i < n; ++i) dx[i] = dxh[i] * inv - x[i] * radial;
}

// Scratch for one backward step.
struct StepAdjoints {
  std::vector<double> dkh, dmh, d_delta, d_row, d_col, g;
  explicit StepAdjoints(int64_t n) : dkh(n), dmh(n), d_delta(n), d_row(n), d_col(n), g(n) {}
};

// Reverse of step_forward. On entry dS, dM are the adjoints of S, M (the states after the step); on
// exit those of S_prev, M_prev. Writes the gradients of k, v, q, m and of the pre-sigmoid gate inputs
// summed over row and column (db_s, db_m: this step's contribution to the bias gradients).
void step_backward(int64_t n, const double* S_prev, const double* M_prev, const double* S,
                   const double* k, const double* q, const double* m, const double* dout,
                   const StepCache& c, double* dS, double* dM, double* dk, double* dv, double* dq,
                   double* dm, double* db_s, double* db_m, StepAdjoints& a) {
  // out = sq^2 sigma(sq): d out / d sq = sq sigma (2 + sq (1 - sigma)).
  for (int64_t i = 0; i < n; ++i) {
    const double sg = sigmoid(c.sq[i]);
    a.g[i] = dout[i] * c.sq[i] * sg * (2.0 + c.sq[i] * (1.0 - sg));
  }
  for (int64_t j = 0; j < n; ++j) {
    double acc = 0.0;
    for (int64_t i = 0; i < n; ++i) acc += S[i * n + j] * a.g[i];
    dq[j] = acc;
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) dS[i * n + j] += a.g[i] * q[j];
  }

  // M update. d_row, d_col become the adjoints of the gates' pre-sigmoid inputs.
  for (int64_t i = 0; i < n; ++i) {
    a.d_row[i] = 0.0;
    a.d_col[i] = 0.0;
    a.d_delta[i] = 0.0;
    a.dmh[i] = 0.0;
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double d = dM[i * n + j];
      a.d_row[i] += d * M_prev[i * n + j] * c.m_col[j];
      a.d_col[j] += d * c.m_row[i] * M_prev[i * n + j];
      a.d_delta[i] += d * c.mh[j];
      a.dmh[j] += d * c.m_delta[i];
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    a.d_row[i] *= c.m_row[i] * (1.0 - c.m_row[i]);
    a.d_col[i] *= c.m_col[i] * (1.0 - c.m_col[i]);
    db_m[i] = a.d_row[i] + a.d_col[i];
  }
  // m_delta = s_delta - M_prev mh; row gate reads S mh, column gate S^T mh. The gradient through M
  // into M_prev is the gated copy plus the m_delta term, so dM is rewritten in place only after its
  // old values have been used above.
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double mp = M_prev[i * n + j];
      a.dmh[j] -= mp * a.d_delta[i];
      a.dmh[j] += S[i * n + j] * a.d_row[i];
      a.dmh[i] += S[i * n + j] * a.d_col[j];
      dS[i * n + j] += a.d_row[i] * c.mh[j] + c.mh[i] * a.d_col[j];
      dM[i * n + j] = dM[i * n + j] * c.m_row[i] * c.m_col[j] - a.d_delta[i] * c.mh[j];
    }
  }
  normalize_backward(n, m, c.m_norm, a.dmh.data(), dm);

  // S update; d_delta carries on as the adjoint of s_delta (it already holds the part through m_delta).
  for (int64_t i = 0; i < n; ++i) {
    a.d_row[i] = 0.0;
    a.d_col[i] = 0.0;
    a.dkh[i] = 0.0;
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double d = dS[i * n + j];
      a.d_row[i] += d * S_prev[i * n + j] * c.s_col[j];
      a.d_col[j] += d * c.s_row[i] * S_prev[i * n + j];
      a.d_delta[i] += d * c.kh[j];
      a.dkh[j] += d * c.s_delta[i];
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    dv[i] = a.d_delta[i];
    a.d_row[i] *= c.s_row[i] * (1.0 - c.s_row[i]);
    a.d_col[i] *= c.s_col[i] * (1.0 - c.s_col[i]);
    db_s[i] = a.d_row[i] + a.d_col[i];
  }
  // s_delta = v - S_prev kh; row gate reads M_prev kh, column gate M_prev^T kh.
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double sp = S_prev[i * n + j];
      const double mp = M_prev[i * n + j];
      a.dkh[j] -= sp * a.d_delta[i];
      a.dkh[j] += mp * a.d_row[i];
      a.dkh[i] += mp * a.d_col[j];
      dM[i * n + j] += a.d_row[i] * c.kh[j] + c.kh[i] * a.d_col[j];
      dS[i * n + j] = dS[i * n + j] * c.s_row[i] * c.s_col[j] - a.d_delta[i] * c.kh[j];
    }
  }
  normalize_backward(n, k, c.k_norm, a.dkh.data(), dk);
}

void load_state(const std::vector<double>& init, int64_t b, int64_t nn, double* state) {
  for (int64_t i = 0; i < nn; ++i) state[i] = init.empty() ? 0.0 : init[b * nn + i];
}

}  // namespace

E79Outputs e79_fwd_ref(const E79Shape& s, const E79Inputs& in) {
  check_args(s, in);
  const int64_t n = s.n, nn = n * n;
  E79Outputs res;
  res.out.assign(static_cast<size_t>(s.T * s.B * n), 0.0);
  res.S.assign(static_cast<size_t>(s.B * nn), 0.0);
  res.M.assign(static_cast<size_t>(s.B * nn), 0.0);
  // Two buffers per state, swapped each step, so step_forward never reads what it writes.
  std::vector<double> S_a(nn), S_b(nn), M_a(nn), M_b(nn);
  StepCache c(n);
  for (int64_t b = 0; b < s.B; ++b) {
    double* S_cur = S_a.data();
    double* S_nxt = S_b.data();
    double* M_cur = M_a.data();
    double* M_nxt = M_b.data();
    load_state(in.S0, b, nn, S_cur);
    load_state(in.M0, b, nn, M_cur);
    for (int64_t t = 0; t < s.T; ++t) {
      const int64_t row = (t * s.B + b) * n;
      const int64_t bias = bias_offset(s, t, b);
      step_forward(n, S_cur, M_cur, &in.k[row], &in.v[row], &in.q[row], &in.m[row],
                   bias < 0 ? nullptr : &in.b_s[bias], bias < 0 ? nullptr : &in.b_m[bias], S_nxt,
                   M_nxt, &res.out[row], c);
      std::swap(S_cur, S_nxt);
      std::swap(M_cur, M_nxt);
    }
    for (int64_t i = 0; i < nn; ++i) {
      res.S[b * nn + i] = S_cur[i];
      res.M[b * nn + i] = M_cur[i];
    }
  }
  return res;
}

E79Grads e79_bwd_ref(const E79Shape& s, const E79Inputs& in, const std::vector<double>& dout,
                     const std::vector<double>* dS_final, const std::vector<double>* dM_final) {
  check_args(s, in);
  const int64_t T = s.T, n = s.n, nn = n * n;
  check_size(dout, T * s.B * n, "dout", false);
  if (dS_final) check_size(*dS_final, s.B * nn, "dS_final", false);
  if (dM_final) check_size(*dM_final, s.B * nn, "dM_final", false);

  const size_t tbn = static_cast<size_t>(T * s.B * n);
  E79Grads g;
  g.dk.assign(tbn, 0.0);
  g.dv.assign(tbn, 0.0);
  g.dq.assign(tbn, 0.0);
  g.dm.assign(tbn, 0.0);
  if (s.bias_mode != kE79BiasNone) {
    g.db_s.assign(in.b_s.size(), 0.0);
    g.db_m.assign(in.b_m.size(), 0.0);
  }
  if (!in.S0.empty()) g.dS0.assign(in.S0.size(), 0.0);
  if (!in.M0.empty()) g.dM0.assign(in.M0.size(), 0.0);

  // Slot t + 1 of Ss, Ms holds the state after step t; slot 0 the initial state.
  std::vector<double> Ss(static_cast<size_t>((T + 1) * nn)), Ms(static_cast<size_t>((T + 1) * nn));
  std::vector<double> dS(nn), dM(nn), db_s_t(n), db_m_t(n), out_t(n);
  StepCache c(n);
  StepAdjoints a(n);
  for (int64_t b = 0; b < s.B; ++b) {
    load_state(in.S0, b, nn, Ss.data());
    load_state(in.M0, b, nn, Ms.data());
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = (t * s.B + b) * n;
      const int64_t bias = bias_offset(s, t, b);
      step_forward(n, &Ss[t * nn], &Ms[t * nn], &in.k[row], &in.v[row], &in.q[row], &in.m[row],
                   bias < 0 ? nullptr : &in.b_s[bias], bias < 0 ? nullptr : &in.b_m[bias],
                   &Ss[(t + 1) * nn], &Ms[(t + 1) * nn], out_t.data(), c);
    }

    for (int64_t i = 0; i < nn; ++i) {
      dS[i] = dS_final ? (*dS_final)[b * nn + i] : 0.0;
      dM[i] = dM_final ? (*dM_final)[b * nn + i] : 0.0;
    }
    for (int64_t t = T - 1; t >= 0; --t) {
      const int64_t row = (t * s.B + b) * n;
      const int64_t bias = bias_offset(s, t, b);
      // Recomputes the step's gate vectors (it rewrites the same S_{t+1}, M_{t+1}) so that only the
      // states, not 9 vectors per step, are kept.
      step_forward(n, &Ss[t * nn], &Ms[t * nn], &in.k[row], &in.v[row], &in.q[row], &in.m[row],
                   bias < 0 ? nullptr : &in.b_s[bias], bias < 0 ? nullptr : &in.b_m[bias],
                   &Ss[(t + 1) * nn], &Ms[(t + 1) * nn], out_t.data(), c);
      step_backward(n, &Ss[t * nn], &Ms[t * nn], &Ss[(t + 1) * nn], &in.k[row], &in.q[row],
                    &in.m[row], &dout[row], c, dS.data(), dM.data(), &g.dk[row], &g.dv[row],
                    &g.dq[row], &g.dm[row], db_s_t.data(), db_m_t.data(), a);
      if (bias >= 0) {
        for (int64_t i = 0; i < n; ++i) {
          g.db_s[bias + i] += db_s_t[i];
          g.db_m[bias + i] += db_m_t[i];
        }
      }
    }
    for (int64_t i = 0; i < nn; ++i) {
      if (!g.dS0.empty()) g.dS0[b * nn + i] = dS[i];
      if (!g.dM0.empty()) g.dM0[b * nn + i] = dM[i];
    }
  }
  return g;
}

}  // namespace kspec::ref
