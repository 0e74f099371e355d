// Tests of the float64 mHC reference: the backward of the pre op, the post op and Sinkhorn-Knopp against
// central finite differences of their forwards, R doubly stochastic at eps = 0, argument errors, and
// values pinned on closed-form inputs that the Python twin's test (tests/python/test_reference_mhc.py)
// pins to the same numbers, so both references agree.
#include "mhc/reference.h"
#include "reference_test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

using kspec::testing::abs_dot;
using kspec::testing::dot;
using kspec::testing::expect_grad_near;
using kspec::testing::random_nonzero;
using kspec::testing::random_uniform;

using namespace kspec::ref;

constexpr double kStep = 1e-6;

MhcPreInputs pre_inputs(std::mt19937_64& rng, const MhcShape& s, bool with_gamma) {
  const int64_t nd = s.n * s.D, m = mhc_proj_rows(s.n, s.pre_only);
  MhcPreInputs in;
  in.x = random_nonzero(rng, s.T * nd, 0.1, 1.5);
  in.phi = random_nonzero(rng, m * nd, 0.05, 0.6);
  in.alpha = random_nonzero(rng, mhc_alpha_size(s.pre_only), 0.3, 1.2);
  in.bias = random_nonzero(rng, m, 0.05, 0.8);
  if (with_gamma) in.gamma = random_nonzero(rng, nd, 0.5, 1.5);
  return in;
}

// Upstream gradients given: a bit each for dh_pre, dh_post, dr, dx_post (dy always).
constexpr int kDhPre = 1, kDhPost = 2, kDr = 4, kDxPost = 8;

// T, n, D, t_max, pre_only, gamma, upstream bits
using PreParam = std::tuple<int64_t, int64_t, int64_t, int, bool, bool, int>;

class MhcPreReferenceFiniteDiff : public ::testing::TestWithParam<PreParam> {};

TEST_P(MhcPreReferenceFiniteDiff, BackwardMatchesCentralDifferences) {
  const auto [T, n, D, t_max, pre_only, with_gamma, given] = GetParam();
  const MhcShape s{T, n, D, pre_only};
  const MhcEps e{1e-6, 1e-6, 1e-6, t_max};
  std::mt19937_64 rng(static_cast<uint64_t>(T * 1000 + n * 100 + D * 10 + t_max + 7 * pre_only + given));
  MhcPreInputs in = pre_inputs(rng, s, with_gamma);
  MhcPreUpstream up;
  up.dy = random_nonzero(rng, T * D, 0.1, 1.0);
  if (given & kDhPre) up.dh_pre = random_nonzero(rng, T * n, 0.1, 1.0);
  if (given & kDhPost) up.dh_post = random_nonzero(rng, T * n, 0.1, 1.0);
  if (given & kDr) up.dr = random_nonzero(rng, T * n * n, 0.1, 1.0);
  if (given & kDxPost) up.dx_post = random_nonzero(rng, T * n * D, 0.1, 1.0);

  auto terms = [&](bool absolute) {
    const MhcPreOutputs o = mhc_pre_fwd_ref(s, e, in);
    auto d = [&](const std::vector<double>& a, const std::vector<double>& b) {
      return a.empty() ? 0.0 : absolute ? abs_dot(a, b) : dot(a, b);
    };
    // dx_post enters dx as the gradient of <dx_post, x>.
    return d(up.dy, o.y) + d(up.dh_pre, o.h_pre) + d(up.dh_post, o.h_post) + d(up.dr, o.r) + d(up.dx_post, in.x);
  };
  auto loss = [&]() { return terms(false); };
  const MhcPreGrads g = mhc_pre_bwd_ref(s, e, in, up);
  const double fd_noise = 1e-9 * (1.0 + terms(true));
  auto fd = [&](std::vector<double>& param) { return kspec::testing::central_diff(loss, param, kStep); };
  expect_grad_near(g.dx, fd(in.x), fd_noise, "dx");
  expect_grad_near(g.dphi, fd(in.phi), fd_noise, "dphi");
  expect_grad_near(g.dalpha, fd(in.alpha), fd_noise, "dalpha");
  expect_grad_near(g.dbias, fd(in.bias), fd_noise, "dbias");
  if (with_gamma) {
    expect_grad_near(g.dgamma, fd(in.gamma), fd_noise, "dgamma");
  } else {
    EXPECT_TRUE(g.dgamma.empty());
  }
}

const PreParam kPreCases[] = {
    {3, 2, 3, 20, false, true, kDhPre | kDhPost | kDr | kDxPost},
    {2, 3, 2, 1, false, true, kDhPre | kDhPost | kDr},
    {1, 4, 3, 20, false, false, kDhPost | kDr},
    {2, 1, 5, 20, false, true, kDr},
    {2, 2, 4, 3, true, true, kDhPre | kDxPost},
    {1, 3, 1, 20, true, false, 0},
    // Each upstream gradient alone (besides dy).
    {2, 2, 3, 20, false, true, kDhPre},
    {2, 2, 3, 20, false, true, kDhPost},
    {2, 2, 3, 20, false, true, kDr},
    {2, 2, 3, 20, false, true, kDxPost},
};

std::string pre_param_name(const ::testing::TestParamInfo<PreParam>& info) {
  const auto [T, n, D, t_max, pre_only, with_gamma, given] = info.param;
  return "T" + std::to_string(T) + "_n" + std::to_string(n) + "_D" + std::to_string(D) + "_t" +
         std::to_string(t_max) + (pre_only ? "_preonly" : "") + (with_gamma ? "_gamma" : "") + "_up" +
         std::to_string(given);
}

INSTANTIATE_TEST_SUITE_P(Cases, MhcPreReferenceFiniteDiff, ::testing::ValuesIn(kPreCases), pre_param_name);

TEST(MhcReference, PostBackwardMatchesCentralDifferences) {
  for (const auto& [T, n, D] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {2, 3, 4}, {3, 4, 5}}) {
    const MhcShape s{T, n, D, false};
    std::mt19937_64 rng(static_cast<uint64_t>(100 + T * 10 + n));
    std::vector<double> x = random_nonzero(rng, T * n * D, 0.1, 1.5), f = random_nonzero(rng, T * D, 0.1, 1.5);
    std::vector<double> hp = random_nonzero(rng, T * n, 0.1, 2.0), r = random_nonzero(rng, T * n * n, 0.05, 1.0);
    const std::vector<double> dout = random_nonzero(rng, T * n * D, 0.1, 1.0);
    auto loss = [&]() { return dot(dout, mhc_post_fwd_ref(s, x, f, hp, r)); };
    const MhcPostGrads g = mhc_post_bwd_ref(s, x, f, hp, r, dout);
    const std::string at = " T=" + std::to_string(T) + " n=" + std::to_string(n);
    expect_grad_near(g.dx, kspec::testing::central_diff(loss, x, kStep), 1e-9, "dx" + at);
    expect_grad_near(g.df, kspec::testing::central_diff(loss, f, kStep), 1e-9, "df" + at);
    expect_grad_near(g.dh_post, kspec::testing::central_diff(loss, hp, kStep), 1e-9, "dh_post" + at);
    expect_grad_near(g.dr, kspec::testing::central_diff(loss, r, kStep), 1e-9, "dr" + at);
  }
}

// n, t_max, eps, logit scale
using SkParam = std::tuple<int64_t, int, double, double>;
class MhcSinkhornReference : public ::testing::TestWithParam<SkParam> {};

// Logits up to +-30 (saturated softmax rows) stay finite, and the gradient exact.
TEST_P(MhcSinkhornReference, BackwardMatchesCentralDifferences) {
  const auto [n, t_max, eps, scale] = GetParam();
  const int64_t T = 2;
  std::mt19937_64 rng(static_cast<uint64_t>(n * 100 + t_max + static_cast<int>(scale)));
  std::vector<double> z = random_uniform(rng, T * n * n, -scale, scale);
  const std::vector<double> dR = random_nonzero(rng, T * n * n, 0.1, 1.0);
  const std::vector<double> r = mhc_sinkhorn_fwd_ref(z, T, n, t_max, eps);
  const std::vector<double> g = mhc_sinkhorn_bwd_ref(z, dR, T, n, t_max, eps);
  for (size_t i = 0; i < r.size(); ++i) {
    ASSERT_TRUE(std::isfinite(r[i]));
    ASSERT_TRUE(std::isfinite(g[i]));
  }
  auto loss = [&]() { return dot(dR, mhc_sinkhorn_fwd_ref(z, T, n, t_max, eps)); };
  double dr_abs = 0.0;
  for (double v : dR) dr_abs += std::abs(v);
  // Saturated rows make the function steep: the step's rounding error scales with the loss.
  expect_grad_near(g, kspec::testing::central_diff(loss, z, kStep), 1e-9 * (1.0 + dr_abs) * (scale > 1 ? 30.0 : 1.0),
                   "dlogits");
}

INSTANTIATE_TEST_SUITE_P(Cases, MhcSinkhornReference,
                         ::testing::Combine(::testing::Values<int64_t>(1, 3, 4, 8), ::testing::Values(1, 20),
                                            ::testing::Values(0.0, 1e-6), ::testing::Values(1.0, 30.0)));

// eps = 0 is the paper's Eq. 9 with H_res = R^T: every column sums to 1, so each output stream is a
// convex combination; rows only approach 1, closer with more rounds.
TEST(MhcReference, SinkhornEpsZeroColumnsSumToOne) {
  for (int64_t n : {1, 2, 3, 4, 8}) {
    for (int t_max : {1, 2, 20}) {
      const int64_t T = 5;
      std::mt19937_64 rng(static_cast<uint64_t>(n + 10 * t_max));
      const std::vector<double> z = random_uniform(rng, T * n * n, -3.0, 3.0);
      const std::vector<double> r = mhc_sinkhorn_fwd_ref(z, T, n, t_max, 0.0);
      const std::vector<double> r1 = mhc_sinkhorn_fwd_ref(z, T, n, 1, 0.0);
      double row_err = 0.0, row_err1 = 0.0;
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t k = 0; k < n; ++k) {
          double col = 0.0;
          for (int64_t j = 0; j < n; ++j) {
            EXPECT_GE(r[(t * n + j) * n + k], 0.0);
            col += r[(t * n + j) * n + k];
          }
          EXPECT_NEAR(col, 1.0, 1e-14) << "n=" << n << " t_max=" << t_max;
        }
        for (int64_t j = 0; j < n; ++j) {
          double row = 0.0, row1 = 0.0;
          for (int64_t k = 0; k < n; ++k) {
            row += r[(t * n + j) * n + k];
            row1 += r1[(t * n + j) * n + k];
          }
          row_err = std::max(row_err, std::abs(row - 1.0));
          row_err1 = std::max(row_err1, std::abs(row1 - 1.0));
        }
      }
      EXPECT_LE(row_err, row_err1 + 1e-15) << "n=" << n << " t_max=" << t_max;
      if (t_max == 20) {
        EXPECT_LT(row_err, 0.05) << "n=" << n;
      }
    }
  }
}

TEST(MhcReference, RejectsBadArguments) {
  const MhcShape s{2, 3, 4, false};
  const MhcEps e;
  std::mt19937_64 rng(3);
  const MhcPreInputs good = pre_inputs(rng, s, true);
  EXPECT_NO_THROW(mhc_pre_fwd_ref(s, e, good));
  auto expect_message = [&](const MhcShape& sh, const MhcEps& ep, const MhcPreInputs& in, const std::string& word) {
    try {
      mhc_pre_fwd_ref(sh, ep, in);
      ADD_FAILURE() << "no error for " << word;
    } catch (const std::invalid_argument& err) {
      EXPECT_NE(std::string(err.what()).find(word), std::string::npos) << err.what();
    }
  };
  MhcPreInputs bad = good;
  bad.phi.pop_back();
  expect_message(s, e, bad, "phi");
  bad = good;
  bad.alpha.resize(1);
  expect_message(s, e, bad, "alpha");
  bad = good;
  bad.bias.resize(3);
  expect_message(s, e, bad, "bias");
  bad = good;
  bad.gamma.resize(5);
  expect_message(s, e, bad, "gamma");
  bad = good;
  bad.x.pop_back();
  expect_message(s, e, bad, "x");
  expect_message(s, MhcEps{1e-6, 1e-6, 1e-6, 0}, good, "t_max");
  expect_message(s, MhcEps{1e-6, 1e-6, -1.0, 20}, good, "eps_sk");
  expect_message(s, MhcEps{-1.0, 1e-6, 1e-6, 20}, good, "eps_rms");
  const std::vector<double> f(8, 0.5), hp(6, 0.5), r(18, 0.5), x(24, 0.5);
  EXPECT_THROW(mhc_post_fwd_ref(s, x, f, hp, std::vector<double>(17, 0.5)), std::invalid_argument);
  EXPECT_THROW(mhc_post_bwd_ref(s, x, f, hp, r, std::vector<double>(23, 0.5)), std::invalid_argument);
}

// ---- the values the Python twin pins too ----

// sin(0.7 (i + 1) + salt) * 0.9: inputs both tests build with no RNG to port.
std::vector<double> closed_form(int64_t count, double salt) {
  std::vector<double> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) v[i] = 0.9 * std::sin(0.7 * (static_cast<double>(i) + 1.0) + salt);
  return v;
}

std::vector<double> scaled(std::vector<double> v, double a, double b = 0.0) {
  for (double& e : v) e = b + a * e;
  return v;
}

// sum_i a_i cos(0.3 i): one number that moves with every element and its position.
double checksum(const std::vector<double>& a) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * std::cos(0.3 * static_cast<double>(i));
  return s;
}

TEST(MhcReference, PinnedValuesSharedWithPython) {
  const int64_t T = 3, n = 3, D = 5, m = mhc_proj_rows(n, false);
  const MhcShape s{T, n, D, false};
  const MhcEps e{1e-6, 1e-6, 1e-6, 20};
  MhcPreInputs in;
  in.x = closed_form(T * n * D, 0.0);
  in.phi = scaled(closed_form(m * n * D, 1.0), 0.3);
  in.alpha = {0.8, -0.6, 1.1};
  in.bias = scaled(closed_form(m, 2.0), 0.5);
  in.gamma = scaled(closed_form(n * D, 3.0), 0.3, 1.0);
  MhcPreUpstream up;
  up.dy = closed_form(T * D, 4.0);
  up.dh_pre = closed_form(T * n, 5.0);
  up.dh_post = closed_form(T * n, 6.0);
  up.dr = closed_form(T * n * n, 7.0);
  const std::vector<double> f = closed_form(T * D, 8.0), dout = closed_form(T * n * D, 9.0);
  const MhcPreOutputs o = mhc_pre_fwd_ref(s, e, in);
  const MhcPreGrads g = mhc_pre_bwd_ref(s, e, in, up);
  const MhcPostGrads pg = mhc_post_bwd_ref(s, in.x, f, o.h_post, o.r, dout);
  const std::map<std::string, std::vector<double>> got = {
      {"y", o.y}, {"h_pre", o.h_pre}, {"h_post", o.h_post}, {"r", o.r}, {"inv", o.inv}, {"h", o.h},
      {"dx", g.dx}, {"dphi", g.dphi}, {"dalpha", g.dalpha}, {"dbias", g.dbias}, {"dgamma", g.dgamma},
      {"out", mhc_post_fwd_ref(s, in.x, f, o.h_post, o.r)}, {"post_dx", pg.dx}, {"post_df", pg.df},
      {"post_dh_post", pg.dh_post}, {"post_dr", pg.dr}};
  // Printed by the Python twin (tests/python/test_reference_mhc.py: PINNED).
  const std::map<std::string, double> pinned = {
      {"y", 3.017817788663582},
      {"h_pre", 1.2060452877637107},
      {"h_post", 2.0949119161888716},
      {"r", 1.3300626882935802},
      {"inv", 4.37085853963657},
      {"h", -3.241566664675921},
      {"dx", -0.7863426025632474},
      {"dphi", -1.2150502707106994},
      {"dalpha", -0.8625092874771964},
      {"dbias", 0.005157388729150891},
      {"dgamma", -0.15776035321579543},
      {"out", 1.4418592359881426},
      {"post_dx", 1.091260926556428},
      {"post_df", -1.186236579516973},
      {"post_dh_post", 1.080366588968266},
      {"post_dr", -0.020640251053114844},
  };
  ASSERT_EQ(got.size(), pinned.size());
  for (const auto& [name, value] : pinned) {
    EXPECT_NEAR(checksum(got.at(name)), value, 1e-12 * std::abs(value) + 1e-13) << name;
  }
}

}  // namespace
