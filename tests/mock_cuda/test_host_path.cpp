// kspec's host path on the mock driver (tests/mock_cuda/cuda_mock.cpp, cublaslt_mock.cpp), so that CI
// without a GPU runs it: a call whose signature was seen before (kspec::call's cache hit, BoundCall::run)
// launches once and allocates nothing, and still refuses what depends on the pointers (null data,
// overlap); a repeated GEMM reuses its cuBLASLt descriptors and algorithm.
#include <gtest/gtest.h>

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "jit/driver.h"
#include "kspec/kspec.h"
#include "mock_test_process.h"
#include "templates/norm_act/params.h"

namespace kspec {
namespace {

// A counter of the mock library (-1 before it is loaded).
template <typename T = long long>
T mock_value(const char* name) {
  void* lib = dlopen(KSPEC_CUDA_MOCK, RTLD_NOW | RTLD_NOLOAD);
  auto fn = lib ? reinterpret_cast<T (*)()>(dlsym(lib, name)) : nullptr;
  if (lib) dlclose(lib);  // drops only the reference NOLOAD took
  return fn ? fn() : T(-1);
}

long mock_launches() { return static_cast<long>(mock_value("kspec_mock_launches")); }

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

// norm_act.fwd on ins, outs, params (a's stream) is refused: an InvalidArgument whose message holds `says`.
void expect_call_refused(const NormActCall& a, const std::vector<TensorView>& ins, const std::vector<TensorView>& outs,
                         const Params& params, const std::string& says) {
  try {
    call("norm_act.fwd", ins, outs, params, a.stream);
    FAIL() << "accepted; expected: " << says;
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

// a's own call, after refused ones, still runs: one launch.
void expect_call_launches_once(const NormActCall& a) {
  const long launches = mock_launches();
  call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
  EXPECT_EQ(mock_launches() - launches, 1);
}

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
  const long long queries = mock_value("kspec_mock_stream_queries");
  constexpr int kRuns = 100;
  for (int i = 0; i < kRuns; ++i) bound.run(none, a.outs, a.stream);
  EXPECT_EQ(g_allocations.load() - allocations, 0) << "heap allocations in " << kRuns << " runs";
  EXPECT_EQ(mock_launches() - launches, kRuns);
  EXPECT_EQ(bound.runs(), kRuns + 1);
  // norm_act binds no tables: nothing for the destructor to wait for, so no capture query and no event
  // record per run (before: one of each).
  EXPECT_EQ(mock_value("kspec_mock_stream_queries") - queries, 0);
  EXPECT_TRUE(bound.idle());
}

// The params struct norm_act's launchers passed to their last kernel (the mock keeps it).
struct LastParams {
  LastParams() { fn("kspec_mock_record_arg", sizeof(NormActParams)); }
  ~LastParams() { fn("kspec_mock_record_arg", 0); }
  NormActParams get() const {
    NormActParams p{};
    void* lib = dlopen(KSPEC_CUDA_MOCK, RTLD_NOW | RTLD_NOLOAD);
    if (auto f = lib ? reinterpret_cast<void (*)(void*)>(dlsym(lib, "kspec_mock_last_arg")) : nullptr) f(&p);
    if (lib) dlclose(lib);
    return p;
  }
  static void fn(const char* name, size_t n) {
    void* lib = dlopen(KSPEC_CUDA_MOCK, RTLD_NOW | RTLD_NOLOAD);
    if (auto f = lib ? reinterpret_cast<void (*)(size_t)>(dlsym(lib, name)) : nullptr) f(n);
    if (lib) dlclose(lib);
  }
};

// norm_act's launchers find their tensors by schema positions resolved when the op is made: each field of
// the kernels' params is the call's buffer of that name, on a miss, a hit and a bound run, forward and
// backward (with and without a bias).
TEST_F(HostPath, NormActLaunchesPassEachTensorInItsPlace) {
  LastParams last;
  NormActCall f;
  auto ptr = [&](int i) { return reinterpret_cast<void*>(f.bufs[static_cast<size_t>(i)]); };
  for (int i = 0; i < 2; ++i) {  // a miss, then a hit
    call("norm_act.fwd", f.ins, f.outs, {{"norm", std::string("layernorm")}, {"eps", 0.25}}, f.stream);
    const NormActParams p = last.get();
    EXPECT_EQ(p.x, ptr(0));
    EXPECT_EQ(p.weight, ptr(1));
    EXPECT_EQ(p.bias, ptr(2));
    EXPECT_EQ(p.y, ptr(3));
    EXPECT_EQ(static_cast<void*>(p.mean), ptr(4));
    EXPECT_EQ(static_cast<void*>(p.rstd), ptr(5));
    EXPECT_EQ(p.rows, 4);
    EXPECT_EQ(p.eps, 0.25f);
  }
  BoundCall bound("norm_act.fwd", f.ins, f.outs, f.params);
  bound.run({}, f.outs, f.stream);
  EXPECT_EQ(last.get().y, ptr(3));
  EXPECT_EQ(static_cast<void*>(last.get().rstd), ptr(5));
  // The backward: dy x weight bias mean rstd -> dx dweight dbias, its buffers in another order.
  NormActCall g;
  const TensorView dy = f.ins[0], x = g.ins[0], w = f.ins[1], bias = g.ins[1], mean = f.outs[1], rstd = g.outs[1];
  const TensorView dx = g.outs[0], dw = f.ins[2], db = g.ins[2];
  for (bool with_bias : {true, false}) {
    for (int i = 0; i < 2; ++i) {
      call("norm_act.bwd", {dy, x, w, with_bias ? bias : TensorView(), mean, rstd}, {dx, dw, with_bias ? db : TensorView()},
           f.params, f.stream);
      const NormActParams p = last.get();  // the reduction, launched last, reads the same struct
      EXPECT_EQ(p.dy, dy.data);
      EXPECT_EQ(p.x, x.data);
      EXPECT_EQ(p.weight, w.data);
      EXPECT_EQ(p.bias, with_bias ? bias.data : nullptr);
      EXPECT_EQ(static_cast<void*>(p.mean), mean.data);
      EXPECT_EQ(static_cast<void*>(p.rstd), rstd.data);
      EXPECT_EQ(p.dx, dx.data);
      EXPECT_EQ(p.dweight, dw.data);
      EXPECT_EQ(p.dbias, with_bias ? db.data : nullptr);
    }
  }
}

// A hit of the thread's last signature (recognised in place, its scratch's views updated by address only)
// and of a signature seen before: each launch carries its own call's buffers, and a call differing from the
// last in a param's value, a stride, or one argument absent is no repeat of it.
TEST_F(HostPath, CallRepeatsTakeTheirOwnPointersAndNoOtherSignature) {
  LastParams last;
  NormActCall f, g;
  auto check = [&](const NormActCall& c, float eps, long long x_row) {
    const NormActParams p = last.get();
    EXPECT_EQ(p.x, c.ins[0].data);
    EXPECT_EQ(p.weight, c.ins[1].data);
    EXPECT_EQ(p.bias, c.ins[2].data);
    EXPECT_EQ(p.y, c.outs[0].data);
    EXPECT_EQ(static_cast<void*>(p.mean), c.outs[1].data);
    EXPECT_EQ(static_cast<void*>(p.rstd), c.outs[2].data);
    EXPECT_EQ(p.eps, eps);
    EXPECT_EQ(p.x_row_stride, x_row);
  };
  const Params quarter{{"norm", std::string("layernorm")}, {"eps", 0.25}}, half{{"norm", std::string("layernorm")},
                                                                                {"eps", 0.5}};
  // x with its rows 512 apart (the mock reads no buffer): a stride the key holds, the shape the same
  NormActCall strided;
  strided.ins[0] = TensorView::strided(strided.ins[0].data, DType::f32, {4, 256}, {512, 1}, 0);
  for (int i = 0; i < 3; ++i) {
    call("norm_act.fwd", f.ins, f.outs, quarter, f.stream);
    check(f, 0.25f, 256);
    call("norm_act.fwd", g.ins, g.outs, quarter, g.stream);  // the same signature, other buffers
    check(g, 0.25f, 256);
    call("norm_act.fwd", g.ins, g.outs, half, g.stream);  // another eps
    check(g, 0.5f, 256);
    call("norm_act.fwd", strided.ins, strided.outs, half, strided.stream);
    check(strided, 0.5f, 512);
  }
  std::vector<TensorView> no_bias = f.ins;
  no_bias[2] = TensorView();
  call("norm_act.fwd", f.ins, f.outs, quarter, f.stream);
  call("norm_act.fwd", no_bias, f.outs, quarter, f.stream);
  EXPECT_EQ(last.get().bias, nullptr);
  // A bound run with outputs moved to other buffers of the same layout launches with those.
  BoundCall bound("norm_act.fwd", f.ins, f.outs, f.params);
  for (const NormActCall* c : {&f, &g, &f}) {
    bound.run({}, c->outs, f.stream);
    EXPECT_EQ(last.get().x, f.ins[0].data);
    EXPECT_EQ(last.get().y, c->outs[0].data);
    EXPECT_EQ(static_cast<void*>(last.get().rstd), c->outs[2].data);
  }
}

// A thread with no current context (torch's autograd worker for device 0) keeps device 0's primary context
// after a call, as the runtime's first call there would bind it: no unbind and rebind per backward node. A
// thread with another context current gets it back.
TEST_F(HostPath, ContextGuardKeepsDeviceZerosContextOnAThreadWithoutOne) {
  NormActCall a;
  call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
  CUcontext on_fresh_thread = reinterpret_cast<CUcontext>(uintptr_t(1)), after_other = nullptr;
  int other_token = 0;
  const auto other = reinterpret_cast<CUcontext>(&other_token);
  std::thread t([&] {
    CUcontext none = reinterpret_cast<CUcontext>(uintptr_t(1));
    CU_CHECK(cuCtxGetCurrent(&none));
    EXPECT_EQ(none, nullptr);
    call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
    CU_CHECK(cuCtxGetCurrent(&on_fresh_thread));
    CU_CHECK(cuCtxSetCurrent(other));
    call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
    CU_CHECK(cuCtxGetCurrent(&after_other));
  });
  t.join();
  EXPECT_EQ(on_fresh_thread, jit::primary_context(0));
  EXPECT_EQ(after_other, other);
}

// The hit path keeps the checks that depend on the pointers, with full validation's messages.
TEST_F(HostPath, CallHitStillChecksPointers) {
  NormActCall a;
  call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
  std::vector<TensorView> null_x = a.ins;
  null_x[0].data = nullptr;
  expect_call_refused(a, null_x, a.outs, a.params, "'x'");
  std::vector<TensorView> aliased = a.outs;
  aliased[0].data = a.ins[0].data;  // y over x
  expect_call_refused(a, a.ins, aliased, a.params, "'y'");
  expect_call_launches_once(a);  // the good call still runs after them
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

// A repeat compares its views with its scratch slot's and takes their addresses in one pass (take_repeat): one
// that differs only in its last view has already written its inputs' addresses into the slot. The next call
// with exactly those addresses must not count as checked for overlap: here it has y over its own x.
TEST_F(HostPath, RepeatThatDiffersLateStillChecksOverlapAfterwards) {
  NormActCall a, b;
  call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);  // checked, and the op's repeat from now on
  call("norm_act.fwd", a.ins, a.outs, a.params, a.stream);
  // x is a's y buffer; its outputs are b's with y's rows 512 apart: a signature of its own, found different
  // only at y, after the slot took the inputs' addresses
  std::vector<TensorView> x_from_y = a.ins, strided_outs = b.outs;
  x_from_y[0].data = a.outs[0].data;
  strided_outs[0] = TensorView::strided(b.outs[0].data, DType::f32, {4, 256}, {512, 1}, 0);
  call("norm_act.fwd", x_from_y, strided_outs, a.params, a.stream);
  // the same inputs, a's outputs: y is x's memory
  expect_call_refused(a, x_from_y, a.outs, a.params, "'y'");
  expect_call_launches_once(a);
}

// Runs of one bound call from two threads take turns (a flag, not a mutex): every launch passes the
// outputs of the run that made it (bounded: 2 threads x 300 runs).
TEST_F(HostPath, BoundRunFromTwoThreadsKeepsEachRunsOutputs) {
  NormActCall a, b;
  BoundCall bound("norm_act.fwd", a.ins, a.outs, a.params);
  const long launches = mock_launches();
  std::atomic<int> wrong{0};
  auto work = [&](const NormActCall& c) {
    LastParams last;  // the mock keeps each thread's last launch
    for (int i = 0; i < 300; ++i) {
      bound.run({}, c.outs, c.stream);
      const NormActParams p = last.get();
      if (p.y != c.outs[0].data || static_cast<void*>(p.rstd) != c.outs[2].data || p.x != a.ins[0].data) ++wrong;
    }
  };
  std::thread t(work, std::cref(b));
  work(a);
  t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(mock_launches() - launches, 600);
  EXPECT_EQ(bound.runs(), 600);
}

// A bound run refuses outputs unlike the bound ones, with the messages it gave before its checks became one pass.
TEST_F(HostPath, BoundRunRefusesOtherOutputs) {
  NormActCall a;
  BoundCall bound("norm_act.fwd", a.ins, a.outs, a.params);
  auto refused = [&](std::vector<TensorView> outs, const char* what) {
    try {
      bound.run({}, outs, a.stream);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  std::vector<TensorView> outs = a.outs;
  outs[2] = TensorView();
  refused(outs, "output 'rstd' is required");
  outs = a.outs;
  outs[0] = TensorView(a.outs[0].data, DType::f32, {2, 512}, 0);
  refused(outs, "output 'y': expected a tensor laid out like the bound one");
  outs = a.outs;
  outs[1].data = static_cast<char*>(outs[1].data) + 2;  // mean less aligned than bound
  refused(outs, "output 'mean': expected a tensor laid out like the bound one");
  outs = a.outs;
  outs[0].data = nullptr;
  refused(outs, "output 'y': expected a tensor laid out like the bound one");
  const long launches = mock_launches();
  bound.run({}, a.outs, a.stream);
  EXPECT_EQ(mock_launches() - launches, 1);
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
  expect_call_refused(a, a.ins, a.outs, no_stats, "output 'mean' must be None when 'save_stats' is false");
  expect_call_refused(a, a.ins, y_only, a.params, "output 'mean' is required when 'save_stats' is true");
}

// What the torch extension asks before each call that allocates its outputs: a repeated signature,
// answered into the caller's vector, allocates nothing (before: the key's buffer and a copy of the
// specs, a vector per output shape, on every call).
TEST_F(HostPath, InferOutputsHitAllocatesNothing) {
  NormActCall a;
  std::vector<OutputSpec> specs;
  infer_outputs("norm_act.fwd", a.ins, a.params, &specs);
  infer_outputs("norm_act.fwd", a.ins, a.params, &specs);
  const long allocations = g_allocations.load();
  for (int i = 0; i < 100; ++i) infer_outputs("norm_act.fwd", a.ins, a.params, &specs);
  EXPECT_EQ(g_allocations.load() - allocations, 0) << "heap allocations in 100 repeated infer_outputs";
  auto is = [](const std::vector<int64_t>& shape, std::initializer_list<int64_t> want) {
    return std::equal(shape.begin(), shape.end(), want.begin(), want.end());
  };
  ASSERT_EQ(specs.size(), 3u);
  EXPECT_TRUE(is(specs[0].shape, {4, 256}));
  EXPECT_TRUE(is(specs[1].shape, {4}));
  EXPECT_EQ(specs[0].dtype, DType::f32);
  // Another signature into the same vector gets its own answer (no stale shape).
  std::vector<TensorView> wider = a.ins;
  wider[0] = TensorView(a.ins[0].data, DType::f32, {2, 256}, 0);
  infer_outputs("norm_act.fwd", wider, a.params, &specs);
  EXPECT_TRUE(is(specs[0].shape, {2, 256}));
  EXPECT_TRUE(is(specs[2].shape, {2}));
}

// An fp32 linear layer x [rows, 64] · W [64, 64]ᵀ (+ bias) in mock device memory: gemm through cuBLASLt.
struct GemmCall {
  std::vector<CUdeviceptr> bufs;
  std::vector<TensorView> ins, outs;
  Params params{{"act", std::string("none")}};
  Stream stream = reinterpret_cast<Stream>(uintptr_t(0x100));
  explicit GemmCall(int64_t rows) {
    for (int i = 0; i < 5; ++i) {
      CUdeviceptr p = 0;
      CU_CHECK(cuMemAlloc(&p, 64 * 64 * 4));
      bufs.push_back(p);
    }
    auto v = [&](int i, std::initializer_list<int64_t> shape) {
      return TensorView(reinterpret_cast<void*>(bufs[i]), DType::f32, shape, 0);
    };
    ins = {v(0, {rows, 64}), v(1, {64, 64}), v(2, {64})};
    outs = {v(3, {rows, 64}), TensorView()};
  }
  void run() const { call("gemm", ins, outs, params, stream); }
  ~GemmCall() {
    for (auto p : bufs) jit::driver().cuMemFree(p);
  }
};

long long lt_setup_calls() { return mock_value("kspec_mock_lt_setup_calls"); }
long long lt_matmuls() { return mock_value("kspec_mock_lt_matmuls"); }

// A repeated problem makes no descriptor, attribute or heuristic call: only the matmul (before the plan
// cache, every call created a matmul descriptor and three layouts and set their attributes).
TEST_F(HostPath, GemmReusesItsCuBlasLtPlan) {
  GemmCall a(4), b(8);  // b: another m, so another problem
  a.run();
  ASSERT_GE(lt_matmuls(), 1) << "the mock cuBLASLt did not load from " KSPEC_CUDA_MOCK;
  long long setup = lt_setup_calls(), matmuls = lt_matmuls();
  constexpr int kCalls = 50;
  for (int i = 0; i < kCalls; ++i) a.run();
  EXPECT_EQ(lt_setup_calls() - setup, 0) << "cuBLASLt setup calls in " << kCalls << " repeated calls";
  EXPECT_EQ(lt_matmuls() - matmuls, kCalls);

  setup = lt_setup_calls();
  b.run();  // a changed problem builds its own plan
  EXPECT_GT(lt_setup_calls() - setup, 0) << "a changed problem reused another's descriptors";
  setup = lt_setup_calls();
  for (int i = 0; i < kCalls; ++i) {  // interleaved, as a step's layers are: each keeps its plan
    a.run();
    b.run();
  }
  EXPECT_EQ(lt_setup_calls() - setup, 0);

  // The same problem with another bias buffer: the plan is reused with the call's own bias pointer.
  GemmCall c(4);
  ASSERT_NE(c.ins[2].data, a.ins[2].data);
  setup = lt_setup_calls();
  c.run();
  EXPECT_EQ(lt_setup_calls() - setup, 1) << "more than the bias pointer was set";
  EXPECT_EQ(mock_value<const void*>("kspec_mock_lt_last_bias"), c.ins[2].data);
  a.run();
  EXPECT_EQ(mock_value<const void*>("kspec_mock_lt_last_bias"), a.ins[2].data);
}

// Plans are per thread (a call sets its pointers in its plan's descriptor): a second thread builds its
// own descriptors, with the algorithm the first one chose (no second heuristic query), and both run.
TEST_F(HostPath, GemmPlanPerThread) {
  GemmCall a(16);
  a.run();
  long long setup = lt_setup_calls();
  const long long matmuls = lt_matmuls();
  std::thread([&] {
    for (int i = 0; i < 20; ++i) a.run();
  }).join();
  const long long other_thread = lt_setup_calls() - setup;
  EXPECT_GT(other_thread, 0) << "the second thread used the first one's descriptors";
  EXPECT_EQ(lt_matmuls() - matmuls, 20);
  // Its own plan built once: the same count as the first thread's build, less the heuristic's preference
  // (created, set, queried: 3 calls) and the algorithm's attribute reads.
  setup = lt_setup_calls();
  GemmCall fresh(24);
  fresh.run();
  EXPECT_LT(other_thread, lt_setup_calls() - setup);
}

}  // namespace
}  // namespace kspec
