// Validation refuses an output that shares memory with an input or another output (issue 26, item 13),
// except an output the schema declares as an input updated in place, given as that very tensor; views
// whose ranges interleave without a common element stay accepted. No GPU: fake device pointers.
#include <cstdint>
#include <string>
#include <vector>

#include "api/src/op.h"
#include "kspec/kspec.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::fake;

namespace {

// The message of the InvalidArgument that `f` throws, or "" (a failure) when it throws none.
template <class F>
std::string invalid(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected InvalidArgument";
  return "";
}

void expect_has(const std::string& msg, std::vector<std::string> fragments) {
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
}

struct NormAct {
  TensorView x{fake(), DType::bf16, {12, 1024}, 0};
  TensorView w{fake(1 << 20), DType::bf16, {1024}, 0};
  TensorView b{fake(2 << 20), DType::bf16, {1024}, 0};
  TensorView y{fake(3 << 20), DType::bf16, {12, 1024}, 0};
  TensorView mean{fake(8 << 20), DType::f32, {12}, 0};
  TensorView rstd{fake(9 << 20), DType::f32, {12}, 0};
  std::vector<TensorView> in() const { return {x, w, b}; }
  std::vector<TensorView> out() const { return {y, mean, rstd}; }
};

}  // namespace

TEST(Overlap, OutputOverlappingAnInputIsRefusedByTheCall) {
  {  // the same tensor
    NormAct a;
    a.y = a.x;
    expect_has(invalid([&] { call("norm_act.fwd", a.in(), a.out()); }),
               {"norm_act.fwd", "output 'y'", "input 'x'", "shares memory"});
  }
  {  // a view starting one row into x
    NormAct a;
    a.y.data = static_cast<char*>(a.x.data) + 1024 * 2;
    expect_has(invalid([&] { call("norm_act.fwd", a.in(), a.out()); }), {"output 'y'", "input 'x'"});
  }
  {  // an output ending inside an input: mean's last element is the bias's first bytes
    NormAct a;
    a.mean.data = static_cast<char*>(a.b.data) - 11 * 4;
    expect_has(invalid([&] { call("norm_act.fwd", a.in(), a.out()); }), {"output 'mean'", "input 'bias'"});
  }
  {  // two outputs in one buffer
    NormAct a;
    a.rstd = a.mean;
    expect_has(invalid([&] { call("norm_act.fwd", a.in(), a.out()); }), {"output 'rstd'", "output 'mean'"});
  }
  {  // explain validates the same way
    NormAct a;
    a.y = a.x;
    expect_has(invalid([&] { explain_plan("norm_act.fwd", a.in(), a.out(), {}); }), {"output 'y'", "input 'x'"});
  }
}

TEST(Overlap, DisjointAndInterleavedViewsPass) {
  const OpInfo& info = op_info("norm_act.fwd");
  NormAct a;
  EXPECT_NO_THROW(check_no_overlap(info, a.in(), a.out()));
  // x and y as the two column halves of one [12, 2048] buffer: their byte ranges interleave, no element is shared.
  a.x = TensorView::strided(fake(), DType::bf16, {12, 1024}, {2048, 1}, 0);
  a.y = TensorView::strided(static_cast<char*>(a.x.data) + 1024 * 2, DType::bf16, {12, 1024}, {2048, 1}, 0);
  EXPECT_NO_THROW(check_no_overlap(info, a.in(), a.out()));
  // y right after x: adjacent, not overlapping.
  NormAct b;
  b.y.data = static_cast<char*>(b.x.data) + 12 * 1024 * 2;
  EXPECT_NO_THROW(check_no_overlap(info, b.in(), b.out()));
  // A left-out optional input and empty tensors share nothing.
  NormAct c;
  c.b = TensorView();
  c.mean = TensorView(c.x.data, DType::f32, {0}, 0);
  EXPECT_NO_THROW(check_no_overlap(info, c.in(), {c.y, c.mean, c.rstd}));
}

TEST(Overlap, HostileStridesNeitherCrashNorPass) {
  const OpInfo& info = op_info("norm_act.fwd");
  NormAct a;
  // Strides whose extent overflows 64 bits: nothing is claimed about them, and nothing crashes.
  a.y = TensorView::strided(fake(3 << 20), DType::bf16, {12, 1024}, {INT64_MAX / 4, 1}, 0);
  EXPECT_NO_THROW(check_no_overlap(info, a.in(), a.out()));
  // A negative stride running back into x from past its end.
  a.y = TensorView::strided(static_cast<char*>(a.x.data) + 12 * 1024 * 2 + 11 * 1024 * 2, DType::bf16, {12, 1024},
                            {-1024 * 2, 1}, 0);
  expect_has(invalid([&] { check_no_overlap(info, a.in(), a.out()); }), {"output 'y'", "input 'x'"});
}

TEST(Overlap, InPlaceOutputMustBeThatInputItself) {
  const OpInfo& info = op_info("selective_scan.step");
  const int64_t batch = 2, dim = 64, dstate = 16;
  TensorView state(fake(), DType::f32, {batch, dim, dstate}, 0);
  TensorView u(fake(1 << 20), DType::bf16, {batch, dim}, 0);
  TensorView delta(fake(2 << 20), DType::bf16, {batch, dim}, 0);
  TensorView A(fake(3 << 20), DType::f32, {dim, dstate}, 0);
  TensorView B(fake(4 << 20), DType::bf16, {batch, 1, dstate}, 0);
  TensorView C(fake(5 << 20), DType::bf16, {batch, 1, dstate}, 0);
  TensorView out(fake(6 << 20), DType::bf16, {batch, dim}, 0);
  std::vector<TensorView> in = {state, u, delta, A, B, C, TensorView(), TensorView(), TensorView()};
  // new_state is state itself: the op updates it in place.
  EXPECT_NO_THROW(check_no_overlap(info, in, {out, state}));
  // new_state one element into state, or another input as new_state: refused.
  TensorView shifted(static_cast<float*>(state.data) + 1, DType::f32, {batch, dim, dstate}, 0);
  expect_has(invalid([&] { check_no_overlap(info, in, {out, shifted}); }),
             {"output 'new_state'", "input 'state'", "itself"});
  TensorView on_a(A.data, DType::f32, {batch, dim, dstate}, 0);
  expect_has(invalid([&] { check_no_overlap(info, in, {out, on_a}); }), {"output 'new_state'", "input 'A'"});
  // out is not declared in place: out on u is refused.
  expect_has(invalid([&] { check_no_overlap(info, in, {u, state}); }), {"output 'out'", "input 'u'"});
}

namespace {

// AdamW's lists on fake pointers, with grad_scale so that its outputs are given.
struct Adamw {
  std::vector<TensorView> p = {TensorView(fake(0), DType::f32, {4, 3}, 0), TensorView(fake(1 << 20), DType::f32, {5}, 0)};
  std::vector<TensorView> g = {TensorView(fake(2 << 20), DType::f32, {4, 3}, 0), TensorView(fake(3 << 20), DType::f32, {5}, 0)};
  std::vector<TensorView> m = {TensorView(fake(4 << 20), DType::f32, {4, 3}, 0), TensorView(fake(5 << 20), DType::f32, {5}, 0)};
  std::vector<TensorView> v = {TensorView(fake(6 << 20), DType::f32, {4, 3}, 0), TensorView(fake(7 << 20), DType::f32, {5}, 0)};
  TensorView scale{fake(10 << 20), DType::f32, {1}, 0};
  TensorView found{fake(8 << 20), DType::f32, {1}, 0};
  TensorView norm{fake(9 << 20), DType::f32, {1}, 0};
  // Inside params[1], 16-byte aligned like the bound outputs (BoundCall::run checks the layout first).
  TensorView on_params() const { return TensorView(static_cast<float*>(p[1].data) + 4, DType::f32, {1}, 0); }
  static TensorView L(const std::vector<TensorView>& x) { return TensorView::list(x.data(), static_cast<int64_t>(x.size())); }
  std::vector<TensorView> in() const { return {L(p), L(g), L(m), L(v), TensorView(), TensorView(), scale}; }
};

}  // namespace

TEST(Overlap, ListElementsAreNamedByIndex) {
  Adamw a;
  expect_has(invalid([&] { call("adamw", a.in(), {a.on_params(), a.norm}, {}); }),
             {"output 'found_inf'", "input 'params'[1]"});
  // A BoundCall is validated the same way at its construction (no GPU needed: validation comes first).
  expect_has(invalid([&] { BoundCall b("adamw", a.in(), {a.found, a.on_params()}, {}); }),
             {"output 'grad_norm'", "input 'params'[1]"});
}

TEST(Overlap, BoundRunRefusesAnOutputMovedOntoAnInput) {
  KSPEC_REQUIRE_GPU();
  Adamw a;
  // Bound on fake pointers: binding validates, plans and uploads the table of pointers, launches nothing.
  BoundCall bound("adamw", a.in(), {a.found, a.norm}, {});
  // run() checks before it launches; this output moved onto a parameter, so it never launches.
  expect_has(invalid([&] { bound.run({}, {a.on_params(), a.norm}); }), {"output 'found_inf'", "input 'params'[1]"});
  EXPECT_EQ(bound.runs(), 0);
}
