// e79 without a GPU: the schema (strided [seqlen, batch, n] views such as column blocks of one fused
// projection and batch-first layouts, the three bias modes, checkpoints), the messages for bad input,
// every case planning its kernels, and every case's specialization compiling for sm_90 without
// spills; the cluster configs' rules and kernels. (GPU: GpuEveryOp.EveryCaseEveryDtypeMatchesReference
// runs the case table against the float64 reference; E79Gpu.* below drive the op from the gemm
// projection in both layouts, and every cluster config of the B = 1 cases.)
#include <algorithm>
#include <cmath>
#include <random>

#include "api/src/op.h"
#include "device_buffer_test_util.h"
#include "e79/reference.h"
#include "jit/driver.h"
#include "jit/handles.h"
#include "kspec/kspec.h"
#include "precompile_test_util.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::fake;
using kspec::testing::message_of;
using kspec::testing::rel_err;

namespace {

// Views of one fused projection kvqm (+ b_s, b_m columns in input-bias mode): [T, B, C] contiguous, or
// batch-first [B, T, C] seen as [T, B, C] through strides; column block j is [T, B, n] with unit stride.
struct Fused {
  int64_t T, B, n, C;
  bool batch_first;
  DType dt;
  TensorView block(int j, uintptr_t base = 0) const {
    int64_t st = batch_first ? C : B * C, sb = batch_first ? T * C : C;
    return TensorView::strided(static_cast<char*>(fake(base)) + j * n * dtype_size(dt), dt, {T, B, n}, {st, sb, 1}, 0);
  }
};

std::vector<TensorView> fwd_inputs(const Fused& f, int bias /*0 none, 1 fixed, 2 input*/) {
  TensorView bs, bm;
  if (bias == 1) {
    bs = TensorView(fake(1 << 28), f.dt, {f.n}, 0);
    bm = TensorView(fake(2 << 28), f.dt, {f.n}, 0);
  } else if (bias == 2) {
    bs = f.block(4);
    bm = f.block(5);
  }
  return {f.block(0), f.block(1), f.block(2), f.block(3), bs, bm, TensorView(), TensorView()};
}

}  // namespace

TEST(E79, InferOutputsForEveryBiasModeAndLayout) {
  for (bool bf : {false, true}) {
    for (int bias : {0, 1, 2}) {
      Fused f{7, 3, 32, bias == 2 ? 6 * 32 : 4 * 32, bf, DType::bf16};
      auto outs = infer_outputs("e79.fwd", fwd_inputs(f, bias));
      ASSERT_EQ(outs.size(), 4u);
      EXPECT_EQ(outs[0].shape, (std::vector<int64_t>{7, 3, 32}));
      EXPECT_EQ(outs[0].dtype, DType::bf16);
      EXPECT_EQ(outs[1].shape, (std::vector<int64_t>{3, 32, 32}));
      EXPECT_EQ(outs[1].dtype, DType::f32);
      EXPECT_FALSE(outs[3].present);  // checkpoints: the caller sizes them (ceil(T / chunk))

      auto in = fwd_inputs(f, bias);
      TensorView dout(fake(3 << 28), DType::bf16, {7, 3, 32}, 0);
      TensorView chk(fake(4 << 28), DType::f32, {3, 1, 2, 32, 32}, 0);
      std::vector<TensorView> bin = {dout};
      bin.insert(bin.end(), in.begin(), in.end());
      bin.insert(bin.end(), {chk, TensorView(), TensorView()});
      auto grads = infer_outputs("e79.bwd", bin);
      ASSERT_EQ(grads.size(), 8u);
      EXPECT_EQ(grads[0].shape, (std::vector<int64_t>{7, 3, 32}));
      EXPECT_EQ(grads[4].present, bias != 0);
      if (bias == 1) {
        EXPECT_EQ(grads[4].shape, (std::vector<int64_t>{32}));
      }
      if (bias == 2) {
        EXPECT_EQ(grads[4].shape, (std::vector<int64_t>{7, 3, 32}));
      }
      EXPECT_FALSE(grads[6].present);  // no S0, no dS0
    }
  }
}

TEST(E79, ValidationNamesTheArgument) {
  Fused f{7, 3, 32, 128, false, DType::bf16};
  {
    Fused g{7, 3, 20, 80, false, DType::bf16};
    EXPECT_THROW(infer_outputs("e79.fwd", fwd_inputs(g, 1)), Unsupported);
    std::string m = message_of([&] { infer_outputs("e79.fwd", fwd_inputs(g, 1)); });
    EXPECT_NE(m.find("n = 20 is not supported"), std::string::npos) << m;
  }
  {
    Fused g{7, 3, 256, 1024, false, DType::bf16};
    std::string m = message_of([&] { infer_outputs("e79.fwd", fwd_inputs(g, 0)); });
    EXPECT_NE(m.find("n = 256 is not supported"), std::string::npos) << m;
  }
  {
    auto in = fwd_inputs(f, 1);
    in[1] = TensorView(fake(9 << 20), DType::f16, {7, 3, 32}, 0);
    std::string m = message_of([&] { infer_outputs("e79.fwd", in); });
    EXPECT_NE(m.find("input 'v'"), std::string::npos) << m;
    EXPECT_NE(m.find("bfloat16"), std::string::npos) << m;
  }
  {
    auto in = fwd_inputs(f, 1);
    in[2] = TensorView(fake(9 << 20), DType::bf16, {7, 4, 32}, 0);
    std::string m = message_of([&] { infer_outputs("e79.fwd", in); });
    EXPECT_NE(m.find("input 'q'"), std::string::npos) << m;
    EXPECT_NE(m.find("batch"), std::string::npos) << m;
  }
  {
    auto in = fwd_inputs(f, 1);
    in[5] = TensorView();
    std::string m = message_of([&] { infer_outputs("e79.fwd", in); });
    EXPECT_NE(m.find("'b_s' and 'b_m' must be given together"), std::string::npos) << m;
  }
  {
    auto in = fwd_inputs(f, 1);
    in[5] = f.block(3);  // b_m per step, b_s fixed
    std::string m = message_of([&] { infer_outputs("e79.fwd", in); });
    EXPECT_NE(m.find("must both be [n]"), std::string::npos) << m;
  }
  {
    auto in = fwd_inputs(f, 1);
    in[0].device = kCpuDevice;
    std::string m = message_of([&] { infer_outputs("e79.fwd", in); });
    EXPECT_NE(m.find("input 'k': expected a CUDA tensor"), std::string::npos) << m;
  }
  {
    auto in = fwd_inputs(f, 0);
    in[6] = TensorView(fake(5 << 28), DType::bf16, {3, 32, 32}, 0);  // S0 must be fp32
    std::string m = message_of([&] { infer_outputs("e79.fwd", in); });
    EXPECT_NE(m.find("input 'S0'"), std::string::npos) << m;
    EXPECT_NE(m.find("float32"), std::string::npos) << m;
  }
}

// Strides are checked by the op (check_call) before anything is launched; a call without a GPU fails
// only later, at the device lookup, so these run on any machine.
TEST(E79, CallChecksStridesAndCheckpointCount) {
  Fused f{7, 3, 32, 128, true, DType::f32};
  auto outs = [&](TensorView out, TensorView chk) {
    return std::vector<TensorView>{out, TensorView(fake(6 << 28), DType::f32, {3, 32, 32}, 0),
                                   TensorView(fake(7 << 28), DType::f32, {3, 32, 32}, 0), chk};
  };
  TensorView out(fake(3 << 28), DType::f32, {7, 3, 32}, 0);
  TensorView chk(fake(4 << 28), DType::f32, {3, 1, 2, 32, 32}, 0);  // ceil(7 / 16) = 1
  auto msg = [&](std::vector<TensorView> in, std::vector<TensorView> o, Params params = {}) {
    return message_of([&] { call("e79.fwd", in, o, params); });
  };
  {
    auto in = fwd_inputs(f, 1);
    in[0] = TensorView::strided(fake(), DType::f32, {7, 3, 32}, {128, 7 * 128, 2}, 0);
    std::string m = msg(in, outs(out, chk));
    EXPECT_NE(m.find("input 'k': expected unit stride along n"), std::string::npos) << m;
  }
  {
    TensorView overlapping = TensorView::strided(fake(3 << 28), DType::f32, {7, 3, 32}, {32, 16, 1}, 0);
    std::string m = msg(fwd_inputs(f, 1), outs(overlapping, chk));
    EXPECT_NE(m.find("output 'out': its rows overlap"), std::string::npos) << m;
  }
  {
    TensorView bad(fake(4 << 28), DType::f32, {3, 2, 2, 32, 32}, 0);
    std::string m = msg(fwd_inputs(f, 1), outs(out, bad));
    EXPECT_NE(m.find("expected 1 checkpoints"), std::string::npos) << m;
    TensorView four(fake(4 << 28), DType::f32, {3, 4, 2, 32, 32}, 0);  // chunk 2: ceil(7 / 2) = 4
    // Valid: BoundCall validates and plans without launching (a launch on these fake pointers would
    // poison the context of a GPU for every later test of the process); without a GPU it fails later.
    m = message_of([&] { BoundCall bound("e79.fwd", fwd_inputs(f, 1), outs(out, four), {{"chunk", int64_t(2)}}); });
    EXPECT_EQ(m.find("checkpoints"), std::string::npos) << m;
  }
  {
    std::string m = msg(fwd_inputs(f, 1), outs(out, chk), {{"chunk", int64_t(0)}});
    EXPECT_NE(m.find("'chunk'"), std::string::npos) << m;
  }
}

TEST(E79, KeyTellsBiasModesDtypesAndChunksApart) {
  const OpDef& op = Registry::global().get("e79.bwd");
  auto problem = [&](std::vector<std::string> without, std::vector<std::string> alt, int64_t chunk, DType dt) {
    CompileRequest r;
    r.op = op.info.name;
    r.dtype = dt;
    r.params = {{"n", int64_t(64)}, {"chunk", chunk}};
    r.without = without;
    r.alt_shapes = alt;
    return problem_from_request(op, r);
  };
  Problem none = problem({"b_s", "b_m"}, {}, 16, DType::bf16), fixed = problem({}, {"b_s", "b_m"}, 16, DType::bf16),
          input = problem({}, {}, 16, DType::bf16), k8 = problem({}, {}, 8, DType::bf16),
          f32 = problem({}, {}, 16, DType::f32);
  std::vector<std::string> names;
  for (const Problem* p : {&none, &fixed, &input, &k8, &f32})
    names.push_back(op.kernels(*p, op.tuning.heuristic(*p))[0].name_expression());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::unique(names.begin(), names.end()), names.end());
  EXPECT_EQ(op.kernels(fixed, op.tuning.heuristic(fixed)).size(), 2u);  // + the bias reduction
  EXPECT_EQ(op.kernels(input, op.tuning.heuristic(input)).size(), 1u);
}

TEST(E79, HeuristicIsValidForEverySupportedN) {
  const OpDef& op = Registry::global().get("e79.fwd");
  for (int64_t n = 8; n <= 128; n += 8) {
    CompileRequest r;
    r.op = op.info.name;
    r.params = {{"n", n}};
    Problem p = problem_from_request(op, r);
    std::string why;
    Config c = op.tuning.heuristic(p);
    EXPECT_TRUE(op.tuning.valid(p, c, &why)) << "n = " << n << ": " << why;
    EXPECT_LE(n * c.get("split") / c.get("cluster"), 512);
    EXPECT_GE(n * c.get("split") / c.get("cluster"), 64);
    EXPECT_FALSE(op.tuning.enumerate(p).empty());
  }
}

// The cluster axis (e79_cluster.cuh: one sequence over a thread-block cluster): only for sm_90 and newer,
// n a multiple of the cluster, split >= cluster, whole warps of at most 512 threads per CTA; the heuristic
// takes cluster 4 at small batches for n in {64, 96, 128}; a cluster config plans the cluster kernels, any other e79.cuh's.
TEST(E79, ClusterConfigsNeedSm90AndFollowTheRules) {
  const OpDef& op = Registry::global().get("e79.bwd");
  auto problem = [&](const char* arch, int64_t n) {
    CompileRequest r;
    r.op = op.info.name;
    r.arch = arch;
    r.params = {{"n", n}};
    return problem_from_request(op, r);
  };
  for (const char* arch : {"sm_80", "sm_90"}) {
    for (int64_t n = 8; n <= 128; n += 8) {
      Problem p = problem(arch, n);
      // Cluster 4 at small batches (the request's default batch) for n in {64, 96, 128} on sm_90 (measured).
      const bool cl4 = std::string(arch) == "sm_90" && n >= 64 && n % 32 == 0 && p.dim("batch") <= 16;
      EXPECT_EQ(op.tuning.heuristic(p).get("cluster"), cl4 ? 4 : 1) << arch << " n = " << n;
      int clustered = 0;
      for (const Config& c : op.tuning.enumerate(p)) {
        const int64_t s = c.get("split"), cl = c.get("cluster"), threads = n * s / cl;
        auto ks = op.kernels(p, c);
        ASSERT_FALSE(ks.empty());
        if (cl == 1) {
          EXPECT_EQ(ks[0].header, "e79/e79.cuh") << c.str();
          EXPECT_EQ(ks[0].name_expression().rfind("kspec::e79_bwd_kernel<kspec::E79Traits<", 0), 0u) << c.str();
          continue;
        }
        ++clustered;
        EXPECT_EQ(std::string(arch), "sm_90") << "n = " << n << ": " << c.str();
        EXPECT_EQ(n % cl, 0) << c.str();
        EXPECT_GE(s, cl) << c.str();
        EXPECT_EQ(threads % 32, 0) << c.str();
        EXPECT_LE(threads, 512) << c.str();
        EXPECT_EQ(ks[0].header, "e79/e79_cluster.cuh") << c.str();
        EXPECT_EQ(ks[0].name_expression().rfind("kspec::e79_bwd_cluster_kernel<kspec::E79ClusterTraits<", 0), 0u)
            << ks[0].name_expression();
      }
      if (std::string(arch) == "sm_90" && (n == 8 || n == 32 || n == 64 || n == 128)) {
        EXPECT_GT(clustered, 0) << "n = " << n;
      }
    }
  }
  auto why_not = [&](const char* arch, int64_t n, const char* config) {
    std::string why;
    EXPECT_FALSE(op.tuning.valid(problem(arch, n), Config::parse(config), &why)) << arch << " n = " << n << " " << config;
    return why;
  };
  EXPECT_NE(why_not("sm_80", 64, "split=16,cluster=2").find("sm_90"), std::string::npos);
  EXPECT_NE(why_not("sm_90", 8, "split=8,cluster=4").find("multiple of 32"), std::string::npos);
  EXPECT_NE(why_not("sm_90", 32, "split=2,cluster=4").find("split must be at least cluster"), std::string::npos);
  std::string why;
  EXPECT_TRUE(op.tuning.valid(problem("sm_90", 128), Config::parse("split=32,cluster=8"), &why)) << why;
}

TEST(E79, PrecompilePlansClusterKernelsForSm90Only) {
  int clustered = 0;
  for (const auto& r : precompile_plan({"sm_80"}, {"e79.fwd", "e79.bwd"})) {
    ASSERT_TRUE(r.config.has_value());
    EXPECT_EQ(r.config->get("cluster"), 1) << r.config->str();
  }
  for (const auto& r : precompile_plan({"sm_90"}, {"e79.fwd", "e79.bwd"}))
    clustered += r.config.has_value() && r.config->get("cluster") > 1;
  EXPECT_GT(clustered, 0);
}

// Cluster kernels at the extremes (n = 8 over 2 CTAs of one warp; n = 128 over 8 CTAs of 512 threads;
// every bias mode) compile for sm_90 without spills or a stack frame. (`kspec precompile --all` compiles
// every config of the representative cases.)
TEST(E79, ClusterKernelsCompileWithoutSpills) {
  struct Item {
    int64_t n;
    const char* config;
    std::vector<std::string> without, alt;
  };
  const std::vector<Item> items = {{8, "split=8,cluster=2", {}, {"b_s", "b_m"}},
                                   {128, "split=32,cluster=8", {}, {}},
                                   {64, "split=16,cluster=4", {"b_s", "b_m"}, {}}};
  for (const char* name : {"e79.fwd", "e79.bwd"}) {
    for (const auto& it : items) {
      CompileRequest r;
      r.op = name;
      r.dtype = DType::bf16;
      r.arch = "sm_90";
      r.params = {{"n", it.n}, {"chunk", int64_t(8)}};
      r.without = it.without;
      r.alt_shapes = it.alt;
      r.config = Config::parse(it.config);
      auto reports = compile(r);
      ASSERT_FALSE(reports.empty()) << name << " " << it.config;
      EXPECT_NE(reports[0].kernel.find("_cluster_kernel<"), std::string::npos) << reports[0].kernel;
      for (const auto& rep : reports) {
        EXPECT_EQ(rep.spill_bytes, 0) << name << " n = " << it.n << " " << it.config << ": " << rep.kernel;
        EXPECT_EQ(rep.stack_bytes, 0) << name << " n = " << it.n << " " << it.config << ": " << rep.kernel;
      }
    }
  }
}

// Every case of both ops compiles for sm_90 (bf16; the base case in every dtype) with the heuristic's
// config, without spills or a stack frame; the representative cases' full tuning spaces in every dtype
// are `kspec precompile --all`'s. (About a minute on two cores.)
TEST(E79, EveryCaseCompilesWithoutSpills) {
  kspec::testing::expect_every_case_compiles({"e79.fwd", "e79.bwd"}, {"n"});
}

// ---- GPU: the op fed by the gemm projection, as kspec.ops.e79 does it ----

namespace {

using DevBuf = kspec::testing::FloatBuffer;

// fp32 end to end: x [T, B, dim] (or batch-first [B, T, dim]) -> gemm with W [C, dim] (C = 4n, or 6n
// with the input biases' rows) -> e79.fwd on column blocks of the projection -> e79.bwd into column
// blocks of one gradient; compared with the float64 reference on the same projection.
// config: forced on both ops (null: the heuristic's).
void run_projected(int64_t T, int64_t B, int64_t dim, int64_t n, bool input_bias, bool batch_first, int64_t chunk,
                   const char* config = nullptr) {
  jit::ContextGuard guard(0);
  const int64_t C = (input_bias ? 6 : 4) * n;
  std::mt19937_64 rng(T * 1000 + B * 10 + n);
  std::normal_distribution<float> nd;
  auto randn = [&](size_t count, float scale) {
    std::vector<float> v(count);
    for (auto& x : v) x = scale * nd(rng);
    return v;
  };
  std::vector<float> x = randn(T * B * dim, 1.0f), W = randn(C * dim, 1.0f / std::sqrt(float(dim)));
  std::vector<float> bsf = randn(n, 1.0f), bmf = randn(n, 1.0f), dout = randn(T * B * n, 1.0f);
  DevBuf dx(x.size() * 4), dW(W.size() * 4), dproj(T * B * C * 4), dbs(n * 4), dbm(n * 4);
  dx.upload(x);
  dW.upload(W);
  dbs.upload(bsf);
  dbm.upload(bmf);
  // x and the projection in one layout: [T, B, *] or batch-first [B, T, *].
  std::initializer_list<int64_t> xshape = {batch_first ? B : T, batch_first ? T : B, dim};
  std::initializer_list<int64_t> pshape = {batch_first ? B : T, batch_first ? T : B, C};
  TensorView xv(dx.ptr(), DType::f32, xshape, 0), Wv(dW.ptr(), DType::f32, {C, dim}, 0);
  TensorView pv(dproj.ptr(), DType::f32, pshape, 0);
  call("gemm", {xv, Wv, TensorView()}, {pv, TensorView()}, {});
  int64_t st = batch_first ? C : B * C, sb = batch_first ? T * C : C;
  auto block = [&](CUdeviceptr base, int j) {
    return TensorView::strided(reinterpret_cast<char*>(base) + j * n * 4, DType::f32, {T, B, n}, {st, sb, 1}, 0);
  };
  TensorView bs = input_bias ? block(dproj.p, 4) : TensorView(dbs.ptr(), DType::f32, {n}, 0);
  TensorView bm = input_bias ? block(dproj.p, 5) : TensorView(dbm.ptr(), DType::f32, {n}, 0);
  int64_t nchk = (T + chunk - 1) / chunk;
  DevBuf dout_b(T * B * n * 4), out_b(T * B * n * 4), S_b(B * n * n * 4), M_b(B * n * n * 4),
      chk_b(B * nchk * 2 * n * n * 4), grad_b(T * B * C * 4), dbs_o(n * 4), dbm_o(n * 4);
  out_b.poison();
  grad_b.poison();
  // out and dout batch-first too when the input is.
  auto tbn = [&](CUdeviceptr p) {
    int64_t ost = batch_first ? n : B * n, osb = batch_first ? T * n : n;
    return TensorView::strided(reinterpret_cast<void*>(p), DType::f32, {T, B, n}, {ost, osb, 1}, 0);
  };
  dout_b.upload(dout);
  Params params = {{"chunk", chunk}};
  Config forced;
  CallOptions opts;
  if (config) {
    forced = Config::parse(config);
    opts.config = &forced;
  }
  call("e79.fwd", {block(dproj.p, 0), block(dproj.p, 1), block(dproj.p, 2), block(dproj.p, 3), bs, bm, {}, {}},
       {tbn(out_b.p), TensorView(S_b.ptr(), DType::f32, {B, n, n}, 0), TensorView(M_b.ptr(), DType::f32, {B, n, n}, 0),
        TensorView(chk_b.ptr(), DType::f32, {B, nchk, 2, n, n}, 0)},
       params, nullptr, opts);
  TensorView dbs_v = input_bias ? block(grad_b.p, 4) : TensorView(dbs_o.ptr(), DType::f32, {n}, 0);
  TensorView dbm_v = input_bias ? block(grad_b.p, 5) : TensorView(dbm_o.ptr(), DType::f32, {n}, 0);
  call("e79.bwd",
       {tbn(dout_b.p), block(dproj.p, 0), block(dproj.p, 1), block(dproj.p, 2), block(dproj.p, 3), bs, bm, {}, {},
        TensorView(chk_b.ptr(), DType::f32, {B, nchk, 2, n, n}, 0), {}, {}},
       {block(grad_b.p, 0), block(grad_b.p, 1), block(grad_b.p, 2), block(grad_b.p, 3), dbs_v, dbm_v, {}, {}}, params,
       nullptr, opts);
  CU_CHECK(cuCtxSynchronize());

  // Host reference on the GPU's projection (the gemm op has its own tests), in [T, B, n] order.
  std::vector<float> proj = dproj.download(T * B * C);
  auto at = [&](const std::vector<float>& buf, int64_t t, int64_t b, int64_t j, int64_t width) {
    return batch_first ? buf[(b * T + t) * width + j] : buf[(t * B + b) * width + j];
  };
  ref::E79Shape s{T, B, n, input_bias ? ref::kE79BiasInput : ref::kE79BiasFixed};
  ref::E79Inputs in;
  std::vector<double>* cols[6] = {&in.k, &in.v, &in.q, &in.m, &in.b_s, &in.b_m};
  std::vector<double> dout_tbn(T * B * n);
  for (int c = 0; c < (input_bias ? 6 : 4); ++c) cols[c]->resize(T * B * n);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n; ++i) {
        for (int c = 0; c < (input_bias ? 6 : 4); ++c) (*cols[c])[(t * B + b) * n + i] = at(proj, t, b, c * n + i, C);
        dout_tbn[(t * B + b) * n + i] = dout[(t * B + b) * n + i];
      }
  if (batch_first)  // dout was uploaded as given: batch-first order
    for (int64_t t = 0; t < T; ++t)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < n; ++i) dout_tbn[(t * B + b) * n + i] = dout[(b * T + t) * n + i];
  if (!input_bias) {
    in.b_s.assign(bsf.begin(), bsf.end());
    in.b_m.assign(bmf.begin(), bmf.end());
  }
  auto fr = ref::e79_fwd_ref(s, in);
  auto gr = ref::e79_bwd_ref(s, in, dout_tbn, nullptr, nullptr);
  std::vector<float> out = out_b.download(T * B * n), grad = grad_b.download(T * B * C);
  std::vector<float> out_tbn(T * B * n);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n; ++i) out_tbn[(t * B + b) * n + i] = at(out, t, b, i, n);
  const double tol = 4e-5;
  std::string where = "T=" + std::to_string(T) + " B=" + std::to_string(B) + " n=" + std::to_string(n) +
                      (input_bias ? " input" : " fixed") + (batch_first ? " batch-first" : "") +
                      (config ? std::string(" ") + config : std::string());
  EXPECT_LE(rel_err(out_tbn, fr.out), tol) << "out " << where;
  EXPECT_LE(rel_err(S_b.download(B * n * n), fr.S), tol) << "S " << where;
  EXPECT_LE(rel_err(M_b.download(B * n * n), fr.M), tol) << "M " << where;
  const std::vector<double>* grads[6] = {&gr.dk, &gr.dv, &gr.dq, &gr.dm, &gr.db_s, &gr.db_m};
  const char* names[6] = {"dk", "dv", "dq", "dm", "db_s", "db_m"};
  for (int c = 0; c < (input_bias ? 6 : 4); ++c) {
    std::vector<float> g(T * B * n);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < n; ++i) g[(t * B + b) * n + i] = at(grad, t, b, c * n + i, C);
    EXPECT_LE(rel_err(g, *grads[c]), tol) << names[c] << " " << where;
  }
  if (!input_bias) {
    EXPECT_LE(rel_err(dbs_o.download(n), gr.db_s), tol) << "db_s " << where;
    EXPECT_LE(rel_err(dbm_o.download(n), gr.db_m), tol) << "db_m " << where;
  }
}

}  // namespace

TEST(E79Gpu, ProjectedThroughGemmContiguous) {
  KSPEC_REQUIRE_GPU();
  run_projected(19, 3, 40, 16, false, false, 8);
  run_projected(19, 3, 40, 16, true, false, 8);
}

TEST(E79Gpu, ProjectedThroughGemmBatchFirst) {
  KSPEC_REQUIRE_GPU();
  run_projected(19, 3, 40, 32, false, true, 4);
  run_projected(17, 2, 24, 64, true, true, 16);
}

// ---- GPU: one sequence over a thread-block cluster (sm_90+) ----

namespace {

bool device_has_clusters() {
  CUdevice dev;
  int major = 0;
  CU_CHECK(cuDeviceGet(&dev, 0));
  CU_CHECK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
  return major >= 9;
}

}  // namespace

// Every cluster config of the B = 1 cases (and of base, n = 48, chunk 5) against the float64 reference,
// forward and backward, through the generic checker (NaN-poisoned outputs).
TEST(E79Gpu, EveryClusterConfigMatchesReference) {
  KSPEC_REQUIRE_GPU();
  if (!device_has_clusters()) GTEST_SKIP() << "thread-block clusters need sm_90 or newer";
  for (const char* op : {"e79.fwd", "e79.bwd"}) {
    for (const char* cs : {"B_1_n_8", "B_1_n_128", "B_1_n_64_T_not_multiple_of_K", "base", "n_48", "chunk_5"}) {
      CheckOptions o;  // the clustered configs on one draw of inputs, against one reference
      o.case_name = cs;
      o.dtypes = {DType::f32};
      for (const Config& cfg : configs_for_case(op, cs, DType::f32))
        if (cfg.get("cluster") != 1) o.configs.push_back(cfg);
      EXPECT_GT(o.configs.size(), 0u) << op << " " << cs;
      auto rows = check_op(op, o);
      EXPECT_EQ(rows.size(), o.configs.size()) << op << " " << cs;
      kspec::testing::report(rows);
    }
  }
}

TEST(E79Gpu, ProjectedThroughGemmWithClusters) {
  KSPEC_REQUIRE_GPU();
  if (!device_has_clusters()) GTEST_SKIP() << "thread-block clusters need sm_90 or newer";
  run_projected(19, 1, 40, 16, false, false, 8, "split=8,cluster=4");
  run_projected(17, 2, 24, 64, true, true, 16, "split=32,cluster=8");
  run_projected(9, 3, 32, 128, false, true, 4, "split=8,cluster=2");
}
