// Tests of the float64 E79 reference: its backward against central finite differences of its forward
// over bias modes, initial states and final-state gradients, its forward against a hand computation,
// and a sequence run in two chunks (states and their adjoints handed across) against one run.
#include "e79/reference.h"
#include "reference_test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

using kspec::testing::random_nonzero;
using kspec::testing::dot;
using kspec::testing::abs_dot;
using kspec::testing::expect_grad_near;

using kspec::ref::e79_bwd_ref;
using kspec::ref::e79_fwd_ref;
using kspec::ref::E79Grads;
using kspec::ref::E79Inputs;
using kspec::ref::E79Outputs;
using kspec::ref::E79Shape;
using kspec::ref::kE79BiasFixed;
using kspec::ref::kE79BiasInput;
using kspec::ref::kE79BiasNone;

E79Inputs make_inputs(std::mt19937_64& rng, const E79Shape& s, bool with_init) {
  const int64_t tbn = s.T * s.B * s.n;
  E79Inputs in;
  in.k = random_nonzero(rng, tbn, 0.1, 0.6);
  in.v = random_nonzero(rng, tbn, 0.1, 0.6);
  in.q = random_nonzero(rng, tbn, 0.1, 0.6);
  in.m = random_nonzero(rng, tbn, 0.1, 0.6);
  const int64_t bias_size = s.bias_mode == kE79BiasFixed ? s.n : s.bias_mode == kE79BiasInput ? tbn : 0;
  in.b_s = random_nonzero(rng, bias_size, 0.1, 0.5);
  in.b_m = random_nonzero(rng, bias_size, 0.1, 0.5);
  if (with_init) {
    in.S0 = random_nonzero(rng, s.B * s.n * s.n, 0.1, 0.5);
    in.M0 = random_nonzero(rng, s.B * s.n * s.n, 0.1, 0.5);
  }
  return in;
}

void expect_all_near(const std::vector<double>& a, const std::vector<double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], 1e-12 * std::max(1.0, std::abs(b[i]))) << what << "[" << i << "]";
  }
}

// bias mode, with S0/M0, with dS_final/dM_final, T, B, n
using FdParam = std::tuple<int, bool, bool, int64_t, int64_t, int64_t>;

class E79ReferenceFiniteDiff : public ::testing::TestWithParam<FdParam> {};

TEST_P(E79ReferenceFiniteDiff, BackwardMatchesCentralDifferences) {
  const auto [bias_mode, with_init, with_dfinal, T, B, n] = GetParam();
  const E79Shape s{T, B, n, bias_mode};
  std::mt19937_64 rng(0xE79u + static_cast<uint64_t>(((bias_mode * 2 + with_init) * 2 + with_dfinal) * 1000 +
                                                     T * 100 + B * 10 + n));
  E79Inputs in = make_inputs(rng, s, with_init);
  const std::vector<double> dout = random_nonzero(rng, T * B * n, 0.1, 1.0);
  const std::vector<double> dS_final = random_nonzero(rng, B * n * n, 0.1, 1.0);
  const std::vector<double> dM_final = random_nonzero(rng, B * n * n, 0.1, 1.0);

  // The loss whose gradients the backward returns.
  auto loss = [&]() {
    const E79Outputs o = e79_fwd_ref(s, in);
    return dot(dout, o.out) + (with_dfinal ? dot(dS_final, o.S) + dot(dM_final, o.M) : 0.0);
  };
  constexpr double kStep = 1e-6;
  auto central_diff = [&](std::vector<double>& param) { return kspec::testing::central_diff(loss, param, kStep); };

  const E79Grads g = e79_bwd_ref(s, in, dout, with_dfinal ? &dS_final : nullptr,
                                 with_dfinal ? &dM_final : nullptr);
  const E79Outputs o = e79_fwd_ref(s, in);
  const double loss_scale =
      abs_dot(dout, o.out) + (with_dfinal ? abs_dot(dS_final, o.S) + abs_dot(dM_final, o.M) : 0.0);
  const double fd_noise = 1e-9 * (1.0 + loss_scale);  // ~4 * 2.2e-16 / kStep, with room

  expect_grad_near(g.dk, central_diff(in.k), fd_noise, "dk");
  expect_grad_near(g.dv, central_diff(in.v), fd_noise, "dv");
  expect_grad_near(g.dq, central_diff(in.q), fd_noise, "dq");
  expect_grad_near(g.dm, central_diff(in.m), fd_noise, "dm");
  if (bias_mode == kE79BiasNone) {
    EXPECT_TRUE(g.db_s.empty());
    EXPECT_TRUE(g.db_m.empty());
  } else {
    expect_grad_near(g.db_s, central_diff(in.b_s), fd_noise, "db_s");
    expect_grad_near(g.db_m, central_diff(in.b_m), fd_noise, "db_m");
  }
  if (with_init) {
    expect_grad_near(g.dS0, central_diff(in.S0), fd_noise, "dS0");
    expect_grad_near(g.dM0, central_diff(in.M0), fd_noise, "dM0");
  } else {
    EXPECT_TRUE(g.dS0.empty());
    EXPECT_TRUE(g.dM0.empty());
  }
}

const char* bias_name(int bias_mode) {
  static const char* const kNames[] = {"nobias", "fixedbias", "inputbias"};
  return kNames[bias_mode];
}

std::string fd_param_name(const ::testing::TestParamInfo<FdParam>& info) {
  const auto [bias_mode, with_init, with_dfinal, T, B, n] = info.param;
  return std::string(bias_name(bias_mode)) + (with_init ? "_init" : "_noinit") +
         (with_dfinal ? "_dfinal" : "_nodfinal") + "_T" + std::to_string(T) + "_B" + std::to_string(B) +
         "_n" + std::to_string(n);
}

INSTANTIATE_TEST_SUITE_P(AllCombinations, E79ReferenceFiniteDiff,
                         ::testing::Combine(::testing::Values(kE79BiasNone, kE79BiasFixed, kE79BiasInput),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values<int64_t>(1, 2, 3),
                                            ::testing::Values<int64_t>(1, 2),
                                            ::testing::Values<int64_t>(2, 3)),
                         fd_param_name);

// From zero states one step is written out by hand: S = v kh^T (the gated term vanishes), so
// Sq = v (kh . q), and M = (v - 0) mh^T.
TEST(E79Reference, FirstStepFromZeroMatchesHandComputation) {
  const E79Shape s{1, 1, 2, kE79BiasFixed};
  E79Inputs in;
  in.k = {0.3, -0.4};
  in.v = {0.7, -0.2};
  in.q = {0.5, 0.6};
  in.m = {-0.6, 0.8};
  in.b_s = {0.1, -0.3};
  in.b_m = {0.2, 0.4};
  const double kh[2] = {0.3 / (0.5 + 1e-6), -0.4 / (0.5 + 1e-6)};
  const double mh[2] = {-0.6 / (1.0 + 1e-6), 0.8 / (1.0 + 1e-6)};
  const double kq = kh[0] * 0.5 + kh[1] * 0.6;

  const E79Outputs o = e79_fwd_ref(s, in);
  ASSERT_EQ(o.out.size(), 2u);
  ASSERT_EQ(o.S.size(), 4u);
  ASSERT_EQ(o.M.size(), 4u);
  for (int i = 0; i < 2; ++i) {
    const double sq = in.v[i] * kq;
    EXPECT_NEAR(o.out[i], sq * sq / (1.0 + std::exp(-sq)), 1e-15);
    for (int j = 0; j < 2; ++j) {
      EXPECT_NEAR(o.S[i * 2 + j], in.v[i] * kh[j], 1e-15);
      EXPECT_NEAR(o.M[i * 2 + j], in.v[i] * mh[j], 1e-15);
    }
  }
}

TEST(E79Reference, RejectsMismatchedSizes) {
  const E79Shape s{2, 1, 3, kE79BiasFixed};
  std::mt19937_64 rng(7);
  const E79Inputs good = make_inputs(rng, s, true);
  EXPECT_NO_THROW(e79_fwd_ref(s, good));
  E79Inputs bad = good;
  bad.k.pop_back();
  EXPECT_THROW(e79_fwd_ref(s, bad), std::invalid_argument);
  bad = good;
  bad.b_s.resize(6);
  EXPECT_THROW(e79_fwd_ref(s, bad), std::invalid_argument);
  bad = good;
  bad.M0.resize(3);
  EXPECT_THROW(e79_fwd_ref(s, bad), std::invalid_argument);
  EXPECT_THROW(e79_fwd_ref(E79Shape{2, 1, 3, 3}, good), std::invalid_argument);
  const std::vector<double> dout(6, 0.5);
  const std::vector<double> short_final(8, 0.5);
  EXPECT_THROW(e79_bwd_ref(s, good, dout, &short_final, nullptr), std::invalid_argument);
  EXPECT_THROW(e79_bwd_ref(s, good, std::vector<double>(5, 0.5), nullptr, nullptr), std::invalid_argument);
}

// Time steps [t0, t1) of a [T, B, n] tensor: a contiguous range, as time is the outer axis.
std::vector<double> slice_time(const std::vector<double>& v, int64_t row, int64_t t0, int64_t t1) {
  return std::vector<double>(v.begin() + t0 * row, v.begin() + t1 * row);
}

std::vector<double> concat(std::vector<double> a, const std::vector<double>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<double> add(std::vector<double> a, const std::vector<double>& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  return a;
}

E79Inputs slice_inputs(const E79Shape& s, const E79Inputs& in, int64_t t0, int64_t t1) {
  const int64_t row = s.B * s.n;
  E79Inputs r = in;
  r.k = slice_time(in.k, row, t0, t1);
  r.v = slice_time(in.v, row, t0, t1);
  r.q = slice_time(in.q, row, t0, t1);
  r.m = slice_time(in.m, row, t0, t1);
  if (s.bias_mode == kE79BiasInput) {
    r.b_s = slice_time(in.b_s, row, t0, t1);
    r.b_m = slice_time(in.b_m, row, t0, t1);
  }
  return r;
}

// bias mode, with S0/M0, T, split point
using ChunkParam = std::tuple<int, bool, int64_t, int64_t>;

class E79ReferenceChunks : public ::testing::TestWithParam<ChunkParam> {};

// Running [0, split) and then [split, T) from its final states is the same recurrence as one run; in
// the backward the second chunk's dS0, dM0 are the first chunk's dS_final, dM_final.
TEST_P(E79ReferenceChunks, TwoChunksEqualOneRun) {
  const auto [bias_mode, with_init, T, split] = GetParam();
  const E79Shape s{T, 2, 3, bias_mode};
  std::mt19937_64 rng(0xC4u + static_cast<uint64_t>((bias_mode * 2 + with_init) * 100 + T * 10 + split));
  const E79Inputs in = make_inputs(rng, s, with_init);
  const std::vector<double> dout = random_nonzero(rng, T * s.B * s.n, 0.1, 1.0);
  const std::vector<double> dS_final = random_nonzero(rng, s.B * s.n * s.n, 0.1, 1.0);
  const std::vector<double> dM_final = random_nonzero(rng, s.B * s.n * s.n, 0.1, 1.0);
  const int64_t row = s.B * s.n;

  const E79Shape s1{split, s.B, s.n, bias_mode};
  const E79Shape s2{T - split, s.B, s.n, bias_mode};
  const E79Inputs in1 = slice_inputs(s, in, 0, split);
  E79Inputs in2 = slice_inputs(s, in, split, T);
  const E79Outputs full = e79_fwd_ref(s, in);
  const E79Outputs o1 = e79_fwd_ref(s1, in1);
  in2.S0 = o1.S;
  in2.M0 = o1.M;
  const E79Outputs o2 = e79_fwd_ref(s2, in2);
  expect_all_near(concat(o1.out, o2.out), full.out, "out");
  expect_all_near(o2.S, full.S, "S");
  expect_all_near(o2.M, full.M, "M");

  const E79Grads g = e79_bwd_ref(s, in, dout, &dS_final, &dM_final);
  const E79Grads g2 = e79_bwd_ref(s2, in2, slice_time(dout, row, split, T), &dS_final, &dM_final);
  const E79Grads g1 = e79_bwd_ref(s1, in1, slice_time(dout, row, 0, split), &g2.dS0, &g2.dM0);
  expect_all_near(concat(g1.dk, g2.dk), g.dk, "dk");
  expect_all_near(concat(g1.dv, g2.dv), g.dv, "dv");
  expect_all_near(concat(g1.dq, g2.dq), g.dq, "dq");
  expect_all_near(concat(g1.dm, g2.dm), g.dm, "dm");
  if (bias_mode == kE79BiasFixed) {
    expect_all_near(add(g1.db_s, g2.db_s), g.db_s, "db_s");
    expect_all_near(add(g1.db_m, g2.db_m), g.db_m, "db_m");
  } else {
    expect_all_near(concat(g1.db_s, g2.db_s), g.db_s, "db_s");
    expect_all_near(concat(g1.db_m, g2.db_m), g.db_m, "db_m");
  }
  expect_all_near(g1.dS0, g.dS0, "dS0");
  expect_all_near(g1.dM0, g.dM0, "dM0");
}

std::string chunk_param_name(const ::testing::TestParamInfo<ChunkParam>& info) {
  const auto [bias_mode, with_init, T, split] = info.param;
  return std::string(bias_name(bias_mode)) + (with_init ? "_init" : "_noinit") + "_T" +
         std::to_string(T) + "_split" + std::to_string(split);
}

INSTANTIATE_TEST_SUITE_P(Splits, E79ReferenceChunks,
                         ::testing::Combine(::testing::Values(kE79BiasNone, kE79BiasFixed, kE79BiasInput),
                                            ::testing::Bool(),
                                            ::testing::Values<int64_t>(2, 5),
                                            ::testing::Values<int64_t>(1)),
                         chunk_param_name);

}  // namespace
