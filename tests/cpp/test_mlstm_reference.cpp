// Tests of the float64 mLSTM reference: the exact backward and the constant-(n, m) backward against
// central differences (the latter of the forward with nrm and m frozen), chunkwise == recurrent for
// several chunk lengths, parallel == recurrent up to eps e^m, two calls passing states == one call,
// log-sigmoid accuracy, and values pinned by the Python twin's test (tests/python/test_reference_mlstm.py).
#include "mlstm/reference.h"
#include "reference_test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

using kspec::testing::central_diff;
using kspec::testing::dot;
using kspec::testing::expect_grad_near;
using kspec::testing::formula;
using kspec::testing::random_nonzero;
using kspec::testing::weighted;

using kspec::ref::log_sigmoid;
using kspec::ref::MlstmGrads;
using kspec::ref::MlstmInputs;
using kspec::ref::MlstmOutputs;
using kspec::ref::MlstmShape;
using kspec::ref::MlstmUpstream;

MlstmInputs make_inputs(std::mt19937_64& rng, const MlstmShape& s, bool with_init) {
  const int64_t seqs = s.B * s.NH;
  MlstmInputs in;
  in.q = random_nonzero(rng, seqs * s.S * s.DK, 0.1, 1.5);
  in.k = random_nonzero(rng, seqs * s.S * s.DK, 0.1, 1.5);
  in.v = random_nonzero(rng, seqs * s.S * s.DV, 0.1, 1.5);
  in.i = random_nonzero(rng, seqs * s.S, 0.1, 2.0);
  in.f = random_nonzero(rng, seqs * s.S, 0.1, 2.0);
  for (double& x : in.f) x += 1.0;
  if (with_init) {
    in.C0 = random_nonzero(rng, seqs * s.DK * s.DV, 0.1, 1.0);
    in.n0 = random_nonzero(rng, seqs * s.DK, 0.1, 1.0);
    in.m0 = random_nonzero(rng, seqs, 0.1, 1.0);
  }
  return in;
}

// Relative to each element, or to 1e-2 of the largest for small ones; the absolute floor is for
// gradients that are exactly zero (df at S = 1 without states) and come out as rounding.
void expect_all_near(const std::vector<double>& a, const std::vector<double>& b, double rtol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double max_abs = 0.0;
  for (double x : b) max_abs = std::max(max_abs, std::abs(x));
  for (size_t j = 0; j < a.size(); ++j)
    EXPECT_NEAR(a[j], b[j], rtol * std::max(std::abs(b[j]), 1e-2 * max_abs) + 1e-14) << what << "[" << j << "]";
}

// The forward with per-step nrm, m given: the function whose gradient the default backward is.
//   C_t = e^(a_t + m_(t-1) - m_t) C_(t-1) + e^(i_t - m_t) k_t v_t^T,  h_t = (s q_t)^T C_t / (nrm_t + eps)
// m_(-1) = m0 (0 without initial states, -inf for the parallel form). Returns h and C_last.
std::pair<std::vector<double>, std::vector<double>> frozen_fwd(const MlstmShape& s, const MlstmInputs& in,
                                                               const std::vector<double>& nrm,
                                                               const std::vector<double>& m, double m_empty) {
  const int64_t kv = s.DK * s.DV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.DK));
  std::vector<double> h(s.B * s.NH * s.S * s.DV), C_all(s.B * s.NH * kv);
  for (int64_t bh = 0; bh < s.B * s.NH; ++bh) {
    std::vector<double> C(kv, 0.0);
    if (!in.C0.empty()) std::copy(in.C0.begin() + bh * kv, in.C0.begin() + (bh + 1) * kv, C.begin());
    double m_prev = in.m0.empty() ? m_empty : in.m0[bh];
    for (int64_t t = 0; t < s.S; ++t) {
      const int64_t r = bh * s.S + t;
      const double g = std::exp(log_sigmoid(in.f[r]) + m_prev - m[r]), e = std::exp(in.i[r] - m[r]);
      for (int64_t d = 0; d < s.DK; ++d)
        for (int64_t c = 0; c < s.DV; ++c) C[d * s.DV + c] = g * C[d * s.DV + c] + e * in.k[r * s.DK + d] * in.v[r * s.DV + c];
      for (int64_t c = 0; c < s.DV; ++c) {
        double num = 0.0;
        for (int64_t d = 0; d < s.DK; ++d) num += scale * in.q[r * s.DK + d] * C[d * s.DV + c];
        h[r * s.DV + c] = num / (nrm[r] + kspec::ref::kMlstmEps);
      }
      m_prev = m[r];
    }
    std::copy(C.begin(), C.end(), C_all.begin() + bh * kv);
  }
  return {h, C_all};
}

constexpr double kStep = 1e-6;

// g's dq, dk, dv, di and df against central differences of loss through in's q, k, v, i and f.
template <typename Loss>
void expect_qkvif_grads_near(const MlstmGrads& g, Loss& loss, MlstmInputs& in, double noise) {
  expect_grad_near(g.dq, central_diff(loss, in.q, kStep), noise, "dq");
  expect_grad_near(g.dk, central_diff(loss, in.k, kStep), noise, "dk");
  expect_grad_near(g.dv, central_diff(loss, in.v, kStep), noise, "dv");
  expect_grad_near(g.di, central_diff(loss, in.i, kStep), noise, "di");
  expect_grad_near(g.df, central_diff(loss, in.f, kStep), noise, "df");
}

// S, with initial states, with dC_last
using FdParam = std::tuple<int64_t, bool, bool>;
class MlstmReferenceFiniteDiff : public ::testing::TestWithParam<FdParam> {};

TEST_P(MlstmReferenceFiniteDiff, ConstantNmBackwardMatchesFrozenCentralDifferences) {
  const auto [S, with_init, with_dC] = GetParam();
  const MlstmShape s{1, 2, S, 3, 2};
  std::mt19937_64 rng(0x3157u + S * 4 + with_init * 2 + with_dC);
  MlstmInputs in = make_inputs(rng, s, with_init);
  const std::vector<double> dh = random_nonzero(rng, 2 * S * 2, 0.1, 1.0);
  const std::vector<double> dC = random_nonzero(rng, 2 * 3 * 2, 0.1, 1.0);
  const MlstmOutputs o = kspec::ref::mlstm_recurrent_fwd_ref(s, in);
  auto loss = [&]() {
    const auto [h, C] = frozen_fwd(s, in, o.nrm, o.m, 0.0);
    return dot(dh, h) + (with_dC ? dot(dC, C) : 0.0);
  };
  const MlstmGrads g = kspec::ref::mlstm_recurrent_bwd_ref(s, in, dh, {with_dC ? &dC : nullptr}, false);
  const double noise = 1e-9;
  expect_qkvif_grads_near(g, loss, in, noise);
  if (with_init) {
    expect_grad_near(g.dC0, central_diff(loss, in.C0, kStep), noise, "dC0");
    EXPECT_EQ(g.dn0, std::vector<double>(in.n0.size(), 0.0));
    EXPECT_EQ(g.dm0, std::vector<double>(in.m0.size(), 0.0));
  } else {
    EXPECT_TRUE(g.dC0.empty() && g.dn0.empty() && g.dm0.empty());
  }
  // The chunkwise backward is the same gradient for every chunk length.
  for (int64_t L : {1, 2, 3, 64}) {
    const MlstmGrads c = kspec::ref::mlstm_chunkwise_bwd_ref(s, in, dh, with_dC ? &dC : nullptr, L);
    const std::string at = " L=" + std::to_string(L);
    expect_all_near(c.dq, g.dq, 1e-10, "dq" + at);
    expect_all_near(c.dk, g.dk, 1e-10, "dk" + at);
    expect_all_near(c.dv, g.dv, 1e-10, "dv" + at);
    expect_all_near(c.di, g.di, 1e-10, "di" + at);
    expect_all_near(c.df, g.df, 1e-10, "df" + at);
    expect_all_near(c.dC0, g.dC0, 1e-10, "dC0" + at);
  }
}

TEST_P(MlstmReferenceFiniteDiff, ExactBackwardMatchesCentralDifferences) {
  const auto [S, with_init, with_up] = GetParam();
  const MlstmShape s{1, 2, S, 3, 2};
  std::mt19937_64 rng(0xE4AC7u + S * 4 + with_init * 2 + with_up);
  MlstmInputs in = make_inputs(rng, s, with_init);
  const double eps = 0.3;  // large: the e^m term, all the exact gradient adds through m, is visible
  const std::vector<double> dh = random_nonzero(rng, 2 * S * 2, 0.1, 1.0);
  const std::vector<double> dC = random_nonzero(rng, 2 * 3 * 2, 0.1, 1.0);
  const std::vector<double> dn = random_nonzero(rng, 2 * 3, 0.1, 1.0);
  const std::vector<double> dm = random_nonzero(rng, 2, 0.1, 1.0);
  auto loss = [&]() {
    const MlstmOutputs o = kspec::ref::mlstm_recurrent_fwd_ref(s, in, eps);
    return dot(dh, o.h) + (with_up ? dot(dC, o.C) + dot(dn, o.n) + dot(dm, o.m_last) : 0.0);
  };
  MlstmUpstream up;
  if (with_up) up = {&dC, &dn, &dm};
  const MlstmGrads g = kspec::ref::mlstm_recurrent_bwd_ref(s, in, dh, up, true, eps);
  const double noise = 1e-9;
  expect_qkvif_grads_near(g, loss, in, noise);
  if (with_init) {
    expect_grad_near(g.dC0, central_diff(loss, in.C0, kStep), noise, "dC0");
    expect_grad_near(g.dn0, central_diff(loss, in.n0, kStep), noise, "dn0");
    expect_grad_near(g.dm0, central_diff(loss, in.m0, kStep), noise, "dm0");
  }
}

std::string fd_name(const ::testing::TestParamInfo<FdParam>& info) {
  const auto [S, with_init, with_up] = info.param;
  return "S" + std::to_string(S) + (with_init ? "_init" : "_noinit") + (with_up ? "_dlast" : "_nodlast");
}

INSTANTIATE_TEST_SUITE_P(Cases, MlstmReferenceFiniteDiff,
                         ::testing::Combine(::testing::Values<int64_t>(1, 2, 5), ::testing::Bool(), ::testing::Bool()),
                         fd_name);

TEST(MlstmReference, ParallelBackwardMatchesFrozenCentralDifferences) {
  const MlstmShape s{1, 2, 5, 3, 2};
  std::mt19937_64 rng(0x9A2u);
  MlstmInputs in = make_inputs(rng, s, false);
  const std::vector<double> dh = random_nonzero(rng, 2 * 5 * 2, 0.1, 1.0);
  const MlstmOutputs o = kspec::ref::mlstm_parallel_fwd_ref(s, in);
  EXPECT_TRUE(o.C.empty() && o.n.empty() && o.m_last.empty());
  auto loss = [&]() { return dot(dh, frozen_fwd(s, in, o.nrm, o.m, -std::numeric_limits<double>::infinity()).first); };
  const MlstmGrads g = kspec::ref::mlstm_parallel_bwd_ref(s, in, dh);
  expect_grad_near(g.dq, central_diff(loss, in.q, kStep), 1e-9, "dq");
  expect_grad_near(g.dk, central_diff(loss, in.k, kStep), 1e-9, "dk");
  expect_grad_near(g.dv, central_diff(loss, in.v, kStep), 1e-9, "dv");
  expect_grad_near(g.di, central_diff(loss, in.i, kStep), 1e-9, "di");
  expect_grad_near(g.df, central_diff(loss, in.f, kStep), 1e-9, "df");
}

// S, with initial states
class MlstmReferenceChunkwise : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {};

TEST_P(MlstmReferenceChunkwise, EqualsRecurrentForEveryChunkLength) {
  const auto [S, with_init] = GetParam();
  const MlstmShape s{2, 2, S, 4, 3};
  std::mt19937_64 rng(0xC40u + S * 2 + with_init);
  const MlstmInputs in = make_inputs(rng, s, with_init);
  const MlstmOutputs want = kspec::ref::mlstm_recurrent_fwd_ref(s, in);
  for (int64_t L : {2, 3, 4, 5, 16, 64}) {
    const MlstmOutputs got = kspec::ref::mlstm_chunkwise_fwd_ref(s, in, L);
    const std::string at = " L=" + std::to_string(L);
    expect_all_near(got.h, want.h, 1e-11, "h" + at);
    expect_all_near(got.nrm, want.nrm, 1e-11, "nrm" + at);
    expect_all_near(got.m, want.m, 1e-11, "m" + at);
    expect_all_near(got.C, want.C, 1e-11, "C" + at);
    expect_all_near(got.n, want.n, 1e-11, "n" + at);
    expect_all_near(got.m_last, want.m_last, 1e-11, "m_last" + at);
  }
}

INSTANTIATE_TEST_SUITE_P(Lengths, MlstmReferenceChunkwise,
                         ::testing::Combine(::testing::Values<int64_t>(1, 2, 7, 16, 17), ::testing::Bool()));

// h = N / (X + eps e^m) with N and X = nrm e^m the same in both forms (the recurrence's m0 = 0 term
// only raises m): with eps = 0 they agree, and with eps they differ by at most |h| eps |e^m_r - e^m_p| / X.
TEST(MlstmReference, ParallelEqualsRecurrentUpToEpsEm) {
  const MlstmShape s{2, 3, 33, 4, 5};
  std::mt19937_64 rng(0x500u);
  const MlstmInputs in = make_inputs(rng, s, false);
  const MlstmOutputs p0 = kspec::ref::mlstm_parallel_fwd_ref(s, in, 0.0);
  const MlstmOutputs r0 = kspec::ref::mlstm_recurrent_fwd_ref(s, in, 0.0);
  expect_all_near(p0.h, r0.h, 1e-11, "h (eps 0)");
  const double eps = 0.1;
  const MlstmOutputs p = kspec::ref::mlstm_parallel_fwd_ref(s, in, eps);
  const MlstmOutputs r = kspec::ref::mlstm_recurrent_fwd_ref(s, in, eps);
  double max_h = 0.0, max_diff = 0.0;
  for (double x : r.h) max_h = std::max(max_h, std::abs(x));
  for (size_t row = 0; row < r.m.size(); ++row) {
    EXPECT_GE(r.m[row], p.m[row] - 1e-12);
    const double X = r.nrm[row] * std::exp(r.m[row]);
    EXPECT_NEAR(p.nrm[row] * std::exp(p.m[row]), X, 1e-11 * X);
    const double bound = eps * std::abs(std::exp(r.m[row]) - std::exp(p.m[row])) / X;
    for (int64_t e = 0; e < s.DV; ++e) {
      const double hr = r.h[row * s.DV + e], diff = std::abs(p.h[row * s.DV + e] - hr);
      max_diff = std::max(max_diff, diff);
      EXPECT_LE(diff, std::abs(hr) * bound + 1e-13 * max_h);
    }
  }
  EXPECT_GT(max_diff, 1e-6);
  const std::vector<double> dh = random_nonzero(rng, static_cast<int64_t>(r.h.size()), 0.1, 1.0);
  const MlstmGrads gp = kspec::ref::mlstm_parallel_bwd_ref(s, in, dh, 0.0);
  const MlstmGrads gr = kspec::ref::mlstm_recurrent_bwd_ref(s, in, dh, {}, false, 0.0);
  expect_all_near(gp.dq, gr.dq, 1e-10, "dq");
  expect_all_near(gp.dk, gr.dk, 1e-10, "dk");
  expect_all_near(gp.dv, gr.dv, 1e-10, "dv");
  expect_all_near(gp.di, gr.di, 1e-10, "di");
  expect_all_near(gp.df, gr.df, 1e-10, "df");
}

// Rows [t0, t1) of every sequence of a [B, NH, S, width] tensor.
std::vector<double> rows(const std::vector<double>& x, int64_t seqs, int64_t S, int64_t width, int64_t t0, int64_t t1) {
  std::vector<double> r;
  for (int64_t bh = 0; bh < seqs; ++bh)
    r.insert(r.end(), x.begin() + (bh * S + t0) * width, x.begin() + (bh * S + t1) * width);
  return r;
}

MlstmInputs slice(const MlstmShape& s, const MlstmInputs& in, int64_t t0, int64_t t1) {
  const int64_t seqs = s.B * s.NH;
  MlstmInputs r;
  r.q = rows(in.q, seqs, s.S, s.DK, t0, t1);
  r.k = rows(in.k, seqs, s.S, s.DK, t0, t1);
  r.v = rows(in.v, seqs, s.S, s.DV, t0, t1);
  r.i = rows(in.i, seqs, s.S, 1, t0, t1);
  r.f = rows(in.f, seqs, s.S, 1, t0, t1);
  return r;
}

// Joins two calls' [B, NH, S_k, width] tensors along S.
std::vector<double> join(const std::vector<double>& a, const std::vector<double>& b, int64_t seqs, int64_t width) {
  const int64_t na = static_cast<int64_t>(a.size()) / seqs / width, nb = static_cast<int64_t>(b.size()) / seqs / width;
  std::vector<double> r;
  for (int64_t bh = 0; bh < seqs; ++bh) {
    r.insert(r.end(), a.begin() + bh * na * width, a.begin() + (bh + 1) * na * width);
    r.insert(r.end(), b.begin() + bh * nb * width, b.begin() + (bh + 1) * nb * width);
  }
  return r;
}

class MlstmReferenceTwoCalls : public ::testing::TestWithParam<int64_t> {};

TEST_P(MlstmReferenceTwoCalls, PassingStatesEqualsOneCall) {
  const int64_t split = GetParam(), S = 10, seqs = 4;
  const MlstmShape s{2, 2, S, 3, 4};
  std::mt19937_64 rng(0x600u + split);
  const MlstmInputs in = make_inputs(rng, s, true);
  const std::vector<double> dh = random_nonzero(rng, seqs * S * 4, 0.1, 1.0);
  const std::vector<double> dC = random_nonzero(rng, seqs * 12, 0.1, 1.0);
  const MlstmShape s1{2, 2, split, 3, 4}, s2{2, 2, S - split, 3, 4};
  MlstmInputs in1 = slice(s, in, 0, split), in2 = slice(s, in, split, S);
  in1.C0 = in.C0, in1.n0 = in.n0, in1.m0 = in.m0;
  const MlstmOutputs full = kspec::ref::mlstm_chunkwise_fwd_ref(s, in, 4);
  const MlstmOutputs o1 = kspec::ref::mlstm_chunkwise_fwd_ref(s1, in1, 4);
  in2.C0 = o1.C, in2.n0 = o1.n, in2.m0 = o1.m_last;
  const MlstmOutputs o2 = kspec::ref::mlstm_chunkwise_fwd_ref(s2, in2, 4);
  expect_all_near(join(o1.h, o2.h, seqs, 4), full.h, 1e-11, "h");
  expect_all_near(o2.C, full.C, 1e-11, "C");
  expect_all_near(o2.n, full.n, 1e-11, "n");
  expect_all_near(o2.m_last, full.m_last, 1e-11, "m");
  const MlstmGrads g = kspec::ref::mlstm_chunkwise_bwd_ref(s, in, dh, &dC, 4);
  const MlstmGrads g2 = kspec::ref::mlstm_chunkwise_bwd_ref(s2, in2, rows(dh, seqs, S, 4, split, S), &dC, 4);
  const MlstmGrads g1 = kspec::ref::mlstm_chunkwise_bwd_ref(s1, in1, rows(dh, seqs, S, 4, 0, split), &g2.dC0, 4);
  expect_all_near(join(g1.dq, g2.dq, seqs, 3), g.dq, 1e-10, "dq");
  expect_all_near(join(g1.dk, g2.dk, seqs, 3), g.dk, 1e-10, "dk");
  expect_all_near(join(g1.dv, g2.dv, seqs, 4), g.dv, 1e-10, "dv");
  expect_all_near(join(g1.di, g2.di, seqs, 1), g.di, 1e-10, "di");
  expect_all_near(join(g1.df, g2.df, seqs, 1), g.df, 1e-10, "df");
  expect_all_near(g1.dC0, g.dC0, 1e-10, "dC0");
}

INSTANTIATE_TEST_SUITE_P(Splits, MlstmReferenceTwoCalls, ::testing::Values<int64_t>(1, 5, 9));

// The deliberate difference from mlstm_kernels: <dC_last, C_last> depends on every f but the first.
TEST(MlstmReference, DCLastReachesDf) {
  const MlstmShape s{1, 1, 6, 3, 2};
  std::mt19937_64 rng(0x700u);
  const MlstmInputs in = make_inputs(rng, s, false);
  const std::vector<double> dh(12, 0.0), dC = random_nonzero(rng, 6, 0.1, 1.0);
  const MlstmGrads g = kspec::ref::mlstm_chunkwise_bwd_ref(s, in, dh, &dC, 4);
  for (int t = 1; t < 6; ++t) EXPECT_GT(std::abs(g.df[t]), 0.0) << t;
}

// Against long double: log1pl(expl(-|x|)) carries 11 more bits than the double formula under test.
TEST(MlstmReference, LogSigmoidAccurateOver40To40) {
  for (int j = 0; j <= 1600; ++j) {
    const double x = -40.0 + 0.05 * j;
    const long double lx = x;
    const long double want = (lx < 0 ? lx : 0.0L) - log1pl(expl(-fabsl(lx)));
    EXPECT_NEAR(log_sigmoid(x), static_cast<double>(want), 4e-16 * std::abs(static_cast<double>(want))) << x;
  }
  EXPECT_TRUE(std::isfinite(log_sigmoid(-1e4)) && std::isfinite(log_sigmoid(1e4)));
  EXPECT_EQ(log_sigmoid(-1e4), -1e4);
}

TEST(MlstmReference, RejectsBadSizes) {
  const MlstmShape s{1, 2, 3, 4, 5};
  std::mt19937_64 rng(8);
  const MlstmInputs good = make_inputs(rng, s, true);
  EXPECT_NO_THROW(kspec::ref::mlstm_recurrent_fwd_ref(s, good));
  MlstmInputs bad = good;
  bad.v.pop_back();
  EXPECT_THROW(kspec::ref::mlstm_recurrent_fwd_ref(s, bad), std::invalid_argument);
  bad = good;
  bad.m0.clear();
  EXPECT_THROW(kspec::ref::mlstm_recurrent_fwd_ref(s, bad), std::invalid_argument);
  EXPECT_THROW(kspec::ref::mlstm_parallel_fwd_ref(s, good), std::invalid_argument);
  EXPECT_THROW(kspec::ref::mlstm_chunkwise_fwd_ref(s, good, 0), std::invalid_argument);
  const std::vector<double> dh(2 * 3 * 5, 0.5), dn(8, 0.5);
  EXPECT_THROW(kspec::ref::mlstm_recurrent_bwd_ref(s, good, dh, {nullptr, &dn, nullptr}, false),
               std::invalid_argument);
  EXPECT_THROW(kspec::ref::mlstm_chunkwise_bwd_ref(s, good, std::vector<double>(7, 0.5), nullptr, 2),
               std::invalid_argument);
}

// tests/python/test_reference_mlstm.py computes the same numbers (PINNED) with the NumPy reference.
TEST(MlstmReference, PinnedValuesSharedWithPython) {
  const MlstmShape s{1, 2, 5, 3, 2};
  MlstmInputs in;
  in.q = formula(30, 0.1, 1.0);
  in.k = formula(30, 0.2, 1.0);
  in.v = formula(20, 0.3, 1.0);
  in.i = formula(10, 0.4, 2.0);
  in.f = formula(10, 0.5, 3.0, 1.0);
  in.C0 = formula(12, 0.6, 1.0);
  in.n0 = formula(6, 0.7, 1.0);
  in.m0 = formula(2, 0.8, 1.0);
  const MlstmOutputs o = kspec::ref::mlstm_chunkwise_fwd_ref(s, in, 2);
  const std::vector<double> dh = formula(20, 0.9, 1.0), dC = formula(12, 1.0, 1.0);
  const MlstmGrads g = kspec::ref::mlstm_chunkwise_bwd_ref(s, in, dh, &dC, 2);
  EXPECT_NEAR(weighted(o.h), 0.43726196266025785, 1e-12);
  EXPECT_NEAR(weighted(o.C), 2.6052150746786054, 1e-12);
  EXPECT_NEAR(weighted(g.dq), -0.33060256511663555, 1e-12);
  EXPECT_NEAR(weighted(g.df), -2.750880048091661, 1e-12);
}

}  // namespace
