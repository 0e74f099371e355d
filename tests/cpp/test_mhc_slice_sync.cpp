// mhc.pre.bwd's algo=mma_slice_du1_nb (10, the heuristic's where nD >= 12288) and mma_slice_du1_mb (11):
// mma_slice_du1's slice kernel with each group of 4 warps under its own named barrier / mbarrier (kGroupSync 1 / 2)
// instead of one block barrier a step (run 35, H200: 1420 / 1422 us against 1512, racecheck clean). Without a GPU: the
// rules, the kernels and their template arguments, the heuristic, every kernel compiling for sm_80 and sm_90 without
// spills. On a GPU: every case with each algo against the float64 reference, the T 16384 x 4 x 4096 case, two runs
// the same bits, and 9's bits.
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

namespace {

constexpr int64_t kSlice = 8, kSliceDu1 = 9, kSliceDu1Nb = 10, kSliceDu1Mb = 11;

Config algo_config(int64_t algo, int64_t tokens = 32) { return kspec::testing::bwd_algo_config(algo, tokens); }

}  // namespace

// The token pass, the slice kernel with kDuHiOnly and kGroupSync 1 / 2 (its last template arguments), the reduce;
// the slice kernel's rules (16-bit x in 16-byte groups, M <= 24, the arch's shared memory); the heuristic's: 10 where
// nD >= 12288 (here 16384), mma_fused_warp_heads below (D 1024: 32 blocks).
TEST(MhcSliceSync, RulesKernelsAndHeuristic) {
  const OpDef& op = Registry::global().get("mhc.pre.bwd");
  const Problem p = bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", 4, 4096);
  std::string why;
  for (int64_t algo : {kSliceDu1Nb, kSliceDu1Mb}) {
    for (int64_t tokens : {16, 32}) EXPECT_TRUE(op.tuning.valid(p, algo_config(algo, tokens), &why)) << algo << ": " << why;
    const auto k = op.kernels(p, algo_config(algo));
    ASSERT_EQ(k.size(), 3u) << algo;
    EXPECT_EQ(k[0].kernel, "kspec::mhc_pre_bwd_token_mma_kernel");
    EXPECT_EQ(k[1].kernel, "kspec::mhc_pre_bwd_slice_mma_kernel");
    EXPECT_EQ(k[1].targs.back(), algo == kSliceDu1Nb ? "1" : "2") << "kGroupSync";
    EXPECT_EQ(k[1].targs[k[1].targs.size() - 2], "true") << "kDuHiOnly";
    EXPECT_EQ(k[2].kernel, "kspec::mhc_pre_bwd_reduce_kernel");
  }
  // The old algos keep one block barrier a step.
  for (int64_t algo : {kSlice, kSliceDu1}) EXPECT_EQ(op.kernels(p, algo_config(algo))[1].targs.back(), "0");
  EXPECT_EQ(op.tuning.heuristic(p).get("algo"), kSliceDu1Nb);
  EXPECT_EQ(op.tuning.heuristic(p).get("tokens"), 32);
  EXPECT_EQ(op.tuning.heuristic(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", 4, 1024)).get("algo"), 4);
  // Where the arch's shared memory is short (sm_86), the heuristic falls back to mma_fused_warp_heads.
  EXPECT_EQ(op.tuning.heuristic(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_86", 4, 4096)).get("algo"), 4);
  for (int64_t algo : {kSliceDu1Nb, kSliceDu1Mb}) {
    EXPECT_FALSE(op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", 5, 256), algo_config(algo, 16), &why));
    EXPECT_NE(why.find("24 projection rows"), std::string::npos) << why;
    EXPECT_FALSE(op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", 4, 100), algo_config(algo, 16), &why));
    EXPECT_NE(why.find("16-byte groups"), std::string::npos) << why;
    EXPECT_FALSE(op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_86", 4, 256), algo_config(algo), &why));
    EXPECT_NE(why.find("shared memory"), std::string::npos) << why;
    EXPECT_FALSE(op.tuning.valid(bwd_problem("mhc.pre.bwd", DType::f32, "sm_90", 4, 256), algo_config(algo), &why));
  }
}

// Every kernel of both algos compiles for sm_80 and sm_90 without spills or stack: n 4 with gamma and dx_post (32
// tokens) and without (16), f16 D 4000, n 1, 2, 3, pre_only n 8; the slice kernel's registers printed (at most 128:
// 512 threads, one block an SM).
TEST(MhcSliceSync, CompilesWithoutSpills) {
  int slice = 0;
  for (const auto& [arch, row, rep] : kspec::testing::compile_bwd_rows_without_spills({
           {"mhc.pre.bwd", DType::bf16, 4, 4096, 32, false, kSliceDu1Nb},
           {"mhc.pre.bwd", DType::bf16, 4, 4096, 16, true, kSliceDu1Mb},
           {"mhc.pre.bwd", DType::f16, 4, 4000, 32, false, kSliceDu1Nb},
           {"mhc.pre.bwd", DType::f16, 2, 256, 64, false, kSliceDu1Mb},
           {"mhc.pre.bwd", DType::bf16, 1, 264, 64, true, kSliceDu1Nb},
           {"mhc.pre.bwd", DType::bf16, 3, 264, 16, false, kSliceDu1Mb},
           {"mhc.pre_only.bwd", DType::f16, 8, 128, 16, false, kSliceDu1Nb},
           {"mhc.pre.bwd", DType::bf16, 4, 4096, 32, false, kSliceDu1Mb}})) {
    if (rep.kernel.find("slice_mma") == std::string::npos) continue;
    std::cout << arch << " " << row.op << " n " << row.n << " D " << row.D << " algo " << row.algo << " "
              << rep.kernel << ": " << rep.registers << " registers\n";
    EXPECT_LE(rep.registers, 128) << rep.kernel;
    ++slice;
  }
  EXPECT_EQ(slice, 16);
}

// Every case of mhc.pre.bwd and mhc.pre_only.bwd that has the algos (T 1, 2, 1031, n 1-4, pre_only n 1-8, D 4000,
// 128 ..., no gamma, each upstream gradient alone), f16 and bf16, each algo at its first token tile, against the
// float64 reference; outputs poisoned before each run (check_op).
TEST(MhcSliceSyncGpu, MatchesReferenceOnEveryCase) {
  KSPEC_REQUIRE_GPU();
  kspec::testing::check_bwd_algos_on_every_case({kSliceDu1Nb, kSliceDu1Mb}, 30, 60);
}

// The shape (T 16384, n 4, D 4096, bf16) against the float64 reference with the named barrier (the default).
TEST(MhcSliceSyncGpu, MatchesReferenceAtDeepseekShape) {
  KSPEC_REQUIRE_GPU();
  kspec::testing::check_bwd_at_deepseek_shape({algo_config(kSliceDu1Nb)});
}

// grads_deterministic: two runs the same bits for every output (T 1031 with D 4000: a last group with fewer tokens;
// T 16384 with D 1000); the group barriers change no value (10 and 11 give 9's bits).
TEST(MhcSliceSyncGpu, BitwiseDeterministicAndAsSliceDu1) {
  KSPEC_REQUIRE_GPU();
  const char* names[] = {"dx", "dphi", "dalpha", "dbias", "dgamma"};
  for (auto [T, D] : {std::pair<int64_t, int64_t>{1031, 4000}, std::pair<int64_t, int64_t>{16384, 1000}}) {
    const auto du1 = pre_bwd_bytes(T, D, algo_config(kSliceDu1));
    const auto nb = pre_bwd_bytes(T, D, algo_config(kSliceDu1Nb)), mb = pre_bwd_bytes(T, D, algo_config(kSliceDu1Mb));
    const auto nb_again = pre_bwd_bytes(T, D, algo_config(kSliceDu1Nb));
    for (size_t k = 0; k < du1.size(); ++k) {
      EXPECT_EQ(nb[k], du1[k]) << names[k] << " T " << T << ": mma_slice_du1_nb against mma_slice_du1";
      EXPECT_EQ(mb[k], du1[k]) << names[k] << " T " << T << ": mma_slice_du1_mb against mma_slice_du1";
      EXPECT_EQ(nb_again[k], nb[k]) << names[k] << " T " << T << ": a second run of mma_slice_du1_nb";
    }
  }
}
