// prepare_call (api/src/plan.h), what the XLA handlers' initialize stage runs: everything kspec::call does
// before its launches — validation with call's messages, the plan, its kernels compiled and loaded —
// and no launch, so the execution after it compiles nothing.
#include <cuda.h>

#include <functional>

#include "api/src/plan.h"
#include "jit/driver.h"
#include "jit/handles.h"
#include "kspec/kspec.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::message_of;

TEST(PrepareCall, ValidatesAsCallDoes) {
  auto* p = reinterpret_cast<void*>(uintptr_t(0x7f0000000000));
  TensorView x(p, DType::f32, {4, 64}, 0), w(p, DType::f32, {63}, 0), y(p, DType::f32, {4, 64}, 0),
      m(p, DType::f32, {4}, 0), r(p, DType::f32, {4}, 0);
  const std::string prepared = message_of([&] { prepare_call("norm_act.fwd", {x, w}, {y, m, r}, {}); });
  EXPECT_NE(prepared.find("input 'weight'"), std::string::npos) << prepared;
  EXPECT_EQ(prepared, message_of([&] { call("norm_act.fwd", {x, w}, {y, m, r}); }));
  EXPECT_NE(message_of([&] { prepare_call("no.such_op", {}, {}, {}); }).find("no.such_op"), std::string::npos);
}

TEST(GpuPrepareCall, CompilesAndLoadsWithoutLaunching) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard g(0);
  const int64_t rows = 3, hidden = 1000 + 8;  // a hidden size no other test plans in this process
  jit::DeviceBuffer bx(rows * hidden * 4), bw(hidden * 4), by(rows * hidden * 4), bm(rows * 4), br(rows * 4);
  TensorView x(reinterpret_cast<void*>(bx.ptr), DType::f32, {rows, hidden}, 0),
      w(reinterpret_cast<void*>(bw.ptr), DType::f32, {hidden}, 0),
      y(reinterpret_cast<void*>(by.ptr), DType::f32, {rows, hidden}, 0),
      m(reinterpret_cast<void*>(bm.ptr), DType::f32, {rows}, 0),
      r(reinterpret_cast<void*>(br.ptr), DType::f32, {rows}, 0);
  CU_CHECK(cuMemsetD8(bx.ptr, 0, rows * hidden * 4));
  CU_CHECK(cuMemsetD8(bw.ptr, 0, hidden * 4));
  const Params params = {{"norm", std::string("rmsnorm")}};
  const Counters before = counters();
  prepare_call("norm_act.fwd", {x, w}, {y, m, r}, params);
  const Counters prepared = counters();
  EXPECT_EQ(prepared.launches, before.launches);
  EXPECT_GT(prepared.compiled + prepared.disk_hits + prepared.memory_hits,
            before.compiled + before.disk_hits + before.memory_hits);
  prepare_call("norm_act.fwd", {x, w}, {y, m, r}, params);  // prepared once: nothing more
  call("norm_act.fwd", {x, w}, {y, m, r}, params);
  CU_CHECK(cuCtxSynchronize());
  const Counters after = counters();
  EXPECT_EQ(after.compiled, prepared.compiled);
  EXPECT_EQ(after.disk_hits, prepared.disk_hits);
  EXPECT_EQ(after.memory_hits, prepared.memory_hits);
  EXPECT_GT(after.launches, prepared.launches);
}
