// difflogic ops without a GPU: output inference, the messages for bad input (dtypes, shapes, the consumers
// CSR's length), and the family's precompile plan compiling for sm_90 without spills. On a GPU
// (skipped without one; the generic checker cannot drive int32 inputs, so these are the ops' checks):
// layer.fwd (soft and hard) and layer.bwd against the float64 reference for every dtype over widths 1, 7,
// 33, 4097, B = 1, 33, 1024, fan-out 4 -> 2048 and self-paired gates; hard mode on {0, 1} inputs bit for
// bit; packed.fwd (w = 32, 64) over three layers bit for bit; two backward runs bitwise equal; a wire out of range gives NaN, not a fault;
// the straight-through estimator with Gumbel noise against the reference on logits + G; the feature-major
// batch-tiled kernels (config lanes) in every dtype against the reference; the staged row-major forward
// (config stage 1) against the reference and the flat row-major kernel.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <tuple>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "difflogic/reference.h"
#include "jit/driver.h"
#include "kspec/kspec.h"
#include "device_buffer_test_util.h"
#include "difflogic_layer_test_util.h"
#include "precompile_test_util.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::DevBuf;
using kspec::testing::fake;
using kspec::testing::fwd_save_xt;
using kspec::testing::LayerRun;
using kspec::testing::message_of;
using kspec::testing::tol;
using kspec::testing::transposed;
using kspec::testing::transposed_bytes;

namespace {

void expect_in(const std::string& msg, const std::vector<std::string>& fragments) {
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
}

std::vector<TensorView> fwd_inputs(int64_t B, int64_t n_in, int64_t n_out, DType dt) {
  return {TensorView(fake(1 << 28), dt, {B, n_in}, 0), TensorView(fake(2 << 28), DType::f32, {n_out, 16}, 0),
          TensorView(fake(3 << 28), DType::i32, {n_out}, 0), TensorView(fake(4 << 28), DType::i32, {n_out}, 0)};
}

std::vector<TensorView> bwd_inputs(int64_t B, int64_t n_in, int64_t n_out, DType dt) {
  auto in = fwd_inputs(B, n_in, n_out, dt);
  in.push_back(TensorView(fake(5 << 28), dt, {B, n_out}, 0));
  in.push_back(TensorView(fake(6 << 28), DType::i32, {n_in + 1 + 2 * n_out}, 0));
  return in;
}

}  // namespace

TEST(DiffLogic, InferOutputs) {
  auto y = infer_outputs("difflogic.layer.fwd", fwd_inputs(3, 10, 7, DType::bf16));
  ASSERT_EQ(y.size(), 2u);
  EXPECT_EQ(y[0].shape, (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(y[0].dtype, DType::bf16);
  EXPECT_FALSE(y[1].present) << "xt is an output only with save_xt";
  Params save;
  save.set("save_xt", true);
  y = infer_outputs("difflogic.layer.fwd", fwd_inputs(3, 10, 7, DType::bf16), save);
  ASSERT_TRUE(y[1].present);
  EXPECT_EQ(y[1].shape, (std::vector<int64_t>{10, 3}));  // [n_in, batch]
  EXPECT_EQ(y[1].dtype, DType::bf16);
  save.set("layout", std::string("feature_major"));
  expect_in(message_of([&] { infer_outputs("difflogic.layer.fwd", fwd_inputs(3, 10, 7, DType::f32), save); }),
            {"save_xt", "row_major"});
  auto g = infer_outputs("difflogic.layer.bwd", bwd_inputs(3, 10, 7, DType::f16));
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].shape, (std::vector<int64_t>{3, 10}));
  EXPECT_EQ(g[0].dtype, DType::f16);
  EXPECT_EQ(g[1].shape, (std::vector<int64_t>{7, 16}));
  EXPECT_EQ(g[1].dtype, DType::f32);
}

// difflogic.transpose: y [cols, rows] in x's dtype; a strided x is refused by name (the op reads rows), and
// every dtype and config compiles for sm_80 and sm_90 without spills or a stack frame (64 x 64 tiles: 16
// or 32 values a thread held between its loads and its shared-memory stores).
TEST(DiffLogic, TransposeShapesMessagesAndCompiles) {
  auto y = infer_outputs("difflogic.transpose", {TensorView(fake(), DType::bf16, {5, 3}, 0)});
  ASSERT_EQ(y.size(), 1u);
  EXPECT_EQ(y[0].shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(y[0].dtype, DType::bf16);
  expect_in(message_of([] {
              infer_outputs("difflogic.transpose", {TensorView::strided(fake(), DType::f32, {5, 3}, {1, 5}, 0)});
            }),
            {"difflogic.transpose", "'x'"});
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (int64_t threads : {128, 256})
      for (const char* arch : {"sm_80", "sm_90"}) {
        CompileRequest r;
        r.op = "difflogic.transpose";
        r.dtype = dt;
        r.arch = arch;
        r.config = Config{{{"threads", threads}}};
        const auto reports = compile(r);
        ASSERT_EQ(reports.size(), 1u);
        EXPECT_EQ(reports[0].spill_bytes, 0) << arch << " " << dtype_short(dt) << " " << threads;
        EXPECT_EQ(reports[0].stack_bytes, 0) << arch << " " << dtype_short(dt) << " " << threads;
      }
}

TEST(DiffLogic, ValidationNamesTheArgument) {
  const char* fwd = "difflogic.layer.fwd";
  {
    auto in = fwd_inputs(3, 10, 7, DType::f32);
    in[2] = TensorView(fake(9 << 28), DType::i64, {7}, 0);
    expect_in(message_of([&] { infer_outputs(fwd, in); }), {"input 'a'", "int32"});
  }
  {
    auto in = fwd_inputs(3, 10, 7, DType::f32);
    in[1] = TensorView(fake(9 << 28), DType::bf16, {7, 16}, 0);
    expect_in(message_of([&] { infer_outputs(fwd, in); }), {"input 'logits'", "float32"});
  }
  {
    auto in = fwd_inputs(3, 10, 7, DType::f32);
    in[1] = TensorView(fake(9 << 28), DType::f32, {7, 15}, 0);
    expect_in(message_of([&] { infer_outputs(fwd, in); }), {"input 'logits'", "16"});
  }
  {
    auto in = fwd_inputs(3, 10, 7, DType::f32);
    in[3] = TensorView(fake(9 << 28), DType::i32, {8}, 0);
    expect_in(message_of([&] { infer_outputs(fwd, in); }), {"input 'b'", "n_out"});
  }
  {
    auto in = fwd_inputs(3, 10, 7, DType::f64);
    expect_in(message_of([&] { infer_outputs(fwd, in); }), {"input 'x'"});
  }
  {
    auto in = fwd_inputs(3, 10, 7, DType::f32);
    expect_in(message_of([&] { infer_outputs(fwd, in, {{"mode", std::string("ste")}}); }), {"parameter 'mode'", "hard"});
  }
  {
    auto in = bwd_inputs(3, 10, 7, DType::bf16);
    in[5] = TensorView(fake(9 << 28), DType::i32, {20}, 0);
    expect_in(message_of([&] { infer_outputs("difflogic.layer.bwd", in); }),
              {"input 'consumers'", "20 elements", "n_in + 1 + 2 n_out = 25"});
  }
  {
    auto in = bwd_inputs(3, 10, 7, DType::bf16);
    in[4] = TensorView(fake(9 << 28), DType::f32, {3, 7}, 0);
    expect_in(message_of([&] { infer_outputs("difflogic.layer.bwd", in); }), {"input 'dout'"});
  }
}

// layout: row_major wants contiguous activations, feature_major the transpose of contiguous [n, B]
// (checked on calls); a size-1 batch fits both.
TEST(DiffLogic, LayoutChecksTheStrides) {
  const OpDef& fwd = Registry::global().get("difflogic.layer.fwd");
  const OpDef& bwd = Registry::global().get("difflogic.layer.bwd");
  const Params fm = {{"layout", std::string("feature_major")}};
  auto t = [](uintptr_t at, int64_t B, int64_t n) { return TensorView::strided(fake(at << 28), DType::f32, {B, n}, {1, B}, 0); };
  auto rm = [](uintptr_t at, int64_t B, int64_t n) { return TensorView(fake(at << 28), DType::f32, {B, n}, 0); };
  auto in = fwd_inputs(3, 10, 7, DType::f32);
  in[0] = t(1, 3, 10);
  EXPECT_NO_THROW(validate_call(fwd, in, {t(8, 3, 7), TensorView()}, fm, nullptr));
  expect_in(message_of([&] { validate_call(fwd, in, {t(8, 3, 7), TensorView()}, {}, nullptr); }),
            {"input 'x'", "layout 'row_major' expects strides (10, 1)", "layout='feature_major'"});
  expect_in(message_of([&] { validate_call(fwd, in, {rm(8, 3, 7), TensorView()}, fm, nullptr); }),
            {"output 'y'", "layout 'feature_major' expects strides (1, 3)"});
  EXPECT_NO_THROW(validate_call(fwd, fwd_inputs(1, 10, 7, DType::f32), {t(8, 1, 7), TensorView()}, fm, nullptr));
  auto bin = bwd_inputs(3, 10, 7, DType::f32);
  bin[0] = t(1, 3, 10);
  bin[4] = t(5, 3, 7);
  const TensorView dlogits(fake(9 << 28), DType::f32, {7, 16}, 0);
  EXPECT_NO_THROW(validate_call(bwd, bin, {t(8, 3, 10), dlogits}, fm, nullptr));
  expect_in(message_of([&] { validate_call(bwd, bin, {rm(8, 3, 10), dlogits}, fm, nullptr); }), {"output 'dx'"});
  bin[4] = rm(5, 3, 7);
  expect_in(message_of([&] { validate_call(bwd, bin, {t(8, 3, 10), dlogits}, fm, nullptr); }), {"input 'dout'"});
}

TEST(DiffLogic, PackedInferenceAndMessages) {
  const char* op = "difflogic.packed.fwd";
  auto in = [](DType words_dt, int64_t words) {
    return std::vector<TensorView>{TensorView(fake(1 << 28), words_dt, {10, words}, 0),
                                   TensorView(fake(2 << 28), DType::f32, {7, 16}, 0),
                                   TensorView(fake(3 << 28), DType::i32, {7}, 0),
                                   TensorView(fake(4 << 28), DType::i32, {7}, 0)};
  };
  auto y = infer_outputs(op, in(DType::i64, 2), {{"batch", int64_t{100}}});
  ASSERT_EQ(y.size(), 1u);
  EXPECT_EQ(y[0].shape, (std::vector<int64_t>{7, 2}));
  EXPECT_EQ(y[0].dtype, DType::i64);
  // Checked on calls (check_call), after the outputs are validated.
  expect_in(message_of([&] {
              validate_call(Registry::global().get(op), in(DType::i32, 3),
                            {TensorView(fake(5 << 28), DType::i32, {7, 3}, 0)}, {{"batch", int64_t{100}}}, nullptr);
            }),
            {"parameter 'batch' = 100 needs 4 words of 32 bits", "input 'x' has 3"});
  expect_in(message_of([&] { infer_outputs(op, in(DType::f32, 4), {{"batch", int64_t{100}}}); }), {"input 'x'", "int32"});
  expect_in(message_of([&] { infer_outputs(op, in(DType::i32, 4), {{"batch", int64_t{0}}}); }), {"parameter 'batch'"});
}

// What `kspec precompile --all` builds for the family (every dtype, every config of the representative
// cases), and the layer ops' feature-major variants of the same requests (no case of theirs: the cases'
// generated inputs are row-major) with every lanes value (0: the flat kernels; else the batch-tiled ones,
// for sm_80 as well, which CI's precompile does not reach), compile for sm_90 without spills or a stack frame.
TEST(DiffLogic, PrecompilePlanCompilesWithoutSpills) {
  // Row-major bwd: tables, dx, dlogits partials and finish; feature-major: tables, dx, dlogits (flat) or
  // tables, dx with the dlogits partials, finish (tiled). Row-major fwd at stage 1: tables, staged, flat; at stage
  // 2 and 4 tables, the cluster kernel, flat (sm_90 only: sm_80 refuses them by name); at stage 8 the tables
  // with the packed wires, the hybrid kernel (test_difflogic_hybrid.cpp has its own checks).
  const std::map<std::string, size_t> kernels = {
      {"difflogic.layer.fwd", 2}, {"difflogic.layer.bwd", 4}, {"difflogic.packed.fwd", 1}};
  const auto kernels_of = [&](const CompileRequest& r) {
    const int64_t stage = r.config && r.config->has("stage") ? r.config->get("stage") : 0;
    return kernels.at(r.op) + (stage == 1 || stage == 2 || stage == 4 ? 1 : 0);
  };
  std::map<std::string, int> requests;
  auto check = [](const CompileRequest& r, size_t want) {
    EXPECT_EQ(kspec::testing::expect_compiles_without_spills(r).size(), want) << r.op;
  };
  for (const auto& r : precompile_plan({"sm_90"}, {"difflogic.layer.fwd", "difflogic.layer.bwd", "difflogic.packed.fwd"})) {
    ++requests[r.op];
    check(r, kernels_of(r));
    if (r.op == "difflogic.packed.fwd") continue;
    ASSERT_TRUE(r.config.has_value()) << r.op;
    EXPECT_EQ(r.config->get("lanes"), 0) << r.op << ": row-major has the flat or staged kernels only";
    const ParamValue* mode = r.params.find("mode");
    const bool fwd = r.op == "difflogic.layer.fwd";
    if (fwd && r.config->get("stage")) {  // the staged kernel for sm_80 too (its 1024 threads: 64 registers)
      CompileRequest sm80 = r;
      sm80.arch = "sm_80";
      if (r.config->get("stage") == 1 || r.config->get("stage") == 8)
        check(sm80, kernels_of(r));
      else
        expect_in(message_of([&] { compile(sm80); }), {"stage " + std::to_string(r.config->get("stage")),
                                                       "thread-block cluster", "needs sm_90", "sm_80"});
      continue;
    }
    for (int64_t lanes : {0, 4, 8, 16, 32}) {
      // The tiled kernels once per dtype (the forward's mode changes the tables kernel only; 128 and 256
      // threads allow the same 255 registers a thread): CI time.
      if (lanes > 0 && ((mode && std::get<std::string>(*mode) == "hard") || r.config->get("threads") != 256))
        continue;
      CompileRequest fm = r;
      fm.params.set("layout", std::string("feature_major"));
      fm.config = Config{{{"threads", r.config->get("threads")}, {"lanes", lanes}}};
      fm.config->values.push_back({fwd ? "stage" : "ahead", 0});
      if (!fwd) fm.config->values.push_back({"pool", 0});
      for (const char* arch : {"sm_90", "sm_80"}) {
        if (lanes == 0 && std::string(arch) == "sm_80") continue;
        fm.arch = arch;
        check(fm, r.op == "difflogic.layer.bwd" ? 3 : 2);
        if (!fwd && lanes > 0) {  // the readers' loads a step ahead
          CompileRequest ahead = fm;
          ahead.config = Config{{{"threads", r.config->get("threads")}, {"lanes", lanes}, {"ahead", 1}, {"pool", 0}}};
          check(ahead, 3);
        }
      }
    }
  }
  // soft and hard x 3 dtypes x 10 configs (threads x stage); 3 dtypes x 2 configs; 2 word widths x 2 threads x
  // 2 vec.
  EXPECT_EQ(requests["difflogic.layer.fwd"], 60);
  EXPECT_EQ(requests["difflogic.layer.bwd"], 6);
  EXPECT_EQ(requests["difflogic.packed.fwd"], 8);
}

// The lanes axis: feature-major defaults to the batch-tiled kernels (lanes 16 forward, 32 backward), row-major
// keeps the flat ones and refuses lanes > 0 with a message naming the axis and the layout.
TEST(DiffLogic, TiledKernelsAreFeatureMajorsDefault) {
  auto kernel_names = [](const std::string& op, const std::string& layout, std::optional<Config> config) {
    CompileRequest r;
    r.op = op;
    r.params.set("layout", layout);
    r.config = std::move(config);
    std::string names;
    for (const auto& rep : compile(r)) names += rep.kernel + " ";
    return names;
  };
  expect_in(kernel_names("difflogic.layer.fwd", "feature_major", std::nullopt),
            {"difflogic_fwd_tiled_kernel<float, 256, 16>"});
  expect_in(kernel_names("difflogic.layer.bwd", "feature_major", std::nullopt),
            {"difflogic_bwd_tiled_kernel<float, 256, 32, false, true>", "difflogic_dlogits_finish_kernel<256, 128>"});
  expect_in(kernel_names("difflogic.layer.bwd", "feature_major",
                         Config{{{"threads", 256}, {"lanes", 8}, {"ahead", 0}, {"pool", 0}}}),
            {"difflogic_bwd_tiled_kernel<float, 256, 8>"});
  expect_in(kernel_names("difflogic.layer.fwd", "row_major", std::nullopt),
            {"difflogic_fwd_staged_kernel<float, 1024>", "difflogic_fwd_kernel<float, 256, false>"});
  expect_in(kernel_names("difflogic.layer.fwd", "row_major", Config{{{"threads", 128}, {"lanes", 0}, {"stage", 0}}}),
            {"difflogic_fwd_kernel<float, 128, false>"});
  expect_in(kernel_names("difflogic.layer.bwd", "feature_major",
                         Config{{{"threads", 128}, {"lanes", 0}, {"ahead", 0}, {"pool", 0}}}),
            {"difflogic_dx_kernel<float, 128, true>", "difflogic_dlogits_fm_kernel<float, 128>"});
  const Config tiled{{{"threads", 256}, {"lanes", 8}, {"stage", 0}}};
  expect_in(message_of([&] { kernel_names("difflogic.layer.fwd", "row_major", tiled); }), {"lanes", "feature_major"});
  const Config staged{{{"threads", 256}, {"lanes", 0}, {"stage", 1}}};
  expect_in(message_of([&] { kernel_names("difflogic.layer.fwd", "feature_major", staged); }),
            {"stage 1", "row_major"});
}

// dx_layout row_major: the tiled backward's row-major-dx variant, compiled for sm_80 and sm_90 in every dtype
// and lanes without spills; the flat kernels (lanes 0) refuse it by name; a feature-major dx is refused.
TEST(DiffLogic, RowMajorDxKernels) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (int64_t lanes : {4, 8, 16, 32})
      for (const char* arch : {"sm_80", "sm_90"}) {
        CompileRequest r;
        r.op = "difflogic.layer.bwd";
        r.dtype = dt;
        r.arch = arch;
        r.params.set("layout", std::string("feature_major"));
        r.params.set("dx_layout", std::string("row_major"));
        for (int64_t ahead : {0, 1}) {
          if (ahead && lanes != 32) continue;  // the default lanes' (CI time; PrecompilePlan compiles the others)
          r.config = Config{{{"threads", 256}, {"lanes", lanes}, {"ahead", ahead}, {"pool", 0}}};
          const auto reports = compile(r);
          ASSERT_EQ(reports.size(), 3u);
          EXPECT_NE(reports[1].kernel.find("difflogic_bwd_tiled_kernel<"), std::string::npos) << reports[1].kernel;
          EXPECT_NE(reports[1].kernel.find(ahead ? ", true, true>" : ", true>"), std::string::npos)
              << reports[1].kernel;
          for (const auto& rep : reports) {
            EXPECT_EQ(rep.spill_bytes, 0) << arch << " " << dtype_short(dt) << " lanes " << lanes << ": " << rep.kernel;
            EXPECT_EQ(rep.stack_bytes, 0) << arch << " " << dtype_short(dt) << " lanes " << lanes << ": " << rep.kernel;
          }
        }
      }
  CompileRequest flat;
  flat.op = "difflogic.layer.bwd";
  flat.params.set("layout", std::string("feature_major"));
  flat.params.set("dx_layout", std::string("row_major"));
  flat.config = Config{{{"threads", 256}, {"lanes", 0}, {"ahead", 0}, {"pool", 0}}};
  expect_in(message_of([&] { compile(flat); }), {"dx_layout", "lanes"});
  flat.params.set("dx_layout", std::string("as_x"));
  flat.config = Config{{{"threads", 256}, {"lanes", 0}, {"ahead", 1}, {"pool", 0}}};
  expect_in(message_of([&] { compile(flat); }), {"ahead 1", "lanes > 0"});
  const int64_t B = 8, n_in = 10, n_out = 7;
  auto in = bwd_inputs(B, n_in, n_out, DType::f32);
  in[0] = TensorView::strided(fake(1 << 28), DType::f32, {B, n_in}, {1, B}, 0);
  in[4] = TensorView::strided(fake(5 << 28), DType::f32, {B, n_out}, {1, B}, 0);
  Params p;
  p.set("layout", std::string("feature_major"));
  p.set("dx_layout", std::string("row_major"));
  const TensorView dx_fm = TensorView::strided(fake(7 << 28), DType::f32, {B, n_in}, {1, B}, 0);
  const TensorView dl(fake(8 << 28), DType::f32, {n_out, 16}, 0);
  const OpDef& bwd = Registry::global().get("difflogic.layer.bwd");
  EXPECT_NO_THROW(validate_call(bwd, in, {TensorView(fake(7 << 28), DType::f32, {B, n_in}, 0), dl}, p, nullptr));
  expect_in(message_of([&] { validate_call(bwd, in, {dx_fm, dl}, p, nullptr); }),
            {"output 'dx'", "dx_layout 'row_major' expects strides (10, 1)"});
}

class DiffLogicGpu : public ::testing::TestWithParam<std::tuple<DType, std::tuple<int64_t, int64_t, int64_t>>> {};

TEST_P(DiffLogicGpu, LayerMatchesReference) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const DType dt = std::get<0>(GetParam());
  const auto [B, n_in, n_out] = std::get<1>(GetParam());
  LayerRun r(B, n_in, n_out, dt, false, static_cast<uint64_t>(B * 1009 + n_in * 31 + n_out));
  for (const char* mode : {"soft", "hard"}) {
    const auto want = r.fwd_ref(mode);
    EXPECT_LE(rel_error(r.fwd(mode), want), tol(dt)) << mode << " " << dtype_short(dt);
  }
  const auto want = r.bwd_ref(1.5);
  const auto got = r.bwd(1.5);
  EXPECT_LE(rel_error(decode(dt, got.first), want.dx), tol(dt)) << "dx " << dtype_short(dt);
  EXPECT_LE(rel_error(decode(DType::f32, got.second), want.dlogits), tol(dt)) << "dlogits " << dtype_short(dt);
  const auto again = r.bwd(1.5);  // fixed-order sums: the same bits
  EXPECT_TRUE(got.first == again.first) << "dx differs between two runs";
  EXPECT_TRUE(got.second == again.second) << "dlogits differs between two runs";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DiffLogicGpu,
    ::testing::Combine(::testing::Values(DType::f32, DType::f16, DType::bf16),
                       ::testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(33, 7, 33),
                                         std::make_tuple(1, 33, 7), std::make_tuple(33, 4097, 4097),
                                         std::make_tuple(1024, 1000, 1000), std::make_tuple(8, 4, 2048))));

// Both layouts (row-major: the chunked dlogits; feature-major: every kernel along the batch) against the
// reference: widths 1 to 4097, B = 1, 33 (a partial chunk), 1024 (16 chunks), every third gate
// self-paired, inputs read by many gates (n_in 7 or 33 under 4097 gates), unread inputs' dx exactly 0, two
// runs bitwise equal.
class DiffLogicGpuLayout
    : public ::testing::TestWithParam<std::tuple<bool, DType, std::tuple<int64_t, int64_t, int64_t>>> {};

TEST_P(DiffLogicGpuLayout, MatchesReference) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const bool fm = std::get<0>(GetParam());
  const DType dt = std::get<1>(GetParam());
  const auto [B, n_in, n_out] = std::get<2>(GetParam());
  LayerRun r(B, n_in, n_out, dt, false, static_cast<uint64_t>(B * 7 + n_in * 13 + n_out), fm);
  for (const char* mode : {"soft", "hard"}) {
    const auto want = r.fwd_ref(mode);
    EXPECT_LE(rel_error(r.fwd(mode), want), tol(dt)) << mode;
  }
  const auto want = r.bwd_ref(0.5);
  const auto got = r.bwd(0.5);
  const auto dx = r.values(got.first, n_in);
  EXPECT_LE(rel_error(dx, want.dx), tol(dt)) << "dx";
  EXPECT_LE(rel_error(decode(DType::f32, got.second), want.dlogits), tol(dt)) << "dlogits";
  r.expect_unread_inputs_zero(dx);
  const auto again = r.bwd(0.5);
  EXPECT_TRUE(got.first == again.first) << "dx differs between two runs";
  EXPECT_TRUE(got.second == again.second) << "dlogits differs between two runs";
  EXPECT_TRUE(r.fwd("soft") == r.fwd("soft")) << "y differs between two runs";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DiffLogicGpuLayout,
    ::testing::Combine(::testing::Bool(), ::testing::Values(DType::f32, DType::bf16),
                       ::testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(33, 7, 33),
                                         std::make_tuple(1024, 33, 7), std::make_tuple(1, 4097, 7),
                                         std::make_tuple(33, 7, 4097), std::make_tuple(1024, 4097, 4097))));

// The feature-major batch-tiled kernels (lanes 4, 8, 16, 32; 0 the flat ones, for comparison) in every dtype
// against the reference: B = 1, 2 and 33 (rows not 16-byte aligned: the scalar path), 1032 (aligned, a
// partial last tile), 1024 (whole tiles); widths 1, 7, 999, 4097; every third gate self-paired, repeated
// wires, an input read by 2048 gates (4 -> 2048); unread inputs' dx exactly 0; two runs bitwise equal.
class DiffLogicGpuTiled
    : public ::testing::TestWithParam<std::tuple<DType, int64_t, std::tuple<int64_t, int64_t, int64_t>>> {};

TEST_P(DiffLogicGpuTiled, MatchesReference) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const DType dt = std::get<0>(GetParam());
  const int64_t lanes = std::get<1>(GetParam());
  const auto [B, n_in, n_out] = std::get<2>(GetParam());
  LayerRun r(B, n_in, n_out, dt, false, static_cast<uint64_t>(B * 5 + n_in * 17 + n_out + lanes), true);
  for (int64_t threads : {128, 256}) {
    const Config config{{{"threads", threads}, {"lanes", lanes}, {"ahead", 0}, {"pool", 0}}};
    const Config fwd_config{{{"threads", threads}, {"lanes", lanes}, {"stage", 0}}};
    for (const char* mode : {"soft", "hard"}) {
      const auto want = r.fwd_ref(mode);
      EXPECT_LE(rel_error(r.fwd(mode, {}, &fwd_config), want), tol(dt)) << mode << " threads " << threads;
    }
    const auto want = r.bwd_ref(0.5);
    const auto got = r.bwd(0.5, {}, &config);
    const auto dx = r.values(got.first, n_in);
    EXPECT_LE(rel_error(dx, want.dx), tol(dt)) << "dx threads " << threads;
    EXPECT_LE(rel_error(decode(DType::f32, got.second), want.dlogits), tol(dt)) << "dlogits threads " << threads;
    r.expect_unread_inputs_zero(dx);
    const auto again = r.bwd(0.5, {}, &config);
    EXPECT_TRUE(got.first == again.first) << "dx differs between two runs";
    EXPECT_TRUE(got.second == again.second) << "dlogits differs between two runs";
    EXPECT_TRUE(r.fwd("soft", {}, &fwd_config) == r.fwd("soft", {}, &fwd_config)) << "y differs between two runs";
    if (lanes > 0) {  // the readers' loads a step ahead: only the loads move, so the same bits
      const Config ahead{{{"threads", threads}, {"lanes", lanes}, {"ahead", 1}, {"pool", 0}}};
      EXPECT_TRUE(r.bwd(0.5, {}, &ahead) == got) << "ahead 1 differs from ahead 0, threads " << threads;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DiffLogicGpuTiled,
    ::testing::Combine(::testing::Values(DType::f32, DType::f16, DType::bf16), ::testing::Values(0, 4, 8, 16, 32),
                       ::testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(2, 7, 33),
                                         std::make_tuple(33, 4097, 999), std::make_tuple(1032, 999, 1000),
                                         std::make_tuple(1024, 4, 2048), std::make_tuple(1024, 33, 7))));

// dx_layout row_major (x and dout feature-major, dx contiguous [B, n_in], written through shared memory):
// the same sums in the same order as the feature-major dx, so dx equals it bit for bit once transposed, and
// dlogits is the same bits; B = 1, 2, 33 (scalar path), 1032 (a partial last tile), widths that no block of
// inputs divides, 4 -> 2048 fan-out.
class DiffLogicGpuRowMajorDx
    : public ::testing::TestWithParam<std::tuple<DType, int64_t, std::tuple<int64_t, int64_t, int64_t>>> {};

TEST_P(DiffLogicGpuRowMajorDx, EqualsFeatureMajorDx) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const DType dt = std::get<0>(GetParam());
  const int64_t lanes = std::get<1>(GetParam());
  const auto [B, n_in, n_out] = std::get<2>(GetParam());
  LayerRun r(B, n_in, n_out, dt, false, static_cast<uint64_t>(B * 3 + n_in * 7 + n_out + lanes), true);
  for (int64_t threads : {128, 256}) {
    const Config config{{{"threads", threads}, {"lanes", lanes}, {"ahead", 0}, {"pool", 0}}};
    const Config ahead{{{"threads", threads}, {"lanes", lanes}, {"ahead", 1}, {"pool", 0}}};
    const auto fm = r.bwd(0.5, {}, &config);
    const auto rm = r.bwd_dx_row_major(0.5, &config);
    EXPECT_TRUE(r.bwd_dx_row_major(0.5, &ahead) == rm) << "ahead 1 differs from ahead 0, threads " << threads;
    const auto want = r.bwd_ref(0.5);
    EXPECT_LE(rel_error(decode(dt, rm.first), want.dx), tol(dt)) << "dx threads " << threads;
    EXPECT_TRUE(decode(dt, rm.first) == r.values(fm.first, n_in)) << "dx differs from the feature-major dx";
    EXPECT_TRUE(rm.second == fm.second) << "dlogits differs from the feature-major run's";
    EXPECT_TRUE(r.bwd_dx_row_major(0.5, &config) == rm) << "two runs differ";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DiffLogicGpuRowMajorDx,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16), ::testing::Values(4, 8, 16, 32),
                       ::testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(2, 7, 33),
                                         std::make_tuple(33, 4097, 999), std::make_tuple(1032, 999, 1000),
                                         std::make_tuple(1024, 4, 2048))));

// The staged row-major forward (stage 1: whole rows of x in shared memory) in every dtype and mode against
// the reference and the flat row-major kernel (stage 0; equal up to FMA contractions): widths 1, 7, 33, 4097
// and 16383 (a row of 64 KB in fp32: 3 rows a pass on the H100), B = 1, 2, 33, 1031 (not a multiple of any
// pass; rows not 16-byte aligned at odd widths: the element-by-element copy), self-paired gates (every
// third), an input read by about 1000 gates (2 -> 1000), unread inputs (n_in 4097 under 7 gates); two runs
// bitwise equal. A width whose row does not fit (65536 fp32: 256 KB, over the H100's 227 KB; in halves 128 KB
// fits) takes the flat kernel from the same plan: also against the reference.
class DiffLogicGpuStaged
    : public ::testing::TestWithParam<std::tuple<DType, std::tuple<int64_t, int64_t, int64_t>>> {};

TEST_P(DiffLogicGpuStaged, MatchesReferenceAndFlatKernel) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const DType dt = std::get<0>(GetParam());
  const auto [B, n_in, n_out] = std::get<1>(GetParam());
  LayerRun r(B, n_in, n_out, dt, false, static_cast<uint64_t>(B * 11 + n_in * 3 + n_out));
  const Config staged{{{"threads", 256}, {"lanes", 0}, {"stage", 1}}};
  const Config flat{{{"threads", 256}, {"lanes", 0}, {"stage", 0}}};
  // Ulps of the activation dtype: the flat kernel's y may differ by the FMA contractions' rounding.
  const double near = dt == DType::f32 ? 1e-6 : tolerance_for(dt);
  for (const char* mode : {"soft", "hard"}) {
    const auto want = r.fwd_ref(mode);
    const auto got = r.fwd(mode, {}, &staged);
    EXPECT_LE(rel_error(got, want), tol(dt)) << mode << " " << dtype_short(dt);
    EXPECT_LE(rel_error(got, r.fwd(mode, {}, &flat)), near) << mode << " " << dtype_short(dt) << ": vs stage 0";
    EXPECT_TRUE(got == r.fwd(mode, {}, &staged)) << mode << ": y differs between two runs";
  }
  // The default config of a row-major forward is the staged one.
  EXPECT_TRUE(r.fwd("soft") == r.fwd("soft", {}, &staged)) << "the default is not stage 1";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DiffLogicGpuStaged,
    ::testing::Combine(::testing::Values(DType::f32, DType::f16, DType::bf16),
                       ::testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(2, 7, 33),
                                         std::make_tuple(33, 33, 7), std::make_tuple(1031, 4097, 4097),
                                         std::make_tuple(33, 4097, 7), std::make_tuple(1031, 2, 1000),
                                         std::make_tuple(7, 16383, 999), std::make_tuple(3, 65536, 257))));

namespace {

bool difflogic_device_has_clusters() {
  CUdevice dev;
  int major = 0;
  CU_CHECK(cuDeviceGet(&dev, 0));
  CU_CHECK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
  return major >= 9;
}

}  // namespace

// The cluster-staged row-major forward (stage 2 and 4: a row split across a thread-block cluster's shared
// memories, read through distributed shared memory; sm_90 and newer) in every dtype and mode against the
// reference and the one-block staged kernel (stage 1; equal up to FMA contractions), two runs bitwise equal:
// widths 1 (ranks without a column), 7, 33, 4097, 64000 (fp32: 256 KB a row, which only a cluster holds; the
// one-block kernel falls back to the flat one there), B 1, 2, 33, 1031 (no pass divides it; odd widths take
// the element-by-element copy), self-paired gates (every third), an input read by about 1000 gates (2 ->
// 1000), unread inputs (4097 -> 7).
class DiffLogicGpuStagedCluster
    : public ::testing::TestWithParam<std::tuple<int64_t, DType, std::tuple<int64_t, int64_t, int64_t>>> {};

TEST_P(DiffLogicGpuStagedCluster, MatchesReferenceAndOneBlockKernel) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  if (!difflogic_device_has_clusters()) GTEST_SKIP() << "thread-block clusters need sm_90";
  const int64_t cluster = std::get<0>(GetParam());
  const DType dt = std::get<1>(GetParam());
  const auto [B, n_in, n_out] = std::get<2>(GetParam());
  LayerRun r(B, n_in, n_out, dt, false, static_cast<uint64_t>(B * 13 + n_in * 5 + n_out));
  const Config clustered{{{"threads", 256}, {"lanes", 0}, {"stage", cluster}}};
  const Config one_block{{{"threads", 256}, {"lanes", 0}, {"stage", 1}}};
  const double near = dt == DType::f32 ? 1e-6 : tolerance_for(dt);
  for (const char* mode : {"soft", "hard"}) {
    const auto want = r.fwd_ref(mode);
    const auto got = r.fwd(mode, {}, &clustered);
    EXPECT_LE(rel_error(got, want), tol(dt)) << mode << " " << dtype_short(dt) << " cluster " << cluster;
    EXPECT_LE(rel_error(got, r.fwd(mode, {}, &one_block)), near) << mode << " " << dtype_short(dt) << ": vs stage 1";
    EXPECT_TRUE(got == r.fwd(mode, {}, &clustered)) << mode << ": y differs between two runs";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DiffLogicGpuStagedCluster,
    ::testing::Combine(::testing::Values(int64_t{2}, int64_t{4}),
                       ::testing::Values(DType::f32, DType::f16, DType::bf16),
                       ::testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(2, 7, 33),
                                         std::make_tuple(33, 33, 7), std::make_tuple(1031, 4097, 4097),
                                         std::make_tuple(33, 4097, 7), std::make_tuple(1031, 2, 1000),
                                         std::make_tuple(5, 64000, 64000))));

// save_xt: the forward also writes x transposed ([n_in, B], bit for bit x's values), y unchanged (against the
// reference, and equal to the same config without save_xt up to FMA contractions): from the staged kernel's
// shared memory at stage 1, by the transpose kernel after the flat one (stage 0, and stage 1 where a row does
// not fit: 65536 fp32) and after the cluster kernel (stage 4, sm_90). Widths 1, 7, 33, 4097, 16000 (3 rows a
// pass in fp32), B 1, 2, 33, 1031; two runs bitwise equal.
class DiffLogicGpuSaveXt
    : public ::testing::TestWithParam<std::tuple<DType, std::tuple<int64_t, int64_t, int64_t>>> {};

TEST_P(DiffLogicGpuSaveXt, WritesXTransposedBesideY) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const DType dt = std::get<0>(GetParam());
  const auto [B, n_in, n_out] = std::get<1>(GetParam());
  LayerRun r(B, n_in, n_out, dt, false, static_cast<uint64_t>(B * 17 + n_in * 7 + n_out));
  const auto xt_want = transposed_bytes(r);
  const double near = dt == DType::f32 ? 1e-6 : tolerance_for(dt);
  std::vector<int64_t> stages = {0, 1};
  if (difflogic_device_has_clusters()) stages.push_back(4);
  for (int64_t stage : stages) {
    const Config config{{{"threads", 256}, {"lanes", 0}, {"stage", stage}}};
    const auto want = ref::difflogic_layer_fwd_ref(B, n_in, r.x, r.logits, r.a, r.b, ref::DiffLogicMode::Soft);
    const auto [y, xt] = fwd_save_xt(r, "soft", config);
    EXPECT_LE(rel_error(y, want), tol(dt)) << dtype_short(dt) << " stage " << stage;
    EXPECT_LE(rel_error(y, r.fwd("soft", {}, &config)), near) << dtype_short(dt) << " stage " << stage;
    EXPECT_TRUE(xt == xt_want) << dtype_short(dt) << " stage " << stage << ": xt is not x transposed";
    const auto again = fwd_save_xt(r, "soft", config);
    EXPECT_TRUE(again.first == y && again.second == xt) << "stage " << stage << ": two runs differ";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DiffLogicGpuSaveXt,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16),
                       ::testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(2, 7, 33),
                                         std::make_tuple(33, 33, 7), std::make_tuple(1031, 4097, 4097),
                                         std::make_tuple(33, 16000, 16000), std::make_tuple(3, 65536, 257))));

// pool (the backward's inputs handed out on demand within a block): the same sums in the same order as the
// tiled kernel (pool 0), so dx and dlogits equal its bits, feature-major and row-major dx alike, ahead 0 and 1;
// against the reference; unread inputs get dx 0; two runs bitwise equal. Widths 1, 7, 33, 4097 (no pool
// divides them), 64000 (fp32 and bf16), B 1, 2, 33, 1032 (a partial last tile), self-paired gates (every
// third), an input read by about 1000 gates (2 -> 1000, and 4 -> 2048), unread inputs (4097 -> 7).
class DiffLogicGpuPool
    : public ::testing::TestWithParam<std::tuple<DType, int64_t, std::tuple<int64_t, int64_t, int64_t>>> {};

TEST_P(DiffLogicGpuPool, EqualsTiledKernelBitForBit) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const DType dt = std::get<0>(GetParam());
  const int64_t lanes = std::get<1>(GetParam());
  const auto [B, n_in, n_out] = std::get<2>(GetParam());
  LayerRun r(B, n_in, n_out, dt, false, static_cast<uint64_t>(B * 5 + n_in * 11 + n_out + lanes), true);
  const auto want = r.bwd_ref(0.5);
  for (int64_t ahead : {0, 1}) {
    const Config tiled{{{"threads", 256}, {"lanes", lanes}, {"ahead", ahead}, {"pool", 0}}};
    const auto fm = r.bwd(0.5, {}, &tiled);
    const auto rm = r.bwd_dx_row_major(0.5, &tiled);
    for (int64_t pool : {32, 64}) {
      const Config pooled{{{"threads", 256}, {"lanes", lanes}, {"ahead", ahead}, {"pool", pool}}};
      const std::string what = "pool " + std::to_string(pool) + " ahead " + std::to_string(ahead);
      const auto got = r.bwd(0.5, {}, &pooled);
      EXPECT_TRUE(got == fm) << what << ": feature-major dx or dlogits differ from the tiled kernel's";
      const auto dx = r.values(got.first, n_in);
      EXPECT_LE(rel_error(dx, want.dx), tol(dt)) << what << " dx";
      EXPECT_LE(rel_error(decode(DType::f32, got.second), want.dlogits), tol(dt)) << what << " dlogits";
      for (int64_t j = 0; j < n_in; ++j) {
        if (r.csr[j] != r.csr[j + 1]) continue;
        for (int64_t s = 0; s < B; ++s) ASSERT_EQ(dx[s * n_in + j], 0.0) << what << ": unread input " << j;
      }
      EXPECT_TRUE(r.bwd(0.5, {}, &pooled) == got) << what << ": two runs differ";
      if (dt != DType::f32 && lanes == 32 && pool == 64) continue;  // refused: its dx staging is over 48 KB
      const auto got_rm = r.bwd_dx_row_major(0.5, &pooled);
      EXPECT_TRUE(got_rm == rm) << what << ": row-major dx or dlogits differ from the tiled kernel's";
      EXPECT_TRUE(r.bwd_dx_row_major(0.5, &pooled) == got_rm) << what << ": two row-major runs differ";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DiffLogicGpuPool,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16), ::testing::Values(8, 32),
                       ::testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(2, 7, 33),
                                         std::make_tuple(33, 33, 7), std::make_tuple(1032, 4097, 4097),
                                         std::make_tuple(33, 4097, 7), std::make_tuple(1032, 2, 1000),
                                         std::make_tuple(1024, 4, 2048), std::make_tuple(5, 64000, 64000))));

// Without a GPU: the pooled backward compiles for sm_80 and sm_90 in every dtype, feature-major and row-major
// dx, ahead 0 and 1, at the default lanes (32) and lanes 8, without spills or a stack frame; configs it cannot
// run are refused by name (pool with the flat kernels, a pool smaller than the block's lane groups, a row-major
// dx staging over 48 KB).
TEST(DiffLogic, PooledBackwardCompiles) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (const char* arch : {"sm_90", "sm_80"})
      for (int64_t lanes : {8, 32})
        for (const char* dx_layout : {"as_x", "row_major"})
          for (int64_t ahead : {0, 1}) {
            if (std::string(arch) == "sm_80" && (ahead == 0 || lanes == 8)) continue;  // CI time: the default's
            CompileRequest r;
            r.op = "difflogic.layer.bwd";
            r.dtype = dt;
            r.arch = arch;
            r.params.set("layout", std::string("feature_major"));
            r.params.set("dx_layout", std::string(dx_layout));
            const int64_t pool = dt == DType::f32 || lanes == 8 ? 64 : 32;
            r.config = Config{{{"threads", 256}, {"lanes", lanes}, {"ahead", ahead}, {"pool", pool}}};
            const auto reports = kspec::testing::expect_compiles_without_spills(r);
            ASSERT_EQ(reports.size(), 3u);
            EXPECT_NE(reports[1].kernel.find("difflogic_bwd_pool_kernel<"), std::string::npos) << reports[1].kernel;
          }
  CompileRequest r;
  r.op = "difflogic.layer.bwd";
  r.params.set("layout", std::string("feature_major"));
  r.config = Config{{{"threads", 256}, {"lanes", 0}, {"ahead", 0}, {"pool", 32}}};
  expect_in(message_of([&] { compile(r); }), {"pool > 0", "lanes > 0"});
  r.config = Config{{{"threads", 256}, {"lanes", 4}, {"ahead", 0}, {"pool", 32}}};
  expect_in(message_of([&] { compile(r); }), {"pool 32", "lane groups"});
  r.dtype = DType::bf16;
  r.params.set("dx_layout", std::string("row_major"));
  r.config = Config{{{"threads", 256}, {"lanes", 32}, {"ahead", 1}, {"pool", 64}}};
  expect_in(message_of([&] { compile(r); }), {"pool 64", "48 KB"});
}

// Without a GPU: the cluster kernels and the staged kernel writing xt compile for their archs in every dtype
// without spills or a stack frame (the staged one for sm_80 too); sm_80 refuses stage 2 and 4 by name; the
// plans' kernels are the ones the launcher indexes (the transpose last, with save_xt).
TEST(DiffLogic, ClusterAndSaveXtKernelsCompile) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (int64_t stage : {0, 1, 2, 4})
      for (bool xt : {false, true}) {
        if (stage != 1 && !xt) continue;  // PrecompilePlanCompilesWithoutSpills has these
        for (const char* arch : {"sm_90", "sm_80"}) {
          CompileRequest r;
          r.op = "difflogic.layer.fwd";
          r.dtype = dt;
          r.arch = arch;
          r.params.set("save_xt", xt);
          r.config = Config{{{"threads", 256}, {"lanes", 0}, {"stage", stage}}};
          if (stage > 1 && std::string(arch) == "sm_80") {
            expect_in(message_of([&] { compile(r); }), {"stage " + std::to_string(stage), "needs sm_90"});
            continue;
          }
          const auto reports = kspec::testing::expect_compiles_without_spills(r);
          ASSERT_EQ(reports.size(), (stage > 0 ? 3u : 2u) + (xt ? 1u : 0u)) << arch << " stage " << stage;
          const std::string main = reports[1].kernel;
          if (stage == 1) {
            EXPECT_NE(main.find("difflogic_fwd_staged_kernel<"), std::string::npos) << main;
            EXPECT_EQ(main.find(", 4, true>") != std::string::npos, xt) << main;  // kXT
          }
          EXPECT_EQ(main.find("difflogic_fwd_staged_cluster_kernel<") != std::string::npos, stage > 1) << main;
          EXPECT_EQ(reports.back().kernel.find("difflogic_transpose_kernel<") != std::string::npos, xt);
        }
      }
  }
}

// Hard mode on {0, 1} inputs is exact in every dtype: equal to the reference bit for bit.
TEST(DiffLogicGpuExact, HardModeOnBitsIsExact) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    LayerRun r(100, 64, 300, dt, true, 5);
    const auto want = ref::difflogic_layer_fwd_ref(100, 64, r.x, r.logits, r.a, r.b, ref::DiffLogicMode::Hard);
    EXPECT_EQ(r.fwd("hard"), want) << dtype_short(dt);
  }
}

// Three hard layers on packed words (w = 32 in int32, 64 in int64; B not a multiple of w) equal the
// reference bit for bit, padding bits cleared: the flat kernel (vec 0) and the rows kernel (vec 1; B = 40000
// spans several blocks of a row at 128 threads).
TEST(DiffLogicGpuExact, PackedEqualsReferenceBitForBit) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const Config configs[] = {Config{{{"threads", 256}, {"vec", 0}}}, Config{{{"threads", 128}, {"vec", 1}}},
                            Config{{{"threads", 256}, {"vec", 1}}}};
  for (const Config& config : configs)
  for (int w : {32, 64})
    for (int64_t B : {1, 33, 64, 100, 1000, 40000}) {
      const int64_t W = (B + w - 1) / w;
      const DType dt = w == 32 ? DType::i32 : DType::i64;
      std::mt19937_64 rng(static_cast<uint64_t>(B * 3 + w));
      std::bernoulli_distribution bit(0.5);
      std::normal_distribution<double> normal(0.0, 1.0);
      int64_t n = 40;
      std::vector<double> x(B * n);
      for (double& v : x) v = bit(rng);
      std::vector<uint64_t> want = ref::difflogic_pack_ref(B, n, x, w);
      auto to_bytes = [&](const std::vector<uint64_t>& v) {
        std::vector<unsigned char> bytes(v.size() * (w / 8));
        for (size_t j = 0; j < v.size(); ++j) std::memcpy(&bytes[j * (w / 8)], &v[j], w / 8);  // little-endian
        return bytes;
      };
      auto cur = std::make_unique<DevBuf>(want.size() * (w / 8));
      const auto first = to_bytes(want);
      cur->upload(first.data(), first.size());
      for (int64_t n_out : {4097, 300, 7}) {
        std::vector<double> logits(n_out * 16);
        for (double& v : logits) v = normal(rng);
        logits[16 * (n_out - 1)] = logits[16 * (n_out - 1) + 5] = 10.0;  // a tie: op 0 (FALSE) wins
        quantize(DType::f32, logits);
        std::vector<int32_t> a, b;
        std::uniform_int_distribution<int32_t> wire(0, static_cast<int32_t>(n - 1));
        for (int64_t g = 0; g < n_out; ++g) {
          a.push_back(wire(rng));
          b.push_back(g % 3 == 0 ? a.back() : wire(rng));
        }
        if (n_out == 7) a[2] = static_cast<int32_t>(n);  // out of range: never followed, zero bits
        std::vector<unsigned char> lbytes;
        encode(DType::f32, logits, lbytes);
        DevBuf l(lbytes.size()), ab(a.size() * 4), bb(b.size() * 4);
        l.upload(lbytes.data(), lbytes.size());
        ab.upload(a.data(), a.size() * 4);
        bb.upload(b.data(), b.size() * 4);
        auto next = std::make_unique<DevBuf>(n_out * W * (w / 8));
        next->poison();
        call("difflogic.packed.fwd",
             {TensorView(cur->ptr(), dt, {n, W}, 0), TensorView(l.ptr(), DType::f32, {n_out, 16}, 0),
              TensorView(ab.ptr(), DType::i32, {n_out}, 0), TensorView(bb.ptr(), DType::i32, {n_out}, 0)},
             {TensorView(next->ptr(), dt, {n_out, W}, 0)}, {{"batch", B}}, nullptr, CallOptions{&config});
        CU_CHECK(cuCtxSynchronize());
        std::vector<int> ops = ref::difflogic_hard_ops(logits, n_out);
        if (n_out == 7) ops[2] = a[2] = 0;  // the reference's zero bits: op 0 (FALSE) on a valid wire
        want = ref::difflogic_packed_fwd_ref(B, n, want, w, ops, a, b);
        EXPECT_TRUE(next->download(n_out * W * (w / 8)) == to_bytes(want))
            << "w " << w << " B " << B << " n_out " << n_out << " vec " << config.get("vec");
        cur = std::move(next);
        n = n_out;
      }
    }
}

// A wire outside [0, n_in) (a wiring that skipped the host check) is not followed: NaN, not a fault.
TEST(DiffLogicGpuExact, WireOutOfRangeGivesNanNotAFault) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  LayerRun r(4, 8, 5, DType::f32, false, 9);
  const int32_t bad = 1 << 30;
  r.a_->upload(&bad, 4);  // gate 0
  const auto y = r.fwd("soft");
  for (int64_t s = 0; s < 4; ++s) {
    EXPECT_TRUE(std::isnan(y[s * 5])) << s;
    EXPECT_TRUE(std::isfinite(y[s * 5 + 1])) << s;
  }
}

// The straight-through estimator with Gumbel noise (hard forward, soft backward, one G from the seed):
// the hard forward equals the reference's hard layer on logits + G, the soft forward and the backward are
// within 1e-4 of the reference's on logits + G, and the noise is the seed's alone: both thread configs give
// the same bits, and another seed other outputs. Gates whose two best noisy logits are within 1e-4 are left
// out of the hard comparison (fp32 logf and float64 log may order them differently).
TEST(DiffLogicGpuExact, StraightThroughGumbelMatchesReference) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const int64_t B = 33, n_in = 4097, n_out = 4097;
  const int64_t seed = (int64_t{5} << 32) + 77;
  LayerRun r(B, n_in, n_out, DType::f32, false, 21);
  auto noisy = r.logits;
  const auto noise = ref::difflogic_gumbel_noise(n_out, static_cast<uint64_t>(seed));
  for (size_t j = 0; j < noisy.size(); ++j) noisy[j] += noise[j];
  Params gumbel;
  gumbel.set("gumbel", true);
  gumbel.set("seed", seed);
  // Every axis named (a config lacking one is refused): the flat kernels at 128 and 256 threads.
  const Config c128{{{"threads", 128}, {"lanes", 0}, {"stage", 0}}},
      c256{{{"threads", 256}, {"lanes", 0}, {"stage", 0}}};
  const Config b128{{{"threads", 128}, {"lanes", 0}, {"ahead", 0}, {"pool", 0}}},
      b256{{{"threads", 256}, {"lanes", 0}, {"ahead", 0}, {"pool", 0}}};

  const auto hard = r.fwd("hard", gumbel, &c128);
  EXPECT_EQ(hard, r.fwd("hard", gumbel, &c256)) << "the noise depends on the launch configuration";
  const auto want_hard = ref::difflogic_layer_fwd_ref(B, n_in, r.x, noisy, r.a, r.b, ref::DiffLogicMode::Hard);
  int64_t compared = 0;
  for (int64_t g = 0; g < n_out; ++g) {
    std::vector<double> l(noisy.begin() + g * 16, noisy.begin() + g * 16 + 16);
    std::sort(l.begin(), l.end());
    if (l[15] - l[14] < 1e-4) continue;
    ++compared;
    for (int64_t s = 0; s < B; ++s)
      ASSERT_NEAR(hard[s * n_out + g], want_hard[s * n_out + g], 1e-6) << "gate " << g << " sample " << s;
  }
  EXPECT_GT(compared, n_out * 99 / 100);
  EXPECT_NE(hard, r.fwd("hard"));  // without noise: other ops for some gates

  const auto soft = r.fwd("soft", gumbel);
  EXPECT_LE(rel_error(soft, ref::difflogic_layer_fwd_ref(B, n_in, r.x, noisy, r.a, r.b, ref::DiffLogicMode::Soft)),
            1e-4);
  const auto want = ref::difflogic_layer_bwd_ref(B, n_in, r.x, noisy, r.a, r.b, r.dout, 1.0);
  const auto got = r.bwd(1.0, gumbel, &b128);
  EXPECT_LE(rel_error(decode(DType::f32, got.first), want.dx), 1e-4) << "dx";
  EXPECT_LE(rel_error(decode(DType::f32, got.second), want.dlogits), 1e-4) << "dlogits";
  const auto again = r.bwd(1.0, gumbel, &b256);
  EXPECT_TRUE(got.first == again.first && got.second == again.second) << "the backward depends on the config";
  Params other = gumbel;
  other.set("seed", seed + 1);
  EXPECT_FALSE(r.bwd(1.0, other).second == got.second) << "the seed does not change the noise";
}
