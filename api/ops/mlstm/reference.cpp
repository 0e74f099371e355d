// Float64 mLSTM reference (see reference.h): one sequence (b, h) at a time, plain loops. The chunkwise
// form is the one primitive: the recurrence is chunk 1, the parallel form one chunk of length S from
// states (0, 0, -inf).
#include "mlstm/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace kspec::ref {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

void check_size(const std::vector<double>& v, int64_t want, const char* name) {
  if (static_cast<int64_t>(v.size()) != want)
    throw std::invalid_argument(std::string("mlstm reference: ") + name + " has " + std::to_string(v.size()) +
                                " elements, expected " + std::to_string(want));
}

// Validates the inputs; returns whether the initial states are given.
bool check(const MlstmShape& s, const MlstmInputs& in) {
  if (s.B < 0 || s.NH < 0 || s.S < 1 || s.DK < 1 || s.DV < 1)
    throw std::invalid_argument("mlstm reference: bad shape (S, DK, DV must be >= 1)");
  const int64_t seqs = s.B * s.NH;
  check_size(in.q, seqs * s.S * s.DK, "q");
  check_size(in.k, seqs * s.S * s.DK, "k");
  check_size(in.v, seqs * s.S * s.DV, "v");
  check_size(in.i, seqs * s.S, "i");
  check_size(in.f, seqs * s.S, "f");
  const bool init = !in.C0.empty();
  if (in.n0.empty() == init || in.m0.empty() == init)
    throw std::invalid_argument("mlstm reference: C0, n0 and m0 must be given together");
  if (init) {
    check_size(in.C0, seqs * s.DK * s.DV, "C0");
    check_size(in.n0, seqs * s.DK, "n0");
    check_size(in.m0, seqs, "m0");
  }
  return init;
}

void check_chunk(int64_t chunk) {
  if (chunk < 1) throw std::invalid_argument("mlstm reference: chunk must be >= 1, got " + std::to_string(chunk));
}

double sigmoid(double x) {
  const double e = std::exp(-std::abs(x));
  return x >= 0.0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

double dot(const double* a, const double* b, int64_t n) {
  double r = 0.0;
  for (int64_t j = 0; j < n; ++j) r += a[j] * b[j];
  return r;
}

// One sequence's pointers at time t0 (a = logsigmoid(f), computed once).
struct Seq {
  const double *q, *k, *v, *i, *a;
};

Seq seq_at(const MlstmShape& s, const MlstmInputs& in, const std::vector<double>& a, int64_t bh, int64_t t0) {
  const int64_t t = bh * s.S + t0;
  return {in.q.data() + t * s.DK, in.k.data() + t * s.DK, in.v.data() + t * s.DV, in.i.data() + t, a.data() + t};
}

// The in-chunk quantities both directions use: b (cumsum of a), the stabilizers m_t, D_ts =
// e^(b_t - b_s + i_s - m_t) (s <= t), g_t = e^(b_t + m - m_t), w_s = e^(b_L - b_s + i_s - m_end) and
// g_end = e^(b_L + m - m_end).
struct ChunkGates {
  std::vector<double> b, m_row, D, g, w;
  double m_end = 0.0, g_end = 0.0;
};

ChunkGates chunk_gates(const Seq& x, int64_t L, double m) {
  ChunkGates c;
  c.b.resize(L);
  c.m_row.resize(L);
  c.D.assign(L * L, 0.0);
  c.g.resize(L);
  c.w.resize(L);
  double run = 0.0;
  for (int64_t t = 0; t < L; ++t) c.b[t] = run += x.a[t];
  for (int64_t t = 0; t < L; ++t) {
    double mt = c.b[t] + m;
    for (int64_t u = 0; u <= t; ++u) mt = std::max(mt, c.b[t] - c.b[u] + x.i[u]);
    c.m_row[t] = mt;
    for (int64_t u = 0; u <= t; ++u) c.D[t * L + u] = std::exp(c.b[t] - c.b[u] + x.i[u] - mt);
    c.g[t] = std::exp(c.b[t] + m - mt);
  }
  c.m_end = c.m_row[L - 1];
  c.g_end = std::exp(c.b[L - 1] + m - c.m_end);
  for (int64_t u = 0; u < L; ++u) c.w[u] = std::exp(c.b[L - 1] - c.b[u] + x.i[u] - c.m_end);
  return c;
}

// One chunk of L steps of one sequence from states (C, n, m), updated in place; writes h, nrm, m per row.
void chunk_fwd(const MlstmShape& s, const Seq& x, int64_t L, double* C, double* n, double& m, double eps, double* h,
               double* nrm, double* m_out) {
  const int64_t DK = s.DK, DV = s.DV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(DK));
  const ChunkGates c = chunk_gates(x, L, m);
  for (int64_t t = 0; t < L; ++t) {
    const double* q = x.q + t * DK;
    double* ht = h + t * DV;
    double z = c.g[t] * scale * dot(q, n, DK);
    for (int64_t e = 0; e < DV; ++e) {
      double r = 0.0;
      for (int64_t d = 0; d < DK; ++d) r += q[d] * C[d * DV + e];
      ht[e] = c.g[t] * scale * r;
    }
    for (int64_t u = 0; u <= t; ++u) {
      const double ct = c.D[t * L + u] * scale * dot(q, x.k + u * DK, DK);
      z += ct;
      for (int64_t e = 0; e < DV; ++e) ht[e] += ct * x.v[u * DV + e];
    }
    nrm[t] = std::max(std::abs(z), std::exp(-c.m_row[t]));
    for (int64_t e = 0; e < DV; ++e) ht[e] /= nrm[t] + eps;
    m_out[t] = c.m_row[t];
  }
  for (int64_t d = 0; d < DK; ++d) {
    n[d] *= c.g_end;
    for (int64_t e = 0; e < DV; ++e) C[d * DV + e] *= c.g_end;
    for (int64_t u = 0; u < L; ++u) {
      const double wk = c.w[u] * x.k[u * DK + d];
      n[d] += wk;
      for (int64_t e = 0; e < DV; ++e) C[d * DV + e] += wk * x.v[u * DV + e];
    }
  }
  m = c.m_end;
}

std::vector<double> log_sigmoid_all(const std::vector<double>& f) {
  std::vector<double> a(f.size());
  for (size_t j = 0; j < f.size(); ++j) a[j] = log_sigmoid(f[j]);
  return a;
}

// The states entering every chunk of every sequence, recorded by chunk_fwd when `entering` is set.
struct Entering {
  std::vector<double> C, m;  // [seqs, nchunks, DK, DV], [seqs, nchunks]
};

MlstmOutputs forward(const MlstmShape& s, const MlstmInputs& in, int64_t chunk, bool parallel, double eps,
                     Entering* entering) {
  const bool init = check(s, in);
  check_chunk(chunk);
  if (parallel && init) throw std::invalid_argument("mlstm reference: the parallel form takes no initial states");
  const int64_t seqs = s.B * s.NH, kv = s.DK * s.DV, nchunks = (s.S + chunk - 1) / chunk;
  const std::vector<double> a = log_sigmoid_all(in.f);
  MlstmOutputs o;
  o.h.resize(seqs * s.S * s.DV);
  o.nrm.resize(seqs * s.S);
  o.m.resize(seqs * s.S);
  o.C = init ? in.C0 : std::vector<double>(seqs * kv, 0.0);
  o.n = init ? in.n0 : std::vector<double>(seqs * s.DK, 0.0);
  o.m_last = init ? in.m0 : std::vector<double>(seqs, parallel ? -kInf : 0.0);
  if (entering) {
    entering->C.resize(seqs * nchunks * kv);
    entering->m.resize(seqs * nchunks);
  }
  for (int64_t bh = 0; bh < seqs; ++bh) {
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t t0 = c * chunk, L = std::min(chunk, s.S - t0);
      double* C = o.C.data() + bh * kv;
      if (entering) {
        std::copy(C, C + kv, entering->C.begin() + (bh * nchunks + c) * kv);
        entering->m[bh * nchunks + c] = o.m_last[bh];
      }
      const int64_t row = bh * s.S + t0;
      chunk_fwd(s, seq_at(s, in, a, bh, t0), L, C, o.n.data() + bh * s.DK, o.m_last[bh], eps,
                o.h.data() + row * s.DV, o.nrm.data() + row, o.m.data() + row);
    }
  }
  if (parallel) o.C.clear(), o.n.clear(), o.m_last.clear();
  return o;
}

void check_dh(const MlstmShape& s, const std::vector<double>& dh) { check_size(dh, s.B * s.NH * s.S * s.DV, "dh"); }

// df from dq, dk: h_t and C_last are linear in q_t and in k_s and scale with e^(F_t), e^(-F_s) (F the
// cumsum of a), so dF_t = q_t . dq_t - k_t . dk_t, plus <dC_last, C_last> at the last step; then
// da = reverse cumsum of dF and df = da sigmoid(-f).
void df_from(const MlstmShape& s, const MlstmInputs& in, const std::vector<double>& dC_last,
             const std::vector<double>& C_last, MlstmGrads& g) {
  const int64_t kv = s.DK * s.DV;
  g.df.resize(in.f.size());
  for (int64_t bh = 0; bh < s.B * s.NH; ++bh) {
    double da = dC_last.empty() ? 0.0 : dot(dC_last.data() + bh * kv, C_last.data() + bh * kv, kv);
    for (int64_t t = s.S - 1; t >= 0; --t) {
      const int64_t r = bh * s.S + t;
      da += dot(in.q.data() + r * s.DK, g.dq.data() + r * s.DK, s.DK) -
            dot(in.k.data() + r * s.DK, g.dk.data() + r * s.DK, s.DK);
      // The sum down to step 0 is <dC, C> of the entering state, which a_0 alone scales: exactly 0
      // without one (the kernel writes the same 0 where this sum leaves rounding noise).
      g.df[r] = (t == 0 && in.C0.empty()) ? 0.0 : da * sigmoid(-in.f[r]);
    }
  }
}

// One chunk's gradients with nrm, m constant, from dC after the chunk (dC: in, replaced by dC before it).
void chunk_bwd(const MlstmShape& s, const Seq& x, int64_t L, const double* C, double m, const double* nrm,
               const double* dh, double eps, double* dC, double* dq, double* dk, double* dv, double* di) {
  const int64_t DK = s.DK, DV = s.DV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(DK));
  const ChunkGates c = chunk_gates(x, L, m);
  std::vector<double> dhn(L * DV), dCin(DK * DV);
  for (int64_t t = 0; t < L; ++t)
    for (int64_t e = 0; e < DV; ++e) dhn[t * DV + e] = dh[t * DV + e] / (nrm[t] + eps);
  std::fill(dq, dq + L * DK, 0.0);
  std::fill(dk, dk + L * DK, 0.0);
  std::fill(dv, dv + L * DV, 0.0);
  for (int64_t t = 0; t < L; ++t) {
    const double* q = x.q + t * DK;
    const double* dht = dhn.data() + t * DV;
    for (int64_t d = 0; d < DK; ++d) dq[t * DK + d] = c.g[t] * dot(C + d * DV, dht, DV);
    for (int64_t u = 0; u <= t; ++u) {
      const double D = c.D[t * L + u];
      const double hv = D * dot(dht, x.v + u * DV, DV);        // D_tu (dhn_t . v_u)
      const double qk = D * scale * dot(q, x.k + u * DK, DK);  // D_tu (s q_t . k_u)
      for (int64_t d = 0; d < DK; ++d) {
        dq[t * DK + d] += hv * x.k[u * DK + d];
        dk[u * DK + d] += hv * scale * q[d];
      }
      for (int64_t e = 0; e < DV; ++e) dv[u * DV + e] += qk * dht[e];
    }
    for (int64_t d = 0; d < DK; ++d) dq[t * DK + d] *= scale;
  }
  for (int64_t u = 0; u < L; ++u) {
    for (int64_t d = 0; d < DK; ++d) dk[u * DK + d] += c.w[u] * dot(dC + d * DV, x.v + u * DV, DV);
    for (int64_t e = 0; e < DV; ++e) {
      double r = 0.0;
      for (int64_t d = 0; d < DK; ++d) r += dC[d * DV + e] * x.k[u * DK + d];
      dv[u * DV + e] += c.w[u] * r;
    }
    di[u] = dot(x.k + u * DK, dk + u * DK, DK);
  }
  for (int64_t d = 0; d < DK; ++d)
    for (int64_t e = 0; e < DV; ++e) {
      double r = c.g_end * dC[d * DV + e];
      for (int64_t t = 0; t < L; ++t) r += c.g[t] * scale * x.q[t * DK + d] * dhn[t * DV + e];
      dCin[d * DV + e] = r;
    }
  std::copy(dCin.begin(), dCin.end(), dC);
}

MlstmGrads backward(const MlstmShape& s, const MlstmInputs& in, const std::vector<double>& dh,
                    const std::vector<double>* dC_last, int64_t chunk, bool parallel, double eps) {
  Entering entering;
  const MlstmOutputs o = forward(s, in, chunk, parallel, eps, &entering);
  check_dh(s, dh);
  const int64_t seqs = s.B * s.NH, kv = s.DK * s.DV, nchunks = (s.S + chunk - 1) / chunk;
  if (dC_last) check_size(*dC_last, seqs * kv, "dC_last");
  const std::vector<double> a = log_sigmoid_all(in.f);
  MlstmGrads g;
  g.dq.resize(in.q.size());
  g.dk.resize(in.k.size());
  g.dv.resize(in.v.size());
  g.di.resize(in.i.size());
  std::vector<double> dC = dC_last ? *dC_last : std::vector<double>(seqs * kv, 0.0);
  for (int64_t bh = 0; bh < seqs; ++bh) {
    for (int64_t c = nchunks - 1; c >= 0; --c) {
      const int64_t t0 = c * chunk, L = std::min(chunk, s.S - t0), r = bh * s.S + t0;
      chunk_bwd(s, seq_at(s, in, a, bh, t0), L, entering.C.data() + (bh * nchunks + c) * kv,
                entering.m[bh * nchunks + c], o.nrm.data() + r, dh.data() + r * s.DV, eps, dC.data() + bh * kv,
                g.dq.data() + r * s.DK, g.dk.data() + r * s.DK, g.dv.data() + r * s.DV, g.di.data() + r);
    }
  }
  df_from(s, in, dC_last ? *dC_last : std::vector<double>{}, o.C, g);
  if (!in.C0.empty()) {
    g.dC0 = std::move(dC);
    g.dn0.assign(in.n0.size(), 0.0);
    g.dm0.assign(in.m0.size(), 0.0);
  }
  return g;
}

}  // namespace

double log_sigmoid(double x) { return std::min(x, 0.0) - std::log1p(std::exp(-std::abs(x))); }

MlstmOutputs mlstm_recurrent_fwd_ref(const MlstmShape& s, const MlstmInputs& in, double eps) {
  return forward(s, in, 1, false, eps, nullptr);
}

MlstmOutputs mlstm_chunkwise_fwd_ref(const MlstmShape& s, const MlstmInputs& in, int64_t chunk, double eps) {
  return forward(s, in, chunk, false, eps, nullptr);
}

MlstmOutputs mlstm_parallel_fwd_ref(const MlstmShape& s, const MlstmInputs& in, double eps) {
  return forward(s, in, s.S, true, eps, nullptr);
}

MlstmGrads mlstm_chunkwise_bwd_ref(const MlstmShape& s, const MlstmInputs& in, const std::vector<double>& dh,
                                   const std::vector<double>* dC_last, int64_t chunk, double eps) {
  return backward(s, in, dh, dC_last, chunk, false, eps);
}

MlstmGrads mlstm_parallel_bwd_ref(const MlstmShape& s, const MlstmInputs& in, const std::vector<double>& dh,
                                  double eps) {
  return backward(s, in, dh, nullptr, s.S, true, eps);
}

MlstmGrads mlstm_recurrent_bwd_ref(const MlstmShape& s, const MlstmInputs& in, const std::vector<double>& dh,
                                   const MlstmUpstream& up, bool exact, double eps) {
  const bool init = check(s, in);
  check_dh(s, dh);
  const int64_t seqs = s.B * s.NH, DK = s.DK, DV = s.DV, kv = DK * DV, S = s.S;
  if (up.dC) check_size(*up.dC, seqs * kv, "dC_last");
  if (up.dn) check_size(*up.dn, seqs * DK, "dn_last");
  if (up.dm) check_size(*up.dm, seqs, "dm_last");
  if (!exact && (up.dn || up.dm))
    throw std::invalid_argument("mlstm reference: dn_last, dm_last need the exact backward (n, m are constants "
                                "otherwise)");
  const double scale = 1.0 / std::sqrt(static_cast<double>(DK));
  const std::vector<double> a = log_sigmoid_all(in.f);
  MlstmGrads g;
  g.dq.resize(in.q.size());
  g.dk.resize(in.k.size());
  g.dv.resize(in.v.size());
  g.di.resize(in.i.size());
  g.df.resize(in.f.size());
  if (init) {
    g.dC0.resize(seqs * kv);
    g.dn0.resize(seqs * DK);
    g.dm0.resize(seqs);
  }
  // The states before each step, t = 0..S (index S: after the last), of one sequence.
  std::vector<double> Cs((S + 1) * kv), ns((S + 1) * DK), ms(S + 1);
  std::vector<double> dC(kv), dn(DK), num(DV), dnum(DV);
  for (int64_t bh = 0; bh < seqs; ++bh) {
    const double* q = in.q.data() + bh * S * DK;
    const double* k = in.k.data() + bh * S * DK;
    const double* v = in.v.data() + bh * S * DV;
    const double* ig = in.i.data() + bh * S;
    const double* at = a.data() + bh * S;
    for (int64_t j = 0; j < kv; ++j) Cs[j] = init ? in.C0[bh * kv + j] : 0.0;
    for (int64_t j = 0; j < DK; ++j) ns[j] = init ? in.n0[bh * DK + j] : 0.0;
    ms[0] = init ? in.m0[bh] : 0.0;
    for (int64_t t = 0; t < S; ++t) {
      const double mn = std::max(at[t] + ms[t], ig[t]);
      const double gt = std::exp(at[t] + ms[t] - mn), et = std::exp(ig[t] - mn);
      for (int64_t d = 0; d < DK; ++d) {
        ns[(t + 1) * DK + d] = gt * ns[t * DK + d] + et * k[t * DK + d];
        for (int64_t e = 0; e < DV; ++e)
          Cs[(t + 1) * kv + d * DV + e] = gt * Cs[t * kv + d * DV + e] + et * k[t * DK + d] * v[t * DV + e];
      }
      ms[t + 1] = mn;
    }
    for (int64_t j = 0; j < kv; ++j) dC[j] = up.dC ? (*up.dC)[bh * kv + j] : 0.0;
    for (int64_t j = 0; j < DK; ++j) dn[j] = up.dn ? (*up.dn)[bh * DK + j] : 0.0;
    double dm = up.dm ? (*up.dm)[bh] : 0.0;
    for (int64_t t = S - 1; t >= 0; --t) {
      const double* C = Cs.data() + t * kv;
      const double* Cn = Cs.data() + (t + 1) * kv;
      const double* n = ns.data() + t * DK;
      const double* nn = ns.data() + (t + 1) * DK;
      const double m = ms[t], mn = ms[t + 1];
      const double gt = std::exp(at[t] + m - mn), et = std::exp(ig[t] - mn);
      const double* qt = q + t * DK;
      const double* kt = k + t * DK;
      const double* vt = v + t * DV;
      const double z = scale * dot(qt, nn, DK);
      const double den = std::max(std::abs(z), std::exp(-mn)) + eps;
      for (int64_t e = 0; e < DV; ++e) {
        double r = 0.0;
        for (int64_t d = 0; d < DK; ++d) r += qt[d] * Cn[d * DV + e];
        num[e] = scale * r;
        dnum[e] = dh[(bh * S + t) * DV + e] / den;
      }
      double* dqt = g.dq.data() + (bh * S + t) * DK;
      for (int64_t d = 0; d < DK; ++d) {
        dqt[d] = dot(Cn + d * DV, dnum.data(), DV);
        for (int64_t e = 0; e < DV; ++e) dC[d * DV + e] += scale * qt[d] * dnum[e];
      }
      if (exact) {
        const double dden = -dot(dnum.data(), num.data(), DV) / den;
        if (std::abs(z) >= std::exp(-mn)) {
          const double dz = z > 0.0 ? dden : z < 0.0 ? -dden : 0.0;
          for (int64_t d = 0; d < DK; ++d) {
            dn[d] += dz * scale * qt[d];
            dqt[d] += dz * nn[d];
          }
        } else {
          dm -= dden * std::exp(-mn);
        }
      }
      for (int64_t d = 0; d < DK; ++d) dqt[d] *= scale;
      double dg = dot(dC.data(), C, kv) + dot(dn.data(), n, DK);
      double de = dot(dn.data(), kt, DK);
      double* dkt = g.dk.data() + (bh * S + t) * DK;
      double* dvt = g.dv.data() + (bh * S + t) * DV;
      for (int64_t e = 0; e < DV; ++e) dvt[e] = 0.0;
      for (int64_t d = 0; d < DK; ++d) {
        const double dCv = dot(dC.data() + d * DV, vt, DV);
        de += kt[d] * dCv;
        dkt[d] = et * (dCv + dn[d]);
        for (int64_t e = 0; e < DV; ++e) dvt[e] += et * dC[d * DV + e] * kt[d];
      }
      double da = dg * gt, di = de * et;
      if (exact) {
        // g = e^(a + m - m'), e = e^(i - m'), then m' = max(a + m, i).
        const double dmn = dm - dg * gt - de * et;
        const bool first = at[t] + m >= ig[t];
        (first ? da : di) += dmn;
        dm = dg * gt + (first ? dmn : 0.0);
        for (int64_t d = 0; d < DK; ++d) dn[d] *= gt;
      }
      for (int64_t j = 0; j < kv; ++j) dC[j] *= gt;
      g.di[bh * S + t] = di;
      g.df[bh * S + t] = da * sigmoid(-in.f[bh * S + t]);
    }
    if (init) {
      std::copy(dC.begin(), dC.end(), g.dC0.begin() + bh * kv);
      for (int64_t d = 0; d < DK; ++d) g.dn0[bh * DK + d] = exact ? dn[d] : 0.0;
      g.dm0[bh] = exact ? dm : 0.0;
    }
  }
  return g;
}

}  // namespace kspec::ref
