// Tests of the float64 difflogic reference: truth tables against the multilinear extensions, the T-form
// against sum_i p_i op_i, the soft backward against central differences (repeated wires, self-paired
// gates, grad_factor), hard mode's ties, packed inference equal to the hard forward bit for bit (w = 32,
// 64, B not a multiple of w), GroupSum, the consumers CSR, Philox's known answers, the Gumbel noise's
// distribution, the straight-through estimator's backward on logits + G against central differences,
// errors naming the argument, and values pinned by the Python twin's test
// (tests/python/test_reference_difflogic.py).
#include "difflogic/reference.h"
#include "reference_test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
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
using kspec::testing::random_uniform;
using kspec::testing::weighted;
namespace ref = kspec::ref;
using ref::DiffLogicMode;

struct Layer {
  int64_t B, n_in, n_out;
  std::vector<double> x, logits;
  std::vector<int32_t> a, b;
};

// Random wiring with every third gate self-paired.
Layer make_layer(std::mt19937_64& rng, int64_t B, int64_t n_in, int64_t n_out) {
  Layer l{B, n_in, n_out, random_uniform(rng, B * n_in, 0.05, 0.95), random_uniform(rng, n_out * 16, -3.0, 3.0), {}, {}};
  std::uniform_int_distribution<int32_t> wire(0, static_cast<int32_t>(n_in - 1));
  for (int64_t g = 0; g < n_out; ++g) {
    l.a.push_back(wire(rng));
    l.b.push_back(g % 3 == 0 ? l.a.back() : wire(rng));
  }
  return l;
}

// g's dx and dlogits against central differences of loss through l's x (times grad_factor) and logits.
template <typename Loss>
void expect_layer_grads_near(const ref::DiffLogicGrads& g, Loss& loss, Layer& l, double grad_factor) {
  std::vector<double> fd_x = central_diff(loss, l.x, 1e-6);
  for (double& v : fd_x) v *= grad_factor;
  expect_grad_near(g.dx, fd_x, 1e-9, "dx");
  expect_grad_near(g.dlogits, central_diff(loss, l.logits, 1e-6), 1e-9, "dlogits");
}

TEST(DiffLogicReference, TruthTablesAreTheMultilinearExtensionsAtCorners) {
  for (int i = 0; i < 16; ++i)
    for (int u = 0; u < 2; ++u)
      for (int v = 0; v < 2; ++v) EXPECT_EQ(ref::difflogic_op(i, u, v), ref::difflogic_truth(i, u, v)) << i;
  EXPECT_EQ(ref::difflogic_truth(6, 0, 1) + ref::difflogic_truth(6, 1, 0), 2);  // XOR
  EXPECT_EQ(ref::difflogic_truth(6, 1, 1), 0);
}

TEST(DiffLogicReference, TFormEqualsTheMixtureOfOps) {
  std::mt19937_64 rng(1);
  const Layer l = make_layer(rng, 5, 4, 9);
  const auto y = ref::difflogic_layer_fwd_ref(l.B, l.n_in, l.x, l.logits, l.a, l.b, DiffLogicMode::Soft);
  for (int64_t g = 0; g < l.n_out; ++g) {
    double mx = -1e300, sum = 0.0;
    for (int i = 0; i < 16; ++i) mx = std::max(mx, l.logits[g * 16 + i]);
    for (int i = 0; i < 16; ++i) sum += std::exp(l.logits[g * 16 + i] - mx);
    for (int64_t s = 0; s < l.B; ++s) {
      double want = 0.0;
      for (int i = 0; i < 16; ++i)
        want += std::exp(l.logits[g * 16 + i] - mx) / sum *
                ref::difflogic_op(i, l.x[s * l.n_in + l.a[g]], l.x[s * l.n_in + l.b[g]]);
      EXPECT_NEAR(y[s * l.n_out + g], want, 1e-14);
    }
  }
}

class DiffLogicBackward : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, double>> {};

TEST_P(DiffLogicBackward, MatchesCentralDifferences) {
  const auto [B, n_in, n_out, grad_factor] = GetParam();
  std::mt19937_64 rng(10 + n_out);
  Layer l = make_layer(rng, B, n_in, n_out);
  const std::vector<double> dout = random_uniform(rng, B * n_out, -1.0, 1.0);
  const auto g = ref::difflogic_layer_bwd_ref(B, n_in, l.x, l.logits, l.a, l.b, dout, grad_factor);
  auto loss = [&] {
    return dot(dout, ref::difflogic_layer_fwd_ref(B, n_in, l.x, l.logits, l.a, l.b, DiffLogicMode::Soft));
  };
  expect_layer_grads_near(g, loss, l, grad_factor);
}

INSTANTIATE_TEST_SUITE_P(Shapes, DiffLogicBackward,
                         ::testing::Values(std::make_tuple(1, 1, 1, 1.0), std::make_tuple(3, 4, 7, 1.0),
                                           std::make_tuple(2, 5, 9, 2.5), std::make_tuple(4, 2, 6, 0.5)));

// ---- the straight-through estimator's Gumbel noise ----

// Random123's published known-answer vectors for Philox4x32-10.
TEST(DiffLogicReference, PhiloxKnownAnswers) {
  EXPECT_EQ(ref::philox4x32_10({0, 0, 0, 0}, {0, 0}),
            (std::array<uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(ref::philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu}),
            (std::array<uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
}

TEST(DiffLogicReference, GumbelNoiseIsGumbelAndDependsOnSeedAndGateOnly) {
  const auto g = ref::difflogic_gumbel_noise(4096, 7);
  double mean = 0.0, sq = 0.0;
  for (double v : g) mean += v / static_cast<double>(g.size());
  for (double v : g) sq += (v - mean) * (v - mean) / static_cast<double>(g.size());
  EXPECT_NEAR(mean, 0.5772156649015329, 0.02);  // Euler's gamma; std of the mean (pi / sqrt 6) / 256
  EXPECT_NEAR(sq, M_PI * M_PI / 6.0, 0.06);
  const auto prefix = ref::difflogic_gumbel_noise(10, 7);
  EXPECT_EQ(prefix, std::vector<double>(g.begin(), g.begin() + 160));  // a gate's noise: (seed, g) alone
  const auto other = ref::difflogic_gumbel_noise(10, 7 + (uint64_t{1} << 32));  // the seed's high word counts
  for (size_t j = 0; j < other.size(); ++j) EXPECT_NE(other[j], prefix[j]) << j;
}

// The estimator's backward is the soft layer's on logits + G (G fixed by the seed), its forward the hard
// layer of argmax(logits + G).
TEST_P(DiffLogicBackward, StraightThroughGumbelMatchesCentralDifferences) {
  const auto [B, n_in, n_out, grad_factor] = GetParam();
  std::mt19937_64 rng(20 + n_out);
  Layer l = make_layer(rng, B, n_in, n_out);
  const std::vector<double> dout = random_uniform(rng, B * n_out, -1.0, 1.0);
  const auto noise = ref::difflogic_gumbel_noise(n_out, 99);
  auto noisy = [&] {
    std::vector<double> v = l.logits;
    for (size_t j = 0; j < v.size(); ++j) v[j] += noise[j];
    return v;
  };
  const auto g = ref::difflogic_layer_bwd_ref(B, n_in, l.x, noisy(), l.a, l.b, dout, grad_factor);
  auto loss = [&] {
    return dot(dout, ref::difflogic_layer_fwd_ref(B, n_in, l.x, noisy(), l.a, l.b, DiffLogicMode::Soft));
  };
  expect_layer_grads_near(g, loss, l, grad_factor);
  const auto hard = ref::difflogic_layer_fwd_ref(B, n_in, l.x, noisy(), l.a, l.b, DiffLogicMode::Hard);
  const auto ops = ref::difflogic_hard_ops(noisy(), n_out);
  for (int64_t s = 0; s < B; ++s)
    for (int64_t k = 0; k < n_out; ++k)
      EXPECT_NEAR(hard[s * n_out + k], ref::difflogic_op(ops[k], l.x[s * n_in + l.a[k]], l.x[s * n_in + l.b[k]]),
                  1e-15);
}

TEST(DiffLogicReference, ConsumersCsrOrdersReadersAndSkipsUnreadInputs) {
  const auto c = ref::difflogic_consumers(5, {2, 0, 2, 3}, {0, 0, 3, 2});
  EXPECT_EQ(c.offsets, (std::vector<int64_t>{0, 3, 3, 6, 8, 8}));
  EXPECT_EQ(c.entries, (std::vector<int64_t>{1, 2, 3, 0, 4, 7, 5, 6}));
  // An unread input gets dx = 0; a self-paired gate's input gets da + db.
  std::vector<double> logits(16, 0.0);
  logits[6] = 3.0;
  const auto g = ref::difflogic_layer_bwd_ref(1, 2, {0.3, 0.8}, logits, {0}, {0}, {1.0});
  EXPECT_EQ(g.dx[1], 0.0);
  const auto t = ref::difflogic_tables(logits, 1, DiffLogicMode::Soft);
  const double x = 0.3, da = (t[2] - t[0]) * (1 - x) + (t[3] - t[1]) * x, db = (t[1] - t[0]) * (1 - x) + (t[3] - t[2]) * x;
  EXPECT_NEAR(g.dx[0], da + db, 1e-15);
}

TEST(DiffLogicReference, HardModeTiesGoToTheLowerIndex) {
  std::vector<double> logits(3 * 16, 0.0);
  logits[16 + 3] = logits[16 + 7] = 2.0;
  logits[32 + 14] = logits[32 + 9] = 1.0;
  EXPECT_EQ(ref::difflogic_hard_ops(logits, 3), (std::vector<int>{0, 3, 9}));
  const std::vector<double> x = {0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.25, 0.5};
  const auto y = ref::difflogic_layer_fwd_ref(4, 2, x, logits, {0, 0, 0}, {1, 1, 1}, DiffLogicMode::Hard);
  for (int s = 0; s < 4; ++s)
    for (int g = 0; g < 3; ++g) EXPECT_EQ(y[s * 3 + g], ref::difflogic_op(std::vector<int>{0, 3, 9}[g], x[2 * s], x[2 * s + 1]));
}

class DiffLogicPacked : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

// Three hard layers on random bits, packed and unpacked, and the packed GroupSum counts.
TEST_P(DiffLogicPacked, EqualsHardForwardBitForBit) {
  const auto [w, B] = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(B * 7 + w));
  int64_t n = 12;
  std::vector<double> x(static_cast<size_t>(B * n));
  std::bernoulli_distribution bit(0.5);
  for (double& v : x) v = bit(rng);
  std::vector<uint64_t> words = ref::difflogic_pack_ref(B, n, x, w);
  ASSERT_EQ(words.size(), static_cast<size_t>(n * ((B + w - 1) / w)));
  EXPECT_EQ(ref::difflogic_unpack_ref(B, n, words, w), x);
  for (int64_t n_out : {20, 16, 10}) {
    Layer l = make_layer(rng, 1, n, n_out);
    x = ref::difflogic_layer_fwd_ref(B, n, x, l.logits, l.a, l.b, DiffLogicMode::Hard);
    words = ref::difflogic_packed_fwd_ref(B, n, words, w, ref::difflogic_hard_ops(l.logits, n_out), l.a, l.b);
    n = n_out;
    EXPECT_EQ(ref::difflogic_unpack_ref(B, n, words, w), x);
    EXPECT_EQ(words, ref::difflogic_pack_ref(B, n, x, w));  // padding bits cleared
  }
  const auto counts = ref::difflogic_packed_group_sum_ref(B, n, words, w, 5);
  const auto sums = ref::difflogic_group_sum_ref(B, n, x, 5, 1.0);
  for (size_t j = 0; j < counts.size(); ++j) EXPECT_EQ(static_cast<double>(counts[j]), sums[j]);
}

INSTANTIATE_TEST_SUITE_P(WidthsAndBatches, DiffLogicPacked,
                         ::testing::Combine(::testing::Values(32, 64), ::testing::Values(1, 33, 64, 100)));

TEST(DiffLogicReference, EveryOpPackedAtEveryCorner) {
  const std::vector<double> x = {0, 0, 0, 1, 1, 0, 1, 1};
  std::vector<int> ops(16);
  for (int i = 0; i < 16; ++i) ops[i] = i;
  for (int w : {32, 64}) {
    const auto y = ref::difflogic_unpack_ref(
        4, 16, ref::difflogic_packed_fwd_ref(4, 2, ref::difflogic_pack_ref(4, 2, x, w), w, ops,
                                             std::vector<int32_t>(16, 0), std::vector<int32_t>(16, 1)),
        w);
    for (int s = 0; s < 4; ++s)
      for (int i = 0; i < 16; ++i) EXPECT_EQ(y[s * 16 + i], ref::difflogic_truth(i, s >> 1, s & 1)) << i << " " << w;
  }
}

TEST(DiffLogicReference, GroupSumAndItsBackward) {
  std::mt19937_64 rng(7);
  std::vector<double> x = random_uniform(rng, 36, -1.0, 1.0);
  const std::vector<double> dy = random_uniform(rng, 12, -1.0, 1.0);
  const auto y = ref::difflogic_group_sum_ref(3, 12, x, 4, 2.0);
  EXPECT_NEAR(y[5], (x[15] + x[16] + x[17]) / 2.0, 1e-15);
  auto loss = [&] {
    const auto v = ref::difflogic_group_sum_ref(3, 12, x, 4, 2.0);
    double s = 0.0;
    for (size_t j = 0; j < v.size(); ++j) s += dy[j] * v[j];
    return s;
  };
  expect_grad_near(ref::difflogic_group_sum_bwd_ref(3, 12, dy, 4, 2.0), central_diff(loss, x, 1e-6), 1e-9, "dx");
}

void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << part << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(DiffLogicReference, ErrorsNameTheArgument) {
  const std::vector<double> x(6, 0.0), l2(32, 0.0);
  expect_error([&] { ref::difflogic_layer_fwd_ref(2, 3, x, l2, {0, 1}, {2, 3}, DiffLogicMode::Soft); },
               "b[1] = 3 is outside [0, 3)");
  expect_error([&] { ref::difflogic_layer_fwd_ref(2, 3, x, l2, {-1, 0}, {0, 0}, DiffLogicMode::Soft); }, "a[0] = -1");
  expect_error([&] { ref::difflogic_layer_fwd_ref(2, 3, x, l2, {0}, {0, 1}, DiffLogicMode::Soft); }, "b (one wire");
  expect_error([&] { ref::difflogic_layer_fwd_ref(2, 3, x, l2, {0}, {0}, DiffLogicMode::Soft); }, "logits");
  expect_error([&] { ref::difflogic_group_sum_ref(2, 3, x, 2, 1.0); }, "divide n = 3");
  expect_error([&] { ref::difflogic_pack_ref(2, 3, x, 16); }, "w = 16");
  expect_error([&] { ref::difflogic_pack_ref(1, 1, {0.5}, 32); }, "expected 0 or 1");
  expect_error([&] { ref::difflogic_packed_fwd_ref(1, 1, {0}, 32, {16}, {0}, {0}); }, "ops[0] = 16");
}

// tests/python/test_reference_difflogic.py computes the same numbers (PINNED) with the NumPy reference.
TEST(DiffLogicReference, PinnedValuesSharedWithPython) {
  const int64_t B = 3, n_in = 5, n_out = 7;
  const auto x = formula(B * n_in, 0.1, 0.45, 0.5), logits = formula(n_out * 16, 0.2, 2.0),
             dout = formula(B * n_out, 0.3, 1.0);
  std::vector<int32_t> a, b;
  for (int32_t g = 0; g < n_out; ++g) {
    a.push_back((3 * g + 1) % n_in);
    b.push_back((2 * g) % n_in);
  }
  const auto y = ref::difflogic_layer_fwd_ref(B, n_in, x, logits, a, b, DiffLogicMode::Soft);
  const auto g = ref::difflogic_layer_bwd_ref(B, n_in, x, logits, a, b, dout, 1.5);
  std::vector<double> bits(x.size());
  for (size_t j = 0; j < x.size(); ++j) bits[j] = x[j] > 0.5 ? 1.0 : 0.0;
  const auto hard = ref::difflogic_unpack_ref(
      B, n_out,
      ref::difflogic_packed_fwd_ref(B, n_in, ref::difflogic_pack_ref(B, n_in, bits, 32), 32,
                                    ref::difflogic_hard_ops(logits, n_out), a, b),
      32);
  EXPECT_NEAR(weighted(y), 1.3609391835026599, 1e-12);
  EXPECT_NEAR(weighted(g.dx), -0.11917770680712834, 1e-12);
  EXPECT_NEAR(weighted(g.dlogits), -0.05810427339926578, 1e-12);
  EXPECT_NEAR(weighted(hard), 0.8392275169378114, 1e-12);
}

// GroupSum, binarize + pack (w = 32, 64) and packed GroupSum on formula inputs: PINNED_BITS there.
TEST(DiffLogicReference, PinnedBitsSharedWithPython) {
  const int64_t B = 37, n = 12;
  const auto x = formula(B * n, 0.4, 0.6, 0.5);
  const auto bits = ref::difflogic_binarize(x);
  std::vector<double> dy;  // x[:, :4], the Python side's upstream gradient
  for (int64_t s = 0; s < B; ++s) dy.insert(dy.end(), x.begin() + s * n, x.begin() + s * n + 4);
  auto as_doubles = [](const std::vector<uint64_t>& w, double scale) {
    std::vector<double> d(w.size());
    for (size_t j = 0; j < w.size(); ++j) d[j] = static_cast<double>(w[j]) / scale;
    return d;
  };
  const auto words64 = ref::difflogic_pack_ref(B, n, bits, 64);
  const auto counts = ref::difflogic_packed_group_sum_ref(B, n, words64, 64, 4);
  EXPECT_NEAR(weighted(ref::difflogic_group_sum_ref(B, n, x, 4, 2.5)), 3.932900446562618, 1e-12);
  EXPECT_NEAR(weighted(ref::difflogic_group_sum_bwd_ref(B, n, dy, 4, 2.5)), -0.21024730192034558, 1e-12);
  EXPECT_NEAR(weighted(as_doubles(ref::difflogic_pack_ref(B, n, bits, 32), 1.0)), -462858463.86566114, 1e-5);
  EXPECT_NEAR(weighted(as_doubles(words64, 4294967296.0)), -27.214010749434678, 1e-12);
  EXPECT_NEAR(weighted(std::vector<double>(counts.begin(), counts.end())), 7.922464655066591, 1e-12);
}

// Gumbel noise of a seed with both key words set, and the estimator on it: PINNED_GUMBEL there.
TEST(DiffLogicReference, PinnedGumbelSharedWithPython) {
  const int64_t B = 3, n_in = 5, n_out = 7;
  const auto x = formula(B * n_in, 0.1, 0.45, 0.5), dout = formula(B * n_out, 0.3, 1.0);
  std::vector<double> logits = formula(n_out * 16, 0.2, 2.0);
  std::vector<int32_t> a, b;
  for (int32_t g = 0; g < n_out; ++g) {
    a.push_back((3 * g + 1) % n_in);
    b.push_back((2 * g) % n_in);
  }
  const auto noise = ref::difflogic_gumbel_noise(n_out, 0x123456789ull);
  for (size_t j = 0; j < logits.size(); ++j) logits[j] += noise[j];
  const auto g = ref::difflogic_layer_bwd_ref(B, n_in, x, logits, a, b, dout, 1.5);
  EXPECT_NEAR(weighted(noise), -8.145101570081561, 1e-12);
  EXPECT_NEAR(weighted(ref::difflogic_layer_fwd_ref(B, n_in, x, logits, a, b, DiffLogicMode::Hard)),
              0.7226733450030891, 1e-12);
  EXPECT_NEAR(weighted(g.dx), -0.3453163755311174, 1e-12);
  EXPECT_NEAR(weighted(g.dlogits), -0.13913343765147065, 1e-12);
}

}  // namespace
