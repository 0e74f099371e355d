// Tests of the float64 norm+activation reference: its backward against central finite differences of
// its forward for every norm x activation x bias combination, and its forward against known values.
// The reference is the spec the GPU kernels are checked against, so it is checked first.
#include "norm_act/reference.h"
#include "reference_test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace {

using kspec::testing::random_nonzero;
using kspec::testing::dot;
using kspec::testing::expect_grad_near;

using kspec::ref::norm_act_bwd_ref;
using kspec::ref::norm_act_fwd_ref;

constexpr int kNormLayer = 0;
constexpr int kNormRms = 1;
constexpr int kActIdentity = 0;
constexpr int kActGeluErf = 3;
constexpr double kEps = 1e-5;

// norm, act, has_bias, hidden, rows
using FdParam = std::tuple<int, int, bool, int64_t, int64_t>;

class NormActReferenceFiniteDiff : public ::testing::TestWithParam<FdParam> {};

TEST_P(NormActReferenceFiniteDiff, BackwardMatchesCentralDifferences) {
  const auto [norm, act, has_bias, hidden, rows] = GetParam();
  std::mt19937_64 rng(0x6b73706563ull + static_cast<uint64_t>(norm * 1000 + act * 100 + hidden * 10 + rows));
  const size_t n = static_cast<size_t>(rows * hidden);
  std::vector<double> x = random_nonzero(rng, n, 0.1, 2.0);
  std::vector<double> dy = random_nonzero(rng, n, 0.1, 1.0);
  std::vector<double> w = random_nonzero(rng, static_cast<size_t>(hidden), 0.5, 1.5);
  std::vector<double> b = random_nonzero(rng, static_cast<size_t>(hidden), 0.1, 1.0);
  const std::vector<double>* bp = has_bias ? &b : nullptr;

  // The loss whose gradients the backward returns: sum(dy * y).
  auto loss = [&](const std::vector<double>& xs, const std::vector<double>& ws,
                  const std::vector<double>* bs) {
    return dot(dy, norm_act_fwd_ref(xs, ws, bs, rows, hidden, norm, act, kEps).y);
  };
  constexpr double kStep = 1e-5;
  auto central_diff = [&](std::vector<double>& param) {
    return kspec::testing::central_diff([&] { return loss(x, w, bp); }, param, kStep);
  };

  const auto analytic = norm_act_bwd_ref(dy, x, w, bp, rows, hidden, norm, act, kEps);
  const std::vector<double> y = norm_act_fwd_ref(x, w, bp, rows, hidden, norm, act, kEps).y;
  double loss_scale = 0.0;
  for (size_t i = 0; i < n; ++i) loss_scale += std::abs(dy[i] * y[i]);
  const double fd_noise = 1e-10 * (1.0 + loss_scale);  // ~4 * 2.2e-16 / kStep, with room
  expect_grad_near(analytic.dx, central_diff(x), fd_noise, "dx");
  expect_grad_near(analytic.dw, central_diff(w), fd_noise, "dw");
  if (has_bias) {
    expect_grad_near(analytic.db, central_diff(b), fd_noise, "db");
  } else {
    EXPECT_TRUE(analytic.db.empty());
  }
}

std::string fd_param_name(const ::testing::TestParamInfo<FdParam>& info) {
  static const char* const kNormNames[] = {"layer", "rms"};
  static const char* const kActNames[] = {"identity", "silu", "gelu_tanh", "gelu_erf"};
  const auto [norm, act, has_bias, hidden, rows] = info.param;
  return std::string(kNormNames[norm]) + "_" + kActNames[act] + (has_bias ? "_bias" : "_nobias") +
         "_h" + std::to_string(hidden) + "_r" + std::to_string(rows);
}

INSTANTIATE_TEST_SUITE_P(AllCombinations, NormActReferenceFiniteDiff,
                         ::testing::Combine(::testing::Values(kNormLayer, kNormRms),
                                            ::testing::Range(kActIdentity, kActGeluErf + 1),
                                            ::testing::Bool(),
                                            ::testing::Values<int64_t>(1, 7, 33),
                                            ::testing::Values<int64_t>(1, 3)),
                         fd_param_name);

// hidden, rows
using StatsParam = std::tuple<int64_t, int64_t>;

class NormActReferenceStats : public ::testing::TestWithParam<StatsParam> {};

// With w = 1, b = 0, identity and eps = 0, LayerNorm's output is xhat itself: each row has mean 0
// and variance 1; RMSNorm's rows have mean square 1. A shifted, scaled input checks the centring.
TEST_P(NormActReferenceStats, NormalizedRowsHaveUnitMoments) {
  const auto [hidden, rows] = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(hidden * 7 + rows));
  std::vector<double> x = random_nonzero(rng, static_cast<size_t>(rows * hidden), 0.1, 2.0);
  for (double& v : x) v = 3.0 * v + 50.0;
  const std::vector<double> w(static_cast<size_t>(hidden), 1.0);
  const std::vector<double> b(static_cast<size_t>(hidden), 0.0);

  const auto ln = norm_act_fwd_ref(x, w, &b, rows, hidden, kNormLayer, kActIdentity, 0.0);
  const auto rms = norm_act_fwd_ref(x, w, nullptr, rows, hidden, kNormRms, kActIdentity, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0.0, sq = 0.0, rms_sq = 0.0, x_sum = 0.0;
    for (int64_t j = 0; j < hidden; ++j) {
      sum += ln.y[r * hidden + j];
      sq += ln.y[r * hidden + j] * ln.y[r * hidden + j];
      rms_sq += rms.y[r * hidden + j] * rms.y[r * hidden + j];
      x_sum += x[r * hidden + j];
    }
    const double n = static_cast<double>(hidden);
    EXPECT_NEAR(sum / n, 0.0, 1e-12) << "row " << r;
    EXPECT_NEAR(sq / n, 1.0, 1e-10) << "row " << r;
    EXPECT_NEAR(rms_sq / n, 1.0, 1e-12) << "row " << r;
    EXPECT_NEAR(ln.mean[r], x_sum / n, 1e-12) << "row " << r;
    EXPECT_EQ(rms.mean[r], 0.0) << "row " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, NormActReferenceStats,
                         ::testing::Combine(::testing::Values<int64_t>(2, 7, 33, 4096),
                                            ::testing::Values<int64_t>(1, 3)));

// LayerNorm over one element makes xhat = 0, so y = act(b): this pins each activation to values
// computed independently (SiLU(1) = 1/(1+e^-1); GELU(1) = Phi(1); tanh-GELU(1) from its formula).
TEST(NormActReference, ActivationValues) {
  const std::vector<double> x = {0.7};
  const std::vector<double> w = {1.3};
  const std::vector<double> b = {1.0};
  const double expected[] = {1.0, 0.7310585786300049, 0.8411919906082768, 0.8413447460685429};
  for (int act = kActIdentity; act <= kActGeluErf; ++act) {
    const auto out = norm_act_fwd_ref(x, w, &b, 1, 1, kNormLayer, act, kEps);
    EXPECT_NEAR(out.y[0], expected[act], 1e-15) << "act " << act;
  }
}

TEST(NormActReference, RejectsBadArguments) {
  const std::vector<double> x(6, 1.0);
  const std::vector<double> w(3, 1.0);
  EXPECT_THROW(norm_act_fwd_ref(x, w, nullptr, 3, 3, kNormLayer, kActIdentity, kEps),
               std::invalid_argument);
  EXPECT_THROW(norm_act_fwd_ref(x, w, nullptr, 2, 3, 2, kActIdentity, kEps), std::invalid_argument);
  EXPECT_THROW(norm_act_fwd_ref(x, w, nullptr, 2, 3, kNormLayer, 4, kEps), std::invalid_argument);
  EXPECT_NO_THROW(norm_act_fwd_ref(x, w, nullptr, 2, 3, kNormRms, kActIdentity, kEps));
}

}  // namespace
