// kspec's host path on the mock driver (tests/mock_cuda/cuda_mock.cpp), so that CI without a GPU runs
// it: a call whose signature was seen before (kspec::call's cache hit, BoundCall::run) launches once
// and allocates nothing, and still refuses what depends on the pointers (null data, overlap).
#include <gtest/gtest.h>

#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "jit/driver.h"
#include "kspec/kspec.h"
#include "mock_test_process.h"

namespace kspec {
namespace {

long mock_launches() {
  static auto fn = reinterpret_cast<long long (*)()>(dlsym(dlopen(KSPEC_CUDA_MOCK, RTLD_NOW | RTLD_NOLOAD), "kspec_mock_launches"));
  return fn ? static_cast<long>(fn()) : -1;
}

// fp32 norm_act.fwd [4, 256] in mock device memory (host memory).
struct NormActCall {
  std::vector<CUdeviceptr> bufs;
  std::vector<TensorView> ins, outs;
  Params params{{"norm", std::string("layernorm")}, {"act", std::string("silu")}};
  Stream stream = reinterpret_cast<Stream>(uintptr_t(0x100));
  NormActCall() {
    for (int i = 0; i < 6; ++i) {
      CUdeviceptr p = 0;
      CU_CHECK(cuMemAlloc(&p, 4 * 256 * 4));
      bufs.push_back(p);
    }
    auto v = [&](int i, std::initializer_list<int64_t> shape) {
      return TensorView(reinterpret_cast<void*>(bufs[i]), DType::f32, shape, 0);
    };
    ins = {v(0, {4, 256}), v(1, {256}), v(2, {256})};
    outs = {v(3, {4, 256}), v(4, {4}), v(5, {4})};
  }
  ~NormActCall() {
    for (auto p : bufs) jit::driver().cuMemFree(p);
  }
};

class HostPath : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kMockSelected);
    ASSERT_TRUE(jit::driver_available()) << "the mock driver did not load from " KSPEC_CUDA_MOCK;
    ASSERT_GE(mock_launches(), 0);
  }
};

// Two signatures interleaved, as a training step's ops are: each keeps its thread's scratch call.
TEST_F(HostPath, CallHitLaunchesOnceAndAllocatesNothing) {
  NormActCall a, b;
  b.params = {{"norm", std::string("rmsnorm")}};
  b.ins[2] = TensorView();  // no bias
  // The first call validates, plans, compiles (NVRTC) or loads; the second fills the thread's scratch.
  for (int i = 0; i < 2; ++i) {
    call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
    call("norm_act.fwd", b.ins, b.outs, b.params, b.stream);
  }
  const long launches = mock_launches(), allocations = g_allocations.load();
  constexpr int kCalls = 100;
  for (int i = 0; i < kCalls; ++i) {
    call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
    call("norm_act.fwd", b.ins, b.outs, b.params, b.stream);
  }
  EXPECT_EQ(g_allocations.load() - allocations, 0) << "heap allocations in " << 2 * kCalls << " cache hits";
  EXPECT_EQ(mock_launches() - launches, 2 * kCalls);
}

TEST_F(HostPath, BoundRunLaunchesOnceAndAllocatesNothing) {
  NormActCall a;
  BoundCall bound("norm_act.fwd", a.ins, a.outs, a.params);
  const Params none;
  bound.run(none, a.outs, a.stream);
  const long launches = mock_launches(), allocations = g_allocations.load();
  constexpr int kRuns = 100;
  for (int i = 0; i < kRuns; ++i) bound.run(none, a.outs, a.stream);
  EXPECT_EQ(g_allocations.load() - allocations, 0) << "heap allocations in " << kRuns << " runs";
  EXPECT_EQ(mock_launches() - launches, kRuns);
  EXPECT_EQ(bound.runs(), kRuns + 1);
}

// The hit path keeps the checks that depend on the pointers, with full validation's messages.
TEST_F(HostPath, CallHitStillChecksPointers) {
  NormActCall a;
  call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
  std::vector<TensorView> null_x = a.ins;
  null_x[0].data = nullptr;
  try {
    call("norm_act.fwd", null_x, a.outs, a.params, a.stream);
    FAIL() << "a null x was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'x'"), std::string::npos) << e.what();
  }
  std::vector<TensorView> aliased = a.outs;
  aliased[0].data = a.ins[0].data;  // y over x
  try {
    call("norm_act.fwd", a.ins, aliased, a.params, a.stream);
    FAIL() << "y sharing x's memory was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'y'"), std::string::npos) << e.what();
  }
  // And the good call still runs after them.
  const long launches = mock_launches();
  call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
  EXPECT_EQ(mock_launches() - launches, 1);
}

// A second thread hits the same cached call concurrently with the first (bounded: 2 threads x 200).
TEST_F(HostPath, CallHitFromTwoThreads) {
  NormActCall a;
  call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
  const long launches = mock_launches();
  auto work = [&] {
    for (int i = 0; i < 200; ++i) call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
  };
  std::thread t(work);
  work();
  t.join();
  EXPECT_EQ(mock_launches() - launches, 400);
}

// norm_act.fwd with save_stats=false has y as its only output (mean and rstd follow the param, as
// present_with), compiles the kernel with kSaveStats = false, and launches with them absent.
TEST_F(HostPath, NormActWithoutStats) {
  NormActCall a;
  Params no_stats = a.params;
  no_stats.set("save_stats", false);
  auto specs = infer_outputs("norm_act.fwd", a.ins, no_stats);
  ASSERT_EQ(specs.size(), 3u);
  EXPECT_TRUE(specs[0].present);
  EXPECT_FALSE(specs[1].present);
  EXPECT_FALSE(specs[2].present);
  for (const auto& s : infer_outputs("norm_act.fwd", a.ins, a.params)) EXPECT_TRUE(s.present);
  const std::vector<TensorView> y_only{a.outs[0], TensorView(), TensorView()};
  EXPECT_NE(explain("norm_act.fwd", a.ins, y_only, no_stats).find(", false>"), std::string::npos);
  EXPECT_EQ(explain("norm_act.fwd", a.ins, a.outs, a.params).find(", false>"), std::string::npos);
  const long launches = mock_launches();
  call("norm_act.fwd", a.ins, y_only, no_stats, a.stream);
  call("norm_act.fwd", a.ins, y_only, no_stats, a.stream);  // the cache hit
  EXPECT_EQ(mock_launches() - launches, 2);
  auto expect_refused = [&](const std::vector<TensorView>& outs, const Params& p, const std::string& says) {
    try {
      call("norm_act.fwd", a.ins, outs, p, a.stream);
      FAIL() << "accepted; expected: " << says;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  expect_refused(a.outs, no_stats, "output 'mean' must be None when 'save_stats' is false");
  expect_refused(y_only, a.params, "output 'mean' is required when 'save_stats' is true");
}

}  // namespace
}  // namespace kspec
