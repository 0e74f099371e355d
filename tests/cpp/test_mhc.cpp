// mhc without a GPU: the schema ([T, n, D] and [B, S, n, D] tokens, pre_only), the messages for bad
// input (each names the argument), and the base and n = 8 cases of every op compiling for sm_90
// without spills. On a GPU: a layer (pre, identity sublayer, post) forward and backward on [B, S, n, D]
// views with padded rows against the float64 reference, and pre.bwd giving the same bits three times.
// mhc.post_pre (post fused with the next pre): its schema and messages; on a GPU, the fused ops against
// post then pre of the reference at the named shapes.
// (GpuEveryOp.EveryCaseEveryDtypeMatchesReference runs the case tables against the reference.)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <random>
#include <tuple>

#include "api/src/op.h"
#include "device_buffer_test_util.h"
#include "jit/driver.h"
#include "jit/handles.h"
#include "kspec/kspec.h"
#include "mhc/reference.h"
#include "mhc_test_util.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::fake;
using kspec::testing::max_rel;
using kspec::testing::mhc_request;
using kspec::testing::message_of;
using kspec::testing::PreArgs;
using kspec::testing::randn;
using kspec::testing::to_double;
using kspec::testing::view;

namespace {

void expect_message(const std::string& op, const std::vector<TensorView>& in, const Params& params,
                    std::initializer_list<const char*> fragments) {
  const std::string msg = message_of([&] { infer_outputs(op, in, params); });
  ASSERT_FALSE(msg.empty()) << op << ": no error";
  for (const char* f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
}

// The tensor-core algos' config: algo, 128 threads, tokens a block.
Config mma_config(int64_t algo, int64_t tokens) {
  return Config{{{"algo", algo}, {"threads", 128}, {"tokens", tokens}}};
}

// c is refused for q's problem, with a reason naming `because`.
void expect_refused(const OpDef& op, const CompileRequest& q, const Config& c, const char* because) {
  std::string why;
  EXPECT_FALSE(op.tuning.valid(problem_from_request(op, q), c, &why))
      << q.op << " " << dtype_short(q.dtype) << " " << q.arch << " " << c.str() << ": not refused (" << because << ")";
  EXPECT_NE(why.find(because), std::string::npos) << why;
}

// A row of a compile table: op at n, D in dt, `tokens` a block.
struct MmaRow {
  const char* op;
  DType dt;
  int64_t n, D, tokens;
  bool bare = false;  // without gamma and dx_post
};

// Every row's mma_config(algo, tokens) is valid for sm_80 and sm_90, and every kernel of its plan
// (`plan_kernels` of them, where given) compiles there without spills or a stack frame; `counted` kernels in
// all whose name holds `counted_name` ("": every kernel), their registers and shared memory printed.
void expect_mma_rows_compile(int64_t algo, const std::vector<MmaRow>& rows, int counted,
                             const char* counted_name = "", size_t plan_kernels = 0) {
  int compiled = 0;
  for (const char* arch : {"sm_80", "sm_90"})
    for (const MmaRow& row : rows) {
      const OpDef& op = Registry::global().get(row.op);
      CompileRequest q = mhc_request(row.op, row.n, row.D, row.dt, arch);
      if (row.bare) q.without = {"gamma", "dx_post"};
      q.config = mma_config(algo, row.tokens);
      const std::string what = std::string(arch) + " " + row.op + " " + dtype_short(row.dt) + " n " +
                               std::to_string(row.n) + " D " + std::to_string(row.D) + " " + q.config->str() +
                               (row.bare ? " (no gamma, dx_post)" : "");
      std::string why;
      ASSERT_TRUE(op.tuning.valid(problem_from_request(op, q), *q.config, &why)) << what << ": " << why;
      const auto reports = compile(q);
      if (plan_kernels) {
        ASSERT_EQ(reports.size(), plan_kernels) << what;
      }
      for (const auto& rep : reports) {
        EXPECT_EQ(rep.spill_bytes, 0) << what << ": " << rep.kernel;
        EXPECT_EQ(rep.stack_bytes, 0) << what << ": " << rep.kernel;
        if (rep.kernel.find(counted_name) == std::string::npos) continue;
        std::cout << what << " " << rep.kernel << ": " << rep.registers << " registers, " << rep.shared_bytes
                  << " bytes of shared memory\n";
        ++compiled;
      }
    }
  EXPECT_EQ(compiled, counted);
}

}  // namespace

TEST(Mhc, InferOutputsForTokensAndBatchSequenceLayouts) {
  for (const auto& lead : {std::vector<int64_t>{15}, std::vector<int64_t>{3, 5}}) {
    PreArgs a;
    a.lead = lead;
    auto outs = infer_outputs("mhc.pre.fwd", a.inputs());
    ASSERT_EQ(outs.size(), 6u);  // y, h_pre, h_post, r, inv, h
    auto with = [&](std::vector<int64_t> rest) {
      std::vector<int64_t> s = lead;
      s.insert(s.end(), rest.begin(), rest.end());
      return s;
    };
    EXPECT_EQ(outs[0].shape, with({40}));
    EXPECT_EQ(outs[0].dtype, DType::bf16);
    EXPECT_EQ(outs[1].shape, with({4}));
    EXPECT_EQ(outs[2].shape, with({4}));
    EXPECT_EQ(outs[3].shape, with({4, 4}));
    EXPECT_EQ(outs[4].shape, with({}));
    EXPECT_EQ(outs[5].shape, with({24}));
    for (size_t i = 1; i < outs.size(); ++i) EXPECT_EQ(outs[i].dtype, DType::f32);
  }
  PreArgs po;
  po.M = 4;
  po.A = 1;
  auto outs = infer_outputs("mhc.pre_only.fwd", po.inputs());
  ASSERT_EQ(outs.size(), 4u);  // y, h_pre, inv, h
  EXPECT_EQ(outs[3].shape, (std::vector<int64_t>{3, 5, 4}));
  // post: out like x.
  std::vector<TensorView> post = {TensorView(fake(), DType::f16, {2, 7, 3, 33}, 0),
                                  TensorView(fake(1 << 28), DType::f16, {2, 7, 33}, 0),
                                  TensorView(fake(2 << 28), DType::f32, {2, 7, 3}, 0),
                                  TensorView(fake(3 << 28), DType::f32, {2, 7, 3, 3}, 0)};
  auto pout = infer_outputs("mhc.post.fwd", post);
  ASSERT_EQ(pout.size(), 1u);
  EXPECT_EQ(pout[0].shape, (std::vector<int64_t>{2, 7, 3, 33}));
  EXPECT_EQ(pout[0].dtype, DType::f16);
}

TEST(Mhc, BadInputNamesTheArgument) {
  const std::string op = "mhc.pre.fwd";
  {
    PreArgs a;
    a.M = 23;
    expect_message(op, a.inputs(), {}, {"input 'phi'", "M = n*n + 2n = 24", "got M = 23"});
  }
  {
    PreArgs a;
    a.G = 0;
    auto in = a.inputs();
    in[1] = TensorView(fake(1 << 28), DType::f32, {24, 161}, 0);
    expect_message(op, in, {}, {"input 'phi'", "nD = n * D = 160", "got nD = 161"});
  }
  {
    PreArgs a;
    a.A = 2;
    expect_message(op, a.inputs(), {}, {"input 'alpha'", "expected [3]", "got [2]"});
  }
  {
    PreArgs a;
    auto in = a.inputs();
    in[3] = TensorView(fake(3 << 28), DType::f32, {25}, 0);
    expect_message(op, in, {}, {"input 'bias'", "M = 25", "M = 24"});
  }
  {
    PreArgs a;
    a.G = 159;
    expect_message(op, a.inputs(), {}, {"input 'gamma'", "nD = 159", "nD = 160"});
  }
  {
    PreArgs a;
    a.n = 9;
    a.M = 99;
    a.G = 0;
    expect_message(op, a.inputs(), {}, {"dim 'n'", "9"});
  }
  {
    PreArgs a;
    expect_message(op, a.inputs(), {{"t_max", int64_t(0)}}, {"t_max"});
    expect_message(op, a.inputs(), {{"t_max", int64_t(65)}}, {"t_max"});
    expect_message(op, a.inputs(), {{"eps_sk", -1e-6}}, {"eps_sk"});
    expect_message(op, a.inputs(), {{"eps_rms", -1.0}}, {"eps_rms"});
  }
  {
    PreArgs a;
    auto in = a.inputs();
    in[0].device = kCpuDevice;
    expect_message(op, in, {}, {"input 'x'", "CUDA tensor"});
  }
  {
    PreArgs a;
    auto in = a.inputs();
    in[0] = TensorView::strided(fake(), DType::bf16, {15, 4, 40}, {160, 1, 4}, 0);
    expect_message(op, in, {}, {"input 'x'", "last dim to be contiguous"});
  }
  {
    PreArgs a;
    auto in = a.inputs();
    in[1] = TensorView(fake(1 << 28), DType::bf16, {24, 160}, 0);
    expect_message(op, in, {}, {"input 'phi'", "float32", "bfloat16"});
  }
  // Mismatched tokens and dtypes between the post op's arguments.
  std::vector<TensorView> post = {TensorView(fake(), DType::bf16, {14, 4, 40}, 0),
                                  TensorView(fake(1 << 28), DType::bf16, {15, 40}, 0),
                                  TensorView(fake(2 << 28), DType::f32, {14, 4}, 0),
                                  TensorView(fake(3 << 28), DType::f32, {14, 4, 4}, 0)};
  expect_message("mhc.post.fwd", post, {}, {"input 'f'", "T = 15", "T = 14"});
  post[1] = TensorView(fake(1 << 28), DType::f16, {14, 40}, 0);
  expect_message("mhc.post.fwd", post, {}, {"input 'f'", "bfloat16", "float16"});
  post[1] = TensorView(fake(1 << 28), DType::bf16, {14, 40}, 0);
  post[3] = TensorView(fake(3 << 28), DType::f32, {14, 4, 3}, 0);
  expect_message("mhc.post.fwd", post, {}, {"input 'h_res'", "n = 3", "n = 4"});
  // pre_only: M = n and alpha [1].
  PreArgs po;
  expect_message("mhc.pre_only.fwd", po.inputs(), {}, {"input 'phi'", "M = n = 4", "got M = 24"});
}

// The base and n = 8 (most registers) cases of every op compile for sm_90 in bf16 with the heuristic's
// config, without spills or a stack frame (`kspec precompile --all` compiles every config of the
// representative cases in every dtype).
TEST(Mhc, BaseAndWidestCasesCompileWithoutSpills) {
  int compiled = 0;
  for (const auto& name : list_ops()) {
    const OpDef& op = Registry::global().get(name);
    if (op.info.family != "mhc") continue;
    for (const auto& cs : op.cases) {
      if (cs.name != "base" && cs.name != "n_8") continue;
      CompileRequest r;
      r.op = name;
      r.dtype = op.dtypes.size() > 1 ? DType::bf16 : op.dtypes.front();
      r.arch = "sm_90";
      r.without = cs.without;
      for (const auto& [k, v] : cs.params.items()) r.params.set(k, v);
      for (const auto& [k, v] : cs.dims)
        if (k != "T") r.params.set(k, v);
      auto reports = compile(r);
      ASSERT_FALSE(reports.empty()) << name << " " << cs.name;
      for (const auto& rep : reports) {
        EXPECT_EQ(rep.spill_bytes, 0) << name << " " << cs.name << ": " << rep.kernel;
        EXPECT_EQ(rep.stack_bytes, 0) << name << " " << cs.name << ": " << rep.kernel;
        ++compiled;
      }
    }
  }
  EXPECT_GE(compiled, 16);
}

// The backward on tensor cores is the heuristic's choice for 16-bit x from sm_80 on: algo=mma_fused at 32
// tokens where M <= 24 (16 at n 3, its rule; H100 run 20: pre fwd+bwd 2056 us against 2543 with mma_tokens,
// 3718 with algo=mma), algo=mma_tokens past that (n 5: 16 tokens), algo=mma where mma_tokens has no tile
// (n 8), with the SIMT heuristic's threads and tokens (1 at n 8, whose token kernel spilled at 4 tokens on
// pre_only without the dx pass); algo=simt for fp32 x and below sm_80, where both are refused by name. The
// mma algos swap the columns kernel and move dx to its own kernel; mma_tokens runs the token pass on tensor
// cores too; mma_fused then does dx and the columns in one kernel, mma_fused_warp_heads (the default where M <= 24)
// with the token pass's heads per warp (post_pre.bwd has no such axis: SIMT).
TEST(Mhc, PreBackwardTakesTensorCoresFromSm80) {
  struct Row {
    const char* op;
    DType dt;
    const char* arch;
    int64_t n, algo, tokens;
  };
  // nD = n x 4096 >= 12288 with M <= 24: mma_slice_du1_nb (10; run 35).
  for (const Row& row : {Row{"mhc.pre.bwd", DType::bf16, "sm_90", 4, 10, 32}, Row{"mhc.pre.bwd", DType::f16, "sm_80", 4, 10, 32},
                         Row{"mhc.pre.bwd", DType::bf16, "sm_90", 3, 10, 16}, Row{"mhc.pre.bwd", DType::bf16, "sm_90", 5, 2, 16},
                         Row{"mhc.pre.bwd", DType::bf16, "sm_90", 8, 1, 1},
                         Row{"mhc.pre_only.bwd", DType::bf16, "sm_90", 4, 10, 32},
                         Row{"mhc.pre.bwd", DType::f32, "sm_90", 4, 0, 4}, Row{"mhc.pre.bwd", DType::bf16, "sm_75", 4, 0, 4},
                         Row{"mhc.pre_only.bwd", DType::f32, "sm_90", 4, 0, 4}}) {
    const OpDef& op = Registry::global().get(row.op);
    CompileRequest r = mhc_request(row.op, row.n, 4096, row.dt, row.arch);
    const Problem p = problem_from_request(op, r);
    const Config h = op.tuning.heuristic(p);
    EXPECT_EQ(h.get("algo"), row.algo) << row.op << " " << row.arch << " n " << row.n;
    EXPECT_EQ(h.get("tokens"), row.tokens) << row.op << " " << row.arch << " n " << row.n;
    EXPECT_TRUE(op.tuning.valid(p, h, nullptr)) << h.str();
    const auto kernels = op.kernels(p, h);
    ASSERT_EQ(kernels.size(), row.algo == 1 || row.algo == 2 ? 4u : 3u);
    EXPECT_EQ(kernels[1].kernel, row.algo >= 8   ? "kspec::mhc_pre_bwd_slice_mma_kernel"
                                 : row.algo >= 3 ? "kspec::mhc_pre_bwd_fused_mma_kernel"
                                 : row.algo >= 1 ? "kspec::mhc_pre_bwd_columns_mma_kernel"
                                                 : "kspec::mhc_pre_bwd_columns_kernel");
    if (row.algo >= 3) {
      EXPECT_EQ(kernels[0].kernel, "kspec::mhc_pre_bwd_token_mma_kernel");
      EXPECT_EQ(kernels[0].targs.back(), row.algo >= 4 ? "true" : "false");  // the heads per warp
      EXPECT_EQ(kernels[2].kernel, "kspec::mhc_pre_bwd_reduce_kernel");
    } else if (row.algo == 2) {
      EXPECT_EQ(kernels[0].kernel, "kspec::mhc_pre_bwd_token_mma_kernel");
      EXPECT_EQ(kernels[3].kernel, "kspec::mhc_pre_bwd_dx_mma_kernel");
    } else if (row.algo == 1) {
      EXPECT_EQ(kernels[0].kernel, "kspec::mhc_pre_bwd_token_kernel");
      EXPECT_EQ(kernels[0].targs.back(), "false");  // no dx pass: kernel 3 writes dx
      EXPECT_EQ(kernels[3].kernel, "kspec::mhc_pre_bwd_dx_mma_kernel");
      if (std::string(row.op) == "mhc.pre_only.bwd") {
        Config four = h;
        for (auto& [axis, v] : four.values)
          if (axis == "tokens") v = 4;
        std::string why;
        EXPECT_FALSE(op.tuning.valid(p, four, &why)) << four.str();
        EXPECT_NE(why.find("1 token a block"), std::string::npos) << why;
      }
    } else {
      Config mma = h;
      for (auto& [axis, v] : mma.values)
        if (axis == "algo") v = 1;
      std::string why;
      EXPECT_FALSE(op.tuning.valid(p, mma, &why)) << row.op << " " << row.arch;
      EXPECT_NE(why.find(row.dt == DType::f32 ? "float32 x" : "sm_80"), std::string::npos) << why;
    }
  }
  // post_pre.bwd: no algo axis, the SIMT kernels.
  {
    const OpDef& op = Registry::global().get("mhc.post_pre.bwd");
    CompileRequest r = mhc_request("mhc.post_pre.bwd", 4, 4096);
    const Problem p = problem_from_request(op, r);
    EXPECT_EQ(op.kernels(p, op.tuning.heuristic(p))[1].kernel, "kspec::mhc_pre_bwd_columns_kernel");
  }
  // The mma columns and dx kernels without spills on sm_80 and sm_90: 8 columns a lane (n = 4, 16-byte
  // loads, 32 tokens for dx; n = 6, the most m16 tiles at 8), 4 (n = 8), element loads (D = 33), pre_only
  // at n = 1.
  int compiled = 0;
  for (const char* arch : {"sm_80", "sm_90"})
    for (auto [name, dt, n, D] : {std::tuple{"mhc.pre.bwd", DType::bf16, 4, 4096}, std::tuple{"mhc.pre.bwd", DType::f16, 6, 64},
                                  std::tuple{"mhc.pre.bwd", DType::bf16, 8, 128}, std::tuple{"mhc.pre.bwd", DType::f16, 3, 33},
                                  std::tuple{"mhc.pre_only.bwd", DType::bf16, 1, 50}}) {
      const OpDef& op = Registry::global().get(name);
      CompileRequest q = mhc_request(name, n, D, dt, arch);
      // algo=mma at the most tokens it takes here (4, or 1: pre_only, n = 8), 128 threads
      const Problem pq = problem_from_request(op, q);
      Config c;
      for (int64_t tok : {4, 1}) {
        c = Config{{{"algo", 1}, {"threads", 128}, {"tokens", tok}}};
        if (op.tuning.valid(pq, c, nullptr)) break;
      }
      ASSERT_TRUE(op.tuning.valid(pq, c, nullptr)) << name << " n " << n;
      q.config = c;
      for (const auto& rep : compile(q)) {
        if (rep.kernel.find("_mma_kernel") == std::string::npos) continue;
        EXPECT_EQ(rep.spill_bytes, 0) << arch << " " << rep.kernel;
        EXPECT_EQ(rep.stack_bytes, 0) << arch << " " << rep.kernel;
        std::cout << arch << " " << rep.kernel << ": " << rep.registers << " registers\n";
        ++compiled;
      }
    }
  EXPECT_EQ(compiled, 20);  // the columns and dx kernels
}

// algo=mma_tokens (2): the token pass on tensor cores too (mhc_pre_bwd_token_mma.cuh), 128 threads and
// whole m16 tiles of tokens, x in 16-byte groups; the rules name what rules a config out (a lane's
// n x tokens / 16 rows of x, element loads, fp32 x, below sm_80); every kernel of its plan compiles without
// spills on sm_80 and sm_90 at the largest legal tile of each shape: n = 4 (32 tokens), n = 2 (64), n = 7
// and n = 6 (16, the most accumulator tiles), n = 3 (16), pre_only at n = 1 (64) and n = 8 (16).
TEST(Mhc, PreBackwardMmaTokensRulesAndCompileWithoutSpills) {
  const OpDef& op = Registry::global().get("mhc.pre.bwd");
  const CompileRequest r = mhc_request("mhc.pre.bwd", 4, 4096);
  const Problem p = problem_from_request(op, r);
  const Config ok = mma_config(2, 32);
  EXPECT_TRUE(op.tuning.valid(p, ok, nullptr));
  const auto kernels = op.kernels(p, ok);
  ASSERT_EQ(kernels.size(), 4u);
  EXPECT_EQ(kernels[0].kernel, "kspec::mhc_pre_bwd_token_mma_kernel");
  EXPECT_EQ(kernels[1].kernel, "kspec::mhc_pre_bwd_columns_mma_kernel");
  EXPECT_EQ(kernels[3].kernel, "kspec::mhc_pre_bwd_dx_mma_kernel");
  for (const auto& [config, fragment] : std::vector<std::pair<Config, const char*>>{
           {mma_config(2, 64), "n x tokens / 16"},
           {mma_config(2, 4), "m16 tiles"},
           {Config{{{"algo", 2}, {"threads", 256}, {"tokens", 32}}}, "128 threads"},
           {mma_config(1, 32), "1 or 4 tokens"},
           {mma_config(0, 16), "1 or 4 tokens"}})
    expect_refused(op, r, config, fragment);
  expect_refused(op, mhc_request("mhc.pre.bwd", 4, 4096, DType::f32), ok, "float32 x");
  expect_refused(op, mhc_request("mhc.pre.bwd", 4, 4096, DType::bf16, "sm_75"), ok, "sm_80");
  // D % 8 != 0: no 16-byte groups, no algo=mma_tokens; n = 8: no tile fits.
  for (const auto& [n, D, tokens, fragment] :
       {std::tuple{2, 100, 16, "16-byte groups"}, std::tuple{3, 33, 16, "16-byte groups"},
        std::tuple{8, 128, 16, "accumulator tiles above 16"}, std::tuple{3, 256, 32, "n = 3 takes 16"}})
    expect_refused(op, mhc_request("mhc.pre.bwd", n, D), mma_config(2, tokens), fragment);
  expect_mma_rows_compile(2,
                          {{"mhc.pre.bwd", DType::bf16, 4, 4096, 32}, {"mhc.pre.bwd", DType::f16, 2, 256, 64},
                           {"mhc.pre.bwd", DType::bf16, 7, 128, 16}, {"mhc.pre.bwd", DType::f16, 6, 64, 16},
                           {"mhc.pre.bwd", DType::f16, 3, 256, 16}, {"mhc.pre_only.bwd", DType::bf16, 1, 64, 64},
                           {"mhc.pre_only.bwd", DType::f16, 8, 128, 16}},
                          14, "token_mma", 4);  // plans of 4 kernels, the token kernel counted
}

// pre.fwd's algo=mma_warp_heads (2): the mma projection, then each warp runs its own tokens' heads (the
// Sinkhorn-Knopp iterates by shuffles) and their y; at most 32 projection rows (n <= 4, pre_only any n),
// refused by name past that; the heuristic's; with the split plan for few tokens beside it; every kernel
// compiles without spills on sm_80 and sm_90 at 64, 32 and 16 tokens, n 4, 3 (element loads) and pre_only n 8.
TEST(Mhc, PreForwardMmaWarpHeadsRulesAndCompileWithoutSpills) {
  const OpDef& op = Registry::global().get("mhc.pre.fwd");
  const CompileRequest r = mhc_request("mhc.pre.fwd", 4, 4096);
  const Problem p = problem_from_request(op, r);
  const Config ok = mma_config(2, 32);
  std::string why;
  EXPECT_TRUE(op.tuning.valid(p, ok, &why)) << why;
  EXPECT_EQ(op.tuning.heuristic(p).get("algo"), 3);  // mma_ring (H100 run 25: 497 us against 521 at 64 tokens)
  const auto kernels = op.kernels(p, ok);
  // The tile's kernel, then the split plan's two (taken by the launcher for T <= 256): projection partials
  // over 64 groups of columns at 16 tokens, then their sum, the heads and y; then the decode kernel (one launch,
  // taken for T <= 16: the rows variant).
  ASSERT_EQ(kernels.size(), 4u);
  EXPECT_EQ(kernels[3].kernel, "kspec::mhc_pre_fwd_decode_kernel");
  EXPECT_EQ(kernels[0].targs.back(), "true");
  EXPECT_EQ(kernels[1].kernel, "kspec::mhc_pre_fwd_mma_kernel");
  EXPECT_EQ(kernels[1].targs[6], "16");
  EXPECT_EQ(kernels[1].targs[8], "64");
  EXPECT_EQ(kernels[2].kernel, "kspec::mhc_pre_fwd_split_heads_kernel");
  EXPECT_EQ(kernels[0].targs[8], "1");
  const auto mma = op.kernels(p, mma_config(1, 32));
  ASSERT_EQ(mma.size(), 1u);
  EXPECT_EQ(mma[0].targs.back(), "false");
  expect_refused(op, mhc_request("mhc.pre.fwd", 5, 256), mma_config(2, 16), "32 projection rows");
  expect_refused(op, mhc_request("mhc.pre.fwd", 4, 4096, DType::f32), ok, "float32 x");
  expect_mma_rows_compile(2,
                          {{"mhc.pre.fwd", DType::bf16, 4, 4096, 64}, {"mhc.pre.fwd", DType::bf16, 4, 4096, 32},
                           {"mhc.pre.fwd", DType::f16, 3, 33, 32}, {"mhc.pre_only.fwd", DType::f16, 8, 128, 16}},
                          32);  // four kernels each
}

// pre.bwd's algo=mma_fused_ring (5): mma_fused_warp_heads with the token pass's rows through a cp.async ring in
// dynamic shared memory (the token kernel's kRing, its next-to-last template argument; the launch passes the
// ring's bytes); mma_fused's rules; not the heuristic's; the token kernel compiles without spills on sm_80 and
// sm_90 at n 4 (32 tokens), n 2 (64), n 3 (16) and pre_only n 8 (16).
TEST(Mhc, PreBackwardMmaFusedRingRulesAndCompileWithoutSpills) {
  const OpDef& op = Registry::global().get("mhc.pre.bwd");
  const Problem p = problem_from_request(op, mhc_request("mhc.pre.bwd", 4, 4096));
  const Config ok = mma_config(5, 32);
  std::string why;
  EXPECT_TRUE(op.tuning.valid(p, ok, &why)) << why;
  EXPECT_EQ(op.tuning.heuristic(p).get("algo"), 10);  // mma_slice_du1_nb at nD 16384
  const auto kernels = op.kernels(p, ok);
  ASSERT_EQ(kernels.size(), 3u);
  EXPECT_EQ(kernels[0].kernel, "kspec::mhc_pre_bwd_token_mma_kernel");
  EXPECT_EQ(kernels[0].targs[9], "true");   // kRing
  EXPECT_EQ(kernels[0].targs[10], "true");  // kWarpHeads
  EXPECT_EQ(kernels[1].kernel, "kspec::mhc_pre_bwd_fused_mma_kernel");
  EXPECT_EQ(op.kernels(p, mma_config(4, 32))[0].targs[9], "false");
  for (const auto& [n, D, tokens, fragment] :
       {std::tuple{5, 256, 16, "24 projection rows"}, std::tuple{4, 100, 16, "16-byte groups"},
        std::tuple{4, 256, 64, "n x tokens / 16"}})
    expect_refused(op, mhc_request("mhc.pre.bwd", n, D), mma_config(5, tokens), fragment);
  expect_mma_rows_compile(5,
                          {{"mhc.pre.bwd", DType::bf16, 4, 4096, 32}, {"mhc.pre.bwd", DType::f16, 2, 256, 64},
                           {"mhc.pre.bwd", DType::bf16, 3, 264, 16}, {"mhc.pre_only.bwd", DType::f16, 8, 128, 16}},
                          8, "token_mma");
}

// pre.fwd's algo=mma_ring (3): algo=mma_warp_heads with the projection's rows of x through a cp.async ring in
// shared memory (the kernel's kRing, its next-to-last template argument; the split plan for few tokens as
// mma_warp_heads'); refused by name at 64 tokens (the ring's shared memory), without 16-byte groups of x, past
// 32 projection rows and for fp32 x; the heuristic's at 32 tokens (H100, run 25: 497 us against mma_warp_heads
// 64's 521); compiles without spills on sm_80 and sm_90 at 32 and 16 tokens, n 4 and pre_only n 8.
TEST(Mhc, PreForwardMmaRingRulesAndCompileWithoutSpills) {
  const OpDef& op = Registry::global().get("mhc.pre.fwd");
  const CompileRequest r = mhc_request("mhc.pre.fwd", 4, 4096);
  const Problem p = problem_from_request(op, r);
  const Config ok = mma_config(3, 32);
  std::string why;
  EXPECT_TRUE(op.tuning.valid(p, ok, &why)) << why;
  EXPECT_EQ(op.tuning.heuristic(p).str(), ok.str());
  const auto kernels = op.kernels(p, ok);
  ASSERT_EQ(kernels.size(), 4u);  // the tile's, the split plan's two, the decode kernel
  EXPECT_EQ(kernels[0].kernel, "kspec::mhc_pre_fwd_mma_kernel");
  EXPECT_EQ(kernels[0].targs[9], "true");  // kRing
  EXPECT_EQ(kernels[0].targs[10], "true");  // kWarpHeads
  EXPECT_EQ(kernels[1].targs[9], "false");  // the split plan's projection: no ring
  EXPECT_EQ(kernels[2].kernel, "kspec::mhc_pre_fwd_split_heads_kernel");
  EXPECT_EQ(op.kernels(p, mma_config(2, 32))[0].targs[9], "false");
  expect_refused(op, r, mma_config(3, 64), "16 or 32 tokens");
  expect_refused(op, mhc_request("mhc.pre.fwd", 4, 100), ok, "16-byte groups");
  expect_refused(op, mhc_request("mhc.pre.fwd", 5, 256), ok, "32 projection rows");
  expect_refused(op, mhc_request("mhc.pre.fwd", 4, 4096, DType::f32), ok, "float32 x");
  expect_mma_rows_compile(3,
                          {{"mhc.pre.fwd", DType::bf16, 4, 4096, 32}, {"mhc.pre.fwd", DType::f16, 4, 4096, 16},
                           {"mhc.pre_only.fwd", DType::f16, 8, 128, 32}},
                          24);  // four kernels each
}

// mhc.post_pre.fwd's algo axis: the SIMT kernel stays the heuristic's; algo=mma (1) and mma_warp_heads (2)
// project x_next on tensor cores (mhc_post_pre_mma.cuh) at whole m16 tiles with x in 16-byte groups and at
// most 4 rows of x a lane (16 tokens up to n 7), refused by name otherwise; compiles without spills on sm_80
// and sm_90.
TEST(Mhc, PostPreForwardMmaRulesAndCompileWithoutSpills) {
  const OpDef& op = Registry::global().get("mhc.post_pre.fwd");
  const Problem p = problem_from_request(op, mhc_request("mhc.post_pre.fwd", 4, 4096));
  EXPECT_EQ(op.tuning.heuristic(p).get("algo"), 0);
  EXPECT_EQ(op.kernels(p, op.tuning.heuristic(p))[0].kernel, "kspec::mhc_post_pre_fwd_kernel");
  std::string why;
  for (int64_t algo : {1, 2}) {
    const Config ok = mma_config(algo, 16);
    EXPECT_TRUE(op.tuning.valid(p, ok, &why)) << why;
    const auto kernels = op.kernels(p, ok);
    ASSERT_EQ(kernels.size(), 1u);
    EXPECT_EQ(kernels[0].kernel, "kspec::mhc_post_pre_fwd_mma_kernel");
    EXPECT_EQ(kernels[0].targs.back(), algo == 2 ? "true" : "false");
  }
  for (const auto& [n, D, algo, tokens, fragment] :
       {std::tuple{4, 4096, 1, 32, "above 4"}, std::tuple{4, 100, 1, 16, "16-byte groups"},
        std::tuple{5, 128, 2, 16, "32 projection rows"}, std::tuple{8, 128, 1, 16, "above 4"},
        std::tuple{4, 4096, 1, 4, "m16 tiles"}, std::tuple{4, 4096, 0, 16, "1 or 4 tokens"}})
    expect_refused(op, mhc_request("mhc.post_pre.fwd", n, D), mma_config(algo, tokens), fragment);
  const char* post_pre = "mhc.post_pre.fwd";
  expect_mma_rows_compile(1,
                          {{post_pre, DType::bf16, 4, 4096, 16}, {post_pre, DType::f16, 2, 256, 32},
                           {post_pre, DType::f16, 7, 128, 16}},
                          6);
  expect_mma_rows_compile(2, {{post_pre, DType::bf16, 4, 4096, 16}, {post_pre, DType::bf16, 1, 64, 64}}, 4);
}

// algo=mma_fused (3): mma_tokens' token pass, then dx and the sums over tokens in one pass over x
// (mhc_pre_bwd_fused_mma.cuh) instead of the columns and dx kernels (two passes): three kernels, the same
// rules as mma_tokens plus M <= 24 (phi's fragments in registers), refused by name past that; every kernel
// compiles without spills on sm_80 and sm_90, with and without dx_post.
TEST(Mhc, PreBackwardMmaFusedRulesAndCompileWithoutSpills) {
  const OpDef& op = Registry::global().get("mhc.pre.bwd");
  const Problem p = problem_from_request(op, mhc_request("mhc.pre.bwd", 4, 4096));
  const Config ok = mma_config(3, 32);
  std::string why;
  EXPECT_TRUE(op.tuning.valid(p, ok, &why)) << why;
  const auto kernels = op.kernels(p, ok);
  ASSERT_EQ(kernels.size(), 3u);
  EXPECT_EQ(kernels[0].kernel, "kspec::mhc_pre_bwd_token_mma_kernel");
  EXPECT_EQ(kernels[1].kernel, "kspec::mhc_pre_bwd_fused_mma_kernel");
  EXPECT_EQ(kernels[2].kernel, "kspec::mhc_pre_bwd_reduce_kernel");
  EXPECT_EQ(op.tuning.heuristic(p).get("algo"), 10);  // mma_slice_du1_nb at nD 16384 (H200 run 35: 1420 us against 1512)
  // algo=mma_fused_warp_heads (4): the same plan, the token kernel with its heads per warp.
  const Config warp_heads = mma_config(4, 32);
  EXPECT_TRUE(op.tuning.valid(p, warp_heads, &why)) << why;
  EXPECT_EQ(kernels[0].targs.back(), "false");
  EXPECT_EQ(op.kernels(p, warp_heads)[0].targs.back(), "true");
  EXPECT_EQ(op.kernels(p, warp_heads)[1].kernel, "kspec::mhc_pre_bwd_fused_mma_kernel");
  for (const auto& [n, D, tokens, fragment] :
       {std::tuple{5, 256, 16, "24 projection rows"}, std::tuple{4, 100, 16, "16-byte groups"},
        std::tuple{4, 256, 64, "n x tokens / 16"}})
    expect_refused(op, mhc_request("mhc.pre.bwd", n, D), mma_config(3, tokens), fragment);
  expect_refused(op, mhc_request("mhc.pre.bwd", 4, 4096, DType::f32), ok, "float32 x");
  // mma_fused's fused kernel counted, mma_fused_warp_heads' token kernel
  expect_mma_rows_compile(3,
                          {{"mhc.pre.bwd", DType::bf16, 4, 4096, 32}, {"mhc.pre.bwd", DType::bf16, 4, 4096, 32, true},
                           {"mhc.pre.bwd", DType::f16, 2, 256, 64}, {"mhc.pre.bwd", DType::bf16, 3, 264, 16},
                           {"mhc.pre_only.bwd", DType::f16, 8, 128, 16}},
                          10, "fused");
  expect_mma_rows_compile(4,
                          {{"mhc.pre.bwd", DType::bf16, 4, 4096, 32}, {"mhc.pre.bwd", DType::f16, 2, 256, 64},
                           {"mhc.pre_only.bwd", DType::f16, 8, 128, 16}},
                          6, "token_mma");
}

// post's `vec` axis: 8 consecutive d a thread with 16-byte loads where D % 8 == 0 and n >= 3 (n <= 7 in
// the backward; refused by name otherwise), the heuristic's where valid (H100: post fwd 428 us against 562 at
// vec 1, fwd+bwd 1060 against 1360); post.fwd and post.bwd at vec 8
// compile without spills on sm_80 and sm_90 for n = 3, 4, 7 (8 forward) in bf16, f16 and fp32 (two 16-byte
// words a row); post_pre.bwd keeps vec 1.
TEST(Mhc, PostVecAxisRulesAndCompileWithoutSpills) {
  for (const char* name : {"mhc.post.fwd", "mhc.post.bwd"}) {
    const OpDef& op = Registry::global().get(name);
    CompileRequest r = mhc_request(name, 4, 4096);
    const Problem p = problem_from_request(op, r);
    EXPECT_EQ(op.tuning.heuristic(p).get("vec"), 8) << name;  // the heuristic's where valid
    const Config v8{{{"threads", 128}, {"vec", 8}}};
    EXPECT_TRUE(op.tuning.valid(p, v8, nullptr)) << name;
    EXPECT_EQ(op.kernels(p, v8)[0].targs.back(), "8") << name;
    for (const auto& [n, D, fragment] : {std::tuple{4, 37, "vec=8 takes D % 8 == 0"}, std::tuple{2, 128, "n >= 3"},
                                         std::tuple{8, 128, "n <= 7"}}) {
      CompileRequest q = r;
      q.params = {{"n", int64_t(n)}, {"D", int64_t(D)}};
      std::string why;
      const bool bwd = std::string(name) == "mhc.post.bwd";
      if (n == 8 && !bwd) {
        EXPECT_TRUE(op.tuning.valid(problem_from_request(op, q), v8, &why)) << why;
        continue;
      }
      EXPECT_FALSE(op.tuning.valid(problem_from_request(op, q), v8, &why)) << name << " n " << n;
      EXPECT_NE(why.find(fragment), std::string::npos) << why;
      EXPECT_EQ(op.tuning.heuristic(problem_from_request(op, q)).get("vec"), 1) << name << " n " << n;
    }
  }
  {
    const OpDef& op = Registry::global().get("mhc.post_pre.bwd");
    CompileRequest r = mhc_request("mhc.post_pre.bwd", 4, 4096);
    const Problem p = problem_from_request(op, r);
    EXPECT_EQ(op.kernels(p, op.tuning.heuristic(p)).back().targs.back(), "1");
  }
  int compiled = 0;
  for (const char* arch : {"sm_80", "sm_90"})
    for (const char* name : {"mhc.post.fwd", "mhc.post.bwd"})
      for (auto [dt, n] : {std::pair{DType::bf16, 3}, std::pair{DType::f16, 4}, std::pair{DType::bf16, 7},
                           std::pair{DType::f32, 4}, std::pair{DType::f32, 7}}) {
        CompileRequest q = mhc_request(name, n, 256, dt, arch);
        q.config = Config{{{"threads", 128}, {"vec", 8}}};
        for (const auto& rep : compile(q)) {
          EXPECT_EQ(rep.spill_bytes, 0) << arch << " " << rep.kernel;
          EXPECT_EQ(rep.stack_bytes, 0) << arch << " " << rep.kernel;
          std::cout << arch << " " << rep.kernel << ": " << rep.registers << " registers\n";
          ++compiled;
        }
      }
  EXPECT_EQ(compiled, 20);
}

// pre.fwd's algo axis: the tensor-core projection (mhc_pre_mma.cuh) is the default from sm_80 on for 16-bit
// x: algo=mma_ring at 32 tokens for x in 16-byte groups with M <= 32, else the heads per warp
// (algo=mma_warp_heads) where M <= 32 at 32 tokens (D % 8 != 0), else algo=mma (n 8) at 16; the
// SIMT kernel (algo=simt) below sm_80, for fp32 x, and selectable everywhere; the rules name what rules a config out;
// the mma kernel compiles without spills for sm_80 and sm_90 at the edges of the rules.
TEST(Mhc, PreForwardTakesTensorCoresFromSm80) {
  struct Row {
    const char* op;
    DType dt;
    int64_t n, D;
    const char* arch;
    int64_t algo, tokens;
  };
  for (const Row& row : {Row{"mhc.pre.fwd", DType::bf16, 4, 4096, "sm_90", 3, 32},
                         Row{"mhc.pre.fwd", DType::f16, 4, 4096, "sm_80", 3, 32},
                         Row{"mhc.pre.fwd", DType::f32, 4, 4096, "sm_90", 0, 4},
                         Row{"mhc.pre.fwd", DType::bf16, 4, 37, "sm_90", 2, 32},
                         Row{"mhc.pre.fwd", DType::bf16, 8, 128, "sm_90", 1, 16},
                         Row{"mhc.pre_only.fwd", DType::bf16, 8, 128, "sm_80", 3, 32},
                         Row{"mhc.pre.fwd", DType::bf16, 4, 4096, "sm_75", 0, 4}}) {
    const OpDef& op = Registry::global().get(row.op);
    CompileRequest r = mhc_request(row.op, row.n, row.D, row.dt, row.arch);
    const Problem p = problem_from_request(op, r);
    const Config c = op.tuning.heuristic(p);
    EXPECT_EQ(c.get("algo"), row.algo) << row.op << " " << row.arch << " D = " << row.D;
    EXPECT_EQ(c.get("tokens"), row.tokens) << row.op << " " << row.arch << " D = " << row.D;
    EXPECT_TRUE(op.tuning.valid(p, c, nullptr)) << c.str();
    EXPECT_TRUE(op.tuning.valid(p, Config{{{"algo", 0}, {"threads", 128}, {"tokens", 1}}}, nullptr));  // selectable
  }
  const OpDef& op = Registry::global().get("mhc.pre.fwd");
  CompileRequest r = mhc_request(op.info.name, 4, 4095, DType::bf16, "sm_80");
  const Problem p = problem_from_request(op, r);
  const std::vector<std::pair<Config, const char*>> bad = {
      {Config{{{"algo", 1}, {"threads", 256}, {"tokens", 16}}}, "128 threads"},
      {Config{{{"algo", 1}, {"threads", 128}, {"tokens", 4}}}, "m16 tiles"},
      {Config{{{"algo", 1}, {"threads", 128}, {"tokens", 64}}}, "64 tokens only with x in 16-byte groups"},
      {Config{{{"algo", 0}, {"threads", 128}, {"tokens", 16}}}, "algo=simt takes 1 or 4 tokens"}};
  for (const auto& [c, fragment] : bad) {
    std::string why;
    EXPECT_FALSE(op.tuning.valid(p, c, &why)) << c.str();
    EXPECT_NE(why.find(fragment), std::string::npos) << why;
  }
  {  // fp32 x: the SIMT kernel only
    CompileRequest f = r;
    f.dtype = DType::f32;
    f.params = {{"n", int64_t(4)}, {"D", int64_t(4096)}};
    std::string why;
    EXPECT_FALSE(op.tuning.valid(problem_from_request(op, f), Config{{{"algo", 1}, {"threads", 128}, {"tokens", 32}}},
                                 &why));
    EXPECT_NE(why.find("float32 x: algo=simt"), std::string::npos) << why;
  }
  r.arch = "sm_75";
  std::string why;
  EXPECT_FALSE(op.tuning.valid(problem_from_request(op, r), Config{{{"algo", 1}, {"threads", 128}, {"tokens", 32}}},
                               &why));
  EXPECT_NE(why.find("sm_80"), std::string::npos) << why;

  // The register-heaviest legal configs (ptxas, NVRTC 13): n = 3 at D = 33 and 96, n = 7 at 16 tokens.
  int compiled = 0;
  for (const char* arch : {"sm_80", "sm_90"})
    for (auto [dt, n, D] : {std::tuple{DType::bf16, 3, 96}, std::tuple{DType::f16, 3, 33}, std::tuple{DType::f16, 3, 96},
                            std::tuple{DType::bf16, 7, 33}, std::tuple{DType::bf16, 4, 4096}}) {
      CompileRequest q = mhc_request("mhc.pre.fwd", n, D, dt, arch);
      q.config = op.tuning.heuristic(problem_from_request(op, q));
      for (const auto& rep : compile(q)) {
        EXPECT_TRUE(rep.kernel.find("mhc_pre_fwd_mma_kernel") != std::string::npos ||
                    rep.kernel.find("mhc_pre_fwd_split_heads_kernel") != std::string::npos ||
                    rep.kernel.find("mhc_pre_fwd_decode_kernel") != std::string::npos)
            << rep.kernel;
        EXPECT_EQ(rep.spill_bytes, 0) << arch << " " << rep.kernel;
        ++compiled;
      }
    }
  EXPECT_EQ(compiled, 34);  // four kernels (mma_ring / mma_warp_heads with the split plan and the decode kernel) but
                            // at n = 7 (mma, one)
}

// ---- GPU ----

namespace {

using DevBuf = kspec::testing::FloatBuffer;

// x [B, S, n, D] fp32 with rows padded to D + pad floats, as a strided view.
TensorView padded(const DevBuf& b, std::vector<int64_t> shape, int64_t pad) {
  const int64_t D = shape.back();
  std::vector<int64_t> strides(shape.size());
  int64_t s = D + pad;
  strides.back() = 1;
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) {
    strides[i] = s;
    s *= shape[i];
  }
  return view(b.ptr(), DType::f32, shape, strides);
}

std::vector<float> pad_rows(const std::vector<float>& v, int64_t D, int64_t pad) {
  std::vector<float> out;
  for (size_t r = 0; r < v.size() / D; ++r) {
    out.insert(out.end(), v.begin() + r * D, v.begin() + (r + 1) * D);
    out.insert(out.end(), pad, 0.f);
  }
  return out;
}

std::vector<float> unpad_rows(const std::vector<float>& v, int64_t D, int64_t pad) {
  std::vector<float> out;
  for (size_t r = 0; r < v.size() / (D + pad); ++r)
    out.insert(out.end(), v.begin() + r * (D + pad), v.begin() + r * (D + pad) + D);
  return out;
}

// Every case of each op but the large ones, in each dtype (none named: the op's), at the case's configs that
// `take` selects (the first `most` of them), against the float64 reference; a case without such a config is
// left out, or a failure where `required`. Returns the cases and the rows checked.
struct EveryCase {
  int cases = 0, rows = 0;
};
EveryCase check_every_case(const std::vector<const char*>& ops, const std::vector<DType>& dtypes,
                           const std::function<bool(const Config&)>& take, size_t most = SIZE_MAX,
                           bool required = false) {
  EveryCase n;
  for (const char* op_name : ops) {
    const OpDef& op = Registry::global().get(op_name);
    for (const Case& cs : op.cases) {
      if (cs.large) continue;
      for (DType dt : dtypes.empty() ? op.dtypes : dtypes) {
        CheckOptions o;
        o.case_name = cs.name;
        o.dtypes = {dt};
        for (const Config& c : configs_for_case(op_name, cs.name, dt))
          if (o.configs.size() < most && take(c)) o.configs.push_back(c);
        if (o.configs.empty()) {
          if (required) ADD_FAILURE() << op_name << " " << cs.name << ": no config taken";
          continue;
        }
        auto rows = check_op(op_name, o);
        EXPECT_EQ(rows.size(), o.configs.size()) << op_name << " " << cs.name;
        kspec::testing::report(rows);
        n.rows += static_cast<int>(rows.size());
        ++n.cases;
      }
    }
  }
  return n;
}
const std::vector<DType> k16Bit = {DType::f16, DType::bf16};
bool algo_is(const Config& c, int64_t algo) { return c.get("algo") == algo; }

}  // namespace

// One layer in fp32: pre.fwd, an identity sublayer (f = y), post.fwd; then post.bwd and pre.bwd with the
// post op's dx added in, on [B, S, n, D] views whose rows are padded (a row stride of D + 3); every
// output against the float64 reference.
TEST(MhcGpu, LayerForwardAndBackwardOnPaddedBatchSequenceViews) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const int64_t B = 2, S = 7, n = 4, D = 100, T = B * S, M = n * n + 2 * n, nd = n * D, pad = 3;
  std::mt19937_64 rng(34);
  std::vector<float> x = randn(rng, T * nd, 1.f), phi = randn(rng, M * nd, 1.f / std::sqrt(float(nd)));
  std::vector<float> alpha = {0.7f, -0.5f, 1.3f}, bias = randn(rng, M, 0.5f), gamma = randn(rng, nd, 0.3f);
  for (auto& g : gamma) g += 1.f;
  std::vector<float> dout = randn(rng, T * nd, 1.f);
  DevBuf xb(T * n * (D + pad) * 4), phib(M * nd * 4), ab(12), bb(M * 4), gb(nd * 4), yb(T * (D + pad) * 4),
      hpre(T * n * 4), hpost(T * n * 4), rb(T * n * n * 4), invb(T * 4), hb(T * M * 4), outb(T * n * (D + pad) * 4),
      doutb(T * n * (D + pad) * 4), dxpost(T * n * (D + pad) * 4), dfb(T * (D + pad) * 4), dhpost(T * n * 4),
      dres(T * n * n * 4), dxb(T * n * (D + pad) * 4), dphi(M * nd * 4), dalpha(12), dbias(M * 4), dgamma(nd * 4);
  xb.upload(pad_rows(x, D, pad));
  phib.upload(phi);
  ab.upload(alpha);
  bb.upload(bias);
  gb.upload(gamma);
  doutb.upload(pad_rows(dout, D, pad));
  for (DevBuf* o : {&yb, &hpre, &hpost, &rb, &invb, &hb, &outb, &dxpost, &dfb, &dhpost, &dres, &dxb, &dphi, &dalpha,
                    &dbias, &dgamma})
    o->poison();
  auto f32 = [](const DevBuf& b, std::vector<int64_t> shape) { return view(b.ptr(), DType::f32, shape); };
  TensorView xv = padded(xb, {B, S, n, D}, pad), yv = padded(yb, {B, S, D}, pad);
  TensorView phiv = f32(phib, {M, nd}), av = f32(ab, {3}), bv = f32(bb, {M}), gv = f32(gb, {nd});
  TensorView hprev = f32(hpre, {B, S, n}), hpostv = f32(hpost, {B, S, n}), rv = f32(rb, {B, S, n, n});
  TensorView invv = f32(invb, {B, S}), hv = f32(hb, {B, S, M});
  call("mhc.pre.fwd", {xv, phiv, av, bv, gv}, {yv, hprev, hpostv, rv, invv, hv});
  call("mhc.post.fwd", {xv, yv, hpostv, rv}, {padded(outb, {B, S, n, D}, pad)});
  TensorView dxpostv = padded(dxpost, {B, S, n, D}, pad), dfv = padded(dfb, {B, S, D}, pad);
  call("mhc.post.bwd", {padded(doutb, {B, S, n, D}, pad), xv, yv, hpostv, rv},
       {dxpostv, dfv, f32(dhpost, {B, S, n}), f32(dres, {B, S, n, n})});
  // f = y: df flows back into y as dy; dh_post and dR into the pre op.
  call("mhc.pre.bwd",
       {dfv, xv, phiv, av, bv, gv, invv, hv, TensorView(), f32(dhpost, {B, S, n}), f32(dres, {B, S, n, n}), dxpostv},
       {padded(dxb, {B, S, n, D}, pad), f32(dphi, {M, nd}), f32(dalpha, {3}), f32(dbias, {M}), f32(dgamma, {nd})});
  CU_CHECK(cuCtxSynchronize());

  const ref::MhcShape s{T, n, D, false};
  const ref::MhcEps e;
  const ref::MhcPreInputs in{to_double(x), to_double(phi), to_double(alpha), to_double(bias), to_double(gamma)};
  const auto fw = ref::mhc_pre_fwd_ref(s, e, in);
  const auto out = ref::mhc_post_fwd_ref(s, in.x, fw.y, fw.h_post, fw.r);
  const auto pg = ref::mhc_post_bwd_ref(s, in.x, fw.y, fw.h_post, fw.r, to_double(dout));
  ref::MhcPreUpstream up;
  up.dy = pg.df;
  up.dh_post = pg.dh_post;
  up.dr = pg.dr;
  up.dx_post = pg.dx;
  const auto g = ref::mhc_pre_bwd_ref(s, e, in, up);
  auto expect_close = [](const char* what, const std::vector<float>& got, const std::vector<double>& want, double tol) {
    EXPECT_LE(max_rel(got, want), tol) << what;
  };
  expect_close("y", unpad_rows(yb.download(T * (D + pad)), D, pad), fw.y, 1e-5);
  expect_close("h_pre", hpre.download(T * n), fw.h_pre, 1e-5);
  expect_close("h_post", hpost.download(T * n), fw.h_post, 1e-5);
  expect_close("r", rb.download(T * n * n), fw.r, 1e-5);
  expect_close("inv", invb.download(T), fw.inv, 1e-5);
  expect_close("h", hb.download(T * M), fw.h, 1e-5);
  expect_close("out", unpad_rows(outb.download(T * n * (D + pad)), D, pad), out, 1e-5);
  expect_close("post dx", unpad_rows(dxpost.download(T * n * (D + pad)), D, pad), pg.dx, 1e-4);
  expect_close("df", unpad_rows(dfb.download(T * (D + pad)), D, pad), pg.df, 1e-4);
  expect_close("dh_post", dhpost.download(T * n), pg.dh_post, 1e-4);
  expect_close("dh_res", dres.download(T * n * n), pg.dr, 1e-4);
  expect_close("dx", unpad_rows(dxb.download(T * n * (D + pad)), D, pad), g.dx, 1e-4);
  expect_close("dphi", dphi.download(M * nd), g.dphi, 1e-4);
  expect_close("dalpha", dalpha.download(3), g.dalpha, 1e-4);
  expect_close("dbias", dbias.download(M), g.dbias, 1e-4);
  expect_close("dgamma", dgamma.download(nd), g.dgamma, 1e-4);
}

// grads_deterministic: several parts along T and blocks along nD (T 1031, D 4000); three runs give the
// same bits for dx, dphi, dalpha, dbias, dgamma (no float atomics anywhere).
TEST(MhcGpu, PreBackwardIsBitwiseDeterministic) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const int64_t T = 1031, n = 4, D = 4000, M = n * n + 2 * n, nd = n * D;
  std::mt19937_64 rng(1031);
  std::vector<float> x = randn(rng, T * nd, 1.f), phi = randn(rng, M * nd, 1.f / std::sqrt(float(nd)));
  std::vector<float> alpha = {0.7f, -0.5f, 1.3f}, bias = randn(rng, M, 0.5f), gamma = randn(rng, nd, 1.f);
  DevBuf xb(T * nd * 4), phib(M * nd * 4), ab(12), bb(M * 4), gb(nd * 4), yb(T * D * 4), hpre(T * n * 4),
      hpost(T * n * 4), rb(T * n * n * 4), invb(T * 4), hb(T * M * 4), dyb(T * D * 4), dhp(T * n * 4),
      drb(T * n * n * 4), dxp(T * nd * 4);
  xb.upload(x);
  phib.upload(phi);
  ab.upload(alpha);
  bb.upload(bias);
  gb.upload(gamma);
  dyb.upload(randn(rng, T * D, 1.f));
  dhp.upload(randn(rng, T * n, 1.f));
  drb.upload(randn(rng, T * n * n, 1.f));
  dxp.upload(randn(rng, T * nd, 1.f));
  auto f32 = [](const DevBuf& b, std::vector<int64_t> shape) { return view(b.ptr(), DType::f32, shape); };
  const TensorView xv = f32(xb, {T, n, D}), phiv = f32(phib, {M, nd}), av = f32(ab, {3}), bv = f32(bb, {M}),
                   gv = f32(gb, {nd}), invv = f32(invb, {T}), hv = f32(hb, {T, M});
  call("mhc.pre.fwd", {xv, phiv, av, bv, gv},
       {f32(yb, {T, D}), f32(hpre, {T, n}), f32(hpost, {T, n}), f32(rb, {T, n, n}), invv, hv});
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 3; ++run) {
    DevBuf dx(T * nd * 4), dphi(M * nd * 4), dalpha(12), dbias(M * 4), dgamma(nd * 4);
    call("mhc.pre.bwd",
         {f32(dyb, {T, D}), xv, phiv, av, bv, gv, invv, hv, TensorView(), f32(dhp, {T, n}), f32(drb, {T, n, n}),
          f32(dxp, {T, n, D})},
         {f32(dx, {T, n, D}), f32(dphi, {M, nd}), f32(dalpha, {3}), f32(dbias, {M}), f32(dgamma, {nd})});
    CU_CHECK(cuCtxSynchronize());
    std::vector<std::vector<float>> got = {dx.download(T * nd), dphi.download(M * nd), dalpha.download(3),
                                           dbias.download(M), dgamma.download(nd)};
    if (run == 0) {
      first = got;
      continue;
    }
    const char* names[] = {"dx", "dphi", "dalpha", "dbias", "dgamma"};
    for (size_t k = 0; k < got.size(); ++k)
      EXPECT_EQ(std::memcmp(got[k].data(), first[k].data(), got[k].size() * 4), 0) << names[k] << " run " << run;
  }
}

// Every algo=mma config (16, 32, 64 tokens where legal) of pre.fwd and pre_only.fwd on the edge cases, each
// dtype, against the float64 reference (GpuEveryOp runs every case with the heuristic's config, mma from
// sm_80 on): T = 1, T = 1031 (not a multiple of any token tile), n = 1, 3, 8, D = 33, 37, 50, 300 (no
// 16-byte groups), no gamma; fp32 x has no mma config (its rule, PreForwardTakesTensorCoresFromSm80).
TEST(MhcGpu, PreForwardEveryMmaConfigMatchesReference) {
  KSPEC_REQUIRE_GPU();
  const std::vector<std::pair<const char*, std::vector<const char*>>> cases = {
      {"mhc.pre.fwd", {"base", "T_1", "n_3", "n_8", "D_37", "dx_dgamma_multiblock"}},
      {"mhc.pre_only.fwd", {"base", "T_1", "no_gamma_n_1"}}};
  int checked = 0;
  for (const auto& [op, names] : cases)
    for (const char* cs : names)
      for (DType dt : {DType::f16, DType::bf16}) {
        CheckOptions o;
        o.case_name = cs;
        o.dtypes = {dt};
        for (const Config& c : configs_for_case(op, cs, dt))
          if (c.get("algo") == 1) o.configs.push_back(c);
        ASSERT_FALSE(o.configs.empty()) << op << " " << cs;
        auto rows = check_op(op, o);
        EXPECT_EQ(rows.size(), o.configs.size()) << op << " " << cs;
        kspec::testing::report(rows);
        checked += static_cast<int>(rows.size());
      }
  EXPECT_GE(checked, 32);  // 38: 2 or 3 tiles per case and dtype
}

// Every case of mhc.pre.bwd and mhc.pre_only.bwd (T = 1, T = 1031 over several parts, n = 1, 3, 8, D = 33,
// 37, no gamma, each upstream gradient alone) with the sums over tokens on tensor cores (algo=mma), f16 and
// bf16, against the float64 reference; the token kernel is the heuristic's (the columns kernel does not
// depend on its threads or tokens).
TEST(MhcGpu, PreBackwardMmaMatchesReferenceOnEveryCase) {
  KSPEC_REQUIRE_GPU();
  const EveryCase n = check_every_case({"mhc.pre.bwd", "mhc.pre_only.bwd"}, k16Bit,
                                       [](const Config& c) { return algo_is(c, 1); }, 1, true);
  EXPECT_GE(n.rows, 50);
}

// Every case of mhc.pre.bwd and mhc.pre_only.bwd that has an algo=mma_tokens config (x in 16-byte groups:
// base, T = 1, T = 2, n = 1, 2, 3, D = 128 ... 7168, t_max 1, eps 0, no gamma, T = 1031 over several parts,
// each upstream gradient alone), at every such config (16, 32, 64 tokens where legal), f16 and bf16, against
// the float64 reference: the token pass on tensor cores (mhc_pre_bwd_token_mma.cuh) with the columns and
// dx kernels of algo=mma.
TEST(MhcGpu, PreBackwardMmaTokensMatchesReferenceOnEveryCase) {
  KSPEC_REQUIRE_GPU();
  // Cases without a config: D % 8 != 0, or n = 8.
  const EveryCase n = check_every_case({"mhc.pre.bwd", "mhc.pre_only.bwd"}, k16Bit,
                                       [](const Config& c) { return algo_is(c, 2); });
  EXPECT_GE(n.cases, 40);
  EXPECT_GE(n.rows, 60);
}

// Every case of mhc.pre.bwd and mhc.pre_only.bwd with an algo=mma_fused or mma_fused_warp_heads config
// (mma_tokens' cases but n <= 4 on pre.bwd), at every such config, f16 and bf16, against the float64
// reference: dx and the sums over tokens from one pass over x (mhc_pre_bwd_fused_mma.cuh), the token pass's
// heads per block or per warp.
TEST(MhcGpu, PreBackwardMmaFusedMatchesReferenceOnEveryCase) {
  KSPEC_REQUIRE_GPU();
  // Cases without a config: D % 8 != 0, or M > 24.
  const EveryCase n = check_every_case({"mhc.pre.bwd", "mhc.pre_only.bwd"}, k16Bit,
                                       [](const Config& c) { return c.get("algo") >= 3; });
  EXPECT_GE(n.cases, 30);
  EXPECT_GE(n.rows, 80);
}

// post.fwd and post.bwd at vec 8 (16-byte loads) on every case with D % 8 == 0, every dtype and thread
// count, against the float64 reference.
TEST(MhcGpu, PostVec8MatchesReferenceOnEveryCase) {
  KSPEC_REQUIRE_GPU();
  // Cases without a config: D % 8 != 0.
  const EveryCase n = check_every_case({"mhc.post.fwd", "mhc.post.bwd"}, {},
                                       [](const Config& c) { return c.get("vec") == 8; });
  EXPECT_GE(n.rows, 100);
}

namespace {

// Round to nearest even, as __float2bfloat16 does.
std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    out[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return out;
}

}  // namespace

// grads_deterministic on the tensor-core backward: bf16 x, T 1031 (several parts along T, a partial last
// token tile), D 4000 (16-byte groups); algo=mma (4 tokens), algo=mma_tokens (32), algo=mma_fused (32) and
// algo=mma_fused_warp_heads (32) each give the same bits three times for dx, dphi, dalpha, dbias, dgamma, and
// the last two the same bits as each other (the heads per warp do the block's operations); so do
// mma_fused_ring (32), mma_fused_ahead and mma_fused_phi_ring (32 and 16 tokens: a token's sums run over the same
// chunks in the same order at any tile) against mma_fused_warp_heads.
TEST(MhcGpu, PreBackwardMmaAlgosAreBitwiseDeterministic) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const int64_t T = 1031, n = 4, D = 4000, M = n * n + 2 * n, nd = n * D;
  std::mt19937_64 rng(34);
  const auto x = to_bf16(randn(rng, T * nd, 1.f)), dy = to_bf16(randn(rng, T * D, 1.f)),
             dxp = to_bf16(randn(rng, T * nd, 1.f));
  DevBuf xb(T * nd * 2), phib(M * nd * 4), ab(12), bb(M * 4), gb(nd * 4), yb(T * D * 2), hpre(T * n * 4),
      hpost(T * n * 4), rb(T * n * n * 4), invb(T * 4), hb(T * M * 4), dyb(T * D * 2), dhp(T * n * 4),
      drb(T * n * n * 4), dxpb(T * nd * 2);
  xb.upload(x.data(), x.size() * 2);
  dyb.upload(dy.data(), dy.size() * 2);
  dxpb.upload(dxp.data(), dxp.size() * 2);
  phib.upload(randn(rng, M * nd, 1.f / std::sqrt(float(nd))));
  ab.upload({0.7f, -0.5f, 1.3f});
  bb.upload(randn(rng, M, 0.5f));
  gb.upload(randn(rng, nd, 1.f));
  dhp.upload(randn(rng, T * n, 1.f));
  drb.upload(randn(rng, T * n * n, 1.f));
  auto f32 = [](const DevBuf& b, std::vector<int64_t> shape) { return view(b.ptr(), DType::f32, shape); };
  auto b16 = [](const DevBuf& b, std::vector<int64_t> shape) { return view(b.ptr(), DType::bf16, shape); };
  const TensorView xv = b16(xb, {T, n, D}), phiv = f32(phib, {M, nd}), av = f32(ab, {3}), bv = f32(bb, {M}),
                   gv = f32(gb, {nd}), invv = f32(invb, {T}), hv = f32(hb, {T, M});
  call("mhc.pre.fwd", {xv, phiv, av, bv, gv},
       {b16(yb, {T, D}), f32(hpre, {T, n}), f32(hpost, {T, n}), f32(rb, {T, n, n}), invv, hv});
  std::map<int64_t, std::vector<std::vector<uint8_t>>> firsts;  // by algo, and 100 + algo at 16 tokens
  for (const Config& config : {Config{{{"algo", 1}, {"threads", 128}, {"tokens", 4}}},
                               Config{{{"algo", 2}, {"threads", 128}, {"tokens", 32}}},
                               Config{{{"algo", 3}, {"threads", 128}, {"tokens", 32}}},
                               Config{{{"algo", 4}, {"threads", 128}, {"tokens", 32}}},
                               Config{{{"algo", 5}, {"threads", 128}, {"tokens", 32}}},
                               Config{{{"algo", 6}, {"threads", 128}, {"tokens", 32}}},
                               Config{{{"algo", 6}, {"threads", 128}, {"tokens", 16}}},
                               Config{{{"algo", 7}, {"threads", 128}, {"tokens", 32}}},
                               Config{{{"algo", 7}, {"threads", 128}, {"tokens", 16}}}}) {
    CallOptions opts;
    opts.config = &config;
    std::vector<std::vector<uint8_t>>& first = firsts[(config.get("tokens") == 16 ? 100 : 0) + config.get("algo")];
    for (int run = 0; run < 3; ++run) {
      DevBuf dx(T * nd * 2), dphi(M * nd * 4), dalpha(12), dbias(M * 4), dgamma(nd * 4);
      for (DevBuf* o : {&dx, &dphi, &dalpha, &dbias, &dgamma}) o->poison();
      call("mhc.pre.bwd",
           {b16(dyb, {T, D}), xv, phiv, av, bv, gv, invv, hv, TensorView(), f32(dhp, {T, n}), f32(drb, {T, n, n}),
            b16(dxpb, {T, n, D})},
           {b16(dx, {T, n, D}), f32(dphi, {M, nd}), f32(dalpha, {3}), f32(dbias, {M}), f32(dgamma, {nd})}, {}, nullptr,
           opts);
      CU_CHECK(cuCtxSynchronize());
      std::vector<std::vector<uint8_t>> got;
      for (const DevBuf* o : {&dx, &dphi, &dalpha, &dbias, &dgamma}) {
        got.emplace_back(o->bytes);
        CU_CHECK(cuMemcpyDtoH(got.back().data(), o->p, o->bytes));
      }
      if (run == 0) {
        first = got;
        continue;
      }
      const char* names[] = {"dx", "dphi", "dalpha", "dbias", "dgamma"};
      for (size_t k = 0; k < got.size(); ++k)
        EXPECT_EQ(got[k], first[k]) << names[k] << " run " << run << " " << config.str();
    }
  }
  const char* names[] = {"dx", "dphi", "dalpha", "dbias", "dgamma"};
  for (size_t k = 0; k < firsts[3].size(); ++k) {
    EXPECT_EQ(firsts[4][k], firsts[3][k]) << names[k] << ": mma_fused_warp_heads against mma_fused";
    EXPECT_EQ(firsts[5][k], firsts[4][k]) << names[k] << ": mma_fused_ring against mma_fused_warp_heads";
    EXPECT_EQ(firsts[6][k], firsts[4][k]) << names[k] << ": mma_fused_ahead against mma_fused_warp_heads";
    EXPECT_EQ(firsts[106][k], firsts[4][k]) << names[k] << ": mma_fused_ahead at 16 tokens against 32";
    EXPECT_EQ(firsts[7][k], firsts[4][k]) << names[k] << ": mma_fused_phi_ring against mma_fused_warp_heads";
    EXPECT_EQ(firsts[107][k], firsts[4][k]) << names[k] << ": mma_fused_phi_ring at 16 tokens against 32";
  }
}

namespace {

// mhc.pre.fwd's outputs (y, h_pre, h_post, r, inv, h: their bytes) at `config` on bf16 T 1031, n 4, D 4000 (a
// partial last tile at every token tile; x in 16-byte groups), the same inputs at every call.
std::vector<std::vector<uint8_t>> pre_fwd_bytes(const Config& config) {
  jit::ContextGuard guard(0);
  const int64_t T = 1031, n = 4, D = 4000, M = n * n + 2 * n, nd = n * D;
  std::mt19937_64 rng(35);
  const auto x = to_bf16(randn(rng, T * nd, 1.f));
  DevBuf xb(T * nd * 2), phib(M * nd * 4), ab(12), bb(M * 4), gb(nd * 4);
  xb.upload(x.data(), x.size() * 2);
  phib.upload(randn(rng, M * nd, 1.f / std::sqrt(float(nd))));
  ab.upload({0.7f, -0.5f, 1.3f});
  bb.upload(randn(rng, M, 0.5f));
  gb.upload(randn(rng, nd, 1.f));
  auto f32 = [](const DevBuf& b, std::vector<int64_t> shape) { return view(b.ptr(), DType::f32, shape); };
  CallOptions opts;
  opts.config = &config;
  DevBuf yb(T * D * 2), hpre(T * n * 4), hpost(T * n * 4), rb(T * n * n * 4), invb(T * 4), hb(T * M * 4);
  for (DevBuf* o : {&yb, &hpre, &hpost, &rb, &invb, &hb}) o->poison();
  call("mhc.pre.fwd",
       {view(xb.ptr(), DType::bf16, {T, n, D}), f32(phib, {M, nd}), f32(ab, {3}), f32(bb, {M}), f32(gb, {nd})},
       {view(yb.ptr(), DType::bf16, {T, D}), f32(hpre, {T, n}), f32(hpost, {T, n}), f32(rb, {T, n, n}),
        f32(invb, {T}), f32(hb, {T, M})},
       {}, nullptr, opts);
  CU_CHECK(cuCtxSynchronize());
  std::vector<std::vector<uint8_t>> out;
  for (const DevBuf* o : {&yb, &hpre, &hpost, &rb, &invb, &hb}) {
    out.emplace_back(o->bytes);
    CU_CHECK(cuMemcpyDtoH(out.back().data(), o->p, o->bytes));
  }
  return out;
}

// pre_fwd_bytes at algo `a` and algo `b`, the same tile, equal output by output.
void expect_pre_fwd_same_bits(int64_t a, int64_t b, int64_t tokens) {
  const auto first = pre_fwd_bytes(Config{{{"algo", a}, {"threads", 128}, {"tokens", tokens}}});
  const auto second = pre_fwd_bytes(Config{{{"algo", b}, {"threads", 128}, {"tokens", tokens}}});
  const char* names[] = {"y", "h_pre", "h_post", "r", "inv", "h"};
  for (size_t q = 0; q < first.size(); ++q)
    EXPECT_EQ(second[q], first[q]) << names[q] << ": algo " << b << " against " << a << ", tokens " << tokens;
}

}  // namespace

// Every case of mhc.pre.fwd and mhc.pre_only.fwd with an algo=mma_warp_heads config (n <= 4 on pre.fwd), at
// every such config, f16 and bf16, against the float64 reference (cases up to 256 tokens run the split plan:
// partial projections over column groups, their sum, the heads and y per range of D); and on bf16 T 1031,
// D 4000 (a partial last tile; the tile plan) the same bits as algo=mma at the same tiles for every output (the
// heads' operations are the same). The split plan at large D: the cases D_2560, D_4000, D_7168 (T 2-3, n 4).
TEST(MhcGpu, PreForwardMmaWarpHeadsMatchesReferenceAndMmaBits) {
  KSPEC_REQUIRE_GPU();
  // Cases without a config: n > 4.
  const EveryCase n = check_every_case({"mhc.pre.fwd", "mhc.pre_only.fwd"}, k16Bit,
                                       [](const Config& c) { return algo_is(c, 2); });
  EXPECT_GE(n.rows, 40);
  for (int64_t tokens : {16, 32, 64}) expect_pre_fwd_same_bits(1, 2, tokens);
}

// Every case of mhc.pre.fwd and mhc.pre_only.fwd with an algo=mma_ring config (x in 16-byte groups, n <= 4 on
// pre.fwd, 16 or 32 tokens), f16 and bf16, against the float64 reference (up to 256 tokens the split plan, as
// mma_warp_heads'); and on bf16 T 1031, D 4000 (the tile plan, a partial last tile) the same bits as
// algo=mma_warp_heads at 16 and 32 tokens for every output: only the path of x into the mmas differs.
TEST(MhcGpu, PreForwardMmaRingMatchesReferenceAndWarpHeadsBits) {
  KSPEC_REQUIRE_GPU();
  // Cases without a config: D % 8 != 0, or n > 4.
  const EveryCase n = check_every_case({"mhc.pre.fwd", "mhc.pre_only.fwd"}, k16Bit,
                                       [](const Config& c) { return algo_is(c, 3); });
  EXPECT_GE(n.cases, 30);
  EXPECT_GE(n.rows, 60);
  for (int64_t tokens : {16, 32}) expect_pre_fwd_same_bits(2, 3, tokens);
}

// Every case of mhc.post_pre.fwd with an algo=mma or mma_warp_heads config (x in 16-byte groups), at every
// such config, f16 and bf16, against the float64 reference: x_next and the projection on tensor cores.
TEST(MhcGpu, PostPreForwardMmaMatchesReferenceOnEveryCase) {
  KSPEC_REQUIRE_GPU();
  // Cases without a config: D % 8 != 0.
  const EveryCase n =
      check_every_case({"mhc.post_pre.fwd"}, k16Bit, [](const Config& c) { return c.get("algo") >= 1; });
  EXPECT_GE(n.rows, 8);
}

// ---- post_pre: post(l) fused with pre(l + 1) ----

namespace {

// post_pre.fwd inputs for x [T, n, D] (bf16): post's x, f, h_post, h_res, then pre's phi, alpha, bias, gamma.
std::vector<TensorView> post_pre_inputs(int64_t T, int64_t n, int64_t D) {
  const int64_t M = n * n + 2 * n;
  return {TensorView(fake(), DType::bf16, {T, n, D}, 0),        TensorView(fake(1 << 28), DType::bf16, {T, D}, 0),
          TensorView(fake(2 << 28), DType::f32, {T, n}, 0),     TensorView(fake(3 << 28), DType::f32, {T, n, n}, 0),
          TensorView(fake(4 << 28), DType::f32, {M, n * D}, 0), TensorView(fake(5 << 28), DType::f32, {3}, 0),
          TensorView(fake(6 << 28), DType::f32, {M}, 0),        TensorView(fake(7 << 28), DType::f32, {n * D}, 0)};
}

}  // namespace

TEST(Mhc, PostPreInfersBothLayersOutputsAndNamesBadArguments) {
  auto outs = infer_outputs("mhc.post_pre.fwd", post_pre_inputs(9, 4, 40));
  ASSERT_EQ(outs.size(), 7u);  // x_next, y, h_pre, h_post_next, r_next, inv, h
  EXPECT_EQ(outs[0].shape, (std::vector<int64_t>{9, 4, 40}));
  EXPECT_EQ(outs[0].dtype, DType::bf16);
  EXPECT_EQ(outs[1].shape, (std::vector<int64_t>{9, 40}));
  EXPECT_EQ(outs[1].dtype, DType::bf16);
  EXPECT_EQ(outs[3].shape, (std::vector<int64_t>{9, 4}));
  EXPECT_EQ(outs[4].shape, (std::vector<int64_t>{9, 4, 4}));
  EXPECT_EQ(outs[5].shape, (std::vector<int64_t>{9}));
  EXPECT_EQ(outs[6].shape, (std::vector<int64_t>{9, 24}));
  const std::string op = "mhc.post_pre.fwd";
  auto in = post_pre_inputs(9, 4, 40);
  in[4] = TensorView(fake(4 << 28), DType::f32, {23, 160}, 0);
  in[6] = TensorView(fake(6 << 28), DType::f32, {23}, 0);
  expect_message(op, in, {}, {"input 'phi'", "M = n*n + 2n = 24", "got M = 23"});
  in = post_pre_inputs(9, 4, 40);
  in[1] = TensorView(fake(1 << 28), DType::bf16, {8, 40}, 0);
  expect_message(op, in, {}, {"input 'f'", "T = 8", "T = 9"});
  in = post_pre_inputs(9, 4, 40);
  in[3] = TensorView(fake(3 << 28), DType::f32, {9, 3, 3}, 0);
  expect_message(op, in, {}, {"input 'h_res'", "n = 3", "n = 4"});
  in = post_pre_inputs(9, 4, 40);
  in[7] = TensorView(fake(7 << 28), DType::f32, {159}, 0);
  expect_message(op, in, {}, {"input 'gamma'", "nD = 159", "nD = 160"});
  in = post_pre_inputs(9, 4, 40);
  expect_message(op, in, {{"t_max", int64_t(0)}}, {"t_max"});
  // The backward op: x_next like x.
  const auto& bwd = Registry::global().get("mhc.post_pre.bwd");
  ASSERT_EQ(bwd.info.outputs.size(), 8u);
  EXPECT_EQ(bwd.info.outputs[0].name, "dx");
  EXPECT_EQ(bwd.info.outputs[4].name, "dphi");
}

// The named shapes (d_not_pow2 at n 4, T 1, n in {1, 3, 8}) in fp32: mhc.post_pre.fwd and
// mhc.post_pre.bwd against post then pre of the float64 reference (the backward with every upstream
// gradient, dx_next among them).
class MhcPostPreGpu : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t>> {};

TEST_P(MhcPostPreGpu, FusedForwardAndBackwardMatchPostThenPre) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const auto [T, n, D] = GetParam();
  const int64_t M = n * n + 2 * n, nd = n * D;
  std::mt19937_64 rng(static_cast<uint64_t>(T * 131 + n * 7 + D));
  std::vector<float> x = randn(rng, T * nd, 1.f), f = randn(rng, T * D, 1.f), hp = randn(rng, T * n, 1.f),
                     hr = randn(rng, T * n * n, 0.5f), phi = randn(rng, M * nd, 1.f / std::sqrt(float(nd)));
  std::vector<float> alpha = {0.7f, -0.5f, 1.3f}, bias = randn(rng, M, 0.5f), gamma = randn(rng, nd, 0.3f);
  for (auto& g : gamma) g += 1.f;
  std::vector<float> dxn = randn(rng, T * nd, 1.f), dy = randn(rng, T * D, 1.f), dhpre = randn(rng, T * n, 1.f),
                     dhpost = randn(rng, T * n, 1.f), dr = randn(rng, T * n * n, 1.f);
  DevBuf xb(T * nd * 4), fb(T * D * 4), hpb(T * n * 4), hrb(T * n * n * 4), phib(M * nd * 4), ab(12), bb(M * 4),
      gb(nd * 4), xnb(T * nd * 4), yb(T * D * 4), hpre(T * n * 4), hpost(T * n * 4), rb(T * n * n * 4), invb(T * 4),
      hb(T * M * 4), dxnb(T * nd * 4), dyb(T * D * 4), dhpreb(T * n * 4), dhpostb(T * n * 4), drb(T * n * n * 4),
      dx(T * nd * 4), df(T * D * 4), dhp(T * n * 4), dhr(T * n * n * 4), dphi(M * nd * 4), dalpha(12), dbias(M * 4),
      dgamma(nd * 4);
  xb.upload(x);
  fb.upload(f);
  hpb.upload(hp);
  hrb.upload(hr);
  phib.upload(phi);
  ab.upload(alpha);
  bb.upload(bias);
  gb.upload(gamma);
  dxnb.upload(dxn);
  dyb.upload(dy);
  dhpreb.upload(dhpre);
  dhpostb.upload(dhpost);
  drb.upload(dr);
  for (DevBuf* o : {&xnb, &yb, &hpre, &hpost, &rb, &invb, &hb, &dx, &df, &dhp, &dhr, &dphi, &dalpha, &dbias, &dgamma})
    o->poison();
  auto f32 = [](const DevBuf& b, std::vector<int64_t> shape) { return view(b.ptr(), DType::f32, shape); };
  const TensorView xv = f32(xb, {T, n, D}), fv = f32(fb, {T, D}), hpv = f32(hpb, {T, n}), hrv = f32(hrb, {T, n, n}),
                   phiv = f32(phib, {M, nd}), av = f32(ab, {3}), bv = f32(bb, {M}), gv = f32(gb, {nd}),
                   xnv = f32(xnb, {T, n, D}), invv = f32(invb, {T}), hv = f32(hb, {T, M});
  call("mhc.post_pre.fwd", {xv, fv, hpv, hrv, phiv, av, bv, gv},
       {xnv, f32(yb, {T, D}), f32(hpre, {T, n}), f32(hpost, {T, n}), f32(rb, {T, n, n}), invv, hv});
  call("mhc.post_pre.bwd",
       {f32(dxnb, {T, n, D}), f32(dyb, {T, D}), f32(dhpreb, {T, n}), f32(dhpostb, {T, n}), f32(drb, {T, n, n}), xv,
        fv, hpv, hrv, xnv, phiv, av, bv, gv, invv, hv},
       {f32(dx, {T, n, D}), f32(df, {T, D}), f32(dhp, {T, n}), f32(dhr, {T, n, n}), f32(dphi, {M, nd}),
        f32(dalpha, {3}), f32(dbias, {M}), f32(dgamma, {nd})});
  CU_CHECK(cuCtxSynchronize());

  const ref::MhcShape s{T, n, D, false};
  const ref::MhcEps e;
  const auto xn = ref::mhc_post_fwd_ref(s, to_double(x), to_double(f), to_double(hp), to_double(hr));
  const ref::MhcPreInputs in{xn, to_double(phi), to_double(alpha), to_double(bias), to_double(gamma)};
  const auto fw = ref::mhc_pre_fwd_ref(s, e, in);
  const auto g = ref::mhc_pre_bwd_ref(
      s, e, in, {to_double(dy), to_double(dhpre), to_double(dhpost), to_double(dr), to_double(dxn)});
  const auto pg = ref::mhc_post_bwd_ref(s, to_double(x), to_double(f), to_double(hp), to_double(hr), g.dx);
  const std::vector<std::tuple<const char*, const DevBuf*, const std::vector<double>*, double>> checks = {
      {"x_next", &xnb, &xn, 1e-5},         {"y", &yb, &fw.y, 1e-5},          {"h_pre", &hpre, &fw.h_pre, 1e-5},
      {"h_post_next", &hpost, &fw.h_post, 1e-5}, {"r_next", &rb, &fw.r, 1e-5}, {"inv", &invb, &fw.inv, 1e-5},
      {"h", &hb, &fw.h, 1e-5},             {"dx", &dx, &pg.dx, 1e-4},        {"df", &df, &pg.df, 1e-4},
      {"dh_post", &dhp, &pg.dh_post, 1e-4}, {"dh_res", &dhr, &pg.dr, 1e-4},  {"dphi", &dphi, &g.dphi, 1e-4},
      {"dalpha", &dalpha, &g.dalpha, 1e-4}, {"dbias", &dbias, &g.dbias, 1e-4}, {"dgamma", &dgamma, &g.dgamma, 1e-4}};
  for (const auto& [name, buf, want, tol] : checks)
    EXPECT_LE(max_rel(buf->download(want->size()), *want), tol) << name;
}

INSTANTIATE_TEST_SUITE_P(
    NamedShapes, MhcPostPreGpu,
    ::testing::Values(std::make_tuple(int64_t(3), int64_t(4), int64_t(4000)),  // d_not_pow2
                      std::make_tuple(int64_t(3), int64_t(4), int64_t(2560)),
                      std::make_tuple(int64_t(2), int64_t(4), int64_t(7168)),
                      std::make_tuple(int64_t(3), int64_t(4), int64_t(1000)),
                      std::make_tuple(int64_t(6), int64_t(4), int64_t(37)),
                      std::make_tuple(int64_t(5), int64_t(4), int64_t(128)),  // the 32-of-128
                      std::make_tuple(int64_t(1), int64_t(4), int64_t(128)),  // T = 1
                      std::make_tuple(int64_t(5), int64_t(1), int64_t(64)),
                      std::make_tuple(int64_t(7), int64_t(3), int64_t(33)),
                      std::make_tuple(int64_t(5), int64_t(8), int64_t(128))),
    [](const ::testing::TestParamInfo<MhcPostPreGpu::ParamType>& p) {
      return "T" + std::to_string(std::get<0>(p.param)) + "_n" + std::to_string(std::get<1>(p.param)) + "_D" +
             std::to_string(std::get<2>(p.param));
    });

// pre.bwd's algo=mma_fused_ahead (6): mma_fused_warp_heads' token pass (heads per warp, no ring), then the fused
// kernel with kAhead (its last template argument: c_v and H_pre a step ahead with dm, 8-byte dx stores, the parts
// from the last); algo=mma_fused_phi_ring (7): that with the token kernel's kPhiRing (its ninth template argument:
// phi and gamma through a per-warp cp.async ring, launched with its dynamic shared memory); mma_fused's rules;
// neither the heuristic's; both compile without spills on sm_80 and sm_90 at n 4 with and without gamma and
// dx_post, n 2 and pre_only n 8, at 32 and 16 tokens.
TEST(Mhc, PreBackwardMmaFusedAheadRulesAndCompileWithoutSpills) {
  const OpDef& op = Registry::global().get("mhc.pre.bwd");
  CompileRequest r = mhc_request("mhc.pre.bwd", 4, 4096);
  const Problem p = problem_from_request(op, r);
  std::string why;
  for (int64_t algo : {6, 7})
    for (int64_t tokens : {32, 16}) {
      const Config ahead{{{"algo", algo}, {"threads", 128}, {"tokens", tokens}}};
      EXPECT_TRUE(op.tuning.valid(p, ahead, &why)) << algo << " " << tokens << ": " << why;
      const auto kernels = op.kernels(p, ahead);
      ASSERT_EQ(kernels.size(), 3u);
      EXPECT_EQ(kernels[0].kernel, "kspec::mhc_pre_bwd_token_mma_kernel");
      EXPECT_EQ(kernels[0].targs[8], algo == 7 ? "true" : "false");  // kPhiRing
      EXPECT_EQ(kernels[0].targs[9], "false");                       // no ring of rows
      EXPECT_EQ(kernels[0].targs[10], "true");                       // heads per warp
      EXPECT_EQ(kernels[1].kernel, "kspec::mhc_pre_bwd_fused_mma_kernel");
      EXPECT_EQ(kernels[1].targs.back(), "true");  // kAhead
    }
  EXPECT_EQ(op.tuning.heuristic(p).get("algo"), 10);  // mma_slice_du1_nb at nD 16384
  for (int64_t algo : {3, 4, 5}) {
    const auto kernels = op.kernels(p, Config{{{"algo", algo}, {"threads", 128}, {"tokens", 32}}});
    EXPECT_EQ(kernels[0].targs[8], "false");
    EXPECT_EQ(kernels[1].targs.back(), "false");
  }
  for (int64_t algo : {6, 7})
    for (const auto& [n, D, tokens, fragment] :
         {std::tuple{5, 256, 16, "24 projection rows"}, std::tuple{4, 100, 16, "16-byte groups"},
          std::tuple{4, 256, 64, "n x tokens / 16"}}) {
      CompileRequest q = r;
      q.params = {{"n", int64_t(n)}, {"D", int64_t(D)}};
      EXPECT_FALSE(op.tuning.valid(problem_from_request(op, q),
                                   Config{{{"algo", algo}, {"threads", 128}, {"tokens", tokens}}}, &why))
          << algo << " " << n << " " << D;
      EXPECT_NE(why.find(fragment), std::string::npos) << why;
    }
  int compiled = 0;
  for (int64_t algo : {6, 7})
    for (const char* arch : {"sm_80", "sm_90"})
      for (auto [name, dt, n, D, tokens, bare] :
           {std::tuple{"mhc.pre.bwd", DType::bf16, 4, 4096, 32, false},
            std::tuple{"mhc.pre.bwd", DType::bf16, 4, 4096, 16, true},
            std::tuple{"mhc.pre.bwd", DType::f16, 2, 256, 64, false},
            std::tuple{"mhc.pre_only.bwd", DType::f16, 8, 128, 16, false}}) {
        const OpDef& o = Registry::global().get(name);
        CompileRequest q = mhc_request(name, n, D, dt, arch);
        if (bare) q.without = {"gamma", "dx_post"};
        q.config = Config{{{"algo", algo}, {"threads", 128}, {"tokens", tokens}}};
        ASSERT_TRUE(o.tuning.valid(problem_from_request(o, q), *q.config, &why)) << name << " n " << n << ": " << why;
        for (const auto& rep : compile(q)) {
          EXPECT_EQ(rep.spill_bytes, 0) << arch << " " << rep.kernel;
          EXPECT_EQ(rep.stack_bytes, 0) << arch << " " << rep.kernel;
          if (rep.kernel.find(algo == 6 ? "fused_mma" : "token_mma") == std::string::npos) continue;
          std::cout << arch << " " << rep.kernel << ": " << rep.registers << " registers\n";
          ++compiled;
        }
      }
  EXPECT_EQ(compiled, 16);
}
