// GPU tests (skipped without a GPU): every op and case against the float64 reference, every tuning
// config of representative cases, bitwise determinism of the backward, CUDA graph capture, many host
// threads on their own streams, row-strided inputs, and every visible device.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "api/src/op.h"
#include "jit/driver.h"
#include "jit/handles.h"
#include "kspec/kspec.h"
#include "test_helpers.h"

using namespace kspec;

namespace {

struct Buf {
  jit::DeviceBuffer mem;
  CUdeviceptr p;  // mem.ptr
  size_t n;       // floats
  explicit Buf(size_t count) : mem(std::max<size_t>(count, 1) * 4), p(mem.ptr), n(count) {}
  void* ptr() const { return mem.data(); }
  void upload(const std::vector<float>& v) { CU_CHECK(cuMemcpyHtoD(p, v.data(), v.size() * 4)); }
  std::vector<float> download() const {
    std::vector<float> v(n);
    CU_CHECK(cuMemcpyDtoH(v.data(), p, n * 4));
    return v;
  }
  void poison() { CU_CHECK(cuMemsetD8(p, 0xFF, std::max<size_t>(n, 1) * 4)); }
};

std::vector<float> randn(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

using kspec::testing::report;

// One norm_act fwd+bwd problem in fp32 with its buffers.
struct Problem32 {
  int64_t rows, hidden;
  Buf x, w, b, y, mean, rstd, dy, dx, dw, db;
  Problem32(int64_t r, int64_t h, uint64_t seed)
      : rows(r), hidden(h), x(r * h), w(h), b(h), y(r * h), mean(r), rstd(r), dy(r * h), dx(r * h), dw(h), db(h) {
    x.upload(randn(r * h, seed));
    w.upload(randn(h, seed + 1));
    b.upload(randn(h, seed + 2));
    dy.upload(randn(r * h, seed + 3));
  }
  void run(Stream s, int device = 0) {
    TensorView xv(x.ptr(), DType::f32, {rows, hidden}, device), wv(w.ptr(), DType::f32, {hidden}, device),
        bv(b.ptr(), DType::f32, {hidden}, device), yv(y.ptr(), DType::f32, {rows, hidden}, device),
        mv(mean.ptr(), DType::f32, {rows}, device), rv(rstd.ptr(), DType::f32, {rows}, device),
        dyv(dy.ptr(), DType::f32, {rows, hidden}, device), dxv(dx.ptr(), DType::f32, {rows, hidden}, device),
        dwv(dw.ptr(), DType::f32, {hidden}, device), dbv(db.ptr(), DType::f32, {hidden}, device);
    ops::NormActOptions o{"layernorm", "gelu_tanh", 1e-5};
    ops::norm_act_fwd(xv, wv, bv, yv, mv, rv, o, s);
    ops::norm_act_bwd(dyv, xv, wv, bv, mv, rv, dxv, dwv, dbv, o, s);
  }
  void poison() {
    for (Buf* buf : {&y, &mean, &rstd, &dx, &dw, &db}) buf->poison();
  }
};

}  // namespace

// One test per registered op (ctest runs them in parallel; one test over every op took 466 s on the H100).
class GpuEveryOp : public ::testing::TestWithParam<std::string> {};

std::string op_test_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  std::replace(name.begin(), name.end(), '.', '_');
  return name;
}

TEST_P(GpuEveryOp, EveryCaseEveryDtypeMatchesReference) {
  KSPEC_REQUIRE_GPU();
  const std::string& op = GetParam();
  if (!Registry::global().get(op).generic_check) GTEST_SKIP() << op << ": TensorList/int data, its own tests";
  CheckOptions o;  // the large cases run in `kspec run --large` (tools/gpu/check.sh), not twice
  auto rows = check_op(op, o);
  EXPECT_FALSE(rows.empty());
  report(rows);
}

TEST_P(GpuEveryOp, EveryTuningConfigMatchesReference) {
  KSPEC_REQUIRE_GPU();
  const std::string& op = GetParam();
  if (!Registry::global().get(op).generic_check) GTEST_SKIP() << op << ": compared by its own suites";
  struct Sel {
    const char* c;
    DType dt;
  };
  auto names = case_names(op);
  for (Sel s : {Sel{"hidden_33", DType::f32}, Sel{"hidden_4095", DType::bf16}, Sel{"rep_4096", DType::bf16},
                Sel{"hidden_8192", DType::f16}, Sel{"hidden_12289", DType::bf16},
                Sel{"streamed_rows_300", DType::f32}, Sel{"base", DType::bf16}, Sel{"seqlen_1023", DType::f32},
                Sel{"seqlen_even_1024", DType::bf16}, Sel{"dstate_256", DType::f16}, Sel{"groups_4", DType::bf16},
                Sel{"fixed_bc", DType::f32}, Sel{"seqlen_2", DType::f16}, Sel{"B_1_n_8", DType::f32},
                Sel{"B_1_n_128", DType::bf16}, Sel{"B_1_n_64_T_not_multiple_of_K", DType::f32}}) {
    if (std::find(names.begin(), names.end(), s.c) == names.end()) continue;  // a case of another family
    CheckOptions o;  // every config on one draw of inputs, against one reference
    o.case_name = s.c;
    o.dtypes = {s.dt};
    o.configs = configs_for_case(op, s.c, s.dt);
    EXPECT_FALSE(o.configs.empty());
    const auto t0 = std::chrono::steady_clock::now();
    auto rows = check_op(op, o);
    // where this test's minutes go (printed, not asserted): configs and seconds per op and case
    std::printf("[ configs  ] %s %s %s: %zu configs, %.1f s\n", op.c_str(), s.c, dtype_name(s.dt), o.configs.size(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    EXPECT_EQ(rows.size(), o.configs.size()) << op << " " << s.c;
    report(rows);
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, GpuEveryOp, ::testing::ValuesIn(list_ops()), op_test_name);

TEST(Gpu, BackwardIsBitwiseDeterministic) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard g(0);
  // Rows held in registers (hidden 1024) and streamed rows (hidden 16384).
  for (auto [rows, hidden] : {std::pair{3000, 1024}, std::pair{700, 16384}}) {
    Problem32 p(rows, hidden, 7);
    p.run(nullptr);
    CU_CHECK(cuCtxSynchronize());
    auto dx1 = p.dx.download(), dw1 = p.dw.download(), db1 = p.db.download();
    p.poison();
    p.run(nullptr);
    CU_CHECK(cuCtxSynchronize());
    auto dx2 = p.dx.download(), dw2 = p.dw.download(), db2 = p.db.download();
    EXPECT_EQ(0, std::memcmp(dx1.data(), dx2.data(), dx1.size() * 4)) << hidden;
    EXPECT_EQ(0, std::memcmp(dw1.data(), dw2.data(), dw1.size() * 4)) << hidden;
    EXPECT_EQ(0, std::memcmp(db1.data(), db2.data(), db1.size() * 4)) << hidden;
  }
}

TEST(Gpu, WorksUnderCudaGraphCapture) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard g(0);
  jit::OwnedStream owned_s = jit::create_stream(CU_STREAM_NON_BLOCKING);
  CUstream s = owned_s.get();
  Problem32 p(777, 256, 11);
  p.run(reinterpret_cast<Stream>(s));  // warm: compile, load, size the workspace (small: ~1 MiB)
  CU_CHECK(cuStreamSynchronize(s));
  auto y_ref = p.y.download(), dw_ref = p.dw.download();
  p.poison();
  int64_t compiled_before = counters().compiled;
  CUgraph graph;
  CUgraphExec exec;
  ASSERT_EQ(jit::driver().cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), CUDA_SUCCESS);
  p.run(reinterpret_cast<Stream>(s));
  ASSERT_EQ(jit::driver().cuStreamEndCapture(s, &graph), CUDA_SUCCESS);
  ASSERT_EQ(jit::driver().cuGraphInstantiate(&exec, graph, 0), CUDA_SUCCESS);
  EXPECT_EQ(counters().compiled, compiled_before);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(jit::driver().cuGraphLaunch(exec, s), CUDA_SUCCESS);
  CU_CHECK(cuStreamSynchronize(s));
  auto y = p.y.download(), dw = p.dw.download();
  EXPECT_EQ(0, std::memcmp(y.data(), y_ref.data(), y.size() * 4));
  EXPECT_EQ(0, std::memcmp(dw.data(), dw_ref.data(), dw.size() * 4));
  // torch.cuda.graph's recipe: warmed on one stream, captured on another whose workspace is too small (here
  // 1 MiB, where the backward's partial sums need several): the captured call allocates its workspace in the
  // graph, and the replays match the eager run.
  jit::OwnedStream owned_warm = jit::create_stream(CU_STREAM_NON_BLOCKING);
  CUstream warm = owned_warm.get();
  Problem32 big(2048, 8192, 12);
  big.run(reinterpret_cast<Stream>(warm));
  CU_CHECK(cuStreamSynchronize(warm));
  auto big_y = big.y.download(), big_dw = big.dw.download();
  big.poison();
  CUgraph big_graph;
  CUgraphExec big_exec;
  ASSERT_EQ(jit::driver().cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), CUDA_SUCCESS);
  big.run(reinterpret_cast<Stream>(s));
  ASSERT_EQ(jit::driver().cuStreamEndCapture(s, &big_graph), CUDA_SUCCESS);
  ASSERT_EQ(jit::driver().cuGraphInstantiate(&big_exec, big_graph, 0), CUDA_SUCCESS);
  for (int i = 0; i < 2; ++i) ASSERT_EQ(jit::driver().cuGraphLaunch(big_exec, warm), CUDA_SUCCESS);
  CU_CHECK(cuStreamSynchronize(warm));
  auto y2 = big.y.download(), dw2 = big.dw.download();
  EXPECT_EQ(0, std::memcmp(y2.data(), big_y.data(), y2.size() * 4));
  EXPECT_EQ(0, std::memcmp(dw2.data(), big_dw.data(), dw2.size() * 4));
  jit::driver().cuGraphExecDestroy(big_exec);
  jit::driver().cuGraphDestroy(big_graph);
  jit::driver().cuGraphExecDestroy(exec);
  jit::driver().cuGraphDestroy(graph);
}

TEST(Gpu, ManyHostThreadsOnTheirOwnStreams) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard g(0);
  constexpr int kThreads = 8;
  std::vector<std::unique_ptr<Problem32>> ps;
  std::vector<std::vector<float>> ref_y, ref_dx;
  for (int i = 0; i < kThreads; ++i) {
    ps.push_back(std::make_unique<Problem32>(129 + 50 * i, 1536, 100 + i));
    ps.back()->run(nullptr);
  }
  CU_CHECK(cuCtxSynchronize());
  for (auto& p : ps) {
    ref_y.push_back(p->y.download());
    ref_dx.push_back(p->dx.download());
    p->poison();
  }
  std::vector<std::thread> ts;
  for (int i = 0; i < kThreads; ++i)
    ts.emplace_back([&, i] {
      jit::ContextGuard tg(0);
      jit::OwnedStream s = jit::create_stream(CU_STREAM_NON_BLOCKING);
      for (int k = 0; k < 20; ++k) ps[i]->run(reinterpret_cast<Stream>(s.get()));
      CU_CHECK(cuStreamSynchronize(s.get()));
    });
  for (auto& t : ts) t.join();
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_EQ(ps[i]->y.download(), ref_y[i]) << i;
    EXPECT_EQ(ps[i]->dx.download(), ref_dx[i]) << i;
  }
}

TEST(Gpu, RowStridedInputMatchesContiguous) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard g(0);
  const int64_t rows = 300, hidden = 1000, stride = 1032;
  Problem32 p(rows, hidden, 21);
  p.run(nullptr);
  CU_CHECK(cuCtxSynchronize());
  auto y_ref = p.y.download();
  auto x = p.x.download();
  std::vector<float> padded(rows * stride, 12345.f);
  for (int64_t r = 0; r < rows; ++r) std::copy(x.begin() + r * hidden, x.begin() + (r + 1) * hidden, padded.begin() + r * stride);
  Buf xs(rows * stride);
  xs.upload(padded);
  p.poison();
  TensorView xv = TensorView::strided(xs.ptr(), DType::f32, {rows, hidden}, {stride, 1}, 0);
  ops::norm_act_fwd(xv, TensorView(p.w.ptr(), DType::f32, {hidden}, 0), TensorView(p.b.ptr(), DType::f32, {hidden}, 0),
                    TensorView(p.y.ptr(), DType::f32, {rows, hidden}, 0), TensorView(p.mean.ptr(), DType::f32, {rows}, 0),
                    TensorView(p.rstd.ptr(), DType::f32, {rows}, 0), {"layernorm", "gelu_tanh", 1e-5});
  CU_CHECK(cuCtxSynchronize());
  EXPECT_EQ(p.y.download(), y_ref);
}

TEST(Gpu, EveryVisibleDevice) {
  KSPEC_REQUIRE_GPU();
  int n = jit::device_count();
  for (int d = 0; d < n; ++d) {
    CheckOptions o;
    o.device = d;
    o.case_name = "base";
    report(check_op("norm_act.fwd", o));
    report(check_op("norm_act.bwd", o));
    for (const char* op : {"selective_scan.fwd", "selective_scan.bwd", "selective_scan.step"}) report(check_op(op, o));
  }
}

TEST(Gpu, ZeroRows) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard g(0);
  Buf w(64), b(64), dw(64), db(64), any(64);
  w.upload(randn(64, 1));
  dw.poison();
  db.poison();
  TensorView x(any.ptr(), DType::f32, {0, 64}, 0), m(any.ptr(), DType::f32, {0}, 0);
  call("norm_act.bwd", {x, x, TensorView(w.ptr(), DType::f32, {64}, 0), TensorView(b.ptr(), DType::f32, {64}, 0), m, m},
       {x, TensorView(dw.ptr(), DType::f32, {64}, 0), TensorView(db.ptr(), DType::f32, {64}, 0)});
  CU_CHECK(cuCtxSynchronize());
  for (float v : dw.download()) EXPECT_EQ(v, 0.f);  // empty sums are zero, not NaN
}
