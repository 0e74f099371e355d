// mhc.pre.fwd's algo=decode (4) and decode_rows (5), the one-launch forward for few tokens
// (templates/mhc/mhc_pre_decode.cuh), and save_stats. Without a GPU: the rules, the outputs without save_stats, and
// the kernel compiling without spills. On a GPU: every case and the decode shapes against the float64 reference,
// decode_rows the same bits as decode, the same bits at every run, on two streams at once and through CUDA graph
// replays. (Helpers shared with test_mhc.cpp in mhc_test_util.h.)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "device_buffer_test_util.h"
#include "jit/driver.h"
#include "jit/handles.h"
#include "kspec/kspec.h"
#include "mhc/reference.h"
#include "mhc_test_util.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::max_rel;
using kspec::testing::mhc_request;
using kspec::testing::PreArgs;
using kspec::testing::randn;
using kspec::testing::to_double;
using kspec::testing::view;

namespace {

using DevBuf = kspec::testing::FloatBuffer;

bool algo_is(const Config& c, int64_t algo) { return c.get("algo") == algo; }

}  // namespace

// pre.fwd's algo=decode (4) and decode_rows (5): one launch for few tokens (mhc_pre_decode.cuh), named threads=256,
// tokens=1 and refused by name otherwise; any dtype (exact fp32 FMAs, fp32 x too), any n; not the heuristic's yet.
// With save_stats=false inv and h are no outputs (pre.fwd and pre_only.fwd). The kernel compiles without spills or
// stack at n 4 (16-byte groups and not), n 8, pre_only n 8; decode_rows at n 1, 4, 8.
TEST(Mhc, PreForwardDecodeRulesSaveStatsAndCompileWithoutSpills) {
  const OpDef& op = Registry::global().get("mhc.pre.fwd");
  const CompileRequest r = mhc_request("mhc.pre.fwd", 4, 4096);
  const Problem p = problem_from_request(op, r);
  const Config ok{{{"algo", 4}, {"threads", 256}, {"tokens", 1}}};
  std::string why;
  EXPECT_TRUE(op.tuning.valid(p, ok, &why)) << why;
  EXPECT_NE(op.tuning.heuristic(p).get("algo"), 4);
  EXPECT_EQ(op.tuning.block_threads(p, ok), 256);
  const auto kernels = op.kernels(p, ok);
  ASSERT_EQ(kernels.size(), 1u);
  EXPECT_EQ(kernels[0].kernel, "kspec::mhc_pre_fwd_decode_kernel");
  EXPECT_EQ(kernels[0].targs.back(), "true");  // kVec
  // algo=decode_rows (5): the same kernel with kRowSplit (its last template argument) on
  const Config rows{{{"algo", 5}, {"threads", 256}, {"tokens", 1}}};
  EXPECT_TRUE(op.tuning.valid(p, rows, &why)) << why;
  const auto rk = op.kernels(p, rows);
  ASSERT_EQ(rk.size(), 1u);
  EXPECT_EQ(rk[0].targs.size(), kernels[0].targs.size() + 1);
  EXPECT_EQ(rk[0].targs.back(), "true");
  for (const Config& bad : {Config{{{"algo", 4}, {"threads", 128}, {"tokens", 1}}},
                            Config{{{"algo", 5}, {"threads", 256}, {"tokens", 16}}}}) {
    EXPECT_FALSE(op.tuning.valid(p, bad, &why)) << bad.str();
    EXPECT_NE(why.find("threads=256, tokens=1"), std::string::npos) << why;
  }
  {
    CompileRequest q = r;
    q.dtype = DType::f32;
    q.params = {{"n", int64_t(8)}, {"D", int64_t(37)}};
    const Problem f = problem_from_request(op, q);
    EXPECT_TRUE(op.tuning.valid(f, ok, &why)) << why;
    EXPECT_EQ(op.kernels(f, ok)[0].targs.back(), "false");
  }

  for (const char* name : {"mhc.pre.fwd", "mhc.pre_only.fwd"}) {
    PreArgs a;
    if (std::string(name) == "mhc.pre_only.fwd") a.M = 4, a.A = 1;
    const size_t n_out = a.M == 4 ? 4 : 6;
    auto kept = infer_outputs(name, a.inputs());
    ASSERT_EQ(kept.size(), n_out);
    EXPECT_TRUE(kept[n_out - 2].present && kept[n_out - 1].present) << name;
    auto dropped = infer_outputs(name, a.inputs(), {{"save_stats", false}});
    ASSERT_EQ(dropped.size(), n_out);
    EXPECT_FALSE(dropped[n_out - 2].present) << name << ": inv";
    EXPECT_FALSE(dropped[n_out - 1].present) << name << ": h";
    for (size_t i = 0; i + 2 < n_out; ++i) EXPECT_TRUE(dropped[i].present) << name << " output " << i;
  }

  int compiled = 0;
  for (auto [name, arch, dt, n, D, algo] :
       {std::tuple{"mhc.pre.fwd", "sm_90", DType::bf16, 4, 4096, 4}, std::tuple{"mhc.pre.fwd", "sm_80", DType::bf16, 4, 4096, 4},
        std::tuple{"mhc.pre.fwd", "sm_90", DType::f32, 4, 4000, 4}, std::tuple{"mhc.pre.fwd", "sm_90", DType::f16, 8, 128, 4},
        std::tuple{"mhc.pre_only.fwd", "sm_90", DType::f16, 8, 128, 4}, std::tuple{"mhc.pre.fwd", "sm_90", DType::bf16, 4, 4096, 5},
        std::tuple{"mhc.pre.fwd", "sm_90", DType::bf16, 1, 4096, 5}, std::tuple{"mhc.pre.fwd", "sm_90", DType::f16, 8, 128, 5}}) {
    const OpDef& o = Registry::global().get(name);
    CompileRequest q = mhc_request(name, n, D, dt, arch);
    q.config = Config{{{"algo", algo}, {"threads", 256}, {"tokens", 1}}};
    ASSERT_TRUE(o.tuning.valid(problem_from_request(o, q), *q.config, &why)) << name << ": " << why;
    for (const auto& rep : compile(q)) {
      EXPECT_EQ(rep.spill_bytes, 0) << arch << " " << name << " n " << n;
      EXPECT_EQ(rep.stack_bytes, 0) << arch << " " << name << " n " << n;
      std::cout << arch << " " << name << " algo " << algo << " n " << n << " D " << D << ": " << rep.registers
                << " registers, "
                << rep.shared_bytes << " bytes of shared memory\n";
      ++compiled;
    }
  }
  EXPECT_EQ(compiled, 8);
}

// ---- algo=decode on the GPU ----

namespace {

// Every case of each op but the large ones, in each dtype, at the case's configs that `take` selects, against the
// float64 reference (a case without such a config a failure). Returns the rows checked.
int check_every_case(const std::vector<const char*>& ops, const std::vector<DType>& dtypes,
                     const std::function<bool(const Config&)>& take) {
  int n = 0;
  for (const char* op_name : ops) {
    const OpDef& op = Registry::global().get(op_name);
    for (const Case& cs : op.cases) {
      if (cs.large) continue;
      for (DType dt : dtypes) {
        CheckOptions o;
        o.case_name = cs.name;
        o.dtypes = {dt};
        for (const Config& c : configs_for_case(op_name, cs.name, dt))
          if (take(c)) o.configs.push_back(c);
        if (o.configs.empty()) {
          ADD_FAILURE() << op_name << " " << cs.name << ": no config taken";
          continue;
        }
        auto rows = check_op(op_name, o);
        EXPECT_EQ(rows.size(), o.configs.size()) << op_name << " " << cs.name;
        kspec::testing::report(rows);
        n += static_cast<int>(rows.size());
      }
    }
  }
  return n;
}

}  // namespace

namespace {

const Config kDecodeConfig{{{"algo", 4}, {"threads", 256}, {"tokens", 1}}};
const Config kDecodeRowsConfig{{{"algo", 5}, {"threads", 256}, {"tokens", 1}}};

// "" when a and b hold the same bytes output by output, else the first output that differs.
std::string first_difference(const std::vector<std::vector<uint8_t>>& a, const std::vector<std::vector<uint8_t>>& b) {
  if (a.size() != b.size()) return "a different number of outputs";
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return "output " + std::to_string(i) + " differs";
  return "";
}

// One mhc.pre.fwd (or pre_only.fwd) problem for algo=decode: x of `dt` [T, n, D], the float64 reference on the
// same (rounded) inputs, the outputs poisoned before each run and read back as bytes.
struct DecodeProblem {
  int64_t T, n, D, M;
  DType dt;
  bool gamma, pre_only;
  std::vector<double> x, phi, alpha, bias, g;
  std::unique_ptr<DevBuf> xb, phib, ab, bb, gb;
  std::vector<std::unique_ptr<DevBuf>> outs;  // y, h_pre, (h_post, r,) inv, h

  DecodeProblem(int64_t T_, int64_t n_, int64_t D_, DType dt_, bool gamma_, bool pre_only_)
      : T(T_), n(n_), D(D_), M(ref::mhc_proj_rows(n_, pre_only_)), dt(dt_), gamma(gamma_), pre_only(pre_only_) {
    std::mt19937_64 rng(static_cast<uint64_t>(T * 1009 + n * 101 + D + (gamma ? 7 : 0) + (pre_only ? 3 : 0)));
    const int64_t nd = n * D;
    auto d = [](const std::vector<float>& v) { return to_double(v); };
    x = d(randn(rng, T * nd, 1.f));
    quantize(dt, x);
    phi = d(randn(rng, M * nd, 1.f / std::sqrt(float(nd))));
    alpha = pre_only ? std::vector<double>{0.7} : std::vector<double>{0.7, -0.5, 1.3};
    bias = d(randn(rng, M, 0.5f));
    if (gamma) {
      g = d(randn(rng, nd, 0.3f));
      for (auto& v : g) v += 1.0;
    }
    std::vector<unsigned char> xbytes;
    encode(dt, x, xbytes);
    xb = std::make_unique<DevBuf>(xbytes.size());
    xb->upload(xbytes.data(), xbytes.size());
    auto f32buf = [](const std::vector<double>& v) {
      auto b = std::make_unique<DevBuf>(v.size() * 4);
      if (!v.empty()) b->upload(std::vector<float>(v.begin(), v.end()));
      return b;
    };
    phib = f32buf(phi);
    ab = f32buf(alpha);
    bb = f32buf(bias);
    gb = f32buf(g);
    for (size_t bytes : out_bytes()) outs.push_back(std::make_unique<DevBuf>(bytes));
  }
  const char* op() const { return pre_only ? "mhc.pre_only.fwd" : "mhc.pre.fwd"; }
  std::vector<size_t> out_bytes() const {
    std::vector<size_t> b = {static_cast<size_t>(T * D * dtype_size(dt)), static_cast<size_t>(T * n * 4)};
    if (!pre_only) b.insert(b.end(), {static_cast<size_t>(T * n * 4), static_cast<size_t>(T * n * n * 4)});
    b.insert(b.end(), {static_cast<size_t>(T * 4), static_cast<size_t>(T * M * 4)});
    return b;
  }
  std::vector<TensorView> inputs() const {
    auto f32 = [](const DevBuf& b, std::vector<int64_t> shape) { return view(b.ptr(), DType::f32, shape); };
    return {view(xb->ptr(), dt, {T, n, D}), f32(*phib, {M, n * D}), f32(*ab, {pre_only ? 1 : 3}), f32(*bb, {M}),
            gamma ? f32(*gb, {n * D}) : TensorView()};
  }
  std::vector<TensorView> outputs(bool save) const {
    auto f32 = [&](size_t i, std::vector<int64_t> shape) { return view(outs[i]->ptr(), DType::f32, shape); };
    std::vector<TensorView> o = {view(outs[0]->ptr(), dt, {T, D}), f32(1, {T, n})};
    if (!pre_only) o.insert(o.end(), {f32(2, {T, n}), f32(3, {T, n, n})});
    const size_t k = o.size();
    o.push_back(save ? f32(k, {T}) : TensorView());
    o.push_back(save ? f32(k + 1, {T, M}) : TensorView());
    return o;
  }
  void poison() {
    for (auto& o : outs) o->poison();
  }
  // Enqueues the call on `stream` (outputs not poisoned: a caller capturing a graph poisons before).
  void enqueue(CUstream stream, const Config& config, bool save = true) const {
    CallOptions opts;
    opts.config = &config;
    Params params;
    if (!save) params.set("save_stats", false);
    call(op(), inputs(), outputs(save), params, reinterpret_cast<Stream>(stream), opts);
  }
  std::vector<std::vector<uint8_t>> bytes() const {
    std::vector<std::vector<uint8_t>> b;
    for (const auto& o : outs) {
      b.emplace_back(o->bytes);
      CU_CHECK(cuMemcpyDtoH(b.back().data(), o->p, o->bytes));
    }
    return b;
  }
  // Every output against the float64 reference: y by its dtype (1e-5, 2e-3, 1e-2), the fp32 ones 1e-5 (the
  // fp32 projection is exact FMAs, x exact in fp32); with `save` false inv and h must still hold the poison.
  void expect_matches_reference(bool save, const std::string& what) const {
    const ref::MhcShape s{T, n, D, pre_only};
    const auto r = ref::mhc_pre_fwd_ref(s, ref::MhcEps{}, {x, phi, alpha, bias, g});
    const double ytol = dt == DType::f32 ? 1e-5 : dt == DType::f16 ? 2e-3 : 1e-2;
    const auto b = bytes();
    std::vector<std::pair<const char*, const std::vector<double>*>> want = {{"y", &r.y}, {"h_pre", &r.h_pre}};
    if (!pre_only) want.insert(want.end(), {{"h_post", &r.h_post}, {"r", &r.r}});
    want.insert(want.end(), {{"inv", &r.inv}, {"h", &r.h}});
    for (size_t i = 0; i < want.size(); ++i) {
      const bool dropped = !save && i + 2 >= want.size();
      const std::vector<double> got = decode(i == 0 ? dt : DType::f32, b[i]);
      if (dropped) {
        EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](double v) { return std::isnan(v); }))
            << what << ": " << want[i].first << " written without save_stats";
        continue;
      }
      std::vector<float> f(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(want[i].second->size()));
      EXPECT_LE(max_rel(f, *want[i].second), i == 0 ? ytol : 1e-5) << what << ": " << want[i].first;
    }
  }
  std::string name() const {
    return std::string(op()) + " T " + std::to_string(T) + " n " + std::to_string(n) + " D " + std::to_string(D) +
           " " + dtype_name(dt) + (gamma ? "" : " no gamma");
  }
};

}  // namespace

// Every case of mhc.pre.fwd and mhc.pre_only.fwd (T 1, 2, 1031; n 1, 2, 3, 8; D 33 to 7168; eps 0; t_max 1 and
// 3; no gamma) with algo=decode and decode_rows, every dtype, against the float64 reference (GpuEveryOp's checker:
// outputs poisoned first).
TEST(MhcGpu, PreForwardDecodeMatchesReferenceOnEveryCase) {
  KSPEC_REQUIRE_GPU();
  const int rows = check_every_case({"mhc.pre.fwd", "mhc.pre_only.fwd"}, {DType::f32, DType::f16, DType::bf16},
                                    [](const Config& c) { return algo_is(c, 4) || algo_is(c, 5); });
  EXPECT_GE(rows, 120);  // both algos
}

// The decode shapes: T 1, 2, 8, 33 (above the heads' 8 tokens at once), 256 against n 1, 3, 4, 8 and D 4000,
// 4096, each dtype, gamma or not, pre_only or not, poisoned outputs against the float64 reference, and decode_rows
// the same bits as decode; T 8, n 4, D 4096 in every combination, and without save_stats (inv and h left as poisoned,
// the other outputs the same bits).
TEST(MhcGpu, PreForwardDecodeShapesMatchReference) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const std::vector<std::pair<int64_t, int64_t>> nd = {{4, 4096}, {4, 4000}, {1, 4000}, {3, 4096}, {8, 4096}};
  const DType dts[] = {DType::bf16, DType::f16, DType::f32};
  int run = 0;
  for (int64_t T : {1, 2, 8, 33, 256})
    for (const auto& [n, D] : nd) {
      DecodeProblem p(T, n, D, dts[run % 3], run % 2 == 0, run % 4 == 3);
      p.poison();
      p.enqueue(nullptr, kDecodeConfig);
      CU_CHECK(cuCtxSynchronize());
      p.expect_matches_reference(true, p.name());
      const auto decode = p.bytes();
      p.poison();
      p.enqueue(nullptr, kDecodeRowsConfig);
      CU_CHECK(cuCtxSynchronize());
      EXPECT_EQ(first_difference(p.bytes(), decode), "") << p.name() << ": decode_rows against decode";
      ++run;
    }
  for (DType dt : dts)
    for (bool gamma : {true, false})
      for (bool po : {false, true}) {
        DecodeProblem p(8, 4, 4096, dt, gamma, po);
        p.poison();
        p.enqueue(nullptr, kDecodeConfig);
        CU_CHECK(cuCtxSynchronize());
        p.expect_matches_reference(true, p.name());
        const auto kept = p.bytes();
        p.poison();
        p.enqueue(nullptr, kDecodeConfig, false);
        CU_CHECK(cuCtxSynchronize());
        p.expect_matches_reference(false, p.name() + " without save_stats");
        const auto dropped = p.bytes();
        for (size_t i = 0; i + 2 < kept.size(); ++i)
          EXPECT_TRUE(dropped[i] == kept[i]) << p.name() << " output " << i;
      }
}

// The same bits at every run (the heads' sums in item order, whichever block runs them), on one stream, and
// on two streams at once, 20 calls each (each stream its own counters); then a CUDA graph of the call captured
// on a third stream and replayed twice gives the eager bits (the graph's counters are zeroed by its memset node,
// and put back to zero by the kernel: the second replay finds them so), and the eager call after it too.
TEST(MhcGpu, PreForwardDecodeIsDeterministicAcrossStreamsAndGraphReplays) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  DecodeProblem p(8, 4, 4096, DType::bf16, true, false);
  p.poison();
  p.enqueue(nullptr, kDecodeConfig);
  CU_CHECK(cuCtxSynchronize());
  const auto first = p.bytes();
  p.expect_matches_reference(true, "first run");
  p.poison();
  p.enqueue(nullptr, kDecodeConfig);
  CU_CHECK(cuCtxSynchronize());
  EXPECT_EQ(first_difference(p.bytes(), first), "") << "second run";
  p.poison();
  p.enqueue(nullptr, kDecodeRowsConfig);
  CU_CHECK(cuCtxSynchronize());
  EXPECT_EQ(first_difference(p.bytes(), first), "") << "decode_rows";

  DecodeProblem q(8, 4, 4096, DType::bf16, true, false);  // the same inputs (the seed is the shape's)
  jit::OwnedStream sa = jit::create_stream(CU_STREAM_NON_BLOCKING), sb = jit::create_stream(CU_STREAM_NON_BLOCKING);
  p.poison();
  q.poison();
  CU_CHECK(cuCtxSynchronize());
  for (int i = 0; i < 20; ++i) {
    p.enqueue(sa.get(), kDecodeConfig);
    q.enqueue(sb.get(), kDecodeConfig);
  }
  CU_CHECK(cuCtxSynchronize());
  EXPECT_EQ(first_difference(p.bytes(), first), "") << "stream a";
  EXPECT_EQ(first_difference(q.bytes(), first), "") << "stream b";

  jit::OwnedStream sc = jit::create_stream(CU_STREAM_NON_BLOCKING);
  CUgraph graph;
  CUgraphExec exec;
  ASSERT_EQ(jit::driver().cuStreamBeginCapture(sc.get(), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), CUDA_SUCCESS);
  p.enqueue(sc.get(), kDecodeConfig);
  ASSERT_EQ(jit::driver().cuStreamEndCapture(sc.get(), &graph), CUDA_SUCCESS);
  ASSERT_EQ(jit::driver().cuGraphInstantiate(&exec, graph, 0), CUDA_SUCCESS);
  for (int replay = 0; replay < 2; ++replay) {
    p.poison();
    CU_CHECK(cuCtxSynchronize());
    ASSERT_EQ(jit::driver().cuGraphLaunch(exec, sa.get()), CUDA_SUCCESS);
    CU_CHECK(cuCtxSynchronize());
    EXPECT_EQ(first_difference(p.bytes(), first), "") << "graph replay " << replay;
  }
  p.poison();
  p.enqueue(sc.get(), kDecodeConfig);
  CU_CHECK(cuCtxSynchronize());
  EXPECT_EQ(first_difference(p.bytes(), first), "") << "eager after the replays";
  jit::driver().cuGraphExecDestroy(exec);
  jit::driver().cuGraphDestroy(graph);
}
