// mlstm ops without a GPU: output inference, the messages for bad input (shapes, head dims, mixed
// dtypes, partial states, host memory, chunk) for the forward and the backward, every case's
// specialization of every mlstm op compiling for sm_90 without spills, and the log-sigmoid probe
// compiling. On a GPU (skipped without one): the kernels' log-sigmoid for every gate dtype, mlstm.step in
// place against the float64 recurrence, two chunkwise calls passing states against one call and against
// the recurrence (so S steps of mlstm.step and one chunkwise call agree through the reference), long
// half-precision sequences, the chunkwise and parallel backward against the reference (dC_last reaching
// df), accumulators_initialized (two calls, NaN-poisoned outputs, bitwise repeatable) and every tuning
// config on three shapes (nondefault_tiles).
// (GpuEveryOp.EveryCaseEveryDtypeMatchesReference runs both case tables against the reference.)
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <tuple>

#include "api/src/device_data.h"
#include "api/src/kernels.h"
#include "api/src/op.h"
#include "device_buffer_test_util.h"
#include "jit/driver.h"
#include "kspec/kspec.h"
#include "mlstm/reference.h"
#include "mlstm/schema.h"
#include "templates/mlstm/params.h"
#include "precompile_test_util.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::fake;
using kspec::testing::max_rel;
using kspec::testing::message_of;
using kspec::testing::rel_err;
using kspec::testing::to_double;

namespace {

// q, k, v, i, f, C0, n0, m0 for mlstm.chunkwise.fwd at fake addresses.
std::vector<TensorView> chunk_inputs(int64_t B, int64_t NH, int64_t S, int64_t dk, int64_t dv, DType dt, bool init) {
  std::vector<TensorView> in = {
      TensorView(fake(1 << 28), dt, {B, NH, S, dk}, 0), TensorView(fake(2 << 28), dt, {B, NH, S, dk}, 0),
      TensorView(fake(3 << 28), dt, {B, NH, S, dv}, 0), TensorView(fake(4 << 28), dt, {B, NH, S}, 0),
      TensorView(fake(5 << 28), dt, {B, NH, S}, 0),     TensorView(),
      TensorView(),                                     TensorView()};
  if (init) {
    in[5] = TensorView(fake(6 << 28), DType::f32, {B, NH, dk, dv}, 0);
    in[6] = TensorView(fake(7 << 28), DType::f32, {B, NH, dk}, 0);
    in[7] = TensorView(fake(8 << 28), DType::f32, {B, NH, 1}, 0);
  }
  return in;
}

void expect_in(const std::string& msg, const std::vector<std::string>& fragments) {
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
}

// A request for op at dhqk x dhhv, bf16, for arch; at `chunk` where given (else the op's default).
CompileRequest mlstm_request(const OpDef& op, int64_t dk, int64_t dv, const char* arch = "sm_90", int64_t chunk = 0) {
  CompileRequest r;
  r.op = op.info.name;
  r.dtype = DType::bf16;
  r.arch = arch;
  r.params.set("dhqk", dk);
  r.params.set("dhhv", dv);
  if (chunk) r.params.set("chunk", chunk);
  return r;
}

// One row of a validity table: config c is valid for p exactly where `why` is "", and where it is not the
// reason names `algo` (where given) and `why`. Returns whether the row is a valid one (its kernels to check).
bool expect_validity(const OpDef& op, const Problem& p, const Config& c, const char* why, const std::string& what,
                     const char* algo = nullptr) {
  std::string reason;
  const bool valid = op.tuning.valid(p, c, &reason);
  EXPECT_EQ(valid, *why == 0) << what << " " << c.str(op.info) << ": " << reason;
  if (*why) expect_in(reason, algo ? std::vector<std::string>{algo, why} : std::vector<std::string>{why});
  return *why == 0;
}

// Every kernel of r's plan compiles without spills or a stack frame.
void expect_no_spills(const CompileRequest& r, const std::string& what) {
  for (const auto& rep : compile(r)) {
    EXPECT_EQ(rep.spill_bytes, 0) << what << " " << r.arch << ": " << rep.kernel;
    EXPECT_EQ(rep.stack_bytes, 0) << what << " " << r.arch << ": " << rep.kernel;
  }
}

}  // namespace

TEST(Mlstm, InferOutputs) {
  auto outs = infer_outputs("mlstm.chunkwise.fwd", chunk_inputs(2, 3, 70, 32, 64, DType::bf16, true));
  ASSERT_EQ(outs.size(), 6u);
  EXPECT_EQ(outs[0].shape, (std::vector<int64_t>{2, 3, 70, 64}));
  EXPECT_EQ(outs[0].dtype, DType::bf16);
  for (int j = 1; j < 6; ++j) EXPECT_FALSE(outs[j].present) << j;  // optional: the caller's choice
  std::vector<TensorView> step = {TensorView(fake(1 << 28), DType::f16, {4, 2, 16}, 0),
                                  TensorView(fake(2 << 28), DType::f16, {4, 2, 16}, 0),
                                  TensorView(fake(3 << 28), DType::f16, {4, 2, 32}, 0),
                                  TensorView(fake(4 << 28), DType::f32, {4, 2, 1}, 0),
                                  TensorView(fake(5 << 28), DType::f32, {4, 2, 1}, 0),
                                  TensorView(fake(6 << 28), DType::f32, {4, 2, 16, 32}, 0),
                                  TensorView(fake(7 << 28), DType::f32, {4, 2, 16}, 0),
                                  TensorView(fake(8 << 28), DType::f32, {4, 2, 1}, 0)};
  auto souts = infer_outputs("mlstm.step", step);
  ASSERT_EQ(souts.size(), 4u);
  EXPECT_EQ(souts[0].shape, (std::vector<int64_t>{4, 2, 32}));
  EXPECT_EQ(souts[0].dtype, DType::f16);
  EXPECT_EQ(souts[1].shape, (std::vector<int64_t>{4, 2, 16, 32}));
}

TEST(Mlstm, ValidationNamesTheArgument) {
  const char* op = "mlstm.chunkwise.fwd";
  {
    auto in = chunk_inputs(2, 3, 70, 32, 64, DType::bf16, false);
    in[1] = TensorView(fake(9 << 28), DType::bf16, {2, 3, 71, 32}, 0);
    expect_in(message_of([&] { infer_outputs(op, in); }), {"input 'k'", "seqlen"});
  }
  {
    auto in = chunk_inputs(2, 3, 70, 48, 64, DType::bf16, false);
    EXPECT_THROW(infer_outputs(op, in), Unsupported);
    expect_in(message_of([&] { infer_outputs(op, in); }), {"dhqk = 48 is not supported", "16, 32, 64"});
  }
  {
    auto in = chunk_inputs(2, 3, 70, 32, 1024, DType::bf16, false);
    expect_in(message_of([&] { infer_outputs(op, in); }), {"dhhv"});
  }
  {
    auto in = chunk_inputs(2, 3, 70, 32, 64, DType::bf16, false);
    in[2] = TensorView(fake(9 << 28), DType::f16, {2, 3, 70, 64}, 0);
    expect_in(message_of([&] { infer_outputs(op, in); }), {"input 'v'", "bfloat16", "float16"});
  }
  {
    auto in = chunk_inputs(2, 3, 70, 32, 64, DType::bf16, false);
    in[4] = TensorView(fake(9 << 28), DType::f32, {2, 3, 70}, 0);  // f fp32 but i bf16
    expect_in(message_of([&] { infer_outputs(op, in); }), {"input 'f'"});
  }
  {
    auto in = chunk_inputs(2, 3, 70, 32, 64, DType::bf16, true);
    in[7] = TensorView();
    expect_in(message_of([&] { infer_outputs(op, in); }), {"'C0', 'n0', 'm0'", "together", "'m0' is missing"});
  }
  {
    auto in = chunk_inputs(2, 3, 70, 32, 64, DType::bf16, true);
    in[5] = TensorView(fake(9 << 28), DType::bf16, {2, 3, 32, 64}, 0);
    expect_in(message_of([&] { infer_outputs(op, in); }), {"input 'C0'", "float32"});
  }
  {
    auto in = chunk_inputs(2, 3, 0, 32, 64, DType::bf16, false);
    expect_in(message_of([&] { infer_outputs(op, in); }), {"seqlen"});
  }
  {
    auto in = chunk_inputs(2, 3, 70, 32, 64, DType::bf16, false);
    in[0].device = kCpuDevice;
    expect_in(message_of([&] { infer_outputs(op, in); }), {"input 'q'", "CUDA tensor"});
  }
  {
    auto in = chunk_inputs(2, 3, 70, 32, 64, DType::bf16, false);
    EXPECT_THROW(infer_outputs(op, in, {{"chunk", int64_t(48)}}), Unsupported);
    expect_in(message_of([&] { infer_outputs(op, in, {{"chunk", int64_t(48)}}); }), {"'chunk' = 48", "16, 32"});
  }
}

// chunk 256 (issue 29's L up to 256) runs on algo=tc only: fp32 inputs get an Unsupported naming the
// chunk, the SIMT kernels' shared-memory limit and why algo=tc cannot run them; bf16 inputs pass, and
// the heuristic picks the tensor cores for them in both directions (algo=simt is out of the space).
TEST(Mlstm, Chunk256IsTensorCoreOnly) {
  const Params chunk256{{"chunk", int64_t(256)}};
  for (const char* op : {"mlstm.chunkwise.fwd", "mlstm.chunkwise.bwd"}) {
    auto in = chunk_inputs(2, 3, 300, 64, 64, DType::f32, false);
    if (std::string(op) == "mlstm.chunkwise.bwd") {
      in.erase(in.begin() + 5, in.end());
      in.insert(in.end(), {TensorView(), TensorView(), TensorView(fake(10u << 28), DType::f32, {2, 3, 300}, 0),
                           TensorView(fake(11u << 28), DType::f32, {2, 3, 300}, 0),
                           TensorView(fake(12u << 28), DType::f32, {2, 3, 300, 64}, 0), TensorView()});
    }
    EXPECT_THROW(infer_outputs(op, in, chunk256), Unsupported) << op;
    expect_in(message_of([&] { infer_outputs(op, in, chunk256); }),
              {"'chunk' = 256", "algo=tc", "227 KB", "float16 or bfloat16"});
    for (TensorView& t : in)
      if (t.data && t.dtype == DType::f32 && t.size(-1) == 64) t.dtype = DType::bf16;  // q, k, v, dh
    for (size_t j = 3; j < 5; ++j) in[j].dtype = DType::bf16;  // i, f
    EXPECT_NO_THROW(infer_outputs(op, in, chunk256)) << op;
    const OpDef& def = Registry::global().get(op);
    const Problem pr = problem_from_request(def, mlstm_request(def, 64, 64, "sm_90", 256));
    // algo=tc_pg forward, algo=tc_merged backward: the tensor cores
    EXPECT_EQ(def.tuning.heuristic(pr).str(def.info),
              std::string(op) == "mlstm.chunkwise.fwd" ? "algo=tc_pg,threads=128" : "algo=tc_merged,threads=128");
    std::string why;
    EXPECT_FALSE(def.tuning.valid(pr, Config{{{"algo", 0}, {"threads", 256}}}, &why)) << op;
    expect_in(why, {"algo=simt", "chunk <= 128"});
  }
}

// The tensor-core backward at head dims over 128 (issue 29's (128, 256) and (256, 512)): one CTA per
// column block of 128, so its kernels are those of 128 x 128 plus one reduce kernel for each gradient
// that sums blocks (dq, dk contract DHHV; dv DHQK; not dq and algo=tc's dk at DHQK <= 128, whose CTAs
// loop over DHHV's blocks), and nothing more at 128 x 128; algo=tc_fused has the same kernels with dv
// and dk as one (and its dk reduced wherever DHHV has several blocks).
TEST(Mlstm, TensorCoreBackwardBlocksLargeHeadDims) {
  const OpDef& op = Registry::global().get("mlstm.chunkwise.bwd");
  const Config tc = Config::parse("algo=tc,threads=128", op.info);
  struct Row {
    int64_t dk, dv;
    size_t kernels, fused_kernels;
    int blocks;
  };
  for (const Row& row :
       std::vector<Row>{{128, 128, 7, 6, 1}, {64, 256, 7, 7, 2}, {128, 256, 7, 7, 2}, {256, 512, 10, 9, 8}}) {
    const Problem p = problem_from_request(op, mlstm_request(op, row.dk, row.dv));
    const auto kernels = op.kernels(p, tc);
    ASSERT_EQ(kernels.size(), row.kernels) << row.dk << " x " << row.dv;
    for (size_t k = 7; k < kernels.size(); ++k)
      EXPECT_EQ(kernels[k].kernel, "kspec::mlstm_tc_reduce_kernel") << k;
    // algo=tc_fused: dv and dk as one kernel (4), df next, the same reduce kernels after it.
    const auto fused = op.kernels(p, Config::parse("algo=tc_fused,threads=128", op.info));
    ASSERT_EQ(fused.size(), row.fused_kernels) << row.dk << " x " << row.dv;
    EXPECT_EQ(fused[4].kernel, "kspec::mlstm_tc_dkv_fused_kernel");
    EXPECT_EQ(fused[5].kernel, "kspec::mlstm_tc_df_kernel");
    for (size_t k = 6; k < fused.size(); ++k) EXPECT_EQ(fused[k].kernel, "kspec::mlstm_tc_reduce_kernel") << k;
    if (row.fused_kernels + 1 == row.kernels) {
      for (size_t k = 6; k < fused.size(); ++k) EXPECT_EQ(fused[k].targs, kernels[k + 1].targs) << k;
    }
    // algo=tc_parts (where tc loops: DHQK <= 128 < DHHV): dq and dk by column blocks, each reduced.
    const Config parts = Config::parse("algo=tc_parts,threads=128", op.info);
    std::string why;
    const bool loops = row.dk <= 128 && row.dv > 128;
    EXPECT_EQ(op.tuning.valid(p, parts, &why), loops) << row.dk << " x " << row.dv << ": " << why;
    if (loops) {
      const auto sep = op.kernels(p, parts);
      ASSERT_EQ(sep.size(), row.kernels + 2) << row.dk << " x " << row.dv;
      EXPECT_EQ(sep[3].targs.back(), "false");
      EXPECT_EQ(kernels[3].targs.back(), "true");  // algo=tc's dq loops
      EXPECT_EQ(sep[5].targs.back(), "false");
      EXPECT_EQ(kernels[5].targs.back(), "true");  // and its dk
    } else {
      EXPECT_NE(why.find("tc_parts"), std::string::npos) << why;
    }
    const int dk = static_cast<int>(row.dk), dv = static_cast<int>(row.dv);
    EXPECT_EQ(mlstm_tc_bwd_blocks(dk, dv), row.blocks);
    // Every CTA's tiles are at most those of 128 x 128 (106 KB at chunk 256, within sm_90's 227 KB).
    EXPECT_LE(mlstm_tc_bwd_smem_bytes(dk, dv, 256), mlstm_tc_bwd_smem_bytes(128, 128, 256));
    EXPECT_LE(mlstm_tc_bwd_smem_bytes(128, 128, 256), 227 * 1024);
  }
  // dv over a single DHQK block needs no sum (written directly).
  EXPECT_FALSE(mlstm_tc_bwd_reduced(128, 256, kMlstmGradDq));  // its CTA loops over DHHV's blocks
  EXPECT_TRUE(mlstm_tc_bwd_reduced(256, 512, kMlstmGradDq));
  EXPECT_EQ(mlstm_tc_dq_blocks(128, 256), 1);
  EXPECT_EQ(mlstm_tc_dq_blocks(256, 512), 8);
  EXPECT_EQ(mlstm_tc_dq_smem_bytes(128, 128, 128), mlstm_tc_bwd_smem_bytes(128, 128, 128));
  EXPECT_LE(mlstm_tc_dq_smem_bytes(128, 512, 256), 227 * 1024);
  EXPECT_FALSE(mlstm_tc_bwd_reduced(128, 256, kMlstmGradDv));
  EXPECT_FALSE(mlstm_tc_bwd_reduced(128, 256, kMlstmGradDk));       // algo=tc: its CTA loops too
  EXPECT_TRUE(mlstm_tc_bwd_reduced(128, 256, kMlstmGradDk, true));  // algo=tc_fused: dv's block
  EXPECT_TRUE(mlstm_tc_bwd_reduced(256, 512, kMlstmGradDk));
  EXPECT_EQ(mlstm_tc_dk_blocks(128, 256), 1);
  EXPECT_EQ(mlstm_tc_dk_smem_bytes(128, 128, 128), mlstm_tc_bwd_smem_bytes(128, 128, 128));
  EXPECT_LE(mlstm_tc_dk_smem_bytes(128, 512, 256), 227 * 1024);
  // Looping at 128 x 256 keeps 2 CTAs an SM (sm_90: 228 KB a multiprocessor, 1 KB reserved a CTA), as the
  // separate Q tile and dC block did before: Q reuses C's buffer in dq, dC the query tiles' in dk.
  for (int chunk : {64, 128, 256}) {
    EXPECT_LE(2 * (mlstm_tc_dq_smem_bytes(128, 256, chunk) + 1024), 228 * 1024) << chunk;
    EXPECT_LE(2 * (mlstm_tc_dk_smem_bytes(128, 256, chunk) + 1024), 228 * 1024) << chunk;
  }
  EXPECT_TRUE(mlstm_tc_bwd_reduced(256, 512, kMlstmGradDv));
  EXPECT_FALSE(mlstm_tc_bwd_reduced(128, 128, kMlstmGradDq));
}

// algo=tc_merged: at DHQK <= 128 (no gradient reduced) algo=tc's CTAs in four launches (gates, both state
// scans, dq/dv/dk, df); a tile's roles are dq, dv's DHHV blocks and dk, and the merged launch's shared
// memory (the largest role's) still leaves 2 CTAs an SM up to DHHV 256 (at 512 algo=tc's dq, with its
// 512-wide dH tile, already holds one). At DHQK 256: both state scans in one launch, dq, dv, dk apart, dv
// looping over DHQK's blocks (no dv partials: only dq's and dk's reduce kernels), 2 CTAs an SM; and
// algo=tc_stream, valid there only, the four launches again (dq and dk streaming DHHV's blocks, their
// dots in two parts for df), 8 roles a tile.
TEST(Mlstm, TensorCoreMergedBackwardKernels) {
  const OpDef& op = Registry::global().get("mlstm.chunkwise.bwd");
  const Config merged = Config::parse("algo=tc_merged,threads=128", op.info),
               stream = Config::parse("algo=tc_stream,threads=128", op.info);
  struct Row {
    int64_t dk, dv;
    int roles;
  };
  for (const Row& row : std::vector<Row>{{32, 32, 3}, {128, 128, 3}, {64, 256, 4}, {128, 256, 4}, {128, 512, 6},
                                         {256, 512, 0}}) {
    const Problem p = problem_from_request(op, mlstm_request(op, row.dk, row.dv));
    std::string why;
    const std::string what = std::to_string(row.dk) + " x " + std::to_string(row.dv);
    ASSERT_TRUE(op.tuning.valid(p, merged, &why)) << what << ": " << why;
    const auto k = op.kernels(p, merged);
    const int dk = static_cast<int>(row.dk), dv = static_cast<int>(row.dv);
    EXPECT_EQ(op.tuning.valid(p, stream, &why), dk > 128) << what << ": " << why;
    if (dk <= 128) expect_in(why, {"tc_stream", "dhqk > 128"});
    if (row.roles == 0) {
      const auto ks = op.kernels(p, stream);
      ASSERT_EQ(ks.size(), 4u) << what;
      EXPECT_EQ(ks[1].kernel, "kspec::mlstm_tc_states_kernel");
      EXPECT_EQ(ks[2].kernel, "kspec::mlstm_tc_grads_kernel");
      EXPECT_EQ(ks[3].kernel, "kspec::mlstm_tc_df_kernel");
      EXPECT_EQ(ks[3].targs.back(), "2");  // q . dq and k . dk in two DHQK blocks
      EXPECT_EQ(mlstm_tc_grads_roles(dk, dv), 2 + dv / 128 + 2);
      EXPECT_EQ(mlstm_tc_dot_parts(dk, true), 2);
      EXPECT_EQ(mlstm_tc_dot_parts(dk, false), 1);
      for (MlstmGrad g : {kMlstmGradDq, kMlstmGradDv, kMlstmGradDk})
        EXPECT_FALSE(mlstm_tc_bwd_reduced(dk, dv, g, false, true, true, true)) << g;
      for (int chunk : {64, 128, 256})
        EXPECT_LE(2 * (mlstm_tc_grads_smem_bytes(dk, dv, chunk) + 1024), 228 * 1024) << what << " chunk " << chunk;
      const std::vector<std::string> names = {
          "kspec::mlstm_tc_gates_kernel", "kspec::mlstm_tc_states_kernel", "kspec::mlstm_tc_dq_kernel",
          "kspec::mlstm_tc_dkv_kernel",   "kspec::mlstm_tc_dkv_kernel",    "kspec::mlstm_tc_df_kernel",
          "kspec::mlstm_tc_reduce_kernel", "kspec::mlstm_tc_reduce_kernel"};
      ASSERT_EQ(k.size(), names.size()) << what;
      for (size_t j = 0; j < names.size(); ++j) EXPECT_EQ(k[j].kernel, names[j]) << j;
      EXPECT_EQ(k[3].targs.back(), "true");   // dv loops over DHQK's blocks
      EXPECT_EQ(k[4].targs.back(), "false");  // dk by column blocks
      EXPECT_EQ(k[6].targs.back(), std::to_string(kMlstmGradDq));
      EXPECT_EQ(k[7].targs.back(), std::to_string(kMlstmGradDk));
      EXPECT_FALSE(mlstm_tc_bwd_reduced(dk, dv, kMlstmGradDv, false, false, true));
      EXPECT_TRUE(mlstm_tc_bwd_reduced(dk, dv, kMlstmGradDv));  // algo=tc's dv
      EXPECT_EQ(mlstm_tc_dv_blocks(dk, dv), dv / 128);
      EXPECT_EQ(mlstm_tc_dv_blocks(dk, dv, false), mlstm_tc_bwd_blocks(dk, dv));
      for (int chunk : {64, 128, 256})
        EXPECT_LE(2 * (mlstm_tc_dv_smem_bytes(dk, dv, chunk) + 1024), 228 * 1024) << what << " chunk " << chunk;
      continue;
    }
    EXPECT_EQ(mlstm_tc_dv_smem_bytes(dk, dv, 128), mlstm_tc_bwd_smem_bytes(dk, dv, 128)) << what;
    ASSERT_EQ(k.size(), 4u) << what;
    EXPECT_EQ(k[0].kernel, "kspec::mlstm_tc_gates_kernel");
    EXPECT_EQ(k[1].kernel, "kspec::mlstm_tc_states_kernel");
    EXPECT_EQ(k[2].kernel, "kspec::mlstm_tc_grads_kernel");
    EXPECT_EQ(k[3].kernel, "kspec::mlstm_tc_df_kernel");
    EXPECT_EQ(mlstm_tc_grads_roles(dk, dv), row.roles) << what;
    for (MlstmGrad g : {kMlstmGradDq, kMlstmGradDv, kMlstmGradDk})
      EXPECT_FALSE(mlstm_tc_bwd_reduced(dk, dv, g)) << what << " grad " << g;
    for (int chunk : {64, 128, 256}) {
      EXPECT_EQ(mlstm_tc_grads_smem_bytes(dk, dv, chunk),
                std::max({mlstm_tc_dq_smem_bytes(dk, dv, chunk), mlstm_tc_bwd_smem_bytes(dk, dv, chunk),
                          mlstm_tc_dk_smem_bytes(dk, dv, chunk)}));
      EXPECT_LE((dv <= 256 ? 2 : 1) * (mlstm_tc_grads_smem_bytes(dk, dv, chunk) + 1024), 228 * 1024)
          << what << " chunk " << chunk;
    }
  }
}

namespace {

// Records an op launcher's launches (nothing runs: a CPU test of the host side's plan).
class RecordingLauncher : public Launcher {
 public:
  struct Launch {
    size_t kernel;
    Dim3 grid, block;
    unsigned shared;
  };
  std::vector<Launch> launches;
  void launch(size_t k, Dim3 grid, Dim3 block, unsigned shared, void**) override {
    launches.push_back({k, grid, block, shared});
  }
  void launch_clusters(size_t k, Dim3 grid, Dim3 block, Dim3, unsigned shared, void** args) override {
    launch(k, grid, block, shared, args);
  }
  void launch_dependent(size_t k, Dim3 grid, Dim3 block, unsigned shared, void** args) override {
    launch(k, grid, block, shared, args);
  }
  void* workspace(size_t) override { return fake(uintptr_t(1) << 40); }
  int multiprocessors() const override { return 132; }
  int occupancy(size_t, unsigned, unsigned) override { return 1; }
};

}  // namespace

// The tensor-core backward's launcher at fake addresses (B = 2, NH = 3, S = 300, chunk 64, bf16, with
// initial states and dC_last), every variant at 128 x 256 and 256 x 512: each kernel of the plan is
// launched exactly once, within sm_90's 227 KB of shared memory; tc_merged's and tc_stream's state scans
// as one grid of two z-slices over the separate kernels' grid, their dq/dv/dk grid one CTA per (tile,
// role) with the largest role's shared memory.
TEST(Mlstm, TensorCoreBackwardLaunchesEveryKernelOnce) {
  const OpDef& op = Registry::global().get("mlstm.chunkwise.bwd");
  const int64_t B = 2, NH = 3, S = 300, L = 64, seqs = B * NH, qtiles = (S + 63) / 64;
  for (const auto& [dk, dv] : std::vector<std::pair<int64_t, int64_t>>{{128, 256}, {256, 512}}) {
    auto in = chunk_inputs(B, NH, S, dk, dv, DType::bf16, true);
    in.erase(in.begin() + 6);  // no n0
    in.push_back(TensorView(fake(10u << 28), DType::f32, {B, NH, S}, 0));
    in.push_back(TensorView(fake(11u << 28), DType::f32, {B, NH, S}, 0));
    in.push_back(TensorView(fake(12u << 28), DType::bf16, {B, NH, S, dv}, 0));
    in.push_back(TensorView(fake(13u << 28), DType::f32, {B, NH, dk, dv}, 0));
    auto at = [](uintptr_t j) { return fake(j << 28); };  // 256 MB apart, past the inputs
    const std::vector<TensorView> out = {
        TensorView(at(14), DType::bf16, {B, NH, S, dk}, 0), TensorView(at(15), DType::bf16, {B, NH, S, dk}, 0),
        TensorView(at(16), DType::bf16, {B, NH, S, dv}, 0), TensorView(at(17), DType::bf16, {B, NH, S}, 0),
        TensorView(at(18), DType::bf16, {B, NH, S}, 0),     TensorView(at(19), DType::f32, {B, NH, dk, dv}, 0)};
    Params params;
    params.set("chunk", L);
    Call call = validate_call(op, in, out, params, nullptr);
    call.problem.arch = "sm_90";
    const int dki = static_cast<int>(dk), dvi = static_cast<int>(dv);
    int ran = 0;  // tc_parts runs at 128 x 256 only, tc_stream at 256 x 512 only
    for (const char* algo : {"tc", "tc_fused", "tc_parts", "tc_merged", "tc_stream"}) {
      const Config c = Config::parse(std::string("algo=") + algo + ",threads=128", op.info);
      if (!op.tuning.valid(call.problem, c, nullptr)) continue;
      ++ran;
      const std::string what = std::to_string(dk) + " x " + std::to_string(dv) + " " + algo;
      const auto kernels = op.kernels(call.problem, c);
      RecordingLauncher rec;
      op.launch(call, c, rec);
      ASSERT_EQ(rec.launches.size(), kernels.size()) << what;
      std::vector<int> times(kernels.size(), 0);
      for (const auto& l : rec.launches) {
        ASSERT_LT(l.kernel, kernels.size()) << what;
        ++times[l.kernel];
        EXPECT_LE(l.shared, 227u * 1024) << what << " " << kernels[l.kernel].kernel;
        const std::string& name = kernels[l.kernel].kernel;
        if (name == "kspec::mlstm_tc_states_kernel") {
          EXPECT_EQ(l.grid.x, unsigned(seqs * (dk / 64))) << what;
          EXPECT_EQ(l.grid.y, unsigned(dv / 64)) << what;
          EXPECT_EQ(l.grid.z, 2u) << what;
        }
        if (name == "kspec::mlstm_tc_grads_kernel") {
          EXPECT_EQ(l.grid.x, unsigned(seqs * qtiles * mlstm_tc_grads_roles(dki, dvi))) << what;
          EXPECT_EQ(l.shared, unsigned(mlstm_tc_grads_smem_bytes(dki, dvi, static_cast<int>(L)))) << what;
        }
        if (name == "kspec::mlstm_tc_dkv_kernel" && kernels[l.kernel].targs[4] == "false") {  // dv
          const bool loops = kernels[l.kernel].targs[5] == "true";  // over DHQK's blocks
          EXPECT_EQ(l.grid.y, unsigned(loops ? dv / 128 : (dk / 128) * (dv / 128))) << what;
        }
      }
      for (size_t k = 0; k < kernels.size(); ++k) EXPECT_EQ(times[k], 1) << what << " " << kernels[k].kernel;
    }
    EXPECT_EQ(ran, 4) << dk << " x " << dv;
  }
}

// mlstm.chunkwise.bwd: q, k, v, i, f, C0, m0, nrm, m_rows, dh, dC_last at fake addresses (i, f fp32).
std::vector<TensorView> bwd_inputs(bool init, bool dC_last) {
  const int64_t B = 2, NH = 3, S = 70, dk = 32, dv = 64;
  auto in = chunk_inputs(B, NH, S, dk, dv, DType::bf16, init);
  in[3] = TensorView(fake(4 << 28), DType::f32, {B, NH, S}, 0);
  in[4] = TensorView(fake(5 << 28), DType::f32, {B, NH, S}, 0);
  in.erase(in.begin() + 6);  // no n0
  in.push_back(TensorView(fake(10u << 28), DType::f32, {B, NH, S}, 0));
  in.push_back(TensorView(fake(11u << 28), DType::f32, {B, NH, S}, 0));
  in.push_back(TensorView(fake(12u << 28), DType::bf16, {B, NH, S, dv}, 0));
  in.push_back(dC_last ? TensorView(fake(13u << 28), DType::f32, {B, NH, dk, dv}, 0) : TensorView());
  return in;
}

TEST(Mlstm, BackwardOutputsAndValidation) {
  const char* op = "mlstm.chunkwise.bwd";
  auto outs = infer_outputs(op, bwd_inputs(true, true));
  ASSERT_EQ(outs.size(), 6u);
  EXPECT_EQ(outs[0].shape, (std::vector<int64_t>{2, 3, 70, 32}));
  EXPECT_EQ(outs[0].dtype, DType::bf16);
  EXPECT_EQ(outs[2].shape, (std::vector<int64_t>{2, 3, 70, 64}));
  EXPECT_EQ(outs[4].dtype, DType::f32);  // df: i's dtype
  EXPECT_TRUE(outs[5].present);          // dC0 with C0
  EXPECT_EQ(outs[5].shape, (std::vector<int64_t>{2, 3, 32, 64}));
  EXPECT_FALSE(infer_outputs(op, bwd_inputs(false, false))[5].present);
  {
    auto in = bwd_inputs(true, false);
    in[6] = TensorView();
    expect_in(message_of([&] { infer_outputs(op, in); }), {"'C0', 'm0'", "together", "'m0' is missing"});
  }
  {
    auto in = bwd_inputs(false, false);
    in[9] = TensorView(fake(12u << 28), DType::f16, {2, 3, 70, 64}, 0);
    expect_in(message_of([&] { infer_outputs(op, in); }), {"input 'dh'", "bfloat16"});
  }
  {
    auto in = bwd_inputs(false, false);
    in[7] = TensorView(fake(10u << 28), DType::f32, {2, 3, 71}, 0);
    expect_in(message_of([&] { infer_outputs(op, in); }), {"input 'nrm'", "seqlen"});
  }
  EXPECT_THROW(infer_outputs(op, bwd_inputs(false, false), {{"chunk", int64_t(48)}}), Unsupported);
  // The parallel form's tile is a tuning axis, not a parameter.
  auto par = bwd_inputs(false, false);
  par.erase(par.begin() + 5, par.begin() + 7);
  par.pop_back();
  EXPECT_EQ(infer_outputs("mlstm.parallel.bwd", par).size(), 5u);
  const auto& axes = op_info("mlstm.parallel.fwd").tuning_axes;
  EXPECT_TRUE(std::any_of(axes.begin(), axes.end(), [](const auto& a) { return a.first == "chunk"; }));
}

// df's error scale (OpDef::error_scale): at S = 1 without states df is exactly 0 (q.dq = k.dk) however
// large q.dq is, so the checker measures df's error against the terms' norm; every other output keeps its
// own norm (scale 0). Without a GPU: the float64 reference of the parallel backward's S_1 case.
TEST(Mlstm, DfErrorIsMeasuredAgainstItsTerms) {
  for (const char* name : {"mlstm.parallel.bwd", "mlstm.chunkwise.bwd"}) {
    SCOPED_TRACE(name);
    const OpDef& op = Registry::global().get(name);
    ASSERT_TRUE(op.error_scale);
    // S = 1 without initial states or dC_last: the parallel table's S_1, the chunkwise table's no_states
    // at seqlen 1
    const char* base = std::string(name) == "mlstm.parallel.bwd" ? "S_1" : "no_states";
    auto it = std::find_if(op.cases.begin(), op.cases.end(), [&](const Case& c) { return c.name == base; });
    ASSERT_NE(it, op.cases.end()) << base;
    Case one = *it;
    for (auto& [k, v] : one.dims)
      if (k == "seqlen") v = int64_t(1);
    const Case* s1 = &one;
    CompileRequest req;
    req.op = name;
    req.dtype = DType::bf16;
    req.arch = "sm_90";
    req.without = s1->without;
    for (const auto& [k, v] : s1->params.items()) req.params.set(k, v);
    for (const auto& [k, v] : s1->dims) req.params.set(k, v);
    const Problem p = problem_from_request(op, req);
    const auto in = random_inputs(op, p, 7);
    const auto ref = op.reference(p, in);
    const auto scale = op.error_scale(p, in, ref);
    ASSERT_EQ(scale.size(), ref.size());
    double df_norm = 0;
    for (double v : ref[4].data) df_norm += v * v;
    EXPECT_LT(std::sqrt(df_norm), 1e-9 * scale[4]);  // df is a cancellation: 0 up to float64 rounding
    EXPECT_GT(scale[4], 1e-3);
    for (size_t i = 0; i < scale.size(); ++i) {
      if (i == 4) continue;
      EXPECT_EQ(scale[i], 0.0) << "output " << i;
    }
  }
}

// Every case of every mlstm op compiles for sm_90 (bf16; the base case in every dtype) with the heuristic's
// config, without spills or a stack frame.
TEST(Mlstm, EveryCaseCompilesWithoutSpills) {
  kspec::testing::expect_every_case_compiles(
      {"mlstm.step", "mlstm.chunkwise.fwd", "mlstm.chunkwise.bwd", "mlstm.parallel.fwd", "mlstm.parallel.bwd"},
      {"dhqk", "dhhv"});
}

// mlstm.chunkwise.bwd's algo=tc_fused and tc_merged (not the heuristic's choice, so not compiled above)
// compile without spills or a stack frame: the base case in fp16 and bf16, chunk 128 and 256, and head
// dims 128 x 256 (tc_fused's dv and dk partials side by side) in bf16; algo=tc at 128 x 256 beside them.
TEST(Mlstm, TensorCoreBackwardCompilesWithoutSpills) {
  const OpDef& op = Registry::global().get("mlstm.chunkwise.bwd");
  const Config tc = Config::parse("algo=tc,threads=128", op.info),
               fused = Config::parse("algo=tc_fused,threads=128", op.info),
               parts = Config::parse("algo=tc_parts,threads=128", op.info),
               merged = Config::parse("algo=tc_merged,threads=128", op.info),
               stream = Config::parse("algo=tc_stream,threads=128", op.info);
  struct Row {
    const char* case_name;
    DType dt;
    const Config& config;
    size_t kernels;
  };
  for (const Row& row : std::vector<Row>{{"base", DType::f16, fused, 6},
                                         {"base", DType::bf16, fused, 6},
                                         {"chunk_128", DType::bf16, fused, 6},
                                         {"chunk_256", DType::bf16, fused, 6},
                                         {"dk_128_dv_256", DType::bf16, fused, 7},
                                         {"dk_128_dv_256", DType::bf16, tc, 7},
                                         {"dk_128_dv_256", DType::bf16, parts, 9},
                                         {"base", DType::f16, merged, 4},
                                         {"chunk_256", DType::bf16, merged, 4},
                                         {"dh_64", DType::bf16, merged, 4},
                                         {"dk_128_dv_256", DType::bf16, merged, 4},
                                         {"dk_256_dv_512", DType::bf16, merged, 8},
                                         {"dk_256_dv_512", DType::bf16, stream, 4}}) {
    int found = 0;
    for (const auto& cs : op.cases) {
      if (cs.name != row.case_name) continue;
      ++found;
      CompileRequest r;
      r.op = op.info.name;
      r.dtype = row.dt;
      r.config = row.config;
      r.tensor_dtypes = cs.tensor_dtypes;
      for (const auto& [k, v] : cs.params.items()) r.params.set(k, v);
      for (const auto& [k, v] : cs.dims)
        if (k == "dhqk" || k == "dhhv") r.params.set(k, v);
      const auto reports = compile(r);
      EXPECT_EQ(reports.size(), row.kernels) << row.case_name;
      for (const auto& rep : reports) {
        EXPECT_EQ(rep.spill_bytes, 0) << row.case_name << " " << dtype_short(row.dt) << ": " << rep.kernel;
        EXPECT_EQ(rep.stack_bytes, 0) << row.case_name << " " << dtype_short(row.dt) << ": " << rep.kernel;
      }
    }
    EXPECT_EQ(found, 1) << row.case_name;
  }
}

// mlstm.step: every legal config of the cases at the model's head dims and the extremes (16 x 16, 512 x
// 512) compiles for sm_80 and sm_90 without spills or a stack frame (algo=split: two kernels, block and
// head: one), and at least one config a case is algo=split (its float4 slabs, where pointers are aligned).
TEST(Mlstm, StepEveryConfigCompilesWithoutSpills) {
  const OpDef& op = Registry::global().get("mlstm.step");
  for (const char* name : {"dh_16", "B_1_dh_128", "B_1_dk_256_dv_64", "dh_512"}) {
    const auto it = std::find_if(op.cases.begin(), op.cases.end(), [&](const Case& c) { return c.name == name; });
    ASSERT_NE(it, op.cases.end()) << name;
    for (const char* arch : {"sm_80", "sm_90"}) {
      int split = 0;
      for (const Config& config : configs_for_case("mlstm.step", name, DType::bf16, arch)) {
        const bool is_split = config.get("algo") == mlstm::kStepSplit;
        split += is_split;
        CompileRequest r;
        r.op = op.info.name;
        r.dtype = DType::bf16;
        r.arch = arch;
        r.config = config;
        for (const auto& [k, v] : it->dims)
          if (k == "dhqk" || k == "dhhv") r.params.set(k, v);
        const auto reports = compile(r);
        EXPECT_EQ(reports.size(), is_split ? 2u : 1u) << name << " " << config.str(op.info);
        for (const auto& rep : reports) {
          EXPECT_EQ(rep.spill_bytes, 0) << name << " " << arch << " " << config.str(op.info) << ": " << rep.kernel;
          EXPECT_EQ(rep.stack_bytes, 0) << name << " " << arch << " " << config.str(op.info) << ": " << rep.kernel;
        }
      }
      EXPECT_GE(split, 1) << name << " " << arch;
    }
  }
}

// mlstm.step's default: algo=split over slabs of 8 columns at B * NH = 8 (128 CTAs at DH 128, where
// slabs of 16 gave 64 and algo=block 8), of 16 from 128 CTAs on, of 32 from 256 CTAs on, never of 8
// below DHQK 32 (under 64 threads); algo=block where a pointer is not 16-byte aligned.
TEST(Mlstm, StepHeuristicSplitsColumns) {
  const OpDef& op = Registry::global().get("mlstm.step");
  auto pick = [&](int64_t B, int64_t dk, int64_t dv, int align) {
    Problem p;
    p.op = &op;
    p.dims = {{"batch", B}, {"heads", 8}, {"dhqk", dk}, {"dhhv", dv}};
    p.align_bytes = align;
    return op.tuning.heuristic(p).str(op.info);
  };
  EXPECT_EQ(pick(1, 128, 128, 16), "algo=split,threads=256,cols=8");
  EXPECT_EQ(pick(2, 128, 128, 16), "algo=split,threads=256,cols=16");
  EXPECT_EQ(pick(1, 32, 128, 16), "algo=split,threads=64,cols=8");
  EXPECT_EQ(pick(8, 128, 128, 16), "algo=split,threads=256,cols=32");
  EXPECT_EQ(pick(64, 128, 128, 16), "algo=split,threads=256,cols=32");
  EXPECT_EQ(pick(1, 16, 16, 16), "algo=split,threads=64,cols=16");
  EXPECT_EQ(pick(1, 128, 128, 4), "algo=block,threads=256,cols=16");
}

// mlstm.step's algo=head (one CTA per sequence, all of C in float4s): valid where a thread owns each
// element of n, a row of C fits the CTA's threads and C at most 64 floats a thread; otherwise a reason
// naming the limit. Never the default (not yet timed against algo=split).
TEST(Mlstm, StepHeadValidity) {
  const OpDef& op = Registry::global().get("mlstm.step");
  struct Row {
    int64_t dk, dv;
    const char* config;
    int align;
    const char* why;  // "" where valid
  };
  for (const Row& row : std::vector<Row>{{128, 128, "algo=head,threads=512,cols=16", 16, ""},
                                         {128, 128, "algo=head,threads=256,cols=16", 16, ""},
                                         {128, 256, "algo=head,threads=512,cols=16", 16, ""},
                                         {16, 16, "algo=head,threads=64,cols=16", 16, ""},
                                         {128, 128, "algo=head,threads=64,cols=16", 16, "threads >= dhqk"},
                                         {512, 512, "algo=head,threads=512,cols=16", 16, "64 floats of C a thread"},
                                         {64, 16, "algo=head,threads=512,cols=16", 16, "more than dhqk"},
                                         {128, 128, "algo=head,threads=256,cols=8", 16, "named with cols=16"},
                                         {128, 128, "algo=head,threads=256,cols=16", 4, "16-byte aligned"}}) {
    Problem p;
    p.op = &op;
    p.dims = {{"batch", 64}, {"heads", 8}, {"dhqk", row.dk}, {"dhhv", row.dv}};
    p.align_bytes = row.align;
    const std::string what = std::to_string(row.dk) + " x " + std::to_string(row.dv) + " align " +
                             std::to_string(row.align);
    expect_validity(op, p, Config::parse(row.config, op.info), row.why, what, "algo=head");
    EXPECT_NE(op.tuning.heuristic(p).get("algo"), mlstm::kStepHead) << what << " " << row.config;
  }
}

// mlstm.step's algo=cluster (split's slabs forming the scalars themselves, a sequence's slabs one cluster):
// sm_90 and newer, split's slab limits, at most 8 slabs a cluster; one kernel (step_cluster.cuh) launched
// over (sequences, slabs); never the default.
TEST(Mlstm, StepClusterValidity) {
  const OpDef& op = Registry::global().get("mlstm.step");
  struct Row {
    int64_t dk, dv;
    const char *config, *arch, *why;  // why: "" where valid
  };
  for (const Row& row : std::vector<Row>{{128, 128, "algo=cluster,threads=256,cols=32", "sm_90", ""},
                                         {128, 128, "algo=cluster,threads=128,cols=16", "sm_90", ""},
                                         {128, 128, "algo=cluster,threads=256,cols=32", "sm_80", "sm_90 or newer"},
                                         {128, 512, "algo=cluster,threads=256,cols=32", "sm_90", "at most 8"},
                                         {128, 16, "algo=cluster,threads=256,cols=32", "sm_90", "wider than dhhv"}}) {
    Problem p = problem_from_request(op, mlstm_request(op, row.dk, row.dv, row.arch));
    p.align_bytes = 16;
    const Config c = Config::parse(row.config, op.info);
    const std::string what = std::to_string(row.dk) + " x " + std::to_string(row.dv) + " " + row.arch;
    if (!expect_validity(op, p, c, row.why, what, "algo=cluster")) continue;
    const auto k = op.kernels(p, c);
    ASSERT_EQ(k.size(), 1u) << what;
    EXPECT_EQ(k[0].kernel, "kspec::mlstm_step_cluster_kernel") << what;
    EXPECT_NE(op.tuning.heuristic(p).get("algo"), mlstm::kStepCluster) << what;
  }
}

// The backward's default: algo=tc_merged on the tensor cores, tc_wide at dhqk > 128 and at 128 x 128 where it
// runs (else tc_stream / tc_merged; all timed faster than tc on the H100), the SIMT kernel where the tensor cores
// do not run (fp32).
TEST(Mlstm, BackwardHeuristicTakesMergedAndStream) {
  const OpDef& op = Registry::global().get("mlstm.chunkwise.bwd");
  auto pick = [&](DType dt, int64_t dk, int64_t dv) {
    CompileRequest r = mlstm_request(op, dk, dv);
    r.dtype = dt;
    const Problem p = problem_from_request(op, r);
    const Config c = op.tuning.heuristic(p);
    std::string why;
    EXPECT_TRUE(op.tuning.valid(p, c, &why)) << c.str(op.info) << ": " << why;
    return c.str(op.info);
  };
  EXPECT_EQ(pick(DType::bf16, 128, 128), "algo=tc_wide,threads=128");
  EXPECT_EQ(pick(DType::f16, 128, 256), "algo=tc_merged,threads=128");
  EXPECT_EQ(pick(DType::bf16, 64, 64), "algo=tc_merged,threads=128");
  EXPECT_EQ(pick(DType::bf16, 256, 512), "algo=tc_wide,threads=128");
  EXPECT_EQ(pick(DType::f32, 128, 128), "algo=simt,threads=256");
}

// algo=tc_wide (both ops): valid where both head dims are >= 128 and chunk <= 128, a clear reason
// elsewhere; the state kernels take the 128 x 128 tile (their last template argument), the backward keeps
// the default's other kernels (tc_merged, tc_stream at DHQK 256); the forward at (256, 512) compiles
// for sm_80 and sm_90 and the backward for sm_90 without spills or a stack frame (CI's precompile checks
// every case on both).
TEST(Mlstm, WideStateTiles) {
  for (const char* name : {"mlstm.chunkwise.fwd", "mlstm.chunkwise.bwd"}) {
    const OpDef& op = Registry::global().get(name);
    const Config wide = Config::parse("algo=tc_wide,threads=128", op.info);
    const bool bwd = op.info.name == "mlstm.chunkwise.bwd";
    struct Row {
      int64_t dk, dv, chunk;
      const char* why;  // "" where valid
    };
    for (const Row& row : std::vector<Row>{{128, 128, 128, ""},
                                           {128, 256, 64, ""},
                                           {256, 512, 128, ""},
                                           {64, 128, 64, "dhqk and dhhv >= 128"},
                                           {128, 64, 64, "dhqk and dhhv >= 128"},
                                           {128, 256, 256, "chunk <= 128"}}) {
      const Problem p = problem_from_request(op, mlstm_request(op, row.dk, row.dv, "sm_90", row.chunk));
      const std::string what = op.info.name + " " + std::to_string(row.dk) + " x " + std::to_string(row.dv) +
                               " chunk " + std::to_string(row.chunk);
      if (!expect_validity(op, p, wide, row.why, what, "algo=tc_wide")) continue;
      const auto k = op.kernels(p, wide);
      ASSERT_EQ(k.size(), bwd ? 4u : 3u) << what;
      EXPECT_EQ(k[1].kernel, bwd ? "kspec::mlstm_tc_states_kernel" : "kspec::mlstm_tc_state_kernel") << what;
      EXPECT_EQ(k[1].targs.back(), "128") << what;
      if (bwd) {
        // the kernels tc_wide shares with tc_stream / tc_merged (what the heuristic took before tc_wide)
        const bool stream = mlstm_tc_streams(static_cast<int>(p.dim("dhqk")));
        const auto dflt = op.kernels(p, Config{{{"algo", stream ? 5 : 4}, {"threads", 128}}});
        ASSERT_EQ(dflt.size(), k.size()) << what;
        for (size_t j : {0u, 2u, 3u}) EXPECT_EQ(k[j].targs, dflt[j].targs) << what << " kernel " << j;
        EXPECT_EQ(dflt[1].targs.size() + 1, k[1].targs.size()) << what;
      }
    }
    EXPECT_EQ(mlstm_tc_state_threads(256, kMlstmTcWideTile), 256);
    EXPECT_LE(mlstm_tc_state_smem_bytes(256, 512, 128, kMlstmTcWideTile), 160 * 1024);  // sm_80's 163 KB
    for (const char* arch : bwd ? std::vector<const char*>{"sm_90"} : std::vector<const char*>{"sm_80", "sm_90"}) {
      CompileRequest r = mlstm_request(op, 256, 512, arch, bwd ? 64 : 128);
      r.config = wide;
      expect_no_spills(r, name);
    }
  }
}

// The backward's algo=tc_overlap and tc_wide_overlap (the grads kernel's next loads prefetched, the gates
// kernel by warps): valid at head dims <= 128 (tc_wide_overlap also where tc_wide runs), a reason naming the
// limit elsewhere; tc_merged's (tc_wide's) states and df kernels, the grads kernel with a last template
// argument "true", the gates kernel by kMlstmTcGatesWarps warps launched with as many 32-thread warps; at
// 128 x 128, chunk 128 everything compiles for sm_80 and sm_90 without spill or stack.
TEST(Mlstm, OverlapBackwardPrefetches) {
  const OpDef& op = Registry::global().get("mlstm.chunkwise.bwd");
  const Config overlap = Config::parse("algo=tc_overlap,threads=128", op.info),
               wide_overlap = Config::parse("algo=tc_wide_overlap,threads=128", op.info),
               merged = Config::parse("algo=tc_merged,threads=128", op.info),
               wide = Config::parse("algo=tc_wide,threads=128", op.info);
  struct Row {
    int64_t dk, dv, chunk;
    const char* why;       // "" where algo=tc_overlap is valid
    const char* wide_why;  // "" where algo=tc_wide_overlap is valid
  };
  for (const Row& row : std::vector<Row>{{128, 128, 128, "", ""},
                                         {128, 128, 64, "", ""},
                                         {32, 64, 64, "", "dhqk and dhhv >= 128"},
                                         {64, 64, 256, "", "chunk <= 128"},
                                         {128, 256, 64, "dhqk and dhhv <= 128", "dhqk and dhhv <= 128"},
                                         {256, 512, 64, "dhqk and dhhv <= 128", "dhqk and dhhv <= 128"}}) {
    const Problem p = problem_from_request(op, mlstm_request(op, row.dk, row.dv, "sm_90", row.chunk));
    const std::string what = std::to_string(row.dk) + " x " + std::to_string(row.dv) + " chunk " +
                             std::to_string(row.chunk);
    for (const auto& [c, base, why_expected] : std::vector<std::tuple<Config, Config, const char*>>{
             {overlap, merged, row.why}, {wide_overlap, wide, row.wide_why}}) {
      if (!expect_validity(op, p, c, why_expected, what)) continue;
      const auto k = op.kernels(p, c), b = op.kernels(p, base);
      ASSERT_EQ(k.size(), 4u) << what;
      ASSERT_EQ(b.size(), 4u) << what;
      for (size_t j : {1u, 3u}) EXPECT_EQ(k[j].targs, b[j].targs) << what << " kernel " << j;
      EXPECT_EQ(k[2].kernel, "kspec::mlstm_tc_grads_kernel") << what;
      std::vector<std::string> targs = b[2].targs;
      targs.push_back("true");
      EXPECT_EQ(k[2].targs, targs) << what;
      EXPECT_EQ(k[0].kernel, "kspec::mlstm_tc_gates_warps_kernel") << what;
      targs = b[0].targs;
      targs.push_back(std::to_string(kMlstmTcGatesWarps));
      EXPECT_EQ(k[0].targs, targs) << what;
    }
  }
  // tc_wide_pg: tc_wide's kernels but the gates kernel by warps (no prefetch), wherever tc_wide runs.
  for (const auto& [dk, dv] : std::vector<std::pair<int64_t, int64_t>>{{128, 128}, {256, 512}}) {
    const Problem p = problem_from_request(op, mlstm_request(op, dk, dv, "sm_90", 128));
    const Config wide_pg = Config::parse("algo=tc_wide_pg,threads=128", op.info);
    std::string why;
    ASSERT_TRUE(op.tuning.valid(p, wide_pg, &why)) << dk << " x " << dv << ": " << why;
    const auto k = op.kernels(p, wide_pg), b = op.kernels(p, wide);
    ASSERT_EQ(k.size(), b.size()) << dk << " x " << dv;
    EXPECT_EQ(k[0].kernel, "kspec::mlstm_tc_gates_warps_kernel");
    for (size_t j = 1; j < k.size(); ++j) EXPECT_EQ(k[j].targs, b[j].targs) << dk << " x " << dv << " kernel " << j;
  }
  for (const char* arch : {"sm_80", "sm_90"}) {
    CompileRequest r = mlstm_request(op, 128, 128, arch, 128);
    r.config = overlap;
    expect_no_spills(r, "tc_overlap 128 x 128 chunk 128");
  }
}

// The forward's algo=tc_pg (the gates kernel by warps): valid wherever algo=tc is, its state and output kernels
// tc's, its gates kernel mlstm_tc_gates_warps_kernel launched with 32 * kMlstmTcGatesWarps threads, one CTA a
// sequence; that kernel compiles for sm_80 and sm_90 without spill or stack at chunks 16 and 128.
TEST(Mlstm, ForwardGatesByWarps) {
  const OpDef& op = Registry::global().get("mlstm.chunkwise.fwd");
  const Config pg = Config::parse("algo=tc_pg,threads=128", op.info),
               tc = Config::parse("algo=tc,threads=128", op.info);
  for (int64_t chunk : {16, 128}) {
    for (const char* arch : {"sm_80", "sm_90"}) {
      CompileRequest r = mlstm_request(op, 64, 64, arch, chunk);
      const Problem p = problem_from_request(op, r);
      const std::string what = std::string(arch) + " chunk " + std::to_string(chunk);
      std::string why;
      ASSERT_TRUE(op.tuning.valid(p, pg, &why)) << what << ": " << why;
      const auto k = op.kernels(p, pg), b = op.kernels(p, tc);
      ASSERT_EQ(k.size(), 3u) << what;
      EXPECT_EQ(k[0].kernel, "kspec::mlstm_tc_gates_warps_kernel") << what;
      for (size_t j : {1u, 2u}) EXPECT_EQ(k[j].targs, b[j].targs) << what << " kernel " << j;
      r.config = pg;
      const auto reports = compile(r);
      ASSERT_EQ(reports.size(), 3u) << what;
      EXPECT_EQ(reports[0].spill_bytes, 0) << what;
      EXPECT_EQ(reports[0].stack_bytes, 0) << what;
    }
  }
  auto in = chunk_inputs(2, 3, 300, 64, 64, DType::bf16, false);
  const std::vector<TensorView> out = {TensorView(fake(uintptr_t(20) << 28), DType::bf16, {2, 3, 300, 64}, 0), TensorView(),
                                       TensorView(), TensorView(), TensorView(), TensorView()};
  Params params;
  params.set("chunk", 64);
  Call call = validate_call(op, in, out, params, nullptr);
  call.problem.arch = "sm_90";
  RecordingLauncher rec;
  op.launch(call, pg, rec);
  ASSERT_EQ(rec.launches.size(), 3u);
  EXPECT_EQ(rec.launches[0].kernel, 0u);
  EXPECT_EQ(rec.launches[0].grid.x, 6u);
  EXPECT_EQ(rec.launches[0].block.x, unsigned(32 * kMlstmTcGatesWarps));
}

// The forward's algo=tc_q128 and tc_wide_q128 (the output kernel on 128 query rows, 8 warps; the latter
// with tc_wide's state tiles): valid at chunks 128 and 256 where the output kernel's shared memory fits
// the arch (DHQK 256 needs sm_90's 227 KB), a reason naming the limit elsewhere; the output kernel takes
// 128 as its last template argument; no spills or stack on sm_80 (128 x 128) and sm_90 (256 x 512).
TEST(Mlstm, ForwardOutputKernelOn128Rows) {
  const OpDef& op = Registry::global().get("mlstm.chunkwise.fwd");
  const Config q128 = Config::parse("algo=tc_q128,threads=128", op.info),
               both = Config::parse("algo=tc_wide_q128,threads=128", op.info);
  struct Row {
    int64_t dk, dv, chunk;
    const char* arch;
    const char* why;  // "" where valid
  };
  for (const Row& row : std::vector<Row>{{128, 128, 128, "sm_80", ""},
                                         {128, 256, 256, "sm_90", ""},
                                         {256, 512, 128, "sm_90", ""},
                                         {256, 512, 128, "sm_80", "shared memory"},
                                         {128, 128, 64, "sm_90", "chunk 128 or 256"}}) {
    const Problem p = problem_from_request(op, mlstm_request(op, row.dk, row.dv, row.arch, row.chunk));
    const std::string what = std::to_string(row.dk) + " x " + std::to_string(row.dv) + " chunk " +
                             std::to_string(row.chunk) + " " + row.arch;
    if (!expect_validity(op, p, q128, row.why, what, "algo=tc_q128")) continue;
    const auto k = op.kernels(p, q128);
    ASSERT_EQ(k.size(), 3u) << what;
    EXPECT_EQ(k[2].kernel, "kspec::mlstm_tc_out_kernel") << what;
    EXPECT_EQ(k[2].targs.back(), "128") << what;
    EXPECT_EQ(k[1].targs, op.kernels(p, Config::parse("algo=tc,threads=128", op.info))[1].targs) << what;
    std::string why;
    EXPECT_EQ(op.tuning.valid(p, both, &why), row.chunk <= 128) << what << ": " << why;
  }
  struct Build {
    int64_t dk, dv, chunk;
    const char* arch;
    const Config& config;
  };
  for (const Build& b : std::vector<Build>{{128, 128, 128, "sm_80", q128}, {256, 512, 128, "sm_90", both}}) {
    CompileRequest r = mlstm_request(op, b.dk, b.dv, b.arch, b.chunk);
    r.config = b.config;
    expect_no_spills(r, b.config.str(op.info));
  }
}

// The log-sigmoid probe (templates/mlstm/log_sigmoid_probe.cuh) compiles for every gate dtype.
jit::KernelSpec log_sigmoid_probe(DType dt, const std::string& arch) {
  jit::KernelSpec s;
  s.header = "mlstm/log_sigmoid_probe.cuh";
  s.kernel = "kspec::mlstm_log_sigmoid_probe_kernel";
  s.targs = {dtype_cuda_type(dt)};
  s.arch = jit::resolve_arch(arch);
  return s;
}

TEST(Mlstm, LogSigmoidProbeCompiles) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    Obtained ob = obtain_binary(log_sigmoid_probe(dt, "sm_90"));
    EXPECT_GT(ob.entry->binary.size(), 0u) << dtype_short(dt);
  }
}

// The chunkwise kernels with shared memory poisoned (KSPEC_MLSTM_POISON_SMEM, templates/mlstm/common.cuh):
// fp32, head dims 32, chunk 16, 128 threads.
jit::KernelSpec poisoned(const char* what, const std::string& arch) {
  jit::KernelSpec s;
  s.header = std::string("mlstm/chunkwise_") + what + ".cuh";
  s.kernel = std::string("kspec::mlstm_chunkwise_") + what + "_kernel";
  s.targs = {"float", "float", "32", "32", "16", "128"};
  s.defines = {{"KSPEC_MLSTM_POISON_SMEM", "1"}};
  s.arch = jit::resolve_arch(arch);
  return s;
}

TEST(Mlstm, PoisonedSharedMemoryKernelsCompile) {
  for (const char* what : {"fwd", "bwd"}) {
    Obtained ob = obtain_binary(poisoned(what, "sm_90"));
    EXPECT_GT(ob.entry->binary.size(), 0u) << what;
  }
}

namespace {

// The op's kernels for a problem and config, compiled with shared memory NaN-poisoned
// (KSPEC_MLSTM_POISON_SMEM).
std::vector<jit::KernelSpec> poisoned_plan(const OpDef& op, const Problem& p, const Config& c) {
  std::vector<jit::KernelSpec> specs = op.kernels(p, c);
  for (auto& s : specs) s.defines.push_back({"KSPEC_MLSTM_POISON_SMEM", "1"});
  return specs;
}

}  // namespace

// The tensor-core kernels of both chunkwise ops compile with their shared memory poisoned (bf16,
// head dims 32, chunk 16).
TEST(Mlstm, PoisonedTensorCoreKernelsCompile) {
  for (const char* name : {"mlstm.chunkwise.fwd", "mlstm.chunkwise.bwd"}) {
    const OpDef& op = Registry::global().get(name);
    CompileRequest r;
    r.op = name;
    r.dtype = DType::bf16;
    r.params.set("dhqk", int64_t(32));
    r.params.set("dhhv", int64_t(32));
    r.params.set("chunk", int64_t(16));
    Problem p = problem_from_request(op, r);
    p.arch = jit::resolve_arch("sm_90");
    for (const auto& spec : poisoned_plan(op, p, Config::parse("algo=tc,threads=128", op.info))) {
      Obtained ob = obtain_binary(spec);
      EXPECT_GT(ob.entry->binary.size(), 0u) << name << " " << spec.kernel;
    }
  }
}

// ---- GPU ----

// logsigmoid_all_dtypes (issue 29): the kernels' log-sigmoid of a gate in fp32, fp16 and bf16 over
// x in [-40, 40] (every 1/64), against float64 of the same (rounded) x: a few fp32 ulp everywhere,
// where log(sigmoid(x)) would lose all digits past x = 17 and exp(-x) overflow below -88.
TEST(MlstmGpu, LogSigmoidAllDtypes) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard ctx(0);
  std::vector<double> x;
  for (int j = -40 * 64; j <= 40 * 64; ++j) x.push_back(j / 64.0);
  const int n = static_cast<int>(x.size());
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    std::vector<double> xq = x;
    quantize(dt, xq);
    std::vector<unsigned char> bytes;
    encode(dt, xq, bytes);
    LoadedKernel& k = load_kernel(log_sigmoid_probe(dt, device_arch(0)), 0);
    DeviceBuffer dx(bytes.size()), dout(n * sizeof(float));
    CU_CHECK(cuMemcpyHtoD(dx.ptr, bytes.data(), bytes.size()));
    void* args[] = {&dx.ptr, &dout.ptr, const_cast<int*>(&n)};
    CU_CHECK(cuLaunchKernel(k.fn, static_cast<unsigned>((n + 255) / 256), 1, 1, 256, 1, 1, 0, nullptr, args, nullptr));
    CU_CHECK(cuCtxSynchronize());
    std::vector<float> out(n);
    CU_CHECK(cuMemcpyDtoH(out.data(), dout.ptr, n * sizeof(float)));
    double worst = 0.0;
    for (int j = 0; j < n; ++j) {
      const double want = std::min(xq[j], 0.0) - std::log1p(std::exp(-std::abs(xq[j])));
      ASSERT_TRUE(std::isfinite(out[j])) << dtype_short(dt) << " x = " << xq[j];
      worst = std::max(worst, std::abs(out[j] - want) / std::abs(want));
    }
    EXPECT_LT(worst, 1e-6) << dtype_short(dt);
  }
}

namespace {

using DevBuf = kspec::testing::FloatBuffer;

// fp32 inputs of one problem, on the host and the device.
struct Problem32 {
  int64_t B, NH, S, dk, dv;
  std::vector<float> q, k, v, i, f, C0, n0, m0;
  Problem32(int64_t B_, int64_t NH_, int64_t S_, int64_t dk_, int64_t dv_, uint64_t seed)
      : B(B_), NH(NH_), S(S_), dk(dk_), dv(dv_) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd;
    auto randn = [&](int64_t n, float shift = 0.0f) {
      std::vector<float> x(n);
      for (auto& e : x) e = nd(rng) + shift;
      return x;
    };
    const int64_t seqs = B * NH;
    q = randn(seqs * S * dk), k = randn(seqs * S * dk), v = randn(seqs * S * dv);
    i = randn(seqs * S), f = randn(seqs * S, 2.0f);
    C0 = randn(seqs * dk * dv), n0 = randn(seqs * dk), m0 = randn(seqs);
  }
  ref::MlstmInputs ref_inputs(bool init) const {
    ref::MlstmInputs r{to_double(q), to_double(k), to_double(v), to_double(i), to_double(f), {}, {}, {}};
    if (init) r.C0 = to_double(C0), r.n0 = to_double(n0), r.m0 = to_double(m0);
    return r;
  }
};

}  // namespace

// The step updates C, n, m in place; h and the states match the float64 recurrence; a second step from
// the updated states matches two steps of the recurrence. Each algorithm: algo=split's slab CTAs all read
// n and m's scalars through the gates kernel while C is updated where it is read, so in place is where
// a race between its two kernels would show (the heuristic's split, slabs of 8, 16 and 64 columns, block;
// head, whose one CTA per sequence writes n' and m' where it read n and m: 16 and 4 passes over the rows;
// cluster, whose rank 0 writes them after the cluster's 4 or 8 slab CTAs have read them).
class MlstmStepInPlace : public ::testing::TestWithParam<const char*> {};

TEST_P(MlstmStepInPlace, MatchesRecurrence) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const int64_t B = 3, NH = 2, dk = 64, dv = 128, seqs = B * NH;
  const std::string text = GetParam();
  if (text.find("algo=cluster") != std::string::npos && jit::compute_capability(device_arch(0)) < 90)
    GTEST_SKIP() << "algo=cluster needs thread-block clusters (sm_90 or newer)";
  const Config config = text.empty() ? Config() : Config::parse(text, op_info("mlstm.step"));
  CallOptions opt;
  if (!text.empty()) opt.config = &config;
  Problem32 pr(B, NH, 2, dk, dv, 11);
  DevBuf q(seqs * dk * 4), k(seqs * dk * 4), v(seqs * dv * 4), i(seqs * 4), f(seqs * 4), C(seqs * dk * dv * 4),
      n(seqs * dk * 4), m(seqs * 4), h(seqs * dv * 4);
  C.upload(pr.C0);
  n.upload(pr.n0);
  m.upload(pr.m0);
  const ref::MlstmOutputs want = ref::mlstm_recurrent_fwd_ref({B, NH, 2, dk, dv}, pr.ref_inputs(true));
  for (int64_t t = 0; t < 2; ++t) {
    auto rows = [&](const std::vector<float>& x, int64_t w) {
      std::vector<float> r;
      for (int64_t s = 0; s < seqs; ++s) r.insert(r.end(), x.begin() + (s * 2 + t) * w, x.begin() + (s * 2 + t + 1) * w);
      return r;
    };
    q.upload(rows(pr.q, dk));
    k.upload(rows(pr.k, dk));
    v.upload(rows(pr.v, dv));
    i.upload(rows(pr.i, 1));
    f.upload(rows(pr.f, 1));
    h.poison();
    TensorView Cv(C.ptr(), DType::f32, {B, NH, dk, dv}, 0), nv(n.ptr(), DType::f32, {B, NH, dk}, 0),
        mv(m.ptr(), DType::f32, {B, NH, 1}, 0);
    call("mlstm.step",
         {TensorView(q.ptr(), DType::f32, {B, NH, dk}, 0), TensorView(k.ptr(), DType::f32, {B, NH, dk}, 0),
          TensorView(v.ptr(), DType::f32, {B, NH, dv}, 0), TensorView(i.ptr(), DType::f32, {B, NH, 1}, 0),
          TensorView(f.ptr(), DType::f32, {B, NH, 1}, 0), Cv, nv, mv},
         {TensorView(h.ptr(), DType::f32, {B, NH, dv}, 0), Cv, nv, mv}, {}, nullptr, opt);
    CU_CHECK(cuCtxSynchronize());
    std::vector<double> h_ref;
    for (int64_t s = 0; s < seqs; ++s)
      h_ref.insert(h_ref.end(), want.h.begin() + (s * 2 + t) * dv, want.h.begin() + (s * 2 + t + 1) * dv);
    EXPECT_LT(rel_err(h.download(seqs * dv), h_ref), 1e-5) << "step " << t;
  }
  EXPECT_LT(rel_err(C.download(seqs * dk * dv), want.C), 1e-5);
  EXPECT_LT(rel_err(n.download(seqs * dk), want.n), 1e-5);
  EXPECT_LT(rel_err(m.download(seqs), want.m_last), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Configs, MlstmStepInPlace,
                         ::testing::Values("", "algo=split,threads=256,cols=16", "algo=split,threads=128,cols=8",
                                           "algo=split,threads=64,cols=64",
                                           "algo=split,threads=128,cols=32", "algo=block,threads=256,cols=16",
                                           "algo=head,threads=128,cols=16", "algo=head,threads=512,cols=16",
                                           "algo=cluster,threads=256,cols=32", "algo=cluster,threads=64,cols=16"));

// algo=split at the model's head dims with one sequence (B = 1: the heuristic's slabs of 8 columns):
// every valid config of mlstm.step (slabs of 8, 16, 32, 64 columns; 64 to 512 threads, so 1 to 16 passes
// over the rows) against the float64 reference, fp32 and bf16, outputs NaN-poisoned by the checker.
TEST(MlstmGpu, StepEveryConfigAtModelHeadDims) {
  KSPEC_REQUIRE_GPU();
  for (const char* cs : {"B_1_dh_128", "B_1_dk_256_dv_64", "dh_64", "B_1_NH_1"}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      CheckOptions o;
      o.case_name = cs;
      o.dtypes = {dt};
      o.configs = configs_for_case("mlstm.step", cs, dt);
      ASSERT_GE(o.configs.size(), 5u) << cs;
      auto rows = check_op("mlstm.step", o);
      EXPECT_EQ(rows.size(), o.configs.size()) << cs;
      kspec::testing::report(rows);
    }
  }
}

// Two chunkwise calls, the second from the first's last states, equal one call (S = 150 split at 70,
// chunk 64: chunks cut differently in the two runs), and both match the reference.
TEST(MlstmGpu, ChunkwiseTwoCallsPassingStatesEqualOne) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const int64_t B = 2, NH = 2, S = 150, split = 70, dk = 32, dv = 64, seqs = B * NH;
  Problem32 pr(B, NH, S, dk, dv, 12);
  auto run = [&](int64_t t0, int64_t t1, const DevBuf* C0, const DevBuf* n0, const DevBuf* m0, DevBuf& h, DevBuf& C,
                 DevBuf& n, DevBuf& m) {
    const int64_t len = t1 - t0;
    auto rows = [&](const std::vector<float>& x, int64_t w) {
      std::vector<float> r;
      for (int64_t s = 0; s < seqs; ++s) r.insert(r.end(), x.begin() + (s * S + t0) * w, x.begin() + (s * S + t1) * w);
      return r;
    };
    DevBuf q(seqs * len * dk * 4), k(seqs * len * dk * 4), v(seqs * len * dv * 4), i(seqs * len * 4), f(seqs * len * 4);
    q.upload(rows(pr.q, dk));
    k.upload(rows(pr.k, dk));
    v.upload(rows(pr.v, dv));
    i.upload(rows(pr.i, 1));
    f.upload(rows(pr.f, 1));
    h.poison();
    C.poison();
    auto view = [](const DevBuf* b, std::initializer_list<int64_t> shape) {
      return b ? TensorView(b->ptr(), DType::f32, shape, 0) : TensorView();
    };
    call("mlstm.chunkwise.fwd",
         {TensorView(q.ptr(), DType::f32, {B, NH, len, dk}, 0), TensorView(k.ptr(), DType::f32, {B, NH, len, dk}, 0),
          TensorView(v.ptr(), DType::f32, {B, NH, len, dv}, 0), TensorView(i.ptr(), DType::f32, {B, NH, len}, 0),
          TensorView(f.ptr(), DType::f32, {B, NH, len}, 0), view(C0, {B, NH, dk, dv}), view(n0, {B, NH, dk}),
          view(m0, {B, NH, 1})},
         {TensorView(h.ptr(), DType::f32, {B, NH, len, dv}, 0), TensorView(), TensorView(),
          TensorView(C.ptr(), DType::f32, {B, NH, dk, dv}, 0), TensorView(n.ptr(), DType::f32, {B, NH, dk}, 0),
          TensorView(m.ptr(), DType::f32, {B, NH, 1}, 0)},
         {{"chunk", int64_t(64)}});
    CU_CHECK(cuCtxSynchronize());
  };
  DevBuf h(seqs * S * dv * 4), C(seqs * dk * dv * 4), n(seqs * dk * 4), m(seqs * 4);
  DevBuf h1(seqs * split * dv * 4), C1(seqs * dk * dv * 4), n1(seqs * dk * 4), m1(seqs * 4);
  DevBuf h2(seqs * (S - split) * dv * 4), C2(seqs * dk * dv * 4), n2(seqs * dk * 4), m2(seqs * 4);
  run(0, S, nullptr, nullptr, nullptr, h, C, n, m);
  run(0, split, nullptr, nullptr, nullptr, h1, C1, n1, m1);
  run(split, S, &C1, &n1, &m1, h2, C2, n2, m2);
  const ref::MlstmOutputs want = ref::mlstm_recurrent_fwd_ref({B, NH, S, dk, dv}, pr.ref_inputs(false));
  EXPECT_LT(rel_err(h.download(seqs * S * dv), want.h), 4e-5);
  EXPECT_LT(rel_err(C.download(seqs * dk * dv), want.C), 4e-5);
  const auto a = h1.download(seqs * split * dv), b = h2.download(seqs * (S - split) * dv);
  std::vector<float> joined;
  for (int64_t s = 0; s < seqs; ++s) {
    joined.insert(joined.end(), a.begin() + s * split * dv, a.begin() + (s + 1) * split * dv);
    joined.insert(joined.end(), b.begin() + s * (S - split) * dv, b.begin() + (s + 1) * (S - split) * dv);
  }
  EXPECT_LT(rel_err(joined, want.h), 4e-5);
  EXPECT_LT(rel_err(C2.download(seqs * dk * dv), to_double(C.download(seqs * dk * dv))), 1e-5);
  EXPECT_LT(rel_err(m2.download(seqs), to_double(m.download(seqs))), 1e-6);
}

namespace {

// mlstm.chunkwise.fwd on the device in dtype dt, no states, h only: inputs rounded to dt in place (so
// the reference sees what the GPU sees); returns h.
std::vector<double> chunkwise_h(DType dt, int64_t S, int64_t dh, int64_t chunk, std::vector<double>& q,
                                std::vector<double>& k, std::vector<double>& v, std::vector<double>& i,
                                std::vector<double>& f) {
  jit::ContextGuard guard(0);
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  auto upload = [&](std::vector<double>& x, std::initializer_list<int64_t> shape) {
    quantize(dt, x);
    std::vector<unsigned char> bytes;
    encode(dt, x, bytes);
    bufs.push_back(std::make_unique<DeviceBuffer>(bytes.size()));
    CU_CHECK(cuMemcpyHtoD(bufs.back()->ptr, bytes.data(), bytes.size()));
    return TensorView(reinterpret_cast<void*>(bufs.back()->ptr), dt, shape, 0);
  };
  std::vector<TensorView> in = {upload(q, {1, 1, S, dh}), upload(k, {1, 1, S, dh}), upload(v, {1, 1, S, dh}),
                                upload(i, {1, 1, S}),     upload(f, {1, 1, S}),     TensorView(),
                                TensorView(),             TensorView()};
  const size_t bytes = static_cast<size_t>(S * dh) * dtype_size(dt);
  DeviceBuffer h(bytes);
  CU_CHECK(cuMemsetD8(h.ptr, 0xFF, bytes));
  call("mlstm.chunkwise.fwd", in,
       {TensorView(reinterpret_cast<void*>(h.ptr), dt, {1, 1, S, dh}, 0), TensorView(), TensorView(), TensorView(),
        TensorView(), TensorView()},
       {{"chunk", chunk}});
  CU_CHECK(cuCtxSynchronize());
  std::vector<unsigned char> out(bytes);
  CU_CHECK(cuMemcpyDtoH(out.data(), h.ptr, bytes));
  return decode(dt, out);
}

}  // namespace

// fp16_long_sequences (issue 29): S = 8192 and 32768 with strong forgetting (f ~ -5, i ~ N(0, 1)) and
// with f ~ 4, i = -10 (m drifts down to -10, e^-m = 2.2e4), in fp16 and bf16: every h finite and within
// the forward tolerance of the float64 reference (m, e^-m and the sums are fp32 in the kernel).
TEST(MlstmGpu, LongSequencesInHalfPrecision) {
  KSPEC_REQUIRE_GPU();
  const int64_t dh = 32;
  for (int64_t S : {8192, 32768}) {
    for (bool forget_hard : {true, false}) {
      for (DType dt : {DType::f16, DType::bf16}) {
        std::mt19937_64 rng(S + forget_hard);
        std::normal_distribution<double> nd;
        auto randn = [&](int64_t n, double mean, double sd) {
          std::vector<double> x(n);
          for (auto& e : x) e = mean + sd * nd(rng);
          return x;
        };
        std::vector<double> q = randn(S * dh, 0, 1), k = randn(S * dh, 0, 1), v = randn(S * dh, 0, 1);
        std::vector<double> i = forget_hard ? randn(S, 0, 1) : randn(S, -10, 0);
        std::vector<double> f = forget_hard ? randn(S, -5, 0.1) : randn(S, 4, 0.1);
        const std::vector<double> got = chunkwise_h(dt, S, dh, 64, q, k, v, i, f);
        const ref::MlstmOutputs want = ref::mlstm_chunkwise_fwd_ref({1, 1, S, dh, dh}, {q, k, v, i, f, {}, {}, {}}, 64);
        double num = 0, den = 0;
        for (size_t j = 0; j < got.size(); ++j) {
          ASSERT_TRUE(std::isfinite(got[j])) << dtype_short(dt) << " S " << S << " element " << j;
          num += (got[j] - want.h[j]) * (got[j] - want.h[j]);
          den += want.h[j] * want.h[j];
        }
        EXPECT_LT(std::sqrt(num / den), dt == DType::f16 ? 3e-3 : 2e-2)
            << dtype_short(dt) << " S " << S << (forget_hard ? " f ~ -5" : " f ~ 4, i = -10");
      }
    }
  }
}

// ---- backward and parallel form ----

namespace {

struct Grads32 {
  std::vector<float> dq, dk, dv, di, df, dC0;
};

// fp32 forward then backward of one problem on the device, every output NaN-poisoned first: the
// backward is given the device forward's nrm and m_rows (as autograd would), with or without the
// initial states and dC_last. parallel: mlstm.parallel.fwd / .bwd (no states) with the config's chunk.
Grads32 device_grads(const Problem32& pr, const std::vector<float>& dh, const std::vector<float>* dC_last, bool init,
                     int64_t chunk, bool parallel = false, const Config* config = nullptr) {
  jit::ContextGuard guard(0);
  const int64_t B = pr.B, NH = pr.NH, S = pr.S, dk = pr.dk, dv = pr.dv, seqs = B * NH;
  auto dev = [](const std::vector<float>& x) {
    auto b = std::make_unique<DevBuf>(x.size() * 4);
    b->upload(x);
    return b;
  };
  auto out = [](size_t n) {
    auto b = std::make_unique<DevBuf>(n * 4);
    b->poison();
    return b;
  };
  auto q = dev(pr.q), k = dev(pr.k), v = dev(pr.v), i = dev(pr.i), f = dev(pr.f), C0 = dev(pr.C0), n0 = dev(pr.n0),
       m0 = dev(pr.m0), dhb = dev(dh);
  auto dCl = dev(dC_last ? *dC_last : std::vector<float>(1));
  auto h = out(seqs * S * dv), nrm = out(seqs * S), mr = out(seqs * S), dq = out(seqs * S * dk), dkb = out(seqs * S * dk),
       dvb = out(seqs * S * dv), di = out(seqs * S), df = out(seqs * S), dC0 = out(seqs * dk * dv);
  using Buf = std::unique_ptr<DevBuf>;
  auto tq = [&](const Buf& b) { return TensorView(b->ptr(), DType::f32, {B, NH, S, dk}, 0); };
  auto tv = [&](const Buf& b) { return TensorView(b->ptr(), DType::f32, {B, NH, S, dv}, 0); };
  auto tr = [&](const Buf& b) { return TensorView(b->ptr(), DType::f32, {B, NH, S}, 0); };
  auto tc = [&](const Buf& b) { return TensorView(b->ptr(), DType::f32, {B, NH, dk, dv}, 0); };
  auto tn = [&](const Buf& b) { return TensorView(b->ptr(), DType::f32, {B, NH, dk}, 0); };
  auto tm = [&](const Buf& b) { return TensorView(b->ptr(), DType::f32, {B, NH, 1}, 0); };
  const std::vector<TensorView> qkvif = {tq(q), tq(k), tv(v), tr(i), tr(f)};
  Params params;
  if (!parallel) params.set("chunk", chunk);
  CallOptions opt;
  opt.config = config;
  if (parallel) {
    call("mlstm.parallel.fwd", qkvif, {tv(h), tr(nrm), tr(mr)}, params, nullptr, opt);
    auto in = qkvif;
    in.insert(in.end(), {tr(nrm), tr(mr), tv(dhb)});
    call("mlstm.parallel.bwd", in, {tq(dq), tq(dkb), tv(dvb), tr(di), tr(df)}, params, nullptr, opt);
  } else {
    auto in = qkvif;
    in.insert(in.end(), {init ? tc(C0) : TensorView(), init ? tn(n0) : TensorView(),
                         init ? tm(m0) : TensorView()});
    call("mlstm.chunkwise.fwd", in, {tv(h), tr(nrm), tr(mr), TensorView(), TensorView(), TensorView()},
         params);
    auto bin = qkvif;
    bin.insert(bin.end(), {init ? tc(C0) : TensorView(), init ? tm(m0) : TensorView(), tr(nrm),
                           tr(mr), tv(dhb), dC_last ? tc(dCl) : TensorView()});
    call("mlstm.chunkwise.bwd", bin,
         {tq(dq), tq(dkb), tv(dvb), tr(di), tr(df), init ? tc(dC0) : TensorView()}, params,
         nullptr, opt);
  }
  CU_CHECK(cuCtxSynchronize());
  Grads32 g{dq->download(seqs * S * dk), dkb->download(seqs * S * dk), dvb->download(seqs * S * dv),
            di->download(seqs * S), df->download(seqs * S), {}};
  if (init && !parallel) g.dC0 = dC0->download(seqs * dk * dv);
  return g;
}

std::vector<float> randn_f(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (auto& e : x) e = nd(rng);
  return x;
}

// Every gradient within the fp32 tolerance (max|x - ref| / max|ref| <= 1e-3).
void expect_grads(const Grads32& g, const ref::MlstmGrads& want, const std::string& what) {
  EXPECT_LT(max_rel(g.dq, want.dq), 1e-3) << what << " dq";
  EXPECT_LT(max_rel(g.dk, want.dk), 1e-3) << what << " dk";
  EXPECT_LT(max_rel(g.dv, want.dv), 1e-3) << what << " dv";
  EXPECT_LT(max_rel(g.di, want.di), 1e-3) << what << " di";
  EXPECT_LT(max_rel(g.df, want.df), 1e-3) << what << " df";
  if (!want.dC0.empty()) {
    EXPECT_LT(max_rel(g.dC0, want.dC0), 1e-3) << what << " dC0";
  }
}

}  // namespace

// mlstm.chunkwise.bwd after the device's forward, fp32, against the float64 reference: S = 150 over
// chunks of 64 and 16 (a short last chunk), with and without initial states and dC_last.
TEST(MlstmGpu, ChunkwiseBackwardMatchesReference) {
  KSPEC_REQUIRE_GPU();
  const int64_t B = 2, NH = 2, S = 150, dk = 32, dv = 64;
  Problem32 pr(B, NH, S, dk, dv, 21);
  const auto dh = randn_f(B * NH * S * dv, 22), dC_last = randn_f(B * NH * dk * dv, 23);
  const std::vector<double> dh_d = to_double(dh), dC_d = to_double(dC_last);
  for (int64_t chunk : {16, 64})
    for (bool init : {false, true})
      for (bool with_dC : {false, true}) {
        const Grads32 g = device_grads(pr, dh, with_dC ? &dC_last : nullptr, init, chunk);
        const auto want = ref::mlstm_chunkwise_bwd_ref({B, NH, S, dk, dv}, pr.ref_inputs(init), dh_d,
                                                       with_dC ? &dC_d : nullptr, chunk);
        expect_grads(g, want, "chunk " + std::to_string(chunk) + (init ? " init" : "") + (with_dC ? " dC_last" : ""));
      }
}

// dC_last_df (issue 29): an upstream dC_last reaches df (mlstm_kernels leaves <dC_last, C_last> out):
// df with dC_last matches the reference and differs from df without it by far more than the tolerance.
TEST(MlstmGpu, DcLastReachesDf) {
  KSPEC_REQUIRE_GPU();
  const int64_t B = 1, NH = 2, S = 100, dk = 32, dv = 32;
  Problem32 pr(B, NH, S, dk, dv, 31);
  const auto dh = randn_f(B * NH * S * dv, 32), dC_last = randn_f(B * NH * dk * dv, 33);
  const std::vector<double> dC_d = to_double(dC_last);
  const Grads32 with = device_grads(pr, dh, &dC_last, true, 64), without = device_grads(pr, dh, nullptr, true, 64);
  const auto want = ref::mlstm_chunkwise_bwd_ref({B, NH, S, dk, dv}, pr.ref_inputs(true), to_double(dh), &dC_d, 64);
  EXPECT_LT(max_rel(with.df, want.df), 1e-3);
  EXPECT_GT(max_rel(without.df, want.df), 1e-2);
}

// accumulators_initialized (issue 29): S of 8 chunks; two calls with different inputs, every output
// NaN-filled before each (device_grads): the second call's gradients match its own reference (nothing
// of the first call's state or of the poison survives), and a third call on the same inputs gives the
// same bits (deterministic: no atomics).
TEST(MlstmGpu, AccumulatorsInitialized) {
  KSPEC_REQUIRE_GPU();
  const int64_t B = 2, NH = 1, S = 128, dk = 32, dv = 32, chunk = 16;
  Problem32 first(B, NH, S, dk, dv, 41), second(B, NH, S, dk, dv, 42);
  const auto dh1 = randn_f(B * NH * S * dv, 43), dh2 = randn_f(B * NH * S * dv, 44);
  const auto dC1 = randn_f(B * NH * dk * dv, 45), dC2 = randn_f(B * NH * dk * dv, 46);
  device_grads(first, dh1, &dC1, true, chunk);
  const Grads32 g = device_grads(second, dh2, &dC2, true, chunk);
  const std::vector<double> dC2_d = to_double(dC2);
  expect_grads(g, ref::mlstm_chunkwise_bwd_ref({B, NH, S, dk, dv}, second.ref_inputs(true), to_double(dh2), &dC2_d,
                                               chunk),
               "second call");
  const Grads32 again = device_grads(second, dh2, &dC2, true, chunk);
  EXPECT_EQ(g.dq, again.dq);
  EXPECT_EQ(g.dk, again.dk);
  EXPECT_EQ(g.dv, again.dv);
  EXPECT_EQ(g.di, again.di);
  EXPECT_EQ(g.df, again.df);
  EXPECT_EQ(g.dC0, again.dC0);
  device_grads(first, dh1, nullptr, false, chunk, true);
  const Grads32 p = device_grads(second, dh2, nullptr, false, chunk, true);
  expect_grads(p, ref::mlstm_parallel_bwd_ref({B, NH, S, dk, dv}, second.ref_inputs(false), to_double(dh2)),
               "parallel, second call");
}

// The parallel form forward and backward, fp32, S in {1, 65, 200}, every chunk tile: against the
// float64 parallel reference (m0 = -inf, no states).
TEST(MlstmGpu, ParallelMatchesReference) {
  KSPEC_REQUIRE_GPU();
  for (int64_t S : {1, 65, 200}) {
    const int64_t B = 1, NH = 2, dk = 32, dv = 64;
    Problem32 pr(B, NH, S, dk, dv, 50 + S);
    const auto dh = randn_f(B * NH * S * dv, 51);
    const auto want = ref::mlstm_parallel_bwd_ref({B, NH, S, dk, dv}, pr.ref_inputs(false), to_double(dh));
    for (int64_t chunk : {16, 32, 64, 128}) {
      const Config c{{{"threads", 128}, {"chunk", chunk}}};
      expect_grads(device_grads(pr, dh, nullptr, false, chunk, true, &c), want,
                   "S " + std::to_string(S) + " chunk " + std::to_string(chunk));
    }
  }
}

// nondefault_tiles (issue 29): every tuning config of every mlstm op on three shapes (a length just past
// a chunk, head dims 16/32, head dims 128/256), fp32 and bf16, against the reference.
// (GpuEveryOp.EveryTuningConfigMatchesReference runs every config of each op's "base" case in bf16.)
TEST(MlstmGpu, EveryTuningConfigOnThreeShapes) {
  KSPEC_REQUIRE_GPU();
  for (const char* op : {"mlstm.step", "mlstm.chunkwise.fwd", "mlstm.chunkwise.bwd", "mlstm.parallel.fwd",
                         "mlstm.parallel.bwd"}) {
    const auto names = case_names(op);
    int shapes = 0;
    for (const char* cs : {"S_65", "dh_16", "dk_16_dv_32", "dk_128_dv_256"}) {
      if (std::find(names.begin(), names.end(), cs) == names.end() || shapes == 3) continue;
      ++shapes;
      for (DType dt : {DType::f32, DType::bf16}) {
        CheckOptions o;
        o.case_name = cs;
        o.dtypes = {dt};
        o.configs = configs_for_case(op, cs, dt);
        ASSERT_FALSE(o.configs.empty()) << op << " " << cs;
        auto rows = check_op(op, o);
        EXPECT_EQ(rows.size(), o.configs.size()) << op << " " << cs;
        kspec::testing::report(rows);
      }
    }
    EXPECT_EQ(shapes, 3) << op;
  }
}

namespace {

// Every output of mlstm.chunkwise.fwd in a 16-bit dtype under a forced config (NaN-poisoned first),
// decoded to double; the inputs are pr's rounded to dt (q, k, v, i, f) and fp32 (states), which
// `rounded` receives for the reference.
std::vector<std::vector<double>> forward16(const Problem32& pr, DType dt, int64_t chunk, bool init, const Config& cfg,
                                           ref::MlstmInputs* rounded) {
  jit::ContextGuard guard(0);
  const int64_t B = pr.B, NH = pr.NH, S = pr.S, dk = pr.dk, dv = pr.dv;
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  auto put = [&](std::vector<double> x, DType t, std::initializer_list<int64_t> shape, std::vector<double>* keep) {
    quantize(t, x);
    if (keep) *keep = x;
    std::vector<unsigned char> bytes;
    encode(t, x, bytes);
    bufs.push_back(std::make_unique<DeviceBuffer>(bytes.size()));
    CU_CHECK(cuMemcpyHtoD(bufs.back()->ptr, bytes.data(), bytes.size()));
    return TensorView(reinterpret_cast<void*>(bufs.back()->ptr), t, shape, 0);
  };
  *rounded = pr.ref_inputs(init);
  std::vector<TensorView> in = {put(to_double(pr.q), dt, {B, NH, S, dk}, &rounded->q),
                                put(to_double(pr.k), dt, {B, NH, S, dk}, &rounded->k),
                                put(to_double(pr.v), dt, {B, NH, S, dv}, &rounded->v),
                                put(to_double(pr.i), dt, {B, NH, S}, &rounded->i),
                                put(to_double(pr.f), dt, {B, NH, S}, &rounded->f),
                                TensorView(), TensorView(), TensorView()};
  if (init) {
    in[5] = put(to_double(pr.C0), DType::f32, {B, NH, dk, dv}, nullptr);
    in[6] = put(to_double(pr.n0), DType::f32, {B, NH, dk}, nullptr);
    in[7] = put(to_double(pr.m0), DType::f32, {B, NH, 1}, nullptr);
  }
  std::vector<DType> types = {dt, DType::f32, DType::f32, DType::f32, DType::f32, DType::f32};
  std::vector<int64_t> sizes = {B * NH * S * dv, B * NH * S, B * NH * S, B * NH * dk * dv, B * NH * dk, B * NH};
  std::vector<std::unique_ptr<DeviceBuffer>> outs;
  for (size_t j = 0; j < types.size(); ++j) {
    outs.push_back(std::make_unique<DeviceBuffer>(static_cast<size_t>(sizes[j]) * dtype_size(types[j])));
    CU_CHECK(cuMemsetD8(outs[j]->ptr, 0xFF, outs[j]->bytes));
  }
  auto at = [&](size_t j) { return reinterpret_cast<void*>(outs[j]->ptr); };
  CallOptions opt;
  opt.config = &cfg;
  call("mlstm.chunkwise.fwd", in,
       {TensorView(at(0), dt, {B, NH, S, dv}, 0), TensorView(at(1), DType::f32, {B, NH, S}, 0),
        TensorView(at(2), DType::f32, {B, NH, S}, 0), TensorView(at(3), DType::f32, {B, NH, dk, dv}, 0),
        TensorView(at(4), DType::f32, {B, NH, dk}, 0), TensorView(at(5), DType::f32, {B, NH, 1}, 0)},
       {{"chunk", chunk}}, nullptr, opt);
  CU_CHECK(cuCtxSynchronize());
  std::vector<std::vector<double>> got;
  for (size_t j = 0; j < types.size(); ++j) {
    std::vector<unsigned char> bytes(outs[j]->bytes);
    CU_CHECK(cuMemcpyDtoH(bytes.data(), outs[j]->ptr, bytes.size()));
    got.push_back(decode(types[j], bytes));
  }
  return got;
}

double rel_max_d(const std::vector<double>& out, const std::vector<double>& ref) {
  return max_rel(std::vector<float>(out.begin(), out.end()), ref);
}

}  // namespace

// The tensor-core forward (algo=tc, templates/mlstm/chunkwise_tc.cuh) in fp16 and bf16 against the
// float64 chunkwise reference of the same rounded inputs, every output: S of 1, 2, one short of and one
// past a chunk, several chunks with a short last one, every chunk size, head dims 16..128, with and
// without initial states. h within the forward tolerance (fp16 3e-3, bf16 2e-2); the last
// states (fp32 sums of 16-bit w_s k_s products) within the same; nrm and m (fp32 gate math) within 1e-4.
TEST(MlstmGpu, TensorCoreForwardMatchesReference) {
  KSPEC_REQUIRE_GPU();
  struct Shape {
    int64_t B, NH, S, dk, dv, chunk;
  };
  const std::vector<Shape> shapes = {{2, 2, 1, 32, 32, 64},   {2, 1, 2, 32, 64, 16},   {1, 2, 63, 32, 32, 64},
                                     {1, 2, 65, 32, 32, 64},  {1, 2, 100, 16, 32, 16}, {1, 2, 150, 64, 64, 32},
                                     {1, 2, 300, 32, 32, 128}, {1, 1, 200, 128, 128, 128}, {1, 1, 130, 128, 256, 64}};
  const Config tc = Config::parse("algo=tc,threads=128", op_info("mlstm.chunkwise.fwd"));
  for (const Shape& sh : shapes) {
    Problem32 pr(sh.B, sh.NH, sh.S, sh.dk, sh.dv, 70 + sh.S);
    for (DType dt : {DType::f16, DType::bf16}) {
      for (bool init : {false, true}) {
        ref::MlstmInputs r;
        const auto got = forward16(pr, dt, sh.chunk, init, tc, &r);
        const auto want = ref::mlstm_chunkwise_fwd_ref({sh.B, sh.NH, sh.S, sh.dk, sh.dv}, r, sh.chunk);
        const std::string what = std::string(dtype_short(dt)) + " S " + std::to_string(sh.S) + " dk " + std::to_string(sh.dk) +
                                 " dv " + std::to_string(sh.dv) + " chunk " + std::to_string(sh.chunk) +
                                 (init ? " init" : "");
        const double tol = dt == DType::f16 ? 3e-3 : 2e-2;
        EXPECT_LT(rel_max_d(got[0], want.h), tol) << what << " h";
        EXPECT_LT(rel_max_d(got[1], want.nrm), 1e-4) << what << " nrm";
        EXPECT_LT(rel_max_d(got[2], want.m), 1e-4) << what << " m_rows";
        EXPECT_LT(rel_max_d(got[3], want.C), tol) << what << " C_last";
        EXPECT_LT(rel_max_d(got[4], want.n), tol) << what << " n_last";
        EXPECT_LT(rel_max_d(got[5], want.m_last), 1e-4) << what << " m_last";
      }
    }
  }
}

// algo=tc forced on every case of both chunkwise ops, fp16 and bf16, against the float64 reference with
// the op's tolerance (the generic checker's rows: S of 1, 2, 63, 64, 65, 100, 300, chunks 16 to 256, head
// dims 16 to 128 x 256 (to 256 x 512 with the large cases), with and without initial states, dC_last,
// nrm and the last states).
TEST(MlstmGpu, TensorCoreEveryCaseMatchesReference) {
  KSPEC_REQUIRE_GPU();
  for (const char* op : {"mlstm.chunkwise.fwd", "mlstm.chunkwise.bwd"}) {
    const Config tc = Config::parse("algo=tc,threads=128", op_info(op));
    int ran = 0;
    for (const auto& cs : Registry::global().get(op).cases) {
      if (cs.large) continue;
      CheckOptions o;
      o.case_name = cs.name;
      o.dtypes = {DType::f16, DType::bf16};
      o.configs = {tc};
      const auto rows = check_op(op, o);
      EXPECT_EQ(rows.size(), 2u) << op << " " << cs.name;
      kspec::testing::report(rows);
      ++ran;
    }
    EXPECT_GE(ran, 14) << op;
  }
}

namespace {

// A device tensor of `shape` in dtype t, every byte 0xFF (NaN in every float type), kept alive by bufs.
TensorView nan_tensor(std::vector<std::unique_ptr<DeviceBuffer>>& bufs, DType t, std::initializer_list<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  bufs.push_back(std::make_unique<DeviceBuffer>(static_cast<size_t>(n) * dtype_size(t)));
  CU_CHECK(cuMemsetD8(bufs.back()->ptr, 0xFF, bufs.back()->bytes));
  return TensorView(reinterpret_cast<void*>(bufs.back()->ptr), t, shape, 0);
}

// Every output of mlstm.chunkwise.bwd in a 16-bit dtype under a forced config (NaN-poisoned first),
// decoded to double, with dC_last and the initial states: the inputs are r's (already rounded to dt),
// nrm and m_rows the float64 forward's of them (as autograd hands the forward's over).
std::vector<std::vector<double>> backward16(const ref::MlstmShape& sh, const ref::MlstmInputs& r,
                                            const std::vector<double>& dh, const std::vector<double>& dC_last,
                                            DType dt, int64_t chunk, const Config& cfg) {
  jit::ContextGuard guard(0);
  const int64_t B = sh.B, NH = sh.NH, S = sh.S, dk = sh.DK, dv = sh.DV;
  const auto fwd = ref::mlstm_chunkwise_fwd_ref(sh, r, chunk);
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  auto put = [&](const std::vector<double>& x, DType t, std::initializer_list<int64_t> shape) {
    std::vector<unsigned char> bytes;
    encode(t, x, bytes);
    bufs.push_back(std::make_unique<DeviceBuffer>(bytes.size()));
    CU_CHECK(cuMemcpyHtoD(bufs.back()->ptr, bytes.data(), bytes.size()));
    return TensorView(reinterpret_cast<void*>(bufs.back()->ptr), t, shape, 0);
  };
  auto nan_out = [&](DType t, std::initializer_list<int64_t> shape) { return nan_tensor(bufs, t, shape); };
  const std::vector<TensorView> in = {
      put(r.q, dt, {B, NH, S, dk}),        put(r.k, dt, {B, NH, S, dk}),       put(r.v, dt, {B, NH, S, dv}),
      put(r.i, dt, {B, NH, S}),            put(r.f, dt, {B, NH, S}),           put(r.C0, DType::f32, {B, NH, dk, dv}),
      put(r.m0, DType::f32, {B, NH, 1}),   put(fwd.nrm, DType::f32, {B, NH, S}), put(fwd.m, DType::f32, {B, NH, S}),
      put(dh, dt, {B, NH, S, dv}),         put(dC_last, DType::f32, {B, NH, dk, dv})};
  const std::vector<TensorView> out = {nan_out(dt, {B, NH, S, dk}), nan_out(dt, {B, NH, S, dk}),
                                       nan_out(dt, {B, NH, S, dv}), nan_out(dt, {B, NH, S}),
                                       nan_out(dt, {B, NH, S}),     nan_out(DType::f32, {B, NH, dk, dv})};
  CallOptions opt;
  opt.config = &cfg;
  call("mlstm.chunkwise.bwd", in, out, {{"chunk", chunk}}, nullptr, opt);
  CU_CHECK(cuCtxSynchronize());
  std::vector<std::vector<double>> got;
  for (const TensorView& t : out) {
    std::vector<unsigned char> bytes(static_cast<size_t>(t.numel()) * dtype_size(t.dtype));
    CU_CHECK(cuMemcpyDtoH(bytes.data(), reinterpret_cast<CUdeviceptr>(t.data), bytes.size()));
    got.push_back(decode(t.dtype, bytes));
  }
  return got;
}

}  // namespace

// The tensor-core forward and backward at issue 29's larger head dims, (128, 256) and (256, 512) (the
// backward in column blocks of 128 with its partial sums reduced in a fixed order), S of 1, 65 and 300,
// chunks 64, 128 and 256, bf16, with initial states and dC_last: every output against the float64
// reference of the same rounded inputs (h within 2e-2, the gradients within 5e-2 as the poisoned-memory
// test), and a second call gives the same bits.
TEST(MlstmGpu, TensorCoreLargeHeadDimsMatchReference) {
  KSPEC_REQUIRE_GPU();
  const DType dt = DType::bf16;
  const Config fwd_tc = Config::parse("algo=tc,threads=128", op_info("mlstm.chunkwise.fwd"));
  const Config bwd_tc = Config::parse("algo=tc,threads=128", op_info("mlstm.chunkwise.bwd"));
  for (const auto& [dk, dv] : std::vector<std::pair<int64_t, int64_t>>{{128, 256}, {256, 512}}) {
    for (int64_t S : {1, 65, 300}) {
      Problem32 pr(1, 1, S, dk, dv, 90 + S + dk);
      std::vector<double> dh = to_double(randn_f(S * dv, 91)), dC_last = to_double(randn_f(dk * dv, 92));
      quantize(dt, dh);
      for (int64_t chunk : {64, 128, 256}) {
        const std::string what = "dk " + std::to_string(dk) + " dv " + std::to_string(dv) + " S " +
                                 std::to_string(S) + " chunk " + std::to_string(chunk);
        ref::MlstmInputs r;
        const auto h = forward16(pr, dt, chunk, true, fwd_tc, &r);
        const ref::MlstmShape sh{1, 1, S, dk, dv};
        const auto want = ref::mlstm_chunkwise_fwd_ref(sh, r, chunk);
        EXPECT_LT(rel_max_d(h[0], want.h), 2e-2) << what << " h";
        EXPECT_LT(rel_max_d(h[3], want.C), 2e-2) << what << " C_last";
        EXPECT_EQ(forward16(pr, dt, chunk, true, fwd_tc, &r)[0], h[0]) << what << " h, second call";
        r.n0.assign(dk, 0.0);  // the backward has no n0 (nrm is its constant)
        const auto g = backward16(sh, r, dh, dC_last, dt, chunk, bwd_tc);
        const auto grads = ref::mlstm_chunkwise_bwd_ref(sh, r, dh, &dC_last, chunk);
        const char* names[] = {"dq", "dk", "dv", "di", "df", "dC0"};
        const std::vector<double>* refs[] = {&grads.dq, &grads.dk, &grads.dv, &grads.di, &grads.df, &grads.dC0};
        for (size_t j = 0; j < 6; ++j) EXPECT_LT(rel_max_d(g[j], *refs[j]), 5e-2) << what << " " << names[j];
        const auto again = backward16(sh, r, dh, dC_last, dt, chunk, bwd_tc);
        for (size_t j = 0; j < 6; ++j) EXPECT_EQ(again[j], g[j]) << what << " " << names[j] << ", second call";
      }
    }
  }
}

namespace {

// Runs an op's launcher on the poisoned build of its plan (poisoned_plan): every launch loads the
// poisoned kernel; the workspace is NaN-filled.
class PoisonedLauncher : public Launcher {
 public:
  explicit PoisonedLauncher(std::vector<jit::KernelSpec> specs) : specs_(std::move(specs)) {}
  void launch(size_t k, Dim3 grid, Dim3 block, unsigned shared, void** args) override {
    LoadedKernel& lk = load_kernel(specs_.at(k), 0);
    if (shared > 48 * 1024)
      CU_CHECK(cuFuncSetAttribute(lk.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, static_cast<int>(shared)));
    CU_CHECK(cuLaunchKernel(lk.fn, grid.x, grid.y, grid.z, block.x, block.y, block.z, shared, nullptr, args, nullptr));
  }
  void launch_clusters(size_t k, Dim3 grid, Dim3 block, Dim3, unsigned shared, void** args) override {
    launch(k, grid, block, shared, args);
  }
  void launch_dependent(size_t k, Dim3 grid, Dim3 block, unsigned shared, void** args) override {
    launch(k, grid, block, shared, args);
  }
  void* workspace(size_t bytes) override {
    ws_ = std::make_unique<DeviceBuffer>(bytes);
    CU_CHECK(cuMemsetD8(ws_->ptr, 0xFF, std::max<size_t>(bytes, 16)));
    return reinterpret_cast<void*>(ws_->ptr);
  }
  int multiprocessors() const override { return 1; }
  int occupancy(size_t, unsigned, unsigned) override { return 1; }

 private:
  std::vector<jit::KernelSpec> specs_;
  std::unique_ptr<DeviceBuffer> ws_;
};

}  // namespace

// accumulators_initialized for algo=tc (issue 29): the tensor-core forward (algo=tc, tc_wide, tc_q128) and
// forward's tc_pg, backward (algo=tc, tc_fused, tc_parts, tc_merged, tc_stream, tc_wide, tc_overlap, tc_wide_overlap) with
// their shared memory and workspace NaN-filled and every output NaN-poisoned, bf16 and fp16, S = 100 over
// chunks of 16 and 64 (short last chunks; tc_q128: one chunk of 128, its rows past S), head dims 32 x 32,
// 128 x 128, 128 x 256 and 256 x 512 (the backward's column blocks, partial sums and loops), with initial states
// and dC_last: every output finite and within tolerance of the float64 reference.
TEST(MlstmGpu, TensorCorePoisonedSharedMemoryNeverReachesOutputs) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const int64_t B = 1, NH = 2, S = 100;
  using Row = std::tuple<int64_t, int64_t, const char*, const char*>;  // dk, dv, backward and forward algo
  for (const auto& [dk, dv, bwd_algo, fwd_algo] : std::vector<Row>{
           {32, 32, "tc", "tc"}, {32, 32, "tc_fused", "tc"}, {32, 32, "tc_merged", "tc_q128"}, {128, 256, "tc", "tc"},
           {128, 256, "tc_fused", "tc"}, {128, 256, "tc_parts", "tc"}, {128, 256, "tc_merged", "tc"},
           {128, 256, "tc_wide", "tc_wide"}, {256, 512, "tc_merged", "tc"}, {256, 512, "tc_stream", "tc"},
           {256, 512, "tc_wide", "tc_wide"}, {32, 32, "tc_overlap", "tc_pg"}, {128, 128, "tc_wide_overlap", "tc"}}) {
    Problem32 pr(B, NH, S, dk, dv, 81);
    const auto dh32 = randn_f(B * NH * S * dv, 82), dC32 = randn_f(B * NH * dk * dv, 83);
    // The forward's 128 query rows take chunks of 128 (S = 100: one CTA a sequence, rows past S).
    const std::vector<int64_t> chunks = std::string(fwd_algo) == "tc_q128" ? std::vector<int64_t>{128}
                                                                            : std::vector<int64_t>{16, 64};
    for (DType dt : {DType::f16, DType::bf16}) {
      for (int64_t chunk : chunks) {
        std::vector<std::unique_ptr<DeviceBuffer>> bufs;
        auto put = [&](std::vector<double> x, DType t, std::initializer_list<int64_t> shape) {
          quantize(t, x);
          std::vector<unsigned char> bytes;
          encode(t, x, bytes);
          bufs.push_back(std::make_unique<DeviceBuffer>(bytes.size()));
          CU_CHECK(cuMemcpyHtoD(bufs.back()->ptr, bytes.data(), bytes.size()));
          return std::make_pair(TensorView(reinterpret_cast<void*>(bufs.back()->ptr), t, shape, 0), x);
        };
        auto nan_out = [&](DType t, std::initializer_list<int64_t> shape) { return nan_tensor(bufs, t, shape); };
        auto fetch = [](const TensorView& t) {
          std::vector<unsigned char> bytes(static_cast<size_t>(t.numel()) * dtype_size(t.dtype));
          CU_CHECK(cuMemcpyDtoH(bytes.data(), reinterpret_cast<CUdeviceptr>(t.data), bytes.size()));
          return decode(t.dtype, bytes);
        };
        auto [q, qd] = put(to_double(pr.q), dt, {B, NH, S, dk});
        auto [k, kd] = put(to_double(pr.k), dt, {B, NH, S, dk});
        auto [v, vd] = put(to_double(pr.v), dt, {B, NH, S, dv});
        auto [i, id] = put(to_double(pr.i), dt, {B, NH, S});
        auto [f, fd] = put(to_double(pr.f), dt, {B, NH, S});
        auto [dh, dhd] = put(to_double(dh32), dt, {B, NH, S, dv});
        auto [C0, C0d] = put(to_double(pr.C0), DType::f32, {B, NH, dk, dv});
        auto [n0, n0d] = put(std::vector<double>(B * NH * dk, 0.0), DType::f32, {B, NH, dk});
        auto [m0, m0d] = put(to_double(pr.m0), DType::f32, {B, NH, 1});
        auto [dCl, dCd] = put(to_double(dC32), DType::f32, {B, NH, dk, dv});
        const TensorView h = nan_out(dt, {B, NH, S, dv}), nrm = nan_out(DType::f32, {B, NH, S}),
                         mr = nan_out(DType::f32, {B, NH, S}), Cl = nan_out(DType::f32, {B, NH, dk, dv}),
                         nl = nan_out(DType::f32, {B, NH, dk}), ml = nan_out(DType::f32, {B, NH, 1});
        const TensorView dq = nan_out(dt, {B, NH, S, dk}), dkk = nan_out(dt, {B, NH, S, dk}),
                         dvv = nan_out(dt, {B, NH, S, dv}), di = nan_out(dt, {B, NH, S}), df = nan_out(dt, {B, NH, S}),
                         dC0 = nan_out(DType::f32, {B, NH, dk, dv});
        Params params;
        params.set("chunk", chunk);
        auto run = [&](const char* name, const std::vector<TensorView>& in, const std::vector<TensorView>& out) {
          const OpDef& op = Registry::global().get(name);
          Call call = validate_call(op, in, out, params, nullptr);
          call.problem.arch = device_arch(0);  // as the plan sets it before compiling (H100 run: NVRTC got -arch=)
          const std::string algo = op.info.name == "mlstm.chunkwise.bwd" ? bwd_algo : fwd_algo;
          const Config c = Config::parse("algo=" + algo + ",threads=128", op.info);
          PoisonedLauncher l(poisoned_plan(op, call.problem, c));
          op.launch(call, c, l);
          CU_CHECK(cuCtxSynchronize());
        };
        run("mlstm.chunkwise.fwd", {q, k, v, i, f, C0, n0, m0}, {h, nrm, mr, Cl, nl, ml});
        run("mlstm.chunkwise.bwd", {q, k, v, i, f, C0, m0, nrm, mr, dh, dCl}, {dq, dkk, dvv, di, df, dC0});
        ref::MlstmInputs r{qd, kd, vd, id, fd, C0d, n0d, m0d};
        const ref::MlstmShape shape{B, NH, S, dk, dv};
        const auto want = ref::mlstm_chunkwise_fwd_ref(shape, r, chunk);
        const auto grads = ref::mlstm_chunkwise_bwd_ref(shape, r, dhd, &dCd, chunk);
        const std::string what = std::string(dtype_short(dt)) + " chunk " + std::to_string(chunk) + " dk " +
                                 std::to_string(dk) + " dv " + std::to_string(dv) + " " + fwd_algo + " / " + bwd_algo;
        const double tol = dt == DType::f16 ? 3e-3 : 2e-2, gtol = dt == DType::f16 ? 1e-2 : 5e-2;
        EXPECT_LT(rel_max_d(fetch(h), want.h), tol) << what << " h";
        EXPECT_LT(rel_max_d(fetch(nrm), want.nrm), 1e-4) << what << " nrm";
        EXPECT_LT(rel_max_d(fetch(mr), want.m), 1e-4) << what << " m_rows";
        EXPECT_LT(rel_max_d(fetch(Cl), want.C), tol) << what << " C_last";
        EXPECT_LT(rel_max_d(fetch(nl), want.n), tol) << what << " n_last";
        EXPECT_LT(rel_max_d(fetch(ml), want.m_last), 1e-4) << what << " m_last";
        EXPECT_LT(rel_max_d(fetch(dq), grads.dq), gtol) << what << " dq";
        EXPECT_LT(rel_max_d(fetch(dkk), grads.dk), gtol) << what << " dk";
        EXPECT_LT(rel_max_d(fetch(dvv), grads.dv), gtol) << what << " dv";
        EXPECT_LT(rel_max_d(fetch(di), grads.di), gtol) << what << " di";
        EXPECT_LT(rel_max_d(fetch(df), grads.df), gtol) << what << " df";
        EXPECT_LT(rel_max_d(fetch(dC0), grads.dC0), gtol) << what << " dC0";
      }
    }
  }
}

// accumulators_initialized, shared memory (issue 29): the chunkwise forward and backward compiled with
// their shared memory NaN-filled at the start (and every output NaN-filled before the launch), over 8
// chunks, with initial states and dC_last: h, nrm, m, the last states and every gradient finite and
// within fp32 tolerance of the reference, so nothing is read before it is written.
TEST(MlstmGpu, PoisonedSharedMemoryNeverReachesOutputs) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const int64_t B = 1, NH = 2, S = 128, dk = 32, dv = 32, chunk = 16, seqs = B * NH;
  Problem32 pr(B, NH, S, dk, dv, 61);
  const auto dh = randn_f(seqs * S * dv, 62), dC_last = randn_f(seqs * dk * dv, 63);
  DevBuf q(seqs * S * dk * 4), k(seqs * S * dk * 4), v(seqs * S * dv * 4), i(seqs * S * 4), f(seqs * S * 4),
      C0(seqs * dk * dv * 4), n0(seqs * dk * 4), m0(seqs * 4), dhb(seqs * S * dv * 4), dCl(seqs * dk * dv * 4);
  q.upload(pr.q), k.upload(pr.k), v.upload(pr.v), i.upload(pr.i), f.upload(pr.f);
  C0.upload(pr.C0), n0.upload(pr.n0), m0.upload(pr.m0), dhb.upload(dh), dCl.upload(dC_last);
  DevBuf h(seqs * S * dv * 4), nrm(seqs * S * 4), mr(seqs * S * 4), C(seqs * dk * dv * 4), n(seqs * dk * 4),
      m(seqs * 4), dq(seqs * S * dk * 4), dkb(seqs * S * dk * 4), dvb(seqs * S * dv * 4), di(seqs * S * 4),
      df(seqs * S * 4), dC0(seqs * dk * dv * 4), qdq(seqs * S * 4);
  for (DevBuf* b : {&h, &nrm, &mr, &C, &n, &m, &dq, &dkb, &dvb, &di, &df, &dC0, &qdq}) b->poison();
  auto f32 = [](const DevBuf& b) { return static_cast<float*>(b.ptr()); };
  MlstmParams a{};
  a.q = q.ptr(), a.k = k.ptr(), a.v = v.ptr(), a.i = i.ptr(), a.f = f.ptr();
  a.C0 = f32(C0), a.n0 = f32(n0), a.m0 = f32(m0);
  a.h = h.ptr(), a.nrm = f32(nrm), a.m_rows = f32(mr), a.C = f32(C), a.n = f32(n), a.m = f32(m);
  a.seqlen = S;
  a.eps = 1e-6f;
  auto launch = [&](const char* what, int smem_floats) {
    LoadedKernel& lk = load_kernel(poisoned(what, device_arch(0)), 0);
    void* args[] = {&a};
    CU_CHECK(cuLaunchKernel(lk.fn, static_cast<unsigned>(seqs), 1, 1, 128, 1, 1,
                            static_cast<unsigned>(smem_floats * sizeof(float)), nullptr, args, nullptr));
  };
  launch("fwd", mlstm_chunkwise_fwd_smem_floats(chunk));
  MlstmParams fwd = a;
  a = MlstmParams{};
  a.q = fwd.q, a.k = fwd.k, a.v = fwd.v, a.i = fwd.i, a.f = fwd.f, a.C0 = fwd.C0, a.m0 = fwd.m0;
  a.nrm = fwd.nrm, a.m_rows = fwd.m_rows, a.dh = dhb.ptr(), a.dC_last = f32(dCl);
  a.dq = dq.ptr(), a.dk = dkb.ptr(), a.dv = dvb.ptr(), a.di = di.ptr(), a.df = df.ptr(), a.C = f32(dC0);
  a.qdq = f32(qdq);
  a.seqlen = S;
  a.eps = 1e-6f;
  launch("bwd", mlstm_chunkwise_bwd_smem_floats(chunk));
  CU_CHECK(cuCtxSynchronize());
  const ref::MlstmShape shape{B, NH, S, dk, dv};
  const auto want = ref::mlstm_chunkwise_fwd_ref(shape, pr.ref_inputs(true), chunk);
  EXPECT_LT(max_rel(h.download(seqs * S * dv), want.h), 1e-4);
  EXPECT_LT(max_rel(nrm.download(seqs * S), want.nrm), 1e-4);
  EXPECT_LT(max_rel(mr.download(seqs * S), want.m), 1e-5);
  EXPECT_LT(max_rel(C.download(seqs * dk * dv), want.C), 1e-4);
  EXPECT_LT(max_rel(n.download(seqs * dk), want.n), 1e-4);
  EXPECT_LT(max_rel(m.download(seqs), want.m_last), 1e-5);
  const std::vector<double> dC_d = to_double(dC_last);
  const Grads32 g{dq.download(seqs * S * dk), dkb.download(seqs * S * dk), dvb.download(seqs * S * dv),
                  di.download(seqs * S), df.download(seqs * S), dC0.download(seqs * dk * dv)};
  expect_grads(g, ref::mlstm_chunkwise_bwd_ref(shape, pr.ref_inputs(true), to_double(dh), &dC_d, chunk),
               "poisoned shared memory");
}
