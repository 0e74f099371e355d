// Helpers shared by the float64 reference tests: random inputs bounded away from zero, the pinned tests' formula
// inputs and weighted loss, and the comparison of an analytic gradient with its central difference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace kspec::testing {

// Uniform in ±[lo, hi]: random signs and magnitudes bounded away from zero, so no term of a gradient
// vanishes by accident and hides a wrong formula.
inline std::vector<double> random_nonzero(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> mag(lo, hi);
  std::bernoulli_distribution neg(0.5);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& e : v) e = neg(rng) ? -mag(rng) : mag(rng);
  return v;
}

inline std::vector<double> random_uniform(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& e : v) e = dist(rng);
  return v;
}

// scale * sin(0.37 j + c) + shift, j = 0..n-1: the inputs of the pinned tests, which the Python twins compute
// the same way.
inline std::vector<double> formula(int64_t n, double c, double scale, double shift = 0.0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) v[j] = scale * std::sin(0.37 * static_cast<double>(j) + c) + shift;
  return v;
}

// sum_j a[j] cos(j): the pinned tests' scalar loss over an output.
inline double weighted(const std::vector<double>& a) {
  double r = 0.0;
  for (size_t j = 0; j < a.size(); ++j) r += a[j] * std::cos(static_cast<double>(j));
  return r;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

inline double abs_dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += std::abs(a[i] * b[i]);
  return s;
}

// An analytic gradient element agrees with its central difference to ~1e-6 relative; elements far
// below the tensor's largest are compared against 1e-3 of that instead, and every element gets the
// difference quotient's own rounding error, fd_noise ≈ eps_machine * loss_scale / step.
inline void expect_grad_near(const std::vector<double>& analytic, const std::vector<double>& numeric,
                             double fd_noise, const std::string& what) {
  ASSERT_EQ(analytic.size(), numeric.size()) << what;
  double max_abs = 0.0;
  for (double v : analytic) max_abs = std::max(max_abs, std::abs(v));
  for (size_t i = 0; i < analytic.size(); ++i) {
    const double tol = 1e-6 * std::max(std::abs(analytic[i]), 1e-3 * max_abs) + fd_noise;
    EXPECT_NEAR(analytic[i], numeric[i], tol) << what << "[" << i << "]";
  }
}

// d loss / d param by central differences, one element at a time (param is restored after each).
template <typename Loss>
std::vector<double> central_diff(Loss&& loss, std::vector<double>& param, double step) {
  std::vector<double> grad(param.size());
  for (size_t i = 0; i < param.size(); ++i) {
    const double saved = param[i];
    param[i] = saved + step;
    const double up = loss();
    param[i] = saved - step;
    const double down = loss();
    param[i] = saved;
    grad[i] = (up - down) / (2.0 * step);
  }
  return grad;
}

}  // namespace kspec::testing
