// Tests of the float64 selective-scan reference: its backward against central finite differences of
// its forward over fixed/variable B and C, groups, softplus and every optional input, and its forward
// against a hand computation, a zero h0, and the same sequence scanned in two chunks.
#include "selective_scan/reference.h"
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
using kspec::testing::random_uniform;
using kspec::testing::dot;
using kspec::testing::abs_dot;
using kspec::testing::expect_grad_near;

using kspec::ref::ScanGrads;
using kspec::ref::ScanInputs;
using kspec::ref::ScanOutputs;
using kspec::ref::ScanShape;
using kspec::ref::selective_scan_bwd_ref;
using kspec::ref::selective_scan_fwd_ref;

// Optional inputs as bits of one mask, so a test parameter can switch each on and off.
constexpr int kHasD = 1;
constexpr int kHasZ = 2;
constexpr int kHasDeltaBias = 4;
constexpr int kHasH0 = 8;
constexpr int kAllOptional = kHasD | kHasZ | kHasDeltaBias | kHasH0;

// How B and C are given: both fixed; both variable with 1 or 2 groups; one variable, one fixed.
enum BcMode { kFixedBc, kVariableBcG1, kVariableBcG2, kVariableBFixedCG2, kFixedBVariableCG1 };
constexpr int kNumBcModes = 5;

ScanShape make_shape(int bc_mode, int64_t batch, int64_t dim, int64_t seqlen, int64_t dstate) {
  ScanShape s;
  s.batch = batch;
  s.dim = dim;
  s.seqlen = seqlen;
  s.dstate = dstate;
  s.variable_b = bc_mode == kVariableBcG1 || bc_mode == kVariableBcG2 || bc_mode == kVariableBFixedCG2;
  s.variable_c = bc_mode == kVariableBcG1 || bc_mode == kVariableBcG2 || bc_mode == kFixedBVariableCG1;
  s.groups = (bc_mode == kVariableBcG2 || bc_mode == kVariableBFixedCG2) ? 2 : 1;
  return s;
}

// Inputs like a real Mamba layer's: A = -exp(N(0, 0.5)) (decaying states), and a positive time step
// when no softplus makes it so.
ScanInputs make_inputs(std::mt19937_64& rng, const ScanShape& s, int optional, bool softplus) {
  const int64_t bdt = s.batch * s.dim * s.seqlen;
  const int64_t variable_bc = s.batch * s.groups * s.dstate * s.seqlen;
  ScanInputs in;
  in.delta_softplus = softplus;
  in.u = random_nonzero(rng, bdt, 0.1, 1.5);
  in.delta = softplus ? random_nonzero(rng, bdt, 0.1, 1.5) : random_uniform(rng, bdt, 0.2, 1.0);
  std::normal_distribution<double> normal(0.0, 0.5);
  in.A.resize(static_cast<size_t>(s.dim * s.dstate));
  for (double& a : in.A) a = -std::exp(normal(rng));
  in.B = random_nonzero(rng, s.variable_b ? variable_bc : s.dim * s.dstate, 0.1, 1.5);
  in.C = random_nonzero(rng, s.variable_c ? variable_bc : s.dim * s.dstate, 0.1, 1.5);
  if (optional & kHasD) in.D = random_nonzero(rng, s.dim, 0.1, 1.5);
  if (optional & kHasZ) in.z = random_nonzero(rng, bdt, 0.1, 2.0);
  if (optional & kHasDeltaBias) {
    in.delta_bias = softplus ? random_nonzero(rng, s.dim, 0.1, 1.0) : random_uniform(rng, s.dim, 0.05, 0.3);
  }
  if (optional & kHasH0) in.h0 = random_nonzero(rng, s.batch * s.dim * s.dstate, 0.1, 1.5);
  return in;
}

void expect_all_near(const std::vector<double>& a, const std::vector<double>& b, double rtol,
                     const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], rtol * std::max(1.0, std::abs(b[i]))) << what << "[" << i << "]";
  }
}

// bc_mode, delta_softplus, optional mask, dstate, seqlen, with dlast_state
using FdParam = std::tuple<int, bool, int, int64_t, int64_t, bool>;

class SelectiveScanReferenceFiniteDiff : public ::testing::TestWithParam<FdParam> {};

TEST_P(SelectiveScanReferenceFiniteDiff, BackwardMatchesCentralDifferences) {
  const auto [bc_mode, softplus, optional, dstate, seqlen, with_dlast] = GetParam();
  const ScanShape s = make_shape(bc_mode, 2, 4, seqlen, dstate);
  std::mt19937_64 rng(0x5353u + static_cast<uint64_t>(((bc_mode * 2 + softplus) * 16 + optional) * 100 +
                                                      dstate * 10 + seqlen));
  ScanInputs in = make_inputs(rng, s, optional, softplus);
  const std::vector<double> dout = random_nonzero(rng, s.batch * s.dim * s.seqlen, 0.1, 1.0);
  const std::vector<double> dlast = random_nonzero(rng, s.batch * s.dim * s.dstate, 0.1, 1.0);
  const std::vector<double>* dlast_ptr = with_dlast ? &dlast : nullptr;

  // The loss whose gradients the backward returns.
  auto loss = [&]() {
    const ScanOutputs o = selective_scan_fwd_ref(s, in);
    return dot(dout, o.out) + (with_dlast ? dot(dlast, o.last_state) : 0.0);
  };
  constexpr double kStep = 1e-6;
  auto central_diff = [&](std::vector<double>& param) { return kspec::testing::central_diff(loss, param, kStep); };

  const ScanGrads g = selective_scan_bwd_ref(s, in, dout, dlast_ptr);
  const ScanOutputs o = selective_scan_fwd_ref(s, in);
  const double loss_scale = abs_dot(dout, o.out) + (with_dlast ? abs_dot(dlast, o.last_state) : 0.0);
  const double fd_noise = 1e-9 * (1.0 + loss_scale);  // ~4 * 2.2e-16 / kStep, with room

  expect_grad_near(g.du, central_diff(in.u), fd_noise, "du");
  expect_grad_near(g.ddelta, central_diff(in.delta), fd_noise, "ddelta");
  expect_grad_near(g.dA, central_diff(in.A), fd_noise, "dA");
  expect_grad_near(g.dB, central_diff(in.B), fd_noise, "dB");
  expect_grad_near(g.dC, central_diff(in.C), fd_noise, "dC");
  struct Optional {
    int bit;
    std::vector<double>* input;
    const std::vector<double>* grad;
    const char* name;
  };
  for (const Optional& opt : {Optional{kHasD, &in.D, &g.dD, "dD"}, Optional{kHasZ, &in.z, &g.dz, "dz"},
                              Optional{kHasDeltaBias, &in.delta_bias, &g.ddelta_bias, "ddelta_bias"},
                              Optional{kHasH0, &in.h0, &g.dh0, "dh0"}}) {
    if (optional & opt.bit) {
      expect_grad_near(*opt.grad, central_diff(*opt.input), fd_noise, opt.name);
    } else {
      EXPECT_TRUE(opt.grad->empty()) << opt.name;
    }
  }
}

std::string fd_param_name(const ::testing::TestParamInfo<FdParam>& info) {
  static const char* const kBcNames[] = {"fixedBC", "varBC_g1", "varBC_g2", "varB_fixedC_g2",
                                         "fixedB_varC_g1"};
  const auto [bc_mode, softplus, optional, dstate, seqlen, with_dlast] = info.param;
  std::string opts;
  if (optional & kHasD) opts += "D";
  if (optional & kHasZ) opts += "z";
  if (optional & kHasDeltaBias) opts += "bias";
  if (optional & kHasH0) opts += "h0";
  return std::string(kBcNames[bc_mode]) + (softplus ? "_softplus" : "_linear") + "_opt" +
         (opts.empty() ? std::string("none") : opts) + "_n" + std::to_string(dstate) + "_t" +
         std::to_string(seqlen) + (with_dlast ? "_dlast" : "_nodlast");
}

INSTANTIATE_TEST_SUITE_P(AllCombinations, SelectiveScanReferenceFiniteDiff,
                         ::testing::Combine(::testing::Range(0, kNumBcModes), ::testing::Bool(),
                                            ::testing::Range(0, kAllOptional + 1),
                                            ::testing::Values<int64_t>(1, 4),
                                            ::testing::Values<int64_t>(1, 2, 7), ::testing::Bool()),
                         fd_param_name);

// One step from h0 with every option, written out from the formulas in reference.h.
TEST(SelectiveScanReference, SeqlenOneMatchesHandComputation) {
  ScanShape s;
  s.dstate = 2;
  s.variable_b = true;
  ScanInputs in;
  in.u = {0.7};
  in.delta = {-0.3};
  in.A = {-0.5, -2.0};
  in.B = {0.9, -1.1};
  in.C = {0.4, 1.3};
  in.D = {0.25};
  in.z = {-0.6};
  in.delta_bias = {0.8};
  in.h0 = {1.5, -0.2};
  in.delta_softplus = true;

  const double dt = std::log(1.0 + std::exp(-0.3 + 0.8));
  const double x0 = std::exp(dt * -0.5) * 1.5 + dt * 0.9 * 0.7;
  const double x1 = std::exp(dt * -2.0) * -0.2 + dt * -1.1 * 0.7;
  const double y = 0.4 * x0 + 1.3 * x1;
  const double out = (y + 0.25 * 0.7) * (-0.6 / (1.0 + std::exp(0.6)));

  const ScanOutputs o = selective_scan_fwd_ref(s, in);
  ASSERT_EQ(o.out.size(), 1u);
  ASSERT_EQ(o.last_state.size(), 2u);
  EXPECT_NEAR(o.out[0], out, 1e-15);
  EXPECT_NEAR(o.last_state[0], x0, 1e-15);
  EXPECT_NEAR(o.last_state[1], x1, 1e-15);
}

class SelectiveScanReferenceProperties : public ::testing::TestWithParam<int> {};

// A zero initial state is the same scan as none: identical outputs and gradients, and dh0 is still
// the adjoint of x_{-1}.
TEST_P(SelectiveScanReferenceProperties, ZeroH0EqualsNoH0) {
  const ScanShape s = make_shape(GetParam(), 2, 4, 7, 4);
  std::mt19937_64 rng(11 + static_cast<uint64_t>(GetParam()));
  ScanInputs in = make_inputs(rng, s, kAllOptional & ~kHasH0, true);
  const std::vector<double> dout = random_nonzero(rng, s.batch * s.dim * s.seqlen, 0.1, 1.0);
  const std::vector<double> dlast = random_nonzero(rng, s.batch * s.dim * s.dstate, 0.1, 1.0);
  ScanInputs zero = in;
  zero.h0.assign(static_cast<size_t>(s.batch * s.dim * s.dstate), 0.0);

  const ScanOutputs a = selective_scan_fwd_ref(s, in);
  const ScanOutputs b = selective_scan_fwd_ref(s, zero);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.last_state, b.last_state);
  const ScanGrads ga = selective_scan_bwd_ref(s, in, dout, &dlast);
  const ScanGrads gb = selective_scan_bwd_ref(s, zero, dout, &dlast);
  EXPECT_EQ(ga.du, gb.du);
  EXPECT_EQ(ga.ddelta, gb.ddelta);
  EXPECT_EQ(ga.dA, gb.dA);
  EXPECT_EQ(ga.dB, gb.dB);
  EXPECT_EQ(ga.dC, gb.dC);
  EXPECT_EQ(ga.dD, gb.dD);
  EXPECT_EQ(ga.dz, gb.dz);
  EXPECT_EQ(ga.ddelta_bias, gb.ddelta_bias);
  EXPECT_TRUE(ga.dh0.empty());
  EXPECT_EQ(gb.dh0.size(), zero.h0.size());
}

// Copies time steps [t0, t1) of a [rows, T] tensor.
std::vector<double> slice_time(const std::vector<double>& v, int64_t T, int64_t t0, int64_t t1) {
  std::vector<double> r;
  for (int64_t row = 0; row < static_cast<int64_t>(v.size()) / T; ++row) {
    r.insert(r.end(), v.begin() + row * T + t0, v.begin() + row * T + t1);
  }
  return r;
}

// Joins two [rows, T1] and [rows, T2] tensors along time.
std::vector<double> concat_time(const std::vector<double>& a, int64_t T1, const std::vector<double>& b,
                                int64_t T2) {
  std::vector<double> r;
  for (int64_t row = 0; row < static_cast<int64_t>(a.size()) / T1; ++row) {
    r.insert(r.end(), a.begin() + row * T1, a.begin() + (row + 1) * T1);
    r.insert(r.end(), b.begin() + row * T2, b.begin() + (row + 1) * T2);
  }
  return r;
}

std::vector<double> add(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r(a);
  for (size_t i = 0; i < r.size(); ++i) r[i] += b[i];
  return r;
}

ScanInputs slice_inputs(const ScanShape& s, const ScanInputs& in, int64_t t0, int64_t t1) {
  ScanInputs r = in;
  r.u = slice_time(in.u, s.seqlen, t0, t1);
  r.delta = slice_time(in.delta, s.seqlen, t0, t1);
  if (!in.z.empty()) r.z = slice_time(in.z, s.seqlen, t0, t1);
  if (s.variable_b) r.B = slice_time(in.B, s.seqlen, t0, t1);
  if (s.variable_c) r.C = slice_time(in.C, s.seqlen, t0, t1);
  return r;
}

// Scans [0, split) and then [split, seqlen) from the first chunk's last state, forward and backward
// (the second chunk's dh0 is the first chunk's dlast_state), and compares with one scan of the whole.
void expect_chunked_equals_full(const ScanShape& s, const ScanInputs& in, int64_t split, double rtol) {
  std::mt19937_64 rng(static_cast<uint64_t>(s.seqlen + split));
  const std::vector<double> dout = random_nonzero(rng, s.batch * s.dim * s.seqlen, 0.1, 1.0);
  const std::vector<double> dlast = random_nonzero(rng, s.batch * s.dim * s.dstate, 0.1, 1.0);
  const int64_t t1 = split, t2 = s.seqlen - split;
  ScanShape s1 = s, s2 = s;
  s1.seqlen = t1;
  s2.seqlen = t2;
  ScanInputs in1 = slice_inputs(s, in, 0, split);
  ScanInputs in2 = slice_inputs(s, in, split, s.seqlen);

  const ScanOutputs full = selective_scan_fwd_ref(s, in);
  const ScanOutputs o1 = selective_scan_fwd_ref(s1, in1);
  in2.h0 = o1.last_state;
  const ScanOutputs o2 = selective_scan_fwd_ref(s2, in2);
  expect_all_near(concat_time(o1.out, t1, o2.out, t2), full.out, rtol, "out");
  expect_all_near(o2.last_state, full.last_state, rtol, "last_state");

  const ScanGrads gf = selective_scan_bwd_ref(s, in, dout, &dlast);
  const ScanGrads g2 = selective_scan_bwd_ref(s2, in2, slice_time(dout, s.seqlen, split, s.seqlen), &dlast);
  const ScanGrads g1 = selective_scan_bwd_ref(s1, in1, slice_time(dout, s.seqlen, 0, split), &g2.dh0);
  expect_all_near(concat_time(g1.du, t1, g2.du, t2), gf.du, rtol, "du");
  expect_all_near(concat_time(g1.ddelta, t1, g2.ddelta, t2), gf.ddelta, rtol, "ddelta");
  expect_all_near(add(g1.dA, g2.dA), gf.dA, rtol, "dA");
  expect_all_near(s.variable_b ? concat_time(g1.dB, t1, g2.dB, t2) : add(g1.dB, g2.dB), gf.dB, rtol, "dB");
  expect_all_near(s.variable_c ? concat_time(g1.dC, t1, g2.dC, t2) : add(g1.dC, g2.dC), gf.dC, rtol, "dC");
  if (!in.D.empty()) expect_all_near(add(g1.dD, g2.dD), gf.dD, rtol, "dD");
  if (!in.z.empty()) expect_all_near(concat_time(g1.dz, t1, g2.dz, t2), gf.dz, rtol, "dz");
  if (!in.delta_bias.empty()) {
    expect_all_near(add(g1.ddelta_bias, g2.ddelta_bias), gf.ddelta_bias, rtol, "ddelta_bias");
  }
  if (!in.h0.empty()) expect_all_near(g1.dh0, gf.dh0, rtol, "dh0");
}

TEST_P(SelectiveScanReferenceProperties, ChunkedEqualsFull) {
  const ScanShape s = make_shape(GetParam(), 2, 4, 7, 4);
  for (int optional : {0, kAllOptional}) {
    std::mt19937_64 rng(23 + static_cast<uint64_t>(GetParam() * 16 + optional));
    const ScanInputs in = make_inputs(rng, s, optional, optional != 0);
    for (int64_t split : {1, 3, 6}) expect_chunked_equals_full(s, in, split, 1e-13);
  }
}

INSTANTIATE_TEST_SUITE_P(BcModes, SelectiveScanReferenceProperties, ::testing::Range(0, kNumBcModes));

// The longest sequences Mamba runs: nothing recursive, and the scratch stays one channel's states.
TEST(SelectiveScanReference, LongSequenceChunkedEqualsFull) {
  const ScanShape s = make_shape(kVariableBcG2, 1, 2, 65536, 4);
  std::mt19937_64 rng(65536);
  const ScanInputs in = make_inputs(rng, s, kAllOptional, true);
  expect_chunked_equals_full(s, in, 40000, 1e-11);
}

TEST(SelectiveScanReference, RejectsBadArguments) {
  std::mt19937_64 rng(3);
  const ScanShape s = make_shape(kVariableBcG2, 2, 4, 3, 2);
  const ScanInputs good = make_inputs(rng, s, kAllOptional, false);
  const std::vector<double> dout(static_cast<size_t>(s.batch * s.dim * s.seqlen), 1.0);
  EXPECT_NO_THROW(selective_scan_fwd_ref(s, good));
  EXPECT_NO_THROW(selective_scan_bwd_ref(s, good, dout, nullptr));

  ScanShape bad_groups = s;
  bad_groups.groups = 3;
  EXPECT_THROW(selective_scan_fwd_ref(bad_groups, good), std::invalid_argument);
  ScanInputs bad = good;
  bad.B.pop_back();
  EXPECT_THROW(selective_scan_fwd_ref(s, bad), std::invalid_argument);
  bad = good;
  bad.D.push_back(1.0);
  EXPECT_THROW(selective_scan_fwd_ref(s, bad), std::invalid_argument);
  ScanShape fixed_c = s;
  fixed_c.variable_c = false;
  EXPECT_THROW(selective_scan_fwd_ref(fixed_c, good), std::invalid_argument);
  EXPECT_THROW(selective_scan_bwd_ref(s, good, std::vector<double>(3, 1.0), nullptr), std::invalid_argument);
  const std::vector<double> short_dlast(5, 1.0);
  EXPECT_THROW(selective_scan_bwd_ref(s, good, dout, &short_dlast), std::invalid_argument);
}

}  // namespace
