// mhc.pre.bwd's algo=mma_slice_du1_nb (10) and mma_slice_du1_mb (11): mma_slice_du1's slice kernel with each group of
// 4 warps under its own named barrier / mbarrier (kGroupSync 1 / 2) instead of one block barrier a step;
// algo=mma_split_du1 (12): 11 after the token pass split in two kernels (templates/mhc/mhc_pre_bwd_split_mma.cuh: the
// projection and <dy, x[i]> over token tile x column slice items, then the heads a warp a token). Without a GPU: the
// rules, the kernels and their template arguments, every kernel compiling for sm_80 and sm_90 without spills (the
// projection kernel at <= 128 registers at 16 tokens: 4 blocks an SM). On a GPU: every case with each algo against
// the float64 reference, the T 16384 x 4 x 4096 case, two runs the same bits, 10 and 11 the bits of 9, 12 within fp32
// rounding of 11.
#include <iostream>
#include <string>
#include <vector>

#include "api/src/op.h"
#include "kspec/kspec.h"
#include "mhc_bwd_test_util.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::bwd_problem;
using kspec::testing::pre_bwd_bytes;
using kspec::testing::rel_diff;

namespace {

constexpr int64_t kSlice = 8, kSliceDu1 = 9, kSliceDu1Nb = 10, kSliceDu1Mb = 11, kSplitDu1 = 12;

Config algo_config(int64_t algo, int64_t tokens = 32) { return kspec::testing::bwd_algo_config(algo, tokens); }

}  // namespace

// 10 and 11: the token pass, the slice kernel with kDuHiOnly and kGroupSync 1 / 2 (its last template arguments), the
// reduce. 12: the projection kernel (grid y = the slices: 8 at D 4096, ceil(ceil(D / 32) / 4) below), the heads
// kernel, the slice kernel (du1, kGroupBar), the reduce. The slice kernel's rules (16-bit x in 16-byte groups, M <=
// 24, the arch's shared memory); the heuristic unchanged (mma_slice_du1 at nD 16384).
TEST(MhcSplit, RulesAndKernels) {
  const OpDef& op = Registry::global().get("mhc.pre.bwd");
  const Problem p = bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", 4, 4096);
  std::string why;
  for (int64_t algo : {kSliceDu1Nb, kSliceDu1Mb, kSplitDu1}) {
    for (int64_t tokens : {16, 32}) EXPECT_TRUE(op.tuning.valid(p, algo_config(algo, tokens), &why)) << algo << ": " << why;
    const auto k = op.kernels(p, algo_config(algo));
    const size_t s = algo == kSplitDu1 ? 2 : 1;
    ASSERT_EQ(k.size(), s + 2) << algo;
    EXPECT_EQ(k[s].kernel, "kspec::mhc_pre_bwd_slice_mma_kernel");
    EXPECT_EQ(k[s].targs.back(), algo == kSliceDu1Nb ? "1" : "2") << "kGroupSync";
    EXPECT_EQ(k[s].targs[k[s].targs.size() - 2], "true") << "kDuHiOnly";
    EXPECT_EQ(k[s + 1].kernel, "kspec::mhc_pre_bwd_reduce_kernel");
    if (algo == kSplitDu1) {
      EXPECT_EQ(k[0].kernel, "kspec::mhc_pre_bwd_proj_mma_kernel");
      EXPECT_EQ(k[0].targs.back(), "8");
      EXPECT_EQ(k[1].kernel, "kspec::mhc_pre_bwd_split_heads_kernel");
      EXPECT_EQ(k[1].targs.back(), "8");
    } else {
      EXPECT_EQ(k[0].kernel, "kspec::mhc_pre_bwd_token_mma_kernel");
    }
  }
  // The old algos keep one block barrier a step.
  for (int64_t algo : {kSlice, kSliceDu1}) EXPECT_EQ(op.kernels(p, algo_config(algo))[1].targs.back(), "0");
  // Fewer slices where D has fewer than 8 groups of 4 chunks: D 264 has 9 chunks, 3 slices.
  EXPECT_EQ(op.kernels(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", 4, 264), algo_config(kSplitDu1))[0].targs.back(),
            "3");
  EXPECT_EQ(op.tuning.heuristic(p).get("algo"), kSliceDu1);
  // 64 tokens: the token pass's tile for n <= 2, but the projection kernel spilled there.
  const Problem p2 = bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", 2, 4096);
  EXPECT_TRUE(op.tuning.valid(p2, algo_config(kSliceDu1Mb, 64), &why)) << why;
  EXPECT_FALSE(op.tuning.valid(p2, algo_config(kSplitDu1, 64), &why));
  EXPECT_NE(why.find("16 or 32 tokens"), std::string::npos) << why;
  for (int64_t algo : {kSliceDu1Nb, kSliceDu1Mb, kSplitDu1}) {
    EXPECT_FALSE(op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", 5, 256), algo_config(algo, 16), &why));
    EXPECT_NE(why.find("24 projection rows"), std::string::npos) << why;
    EXPECT_FALSE(op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", 4, 100), algo_config(algo, 16), &why));
    EXPECT_NE(why.find("16-byte groups"), std::string::npos) << why;
    EXPECT_FALSE(op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_86", 4, 256), algo_config(algo), &why));
    EXPECT_NE(why.find("shared memory"), std::string::npos) << why;
    EXPECT_FALSE(op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::f32, "sm_90", 4, 256), algo_config(algo), &why));
  }
}

// Every kernel of the three algos compiles for sm_80 and sm_90 without spills or stack: n 4 with gamma and dx_post
// (32 tokens) and without (16), f16 D 4000, n 1, 2, 3, pre_only n 8; the projection and slice kernels' registers
// printed, the projection kernel's at most 128 at 16 tokens (4 blocks an SM), 255 at 32 (2).
TEST(MhcSplit, CompilesWithoutSpills) {
  int proj = 0, slice = 0;
  for (const auto& [arch, row, rep] : kspec::testing::compile_bwd_rows_without_spills({
           {"mhc.pre.bwd", DType::bf16, 4, 4096, 32, false, kSplitDu1},
           {"mhc.pre.bwd", DType::bf16, 4, 4096, 16, true, kSplitDu1},
           {"mhc.pre.bwd", DType::f16, 4, 4000, 32, false, kSplitDu1},
           {"mhc.pre.bwd", DType::bf16, 2, 4096, 32, true, kSplitDu1},
           {"mhc.pre.bwd", DType::f16, 2, 256, 32, false, kSplitDu1},
           {"mhc.pre.bwd", DType::bf16, 1, 264, 32, true, kSplitDu1},
           {"mhc.pre.bwd", DType::bf16, 3, 264, 16, false, kSplitDu1},
           {"mhc.pre_only.bwd", DType::f16, 8, 128, 16, false, kSplitDu1},
           {"mhc.pre.bwd", DType::bf16, 4, 4096, 32, false, kSliceDu1Nb},
           {"mhc.pre.bwd", DType::bf16, 4, 4096, 32, false, kSliceDu1Mb}})) {
    const bool is_proj = rep.kernel.find("proj_mma") != std::string::npos;
    const bool is_slice = rep.kernel.find("slice_mma") != std::string::npos;
    if (!is_proj && !is_slice) continue;
    std::cout << arch << " " << row.op << " n " << row.n << " D " << row.D << " tokens " << row.tokens << " "
              << rep.kernel << ": " << rep.registers << " registers\n";
    EXPECT_LE(rep.registers, is_proj && row.tokens > 16 ? 255 : 128) << rep.kernel;
    proj += is_proj;
    slice += is_slice;
  }
  EXPECT_EQ(proj, 16);
  EXPECT_EQ(slice, 20);
}

// Every case of mhc.pre.bwd and mhc.pre_only.bwd that has the algos (T 1, 2, 1031, n 1-4, pre_only n 1-8, D 4000,
// 128 ..., no gamma, each upstream gradient alone), f16 and bf16, each algo at its first token tile, against the
// float64 reference; outputs poisoned before each run (check_op).
TEST(MhcSplitGpu, MatchesReferenceOnEveryCase) {
  KSPEC_REQUIRE_GPU();
  kspec::testing::check_bwd_algos_on_every_case({kSliceDu1Nb, kSliceDu1Mb, kSplitDu1}, 30, 90);
}

// The shape (T 16384, n 4, D 4096, bf16) against the float64 reference with algo=mma_split_du1 and
// mma_slice_du1_mb.
TEST(MhcSplitGpu, MatchesReferenceAtDeepseekShape) {
  KSPEC_REQUIRE_GPU();
  kspec::testing::check_bwd_at_deepseek_shape({algo_config(kSplitDu1, 16), algo_config(kSliceDu1Mb)});
}

// grads_deterministic: two runs the same bits for every output (T 1031 with D 4000: a last group with fewer tokens;
// T 16384 with D 1000); the group barriers change no value (10 and 11 give 9's bits); the split token pass sums each
// token's chunks in another order, so 12 is within fp32 rounding of 11 (dm, hence dphi, dgamma, db, dalpha at 1e-4,
// dx within bf16's 1e-2).
TEST(MhcSplitGpu, BitwiseDeterministicAndAsSlice) {
  KSPEC_REQUIRE_GPU();
  const char* names[] = {"dx", "dphi", "dalpha", "dbias", "dgamma"};
  for (auto [T, D] : {std::pair<int64_t, int64_t>{1031, 4000}, std::pair<int64_t, int64_t>{16384, 1000}}) {
    const auto du1 = pre_bwd_bytes(T, D, algo_config(kSliceDu1));
    const auto nb = pre_bwd_bytes(T, D, algo_config(kSliceDu1Nb)), mb = pre_bwd_bytes(T, D, algo_config(kSliceDu1Mb));
    const auto split = pre_bwd_bytes(T, D, algo_config(kSplitDu1));
    const auto split_again = pre_bwd_bytes(T, D, algo_config(kSplitDu1));
    const auto mb_again = pre_bwd_bytes(T, D, algo_config(kSliceDu1Mb));
    for (size_t k = 0; k < du1.size(); ++k) {
      EXPECT_EQ(nb[k], du1[k]) << names[k] << " T " << T << ": mma_slice_du1_nb against mma_slice_du1";
      EXPECT_EQ(mb[k], du1[k]) << names[k] << " T " << T << ": mma_slice_du1_mb against mma_slice_du1";
      EXPECT_EQ(mb_again[k], mb[k]) << names[k] << " T " << T << ": a second run of mma_slice_du1_mb";
      EXPECT_EQ(split_again[k], split[k]) << names[k] << " T " << T << ": a second run of mma_split_du1";
      EXPECT_LE(rel_diff(split[k], mb[k], k == 0), k == 0 ? 1e-2 : 1e-4) << names[k] << " T " << T;
    }
  }
}
