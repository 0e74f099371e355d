// api/: the registry, schemas, validation messages (every bad argument named, nothing launched),
// output inference, compile without a GPU, the precompile plan and forced configs.
#include <algorithm>
#include <cmath>

#include "adamw/reference.h"
#include "api/src/op.h"
#include "kspec/kspec.h"
#include "precompile_test_util.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::fake;

namespace {

struct FwdArgs {
  TensorView x{fake(), DType::bf16, {4, 3, 1024}, 0};
  TensorView w{fake(1 << 20), DType::bf16, {1024}, 0};
  TensorView b{fake(2 << 20), DType::bf16, {1024}, 0};
  TensorView y{fake(3 << 20), DType::bf16, {4, 3, 1024}, 0};
  TensorView mean{fake(8 << 20), DType::f32, {4, 3}, 0};
  TensorView rstd{fake(9 << 20), DType::f32, {4, 3}, 0};
  std::vector<TensorView> in() const { return {x, w, b}; }
  std::vector<TensorView> out() const { return {y, mean, rstd}; }
};

// Expects validation to fail with InvalidArgument whose message contains every fragment.
void expect_invalid(const FwdArgs& a, const Params& p, std::vector<std::string> fragments, const char* op = "norm_act.fwd") {
  try {
    call(op, a.in(), a.out(), p);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    std::string msg = e.what();
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
  }
}

}  // namespace

TEST(Registry, ListsOpsWithSchemas) {
  auto ops = list_ops();
  EXPECT_NE(std::find(ops.begin(), ops.end(), "norm_act.fwd"), ops.end());
  EXPECT_NE(std::find(ops.begin(), ops.end(), "norm_act.bwd"), ops.end());
  const OpInfo& i = op_info("norm_act.fwd");
  EXPECT_EQ(i.inputs.size(), 3u);
  EXPECT_EQ(i.outputs.size(), 3u);
  std::string d = describe_op("norm_act.bwd");
  EXPECT_NE(d.find("dweight"), std::string::npos);
  EXPECT_NE(d.find("threads_per_row"), std::string::npos);
  EXPECT_THROW(op_info("nope.fwd"), InvalidArgument);
}

TEST(Registry, EveryOpIsFullyDefined) {
  for (const auto& name : list_ops()) {
    const OpDef& op = Registry::global().get(name);
    // A library op (gemm: cuBLASLt) has no NVRTC kernels and may have no tuning space of its own.
    EXPECT_TRUE(op.kernels || op.info.family == "gemm") << name;
    EXPECT_TRUE(op.launch) << name;
    EXPECT_TRUE(op.reference) << name;
    if (!op.tuning.axes.empty()) {
      EXPECT_TRUE(op.tuning.heuristic) << name;
    }
    EXPECT_TRUE(!op.tuning.axes.empty() || op.info.family == "gemm") << name;
    EXPECT_FALSE(op.cases.empty()) << name;
    EXPECT_FALSE(op.dtypes.empty()) << name;
  }
}

TEST(Validation, UnknownOpAndParams) {
  FwdArgs a;
  expect_invalid(a, {}, {"unknown op 'norm_act.fwdd'", "norm_act.fwd"}, "norm_act.fwdd");
  expect_invalid(a, {{"epsilon", 1e-5}}, {"unknown parameter 'epsilon'", "eps"});
  expect_invalid(a, {{"act", std::string("relu6")}}, {"parameter 'act'", "silu", "relu6"});
  expect_invalid(a, {{"eps", std::string("small")}}, {"parameter 'eps'", "number"});
}

TEST(Validation, DtypeRankShapeDevicePointer) {
  {
    FwdArgs a;
    a.x.dtype = DType::i32;
    expect_invalid(a, {}, {"input 'x'", "float32|float16|bfloat16", "int32"});
  }
  {
    FwdArgs a;
    a.w.dtype = DType::f16;
    expect_invalid(a, {}, {"input 'weight'", "bfloat16", "float16"});
  }
  {
    FwdArgs a;
    a.w = TensorView(fake(1 << 20), DType::bf16, {1000}, 0);
    expect_invalid(a, {}, {"input 'weight'", "hidden = 1000", "hidden = 1024"});
  }
  {
    FwdArgs a;
    a.w = TensorView(fake(1 << 20), DType::bf16, {1, 1024}, 0);
    expect_invalid(a, {}, {"input 'weight'", "expected shape [hidden]"});
  }
  {
    FwdArgs a;
    a.x.device = kCpuDevice;
    expect_invalid(a, {}, {"input 'x'", "CUDA tensor", "host memory"});
  }
  {
    FwdArgs a;
    a.b.device = 1;
    expect_invalid(a, {}, {"input 'bias'", "cuda:0", "cuda:1"});
  }
  {
    FwdArgs a;
    a.x.data = nullptr;
    expect_invalid(a, {}, {"input 'x'", "null data pointer"});
  }
  {
    FwdArgs a;
    a.x.data = fake(1);
    expect_invalid(a, {}, {"input 'x'", "not aligned"});
  }
  {
    FwdArgs a;
    a.x = TensorView::strided(fake(), DType::bf16, {12, 1024}, {1, 12}, 0);
    expect_invalid(a, {}, {"input 'x'", "last dim to be contiguous"});
  }
  {
    FwdArgs a;
    a.x = TensorView::strided(fake(), DType::bf16, {4, 3, 1024}, {1024 * 8, 1024 * 2, 1}, 0);
    expect_invalid(a, {}, {"input 'x'", "flattened into rows"});
  }
}

TEST(Validation, OutputsAndCounts) {
  {
    FwdArgs a;
    a.y = TensorView(fake(3 << 20), DType::bf16, {12, 1024}, 0);
    expect_invalid(a, {}, {"output 'y'", "expected shape [4, 3, 1024]"});
  }
  {
    FwdArgs a;
    a.mean = TensorView(fake(8 << 20), DType::f16, {4, 3}, 0);
    expect_invalid(a, {}, {"output 'mean'", "float32"});
  }
  {
    FwdArgs a;
    a.y = TensorView::strided(fake(3 << 20), DType::bf16, {4, 3, 1024}, {512 * 3, 512, 1}, 0);
    expect_invalid(a, {}, {"output 'y'", "overlap"});
  }
  FwdArgs a;
  // Counts: one input too many; the required weight left out (a trailing optional input, bias, may be left
  // out: that call is valid, and with these fake pointers it would launch).
  EXPECT_THROW(call("norm_act.fwd", {a.x, a.w, a.b, a.b}, a.out()), InvalidArgument);
  EXPECT_THROW(call("norm_act.fwd", {a.x}, a.out()), InvalidArgument);
  EXPECT_THROW(call("norm_act.fwd", a.in(), {a.y, a.mean}), InvalidArgument);
  EXPECT_THROW(call("norm_act.fwd", {TensorView(), a.w, a.b}, a.out()), InvalidArgument);
  // bwd: dbias given although bias is None
  TensorView dy = a.x, dx = a.y;
  try {
    call("norm_act.bwd", {dy, a.x, a.w, TensorView(), a.mean, a.rstd}, {dx, a.w, a.b});
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("output 'dbias' must be None"), std::string::npos) << e.what();
  }
}

TEST(Validation, InferOutputs) {
  FwdArgs a;
  auto outs = infer_outputs("norm_act.fwd", a.in());
  ASSERT_EQ(outs.size(), 3u);
  EXPECT_EQ(outs[0].shape, (std::vector<int64_t>{4, 3, 1024}));
  EXPECT_EQ(outs[0].dtype, DType::bf16);
  EXPECT_EQ(outs[1].shape, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(outs[1].dtype, DType::f32);
  auto b = infer_outputs("norm_act.bwd", {a.x, a.x, TensorView(fake(1 << 20), DType::f32, {1024}, 0), TensorView(),
                                          a.mean, a.rstd});
  EXPECT_TRUE(b[0].present);
  EXPECT_EQ(b[1].dtype, DType::f32);  // dweight follows an fp32 weight
  EXPECT_FALSE(b[2].present);         // no bias, no dbias
}

TEST(Compile, WithoutGpuReportsResources) {
  CompileRequest req;
  req.op = "norm_act.bwd";
  req.dtype = DType::bf16;
  req.arch = "sm_90";
  req.params = {{"hidden", int64_t(4096)}, {"norm", std::string("rmsnorm")}, {"act", std::string("silu")}};
  auto reports = compile(req);
  ASSERT_EQ(reports.size(), 2u);  // the row kernel and the deterministic column reduction
  for (const auto& r : reports) {
    EXPECT_EQ(r.key.size(), 64u);
    EXPECT_GT(r.registers, 0);
    EXPECT_EQ(r.spill_bytes, 0) << r.kernel;
    EXPECT_EQ(r.arch, "sm_90a");
  }
  auto again = compile(req);
  EXPECT_EQ(again[0].source, "memory");
  EXPECT_EQ(again[0].key, reports[0].key);
}

TEST(Compile, RequestErrors) {
  CompileRequest req;
  req.op = "norm_act.fwd";
  EXPECT_THROW(compile(req), InvalidArgument);  // hidden is compile-time: must be given
  req.params = {{"hidden", int64_t(33)}};
  Config bad{{{"threads_per_row", 32}, {"rows_per_block", 1}, {"vec", 8}, {"stream", 0}}};
  req.config = bad;
  try {
    compile(req);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not valid"), std::string::npos);
  }
  req.config.reset();
  req.without = {"x"};
  EXPECT_THROW(compile(req), InvalidArgument);
}

TEST(Compile, RowsPastTheRegisterLimitAreStreamed) {
  CompileRequest req;
  req.op = "norm_act.fwd";
  req.dtype = DType::bf16;
  // Up to 8192 the row is held in registers; past it, and for any length, it is streamed.
  for (int64_t hidden : {int64_t(8192), int64_t(6144), int64_t(8191)}) {
    req.params = {{"hidden", hidden}};
    auto r = compile(req);
    EXPECT_EQ(r.at(0).kernel.find("stream"), std::string::npos) << hidden << " " << r.at(0).kernel;
  }
  for (int64_t hidden : {int64_t(8200), int64_t(12289), int64_t(100000)}) {
    req.params = {{"hidden", hidden}};
    auto r = compile(req);
    EXPECT_NE(r.at(0).kernel.find("norm_act_fwd_stream_kernel"), std::string::npos) << hidden;
    EXPECT_EQ(r.at(0).spill_bytes, 0) << hidden;
  }
  req.op = "norm_act.bwd";
  req.params = {{"hidden", int64_t(12289)}, {"act", std::string("gelu_tanh")}};
  auto r = compile(req);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_NE(r[0].kernel.find("norm_act_bwd_stream_dx_kernel"), std::string::npos);
  EXPECT_NE(r[1].kernel.find("norm_act_bwd_stream_dwdb_kernel"), std::string::npos);
  // A streamed row takes a whole block, and short rows are not streamed.
  req.config = Config{{{"threads_per_row", 256}, {"rows_per_block", 2}, {"vec", 1}, {"stream", 1}}};
  EXPECT_THROW(compile(req), InvalidArgument);
  req.params = {{"hidden", int64_t(4096)}};
  req.config = Config{{{"threads_per_row", 256}, {"rows_per_block", 1}, {"vec", 8}, {"stream", 1}}};
  EXPECT_THROW(compile(req), InvalidArgument);
}

// The main job without a GPU: one request per op with kernels and dtype, and the everyday call a user
// types (`kspec compile norm_act.fwd --dtype bf16 --param hidden=4096 --param act=silu`) among them,
// with the same kernels, so that call is a cache hit afterwards.
TEST(Compile, QuickPlanIsOneTypicalCallPerOpAndDtype) {
  auto plan = quick_plan({"sm_90"});
  std::map<std::pair<std::string, std::string>, int> per_op_dtype;
  for (const auto& r : plan) {
    per_op_dtype[{r.op, dtype_short(r.dtype)}]++;
    EXPECT_FALSE(r.config.has_value()) << r.op;  // dispatch's own choice, as `kspec compile` makes it
    EXPECT_EQ(r.arch, "sm_90");
  }
  for (const auto& [k, n] : per_op_dtype) EXPECT_EQ(n, 1) << k.first << " " << k.second;
  EXPECT_LT(plan.size(), precompile_plan({"sm_90"}).size() / 10);

  CompileRequest typed;
  typed.op = "norm_act.fwd";
  typed.dtype = DType::bf16;
  typed.params = {{"hidden", int64_t(4096)}, {"act", std::string("silu")}};
  auto want = explain_request(typed).kernels;
  ASSERT_FALSE(want.empty());
  bool found = false;
  for (const auto& r : plan) {
    if (r.op != "norm_act.fwd" || r.dtype != DType::bf16) continue;
    auto got = explain_request(r).kernels;
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].key, want[i].key);
    found = true;
  }
  EXPECT_TRUE(found);
  EXPECT_EQ(quick_plan({"sm_80", "sm_90"}, {"norm_act.bwd"}).size(), 6u);  // 2 archs x 3 dtypes
}

// CI's sm_80 sweep: every case (the representative ones where an op marks them; never the large) x dtype of each op with kernels, with dispatch's own config for the
// case's whole call (full dims), once per distinct kernel set; each case's call is then a cache hit.
TEST(Compile, DefaultsPlanIsEveryCaseDefaultOnce) {
  auto plan = defaults_plan({"sm_80"}, {"norm_act.fwd", "selective_scan.fwd"});
  std::set<std::string> ops, sigs;
  for (const auto& r : plan) {
    EXPECT_FALSE(r.config.has_value()) << r.op;
    EXPECT_EQ(r.arch, "sm_80");
    ops.insert(r.op);
    std::string sig;
    for (const auto& k : explain_request(r).kernels) sig += k.key;
    EXPECT_TRUE(sigs.insert(sig).second) << r.op << ": two requests for one kernel set";
  }
  EXPECT_EQ(ops, (std::set<std::string>{"norm_act.fwd", "selective_scan.fwd"}));
  // Every case's call is covered: its kernels are some request's kernels.
  const OpDef& op = Registry::global().get("norm_act.fwd");
  const bool any_rep = std::any_of(op.cases.begin(), op.cases.end(), [](const Case& c) { return c.representative; });
  for (const Case& cs : op.cases) {
    if (cs.large || (any_rep && !cs.representative)) continue;
    for (DType dt : op.dtypes) {
      CompileRequest r = kspec::testing::case_compile_request(op, cs, dt, "sm_80");
      for (const auto& [k, v] : cs.dims) r.params.set(k, v);
      std::string sig;
      for (const auto& k : explain_request(r).kernels) sig += k.key;
      EXPECT_TRUE(sigs.count(sig)) << cs.name << " " << dtype_short(dt);
    }
  }
  const auto whole = defaults_plan({"sm_80"});
  EXPECT_LT(whole.size(), precompile_plan({"sm_80"}).size() / 2);
}

TEST(Compile, PrecompilePlanCoversEveryDtypeAndConfig) {
  auto plan = precompile_plan({"sm_90"});
  std::map<std::string, int> per_op;
  std::set<std::string> dtypes, configs;
  for (const auto& r : plan) {
    per_op[r.op]++;
    dtypes.insert(dtype_short(r.dtype));
    ASSERT_TRUE(r.config.has_value());
    configs.insert(r.config->str());
  }
  EXPECT_GT(per_op["norm_act.fwd"], 20);
  EXPECT_GT(per_op["norm_act.bwd"], 20);
  EXPECT_EQ(dtypes.size(), 3u);
  // every vector width and several thread counts appear
  for (const char* v : {"vec=1", "vec=2", "vec=4", "vec=8"})
    EXPECT_TRUE(std::any_of(configs.begin(), configs.end(), [&](const std::string& c) { return c.find(v) != std::string::npos; })) << v;
}

TEST(Params, ParseConfig) {
  Config c = Config::parse("threads_per_row=128,vec=4");
  EXPECT_EQ(c.get("vec"), 4);
  EXPECT_EQ(c.str(), "threads_per_row=128,vec=4");
  EXPECT_THROW(Config::parse("vec"), InvalidArgument);
  EXPECT_THROW(c.get("nope"), InvalidArgument);
  EXPECT_THROW(parse_dtype("float8"), InvalidArgument);
  EXPECT_EQ(parse_dtype("torch.bfloat16"), DType::bf16);
}

// A named choice on a tuning axis (OpInfo::tuning_names): read by name or number, written by name; other
// axes and ops unchanged.
TEST(Params, NamedChoicesOfATuningAxis) {
  const OpInfo& fwd = op_info("selective_scan.fwd");
  const std::string named = "algo=tile,warps=6,items=4,lanes=1,chunk=32,segs=1";
  Config c = Config::parse(named, fwd);
  EXPECT_EQ(c.get("algo"), 2);
  EXPECT_EQ(c.str(), "algo=2,warps=6,items=4,lanes=1,chunk=32,segs=1");  // plan keys stay numeric
  EXPECT_EQ(c.str(fwd), named);
  // The numbers configs held before the names (forced configs, scripts) still read.
  EXPECT_EQ(Config::parse("algo=2,warps=6,items=4,lanes=1,chunk=32,segs=1", fwd).str(fwd), named);
  EXPECT_EQ(Config::parse("algo=warp", fwd).get("algo"), 0);
  EXPECT_EQ(Config::parse("algo=sequential", fwd).get("algo"), 1);
  // The backward has no tile or wide kernel: its names are the first two.
  EXPECT_EQ(Config::parse("algo=wide", fwd).get("algo"), 3);
  EXPECT_THROW(Config::parse("algo=wide", op_info("selective_scan.bwd")), InvalidArgument);
  EXPECT_THROW(Config::parse("algo=tile", op_info("selective_scan.bwd")), InvalidArgument);
  try {
    Config::parse("algo=fast,warps=4", fwd);
    ADD_FAILURE() << "an unknown name was read";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'algo=fast': algo is one of warp, sequential, tile, wide"), std::string::npos)
        << e.what();
  }
  // Without the op, or on an op without names, a word is not a value.
  EXPECT_THROW(Config::parse("algo=tile"), InvalidArgument);
  EXPECT_THROW(Config::parse("vec=wide", op_info("norm_act.fwd")), InvalidArgument);
  EXPECT_EQ(Config::parse("vec=4", op_info("norm_act.fwd")).str(op_info("norm_act.fwd")), "vec=4");
  // The op's description lists the names.
  EXPECT_NE(describe_op("selective_scan.fwd").find("algo{warp,sequential,tile,wide}"), std::string::npos)
      << describe_op("selective_scan.fwd");
}

// ---- gemm: a library op (cuBLASLt) validated like every other op, without a GPU ----

namespace {
void expect_gemm_invalid(const std::vector<TensorView>& in, const std::vector<TensorView>& out, const Params& p,
                         std::vector<std::string> fragments, const char* op = "gemm") {
  try {
    call(op, in, out, p);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
  }
}
}  // namespace

TEST(Validation, GemmStridesAndEpilogues) {
  TensorView x(fake(), DType::bf16, {8, 64}, 0), w(fake(1 << 20), DType::bf16, {32, 64}, 0);
  TensorView b(fake(2 << 20), DType::bf16, {32}, 0), y(fake(3 << 20), DType::bf16, {8, 32}, 0);
  TensorView aux(fake(4 << 20), DType::bf16, {8, 32}, 0);
  // x with no unit-stride dim
  expect_gemm_invalid({TensorView::strided(fake(), DType::bf16, {8, 64}, {128, 2}, 0), w, b}, {y, TensorView()}, {},
                      {"gemm", "'x'", "unit-stride"});
  // y transposed: cuBLASLt's D is never transposed
  expect_gemm_invalid({x, w, b}, {TensorView::strided(fake(3 << 20), DType::bf16, {8, 32}, {1, 8}, 0), TensorView()},
                      {}, {"output 'y'", "unit stride"});
  // the saved pre-activation is for gelu only, and needs n % 8 == 0
  expect_gemm_invalid({x, w, b}, {y, aux}, {{"act", std::string("relu")}}, {"'aux'", "gelu"});
  TensorView w7(fake(1 << 20), DType::bf16, {7, 64}, 0), b7(fake(2 << 20), DType::bf16, {7}, 0);
  expect_gemm_invalid({x, w7, b7}, {TensorView(fake(3 << 20), DType::bf16, {8, 7}, 0),
                                    TensorView(fake(4 << 20), DType::bf16, {8, 7}, 0)},
                      {{"act", std::string("gelu")}}, {"multiple of 8"});
  // weight batch dims must be absent or x's
  TensorView x3(fake(), DType::bf16, {3, 8, 64}, 0), w2(fake(1 << 20), DType::bf16, {2, 32, 64}, 0);
  expect_gemm_invalid({x3, w2, b}, {TensorView(fake(3 << 20), DType::bf16, {3, 8, 32}, 0), TensorView()}, {},
                      {"'weight'", "batch dims"});
  expect_gemm_invalid({x, w, b}, {y, TensorView()}, {{"act", std::string("silu")}}, {"parameter 'act'", "gelu"});
  // the backward needs the saved pre-activation with an activation
  expect_gemm_invalid({y, x, w, TensorView()}, {x, w, TensorView()}, {{"act", std::string("gelu")}},
                      {"gemm.bwd", "'saved'"}, "gemm.bwd");
}

TEST(Registry, LibraryOpsCompileNothingAndPrecompileSkipsThem) {
  CompileRequest req;
  req.op = "gemm";
  req.dtype = DType::bf16;
  req.params = {{"m", int64_t(8)}, {"n", int64_t(8)}, {"k", int64_t(8)}};
  EXPECT_TRUE(compile(req).empty());
  // gemm's one kernel of its own: relu + bias in 16-bit types fill y with the bias (cuBLASLt's C)
  bool fill = false;
  for (const auto& r : precompile_plan({"sm_90"})) {
    if (r.op != "gemm") continue;
    const ParamValue* act = r.params.find("act");
    ASSERT_NE(act, nullptr);
    EXPECT_EQ(std::get<std::string>(*act), "relu");
    EXPECT_NE(r.dtype, DType::f32);
    fill = true;
  }
  EXPECT_TRUE(fill);
  // gemm.bwd compiles its one elementwise kernel only when there is an activation
  bool bwd_with_act = false;
  for (const auto& r : precompile_plan({"sm_90"}, {"gemm.bwd"})) {
    const ParamValue* act = r.params.find("act");
    ASSERT_NE(act, nullptr);
    EXPECT_NE(std::get<std::string>(*act), "none");
    bwd_with_act = true;
  }
  EXPECT_TRUE(bwd_with_act);
}

// ---- TensorList inputs (adamw) and runtime params ----

TEST(Validation, TensorListsAdamw) {
  std::vector<TensorView> p = {TensorView(fake(0), DType::f32, {4, 3}, 0), TensorView(fake(1 << 20), DType::f32, {5}, 0)};
  std::vector<TensorView> g = {TensorView(fake(2 << 20), DType::f32, {4, 3}, 0), TensorView(fake(3 << 20), DType::f32, {5}, 0)};
  std::vector<TensorView> m = {TensorView(fake(4 << 20), DType::f32, {4, 3}, 0), TensorView(fake(5 << 20), DType::f32, {5}, 0)};
  std::vector<TensorView> v = {TensorView(fake(6 << 20), DType::f32, {4, 3}, 0), TensorView(fake(7 << 20), DType::f32, {5}, 0)};
  auto L = [](const std::vector<TensorView>& x) { return TensorView::list(x.data(), static_cast<int64_t>(x.size())); };
  auto expect = [&](const std::vector<TensorView>& in, const Params& prm, std::vector<std::string> frags) {
    try {
      call("adamw", in, {TensorView(), TensorView()}, prm);
      ADD_FAILURE() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      for (const auto& f : frags) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
    }
  };
  const TensorView none;
  // a list where one tensor is expected, and one tensor where a list is
  expect({p[0], L(g), L(m), L(v), none, none, none}, {}, {"input 'params'", "list of tensors"});
  // shapes per index
  auto g2 = g;
  g2[1] = TensorView(fake(3 << 20), DType::f32, {6}, 0);
  expect({L(p), L(g2), L(m), L(v), none, none, none}, {}, {"input 'grads'[1]", "shape", "'params'[1]"});
  // lengths
  auto g3 = g;
  g3.pop_back();
  expect({L(p), L(g3), L(m), L(v), none, none, none}, {}, {"input 'grads'", "tensors = 1", "tensors = 2"});
  // one dtype per list, fp32 state
  auto g4 = g;
  g4[1].dtype = DType::bf16;
  expect({L(p), L(g4), L(m), L(v), none, none, none}, {}, {"'grads'[1]", "float32", "bfloat16"});
  auto m2 = m;
  for (auto& t : m2) t.dtype = DType::bf16;
  expect({L(p), L(g), L(m2), L(v), none, none, none}, {}, {"'exp_avg'", "float32"});
  // one device, contiguity, element alignment
  auto v2 = v;
  v2[0].device = 1;
  expect({L(p), L(g), L(m), L(v2), none, none, none}, {}, {"'exp_avg_sq'[0]", "cuda:0", "cuda:1"});
  auto p2 = p;
  p2[0] = TensorView::strided(fake(0), DType::f32, {4, 3}, {1, 4}, 0);
  expect({L(p2), L(g), L(m), L(v), none, none, none}, {}, {"'params'[0]", "contiguous"});
  auto p3 = p;
  p3[1].data = fake(2);
  expect({L(p3), L(g), L(m), L(v), none, none, none}, {}, {"'params'[1]", "aligned"});
  // bf16 params need their fp32 master copy; betas in range
  auto pb = p, gb = g;
  for (auto& t : pb) t.dtype = DType::bf16;
  for (auto& t : gb) t.dtype = DType::bf16;
  expect({L(pb), L(gb), L(m), L(v), none, none, none}, {}, {"'master'"});
  expect({L(p), L(g), L(m), L(v), none, none, none}, {{"beta2", 1.0}}, {"betas"});
}

TEST(Registry, RuntimeParamsStayOutOfTheSignature) {
  CompileRequest req;
  req.op = "adamw";
  req.params = {{"lr", 0.1}, {"step", int64_t(7)}};
  Problem a = problem_from_request(Registry::global().get("adamw"), req);
  req.params = {{"lr", 0.2}, {"step", int64_t(8)}, {"max_norm", 1.0}};
  Problem b = problem_from_request(Registry::global().get("adamw"), req);
  EXPECT_EQ(a.signature(), b.signature());
  req.params = {{"maximize", true}};
  EXPECT_NE(a.signature(), problem_from_request(Registry::global().get("adamw"), req).signature());
}

// ---- the AdamW float64 reference (the C++ twin of python/kspec/reference/adamw.py) ----

TEST(AdamwReference, FirstStepClippingAndSkippedStep) {
  std::vector<std::vector<double>> p = {{1.0, -2.0, 0.5}, {3.0}}, g = {{0.3, -0.4, 0.0}, {1.2}};
  std::vector<std::vector<double>> m = {{0, 0, 0}, {0}}, v = m, vmax = m;
  auto p0 = p;
  ref::AdamwRefOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  auto r = ref::adamw_ref(p, g, m, v, &vmax, o);
  EXPECT_FALSE(r.found_inf);
  EXPECT_NEAR(r.grad_norm, std::sqrt(0.09 + 0.16 + 1.44), 1e-15);
  for (size_t t = 0; t < p.size(); ++t)
    for (size_t i = 0; i < p[t].size(); ++i)  // step 1: m̂ = g, v̂ = g²
      EXPECT_NEAR(p[t][i], p0[t][i] * (1 - 1e-3) - 1e-2 * g[t][i] / (std::fabs(g[t][i]) + 1e-8), 1e-15);
  // grad scale 4 and clipping to 0.5: the first moment holds (1 - beta1) * g / 4 * coef
  std::vector<std::vector<double>> g4 = {{1.2, -1.6, 0.0}, {4.8}}, m2 = {{0, 0, 0}, {0}}, v2 = m2;
  o.grad_scale = 4.0;
  o.max_norm = 0.5;
  r = ref::adamw_ref(p, g4, m2, v2, nullptr, o);
  double coef = 0.5 / (std::sqrt(1.69) + 1e-6);
  EXPECT_NEAR(m2[1][0], 0.1 * 1.2 * coef, 1e-15);
  g4[0][2] = INFINITY;
  auto before = p;
  EXPECT_TRUE(ref::adamw_ref(p, g4, m2, v2, nullptr, o).found_inf);
  EXPECT_EQ(p, before);
}

// Several configs on one draw of inputs: one row each, in the order given, each naming its config. With a
// GPU they run and pass; without one each row says why it did not run.
TEST(Check, SeveralConfigsOneRowEachInOrder) {
  CheckOptions o;
  o.case_name = "hidden_33";
  o.dtypes = {DType::f32};
  o.configs = configs_for_case("norm_act.fwd", "hidden_33", DType::f32);
  ASSERT_GE(o.configs.size(), 2u);
  auto rows = check_op("norm_act.fwd", o);
  ASSERT_EQ(rows.size(), o.configs.size());
  for (size_t k = 0; k < rows.size(); ++k) {
    EXPECT_EQ(rows[k].config, o.configs[k].str());
    EXPECT_EQ(rows[k].case_name, "hidden_33");
    EXPECT_EQ(rows[k].seed, rows[0].seed);  // the same inputs
    if (kspec::testing::gpu_available()) {
      EXPECT_TRUE(rows[k].passed) << rows[k].config << ": " << rows[k].message;
      EXPECT_FALSE(rows[k].errors.empty());
    } else {
      EXPECT_FALSE(rows[k].passed);
      EXPECT_NE(rows[k].message.find("(seed "), std::string::npos) << rows[k].message;
    }
  }
}
