// mhc.pre.bwd's algo=mma_slice (8): the token pass of mma_fused_ahead, then one block per 128 columns walking every
// token (templates/mhc/mhc_pre_bwd_slice_mma.cuh) and a one-block reduce of db and dalpha. Without a GPU: its
// rules, its kernels and their template arguments, and every kernel compiling for sm_80 and sm_90 without spills;
// algo=mma_slice_du1 (9), that with du in one TF32 mma instead of three.
// On a GPU: every case of pre.bwd and pre_only.bwd that has the algo (T 1, 2, 1031, n 1-4, pre_only n 8, D 128 ...
// 7168, no gamma, each upstream gradient alone) and the T 16384 x 4 x 4096 case against the float64 reference; the
// same bits at every run; dx, db and dalpha the same bits as mma_fused_ahead (the same operations per token).
#include <cmath>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "api/src/op.h"
#include "jit/driver.h"
#include "jit/handles.h"
#include "kspec/kspec.h"
#include "device_buffer_test_util.h"
#include "mhc_bwd_test_util.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::bwd_problem;
using kspec::testing::pre_bwd_bytes;
using kspec::testing::rel_diff;

namespace {

constexpr int64_t kSlice = 8, kSliceDu1 = 9;

Config slice_config(int64_t tokens, int64_t algo = kSlice) { return kspec::testing::bwd_algo_config(algo, tokens); }

}  // namespace

// The rules are mma_fused's (16-bit x in 16-byte groups, M <= 24, mma_tokens' tiles) and the shared memory of the
// arch; not the heuristic's; three kernels: mma_fused_ahead's token pass (heads per warp, no rings), the slice
// kernel (dx_post, 4 groups, kDuHiOnly and kGroupSync 0 its last four template arguments), the reduce with kRowsOnly;
// algo=mma_slice_du1 (9) the same with kDuHiOnly.
TEST(MhcSlice, RulesAndKernels) {
  const OpDef& op = Registry::global().get("mhc.pre.bwd");
  const Problem p = bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", 4, 4096);
  std::string why;
  for (auto [algo, tokens] : {std::pair<int64_t, int64_t>{kSlice, 32}, {kSlice, 16}, {kSliceDu1, 32}}) {
    EXPECT_TRUE(op.tuning.valid(p, slice_config(tokens, algo), &why)) << tokens << ": " << why;
    const auto kernels = op.kernels(p, slice_config(tokens, algo));
    ASSERT_EQ(kernels.size(), 3u);
    EXPECT_EQ(kernels[0].kernel, "kspec::mhc_pre_bwd_token_mma_kernel");
    EXPECT_EQ(kernels[0].targs[8], "false");   // no phi ring
    EXPECT_EQ(kernels[0].targs[9], "false");   // no ring of rows
    EXPECT_EQ(kernels[0].targs[10], "true");   // heads per warp
    EXPECT_EQ(kernels[1].kernel, "kspec::mhc_pre_bwd_slice_mma_kernel");
    const auto& st = kernels[1].targs;
    ASSERT_GE(st.size(), 4u);
    EXPECT_EQ(st[st.size() - 4], "true");                             // dx_post
    EXPECT_EQ(st[st.size() - 3], "4");                                // groups of 4 warps
    EXPECT_EQ(st[st.size() - 2], algo == kSliceDu1 ? "true" : "false");  // kDuHiOnly
    EXPECT_EQ(st.back(), "0");                                        // one block barrier a step
    EXPECT_EQ(kernels[2].kernel, "kspec::mhc_pre_bwd_reduce_kernel");
    EXPECT_EQ(kernels[2].targs.back(), "true");  // db and dalpha only
  }
  // The heuristic's where nD >= 12288: mma_slice_du1_nb (test_mhc_slice_sync.cpp).
  // The other algos keep the whole reduce.
  for (int64_t algo : {3, 4, 6, 7})
    EXPECT_EQ(op.kernels(p, Config{{{"algo", algo}, {"threads", 128}, {"tokens", 32}}})[2].targs.back(), "false");
  for (const auto& [n, D, tokens, fragment] :
       {std::tuple{5, 256, 16, "24 projection rows"}, std::tuple{4, 100, 16, "16-byte groups"},
        std::tuple{4, 256, 64, "n x tokens / 16"}}) {
    EXPECT_FALSE(op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", n, D), slice_config(tokens), &why))
        << n << " " << D;
    EXPECT_NE(why.find(fragment), std::string::npos) << why;
  }
  EXPECT_FALSE(op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::f32, "sm_90", 4, 256), slice_config(16), &why));
  // 142 KB of shared memory at n 4: above sm_86's 99 KB, within sm_80's 163.
  for (int64_t algo : {kSlice, kSliceDu1}) {
    EXPECT_FALSE(
        op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_86", 4, 256), slice_config(32, algo), &why));
    EXPECT_NE(why.find("shared memory"), std::string::npos) << why;
  }
  EXPECT_TRUE(op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_80", 4, 256), slice_config(32), &why)) << why;
}

// Every kernel of the algo compiles for sm_80 and sm_90 without spills or stack: n 4 with gamma and dx_post (32
// tokens), without them (16), n 1, 2, 3, pre_only n 8, and mma_slice_du1 at n 4; the slice kernel's registers printed.
TEST(MhcSlice, CompilesWithoutSpills) {
  int compiled = 0;
  for (const auto& [arch, row, rep] : kspec::testing::compile_bwd_rows_without_spills({
           {"mhc.pre.bwd", DType::bf16, 4, 4096, 32, false, kSlice},
           {"mhc.pre.bwd", DType::bf16, 4, 4096, 16, true, kSlice},
           {"mhc.pre.bwd", DType::f16, 4, 4000, 32, false, kSlice},
           {"mhc.pre.bwd", DType::f16, 2, 256, 64, false, kSlice},
           {"mhc.pre.bwd", DType::bf16, 1, 264, 64, true, kSlice},
           {"mhc.pre.bwd", DType::bf16, 3, 264, 16, false, kSlice},
           {"mhc.pre_only.bwd", DType::f16, 8, 128, 16, false, kSlice},
           {"mhc.pre.bwd", DType::bf16, 4, 4096, 32, false, kSliceDu1}})) {
    if (rep.kernel.find("slice_mma") == std::string::npos) continue;
    std::cout << arch << " " << rep.kernel << ": " << rep.registers << " registers\n";
    EXPECT_LE(rep.registers, 128) << "512 threads, one block an SM";
    ++compiled;
  }
  EXPECT_EQ(compiled, 16);
}

// Every case of mhc.pre.bwd and mhc.pre_only.bwd with an algo=mma_slice config (its first token tile, and
// mma_slice_du1's), f16 and bf16, against the float64 reference (dtype bounds; dx is 16-bit); outputs poisoned before
// each run (check_op).
TEST(MhcSliceGpu, MatchesReferenceOnEveryCase) {
  KSPEC_REQUIRE_GPU();
  kspec::testing::check_bwd_algos_on_every_case({kSlice, kSliceDu1}, 30, 60);
}

// The shape (T 16384, n 4, D 4096, bf16, the large case) against the float64 reference: 128 blocks, each
// walking all 16384 tokens in 4 ranges.
TEST(MhcSliceGpu, MatchesReferenceAtDeepseekShape) {
  KSPEC_REQUIRE_GPU();
  kspec::testing::check_bwd_at_deepseek_shape({slice_config(32)});
}

// grads_deterministic for algo=mma_slice (T 1031: a partial last step in a group's range; T 16384 with D 1000: 32
// blocks, the last one's columns partly past nD): two runs give the same bits for every output; dx, dalpha and dbias
// the same bits as mma_fused_ahead (the same step function per token, the same parts of the row sums), dphi and
// dgamma within the fp32 bound 1e-4 of it (only the order of the sums over tokens differs: 4 runs of 4096 tokens
// against 32 parts of 512; run 33, H100: 2.2e-5 and 1.4e-5 at T 16384). algo=mma_slice_du1: two runs the same
// bits, dphi, dalpha, dbias, dgamma mma_slice's bits (du feeds only dx), dx within bf16's 1e-2 of it.
TEST(MhcSliceGpu, BitwiseDeterministicAndAsFusedAhead) {
  KSPEC_REQUIRE_GPU();
  const char* names[] = {"dx", "dphi", "dalpha", "dbias", "dgamma"};
  for (auto [T, D] : {std::pair<int64_t, int64_t>{1031, 4000}, std::pair<int64_t, int64_t>{16384, 1000}}) {
    const auto first = pre_bwd_bytes(T, D, slice_config(32));
    const auto second = pre_bwd_bytes(T, D, slice_config(32));
    const auto ahead = pre_bwd_bytes(T, D, Config{{{"algo", 6}, {"threads", 128}, {"tokens", 32}}});
    const auto du1 = pre_bwd_bytes(T, D, slice_config(32, kSliceDu1));
    const auto du1_again = pre_bwd_bytes(T, D, slice_config(32, kSliceDu1));
    for (size_t k = 0; k < first.size(); ++k) {
      EXPECT_EQ(second[k], first[k]) << names[k] << " T " << T << ": a second run";
      EXPECT_EQ(du1_again[k], du1[k]) << names[k] << " T " << T << ": a second run of mma_slice_du1";
      if (k == 1 || k == 4) EXPECT_LE(rel_diff(first[k], ahead[k]), 1e-4) << names[k] << " T " << T;
      else EXPECT_EQ(first[k], ahead[k]) << names[k] << " T " << T << ": against mma_fused_ahead";
      if (k == 0) EXPECT_LE(rel_diff(du1[k], first[k], true), 1e-2) << "dx T " << T << ": mma_slice_du1";
      else EXPECT_EQ(du1[k], first[k]) << names[k] << " T " << T << ": mma_slice_du1 against mma_slice";
    }
  }
}
