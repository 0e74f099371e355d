// Tests of the float64 DiffLogic CA step reference (api/ops/difflogic/reference.h): the backward (the
// state through kept cells, the update network and every neighbour's perception; every perception
// kernel's and update layer's logits) against central differences, zero-padded and periodic, with and
// without a fire mask; a kept cell keeps its state; the perception's placement (channel, bit, kernel);
// errors naming the argument; values pinned by the Python twin's test (tests/python/test_reference_difflogic_ca.py).
#include "difflogic/reference.h"
#include "reference_test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

using kspec::testing::central_diff;
using kspec::testing::expect_grad_near;
using kspec::testing::formula;
using kspec::testing::random_uniform;
using kspec::testing::weighted;
namespace ref = kspec::ref;

// C channels, K kernels, perception 9 -> 8 -> 4 -> 2, update (C + 2 C K) -> 6 -> C: a small checkerboard net.
struct SmallCa {
  ref::DiffLogicCa ca;
  ref::DiffLogicCaLogits logits;
};

ref::DiffLogicLayerWires random_wires(std::mt19937_64& rng, int64_t n_in, int64_t width) {
  std::uniform_int_distribution<int32_t> wire(0, static_cast<int32_t>(n_in - 1));
  ref::DiffLogicLayerWires l;
  for (int64_t g = 0; g < width; ++g) {
    l.a.push_back(wire(rng));
    l.b.push_back(g % 4 == 0 ? l.a.back() : wire(rng));
  }
  return l;
}

SmallCa small_ca(uint64_t seed, int64_t C, int64_t K, bool periodic) {
  std::mt19937_64 rng(seed);
  SmallCa s;
  s.ca.C = C;
  s.ca.K = K;
  s.ca.periodic = periodic;
  s.ca.perm = {0, 1, 2, 3, 5, 6, 7, 8};
  std::shuffle(s.ca.perm.begin(), s.ca.perm.end(), rng);
  s.ca.perception = {random_wires(rng, 8, 4), random_wires(rng, 4, 2)};
  s.ca.update = {random_wires(rng, C + 2 * C * K, 6), random_wires(rng, 6, C)};
  for (int64_t width : {8, 4, 2}) s.logits.perception.push_back(random_uniform(rng, K * width * 16, -2.0, 2.0));
  for (int64_t width : {int64_t{6}, C}) s.logits.update.push_back(random_uniform(rng, width * 16, -2.0, 2.0));
  return s;
}

class DiffLogicCaBackward : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(DiffLogicCaBackward, MatchesCentralDifferences) {
  const auto [periodic, masked] = GetParam();
  const int64_t B = 2, H = 3, W = 4, C = 2, K = 2;
  SmallCa s = small_ca(periodic * 2 + masked, C, K, periodic);
  std::mt19937_64 rng(5);
  std::vector<double> state = random_uniform(rng, B * H * W * C, 0.05, 0.95);
  const std::vector<double> dnew = random_uniform(rng, B * H * W * C, -1.0, 1.0);
  std::vector<double> fire(static_cast<size_t>(B * H * W));
  for (size_t j = 0; j < fire.size(); ++j) fire[j] = j % 3 == 1 ? 0.0 : 1.0;
  const std::vector<double>* mask = masked ? &fire : nullptr;
  const auto g = ref::difflogic_ca_step_bwd_ref(s.ca, B, H, W, state, s.logits, mask, dnew);
  auto loss = [&] {
    const auto next = ref::difflogic_ca_step_ref(s.ca, B, H, W, state, s.logits, mask, ref::DiffLogicMode::Soft);
    double v = 0.0;
    for (size_t j = 0; j < next.size(); ++j) v += dnew[j] * next[j];
    return v;
  };
  expect_grad_near(g.dstate, central_diff(loss, state, 1e-6), 1e-9, "dstate");
  for (size_t l = 0; l < s.logits.perception.size(); ++l)
    expect_grad_near(g.dlogits.perception[l], central_diff(loss, s.logits.perception[l], 1e-6), 1e-9,
                     "dperception[" + std::to_string(l) + "]");
  for (size_t l = 0; l < s.logits.update.size(); ++l)
    expect_grad_near(g.dlogits.update[l], central_diff(loss, s.logits.update[l], 1e-6), 1e-9,
                     "dupdate[" + std::to_string(l) + "]");
}

INSTANTIATE_TEST_SUITE_P(PaddingAndMask, DiffLogicCaBackward,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

// A cell the mask keeps has its old state; a fired one the update network's output, which with
// pass-through logits (op 3, "a", everywhere) and wiring is readable: the update's output c is state c.
TEST(DiffLogicCaReference, KeptCellsKeepTheirStateAndPerceptionIsPlacedByChannelBitKernel) {
  const int64_t B = 1, H = 2, W = 3, C = 2, K = 3;
  SmallCa s = small_ca(3, C, K, true);
  std::vector<double> state = {0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.4, 0.6, 0.5, 0.5, 0.6, 0.4};
  // Update: one layer reading input `pick` on both wires with op 3 (a): output c = input pick[c].
  auto pass = [&](std::vector<int32_t> pick) {
    s.ca.update = {{pick, pick}};
    s.logits.update = {std::vector<double>(static_cast<size_t>(C * 16), 0.0)};
    for (int64_t c = 0; c < C; ++c) s.logits.update[0][c * 16 + 3] = 50.0;
  };
  pass({0, 1});
  std::vector<double> fire = {1, 0, 1, 1, 0, 1};
  auto next = ref::difflogic_ca_step_ref(s.ca, B, H, W, state, s.logits, &fire, ref::DiffLogicMode::Hard);
  EXPECT_EQ(next, state);  // the update copies the state: fired or kept, the same
  // Perception slot c P K + bit K + k of channel 1, bit 1, kernel 2 vs the same kernel run by hand: the
  // hard perception of kernel 2 on channel 1's patch.
  const int32_t slot = static_cast<int32_t>(C + 1 * 2 * K + 1 * K + 2);
  pass({slot, slot});
  next = ref::difflogic_ca_step_ref(s.ca, B, H, W, state, s.logits, nullptr, ref::DiffLogicMode::Hard);
  for (int64_t cell = 0; cell < B * H * W; ++cell) {
    const int64_t h = cell / W, w = cell % W;
    std::vector<double> patch(9);
    for (int q = 0; q < 9; ++q) patch[q] = state[(((h + q / 3 - 1 + H) % H) * W + (w + q % 3 - 1 + W) % W) * C + 1];
    std::vector<double> x = patch;
    int64_t n_in = 9;
    for (size_t l = 0; l < 3; ++l) {
      const auto wires = l == 0 ? ref::DiffLogicLayerWires{s.ca.perm, std::vector<int32_t>(8, 4)} : s.ca.perception[l - 1];
      const auto width = static_cast<int64_t>(wires.a.size());
      const std::vector<double> lk(s.logits.perception[l].begin() + 2 * width * 16,
                                   s.logits.perception[l].begin() + 3 * width * 16);
      x = ref::difflogic_layer_fwd_ref(1, n_in, x, lk, wires.a, wires.b, ref::DiffLogicMode::Hard);
      n_in = width;
    }
    EXPECT_EQ(next[cell * C], x[1]) << cell;
  }
}

TEST(DiffLogicCaReference, ErrorsNameTheArgument) {
  SmallCa s = small_ca(1, 2, 2, false);
  const std::vector<double> state(2 * 3 * 4 * 2, 0.5);
  auto expect_error = [&](const SmallCa& bad, const std::string& fragment) {
    try {
      ref::difflogic_ca_step_ref(bad.ca, 2, 3, 4, state, bad.logits, nullptr, ref::DiffLogicMode::Soft);
      ADD_FAILURE() << "no error, expected: " << fragment;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  SmallCa bad = s;
  bad.ca.perm[3] = 9;
  expect_error(bad, "a[3] = 9 is outside [0, 9)");
  bad = s;
  bad.ca.update.back().a.pop_back();
  bad.ca.update.back().b.pop_back();
  expect_error(bad, "update logits [1]");
  bad = s;
  bad.logits.perception[1].pop_back();
  expect_error(bad, "perception logits [1] ([K, width, 16])");
  bad = s;
  std::mt19937_64 rng(1);
  bad.ca.update.push_back(random_wires(rng, 2, 3));
  bad.logits.update.push_back(std::vector<double>(3 * 16));
  expect_error(bad, "last width is 3, expected C = 2");
}

// A formula CA (C = 2, K = 2, periodic, a fire mask): PINNED there.
TEST(DiffLogicCaReference, PinnedValuesSharedWithPython) {
  const int64_t B = 1, H = 3, W = 3, C = 2, K = 2;
  ref::DiffLogicCa ca;
  ca.C = C;
  ca.K = K;
  ca.periodic = true;
  ca.perm = {8, 7, 6, 5, 3, 2, 1, 0};
  auto wires = [](int64_t n_in, int64_t width, int32_t m) {
    ref::DiffLogicLayerWires l;
    for (int32_t g = 0; g < width; ++g) {
      l.a.push_back((m * g + 1) % static_cast<int32_t>(n_in));
      l.b.push_back((2 * g) % static_cast<int32_t>(n_in));
    }
    return l;
  };
  ca.perception = {wires(8, 4, 3), wires(4, 2, 1)};
  ca.update = {wires(C + 2 * C * K, 6, 5), wires(6, C, 1)};
  ref::DiffLogicCaLogits logits;
  double c = 0.2;
  for (int64_t width : {8, 4, 2}) logits.perception.push_back(formula(K * width * 16, c += 0.1, 2.0));
  for (int64_t width : {int64_t{6}, C}) logits.update.push_back(formula(width * 16, c += 0.1, 2.0));
  const auto state = formula(B * H * W * C, 0.1, 0.45, 0.5), dnew = formula(B * H * W * C, 0.3, 1.0);
  const std::vector<double> fire = {1, 1, 0, 1, 1, 1, 0, 1, 1};
  const auto next = ref::difflogic_ca_step_ref(ca, B, H, W, state, logits, &fire, ref::DiffLogicMode::Soft);
  const auto g = ref::difflogic_ca_step_bwd_ref(ca, B, H, W, state, logits, &fire, dnew);
  EXPECT_NEAR(weighted(next), -0.8070537881094376, 1e-12);
  EXPECT_NEAR(weighted(g.dstate), -1.956605101685864, 1e-12);
  EXPECT_NEAR(weighted(g.dlogits.perception[0]), 0.007162407501578153, 1e-12);
  EXPECT_NEAR(weighted(g.dlogits.update[0]), -0.06100627529083135, 1e-12);
}

}  // namespace
