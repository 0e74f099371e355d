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
#include "test_helpers.h"

using namespace kspec;

namespace {

constexpr int64_t kSlice = 8, kSliceDu1 = 9;

Config slice_config(int64_t tokens, int64_t algo = kSlice) {
  return Config{{{"algo", algo}, {"threads", 128}, {"tokens", tokens}}};
}

// A request for `op` at n, D (without gamma and dx_post when `bare`), at algo=mma_slice with `tokens`.
CompileRequest slice_request(const char* op, DType dt, const char* arch, int64_t n, int64_t D, bool bare = false,
                             int64_t tokens = 32, int64_t algo = kSlice) {
  CompileRequest r;
  r.op = op;
  r.dtype = dt;
  r.arch = arch;
  r.params = {{"n", n}, {"D", D}};
  if (bare) r.without = {"gamma", "dx_post"};
  r.config = slice_config(tokens, algo);
  return r;
}

Problem bwd_problem(const char* op, DType dt, const char* arch, int64_t n, int64_t D) {
  return problem_from_request(Registry::global().get(op), slice_request(op, dt, arch, n, D));
}

}  // namespace

// The rules are mma_fused's (16-bit x in 16-byte groups, M <= 24, mma_tokens' tiles) and the shared memory of the
// arch; not the heuristic's; three kernels: mma_fused_ahead's token pass (heads per warp, no rings), the slice
// kernel (dx_post, 4 groups and kDuHiOnly its last three template arguments), the reduce with kRowsOnly;
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
    ASSERT_GE(st.size(), 3u);
    EXPECT_EQ(st[st.size() - 3], "true");                             // dx_post
    EXPECT_EQ(st[st.size() - 2], "4");                                // groups of 4 warps
    EXPECT_EQ(st.back(), algo == kSliceDu1 ? "true" : "false");       // kDuHiOnly
    EXPECT_EQ(kernels[2].kernel, "kspec::mhc_pre_bwd_reduce_kernel");
    EXPECT_EQ(kernels[2].targs.back(), "true");  // db and dalpha only
  }
  // The heuristic's: mma_slice_du1 where nD >= 12288 (here 16384), mma_fused_warp_heads below (D 1024: 32 blocks).
  EXPECT_EQ(op.tuning.heuristic(p).get("algo"), kSliceDu1);
  EXPECT_EQ(op.tuning.heuristic(bwd_problem("mhc.pre.bwd", DType::bf16, "sm_90", 4, 1024)).get("algo"), 4);
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
  std::string why;
  for (const char* arch : {"sm_80", "sm_90"})
    for (auto [name, dt, n, D, tokens, bare, algo] :
         {std::tuple{"mhc.pre.bwd", DType::bf16, 4, 4096, 32, false, kSlice},
          std::tuple{"mhc.pre.bwd", DType::bf16, 4, 4096, 16, true, kSlice},
          std::tuple{"mhc.pre.bwd", DType::f16, 4, 4000, 32, false, kSlice},
          std::tuple{"mhc.pre.bwd", DType::f16, 2, 256, 64, false, kSlice},
          std::tuple{"mhc.pre.bwd", DType::bf16, 1, 264, 64, true, kSlice},
          std::tuple{"mhc.pre.bwd", DType::bf16, 3, 264, 16, false, kSlice},
          std::tuple{"mhc.pre_only.bwd", DType::f16, 8, 128, 16, false, kSlice},
          std::tuple{"mhc.pre.bwd", DType::bf16, 4, 4096, 32, false, kSliceDu1}}) {
      const CompileRequest q = slice_request(name, dt, arch, n, D, bare, tokens, algo);
      const OpDef& o = Registry::global().get(name);
      ASSERT_TRUE(o.tuning.valid(problem_from_request(o, q), *q.config, &why)) << name << " n " << n << ": " << why;
      for (const auto& rep : compile(q)) {
        EXPECT_EQ(rep.spill_bytes, 0) << arch << " " << rep.kernel;
        EXPECT_EQ(rep.stack_bytes, 0) << arch << " " << rep.kernel;
        if (rep.kernel.find("slice_mma") == std::string::npos) continue;
        std::cout << arch << " " << rep.kernel << ": " << rep.registers << " registers\n";
        EXPECT_LE(rep.registers, 128) << "512 threads, one block an SM";
        ++compiled;
      }
    }
  EXPECT_EQ(compiled, 16);
}

// Every case of mhc.pre.bwd and mhc.pre_only.bwd with an algo=mma_slice config (its first token tile, and
// mma_slice_du1's), f16 and bf16, against the float64 reference (dtype bounds; dx is 16-bit); outputs poisoned before
// each run (check_op).
TEST(MhcSliceGpu, MatchesReferenceOnEveryCase) {
  KSPEC_REQUIRE_GPU();
  int cases = 0, rows = 0;
  for (const char* name : {"mhc.pre.bwd", "mhc.pre_only.bwd"})
    for (const Case& cs : Registry::global().get(name).cases)
      for (DType dt : {DType::f16, DType::bf16}) {
        if (cs.large) continue;  // the next test takes the large one
        CheckOptions o;
        o.case_name = cs.name;
        o.dtypes = {dt};
        bool taken[2] = {false, false};
        for (const Config& c : configs_for_case(name, cs.name, dt)) {
          const int64_t algo = c.get("algo");
          if ((algo == kSlice || algo == kSliceDu1) && !taken[algo - kSlice]) {
            taken[algo - kSlice] = true;
            o.configs.push_back(c);
          }
        }
        if (o.configs.empty()) continue;  // D % 8 != 0, M > 24
        const auto got = check_op(name, o);
        EXPECT_EQ(got.size(), o.configs.size()) << name << " " << cs.name;
        kspec::testing::report(got);
        rows += static_cast<int>(got.size());
        ++cases;
      }
  EXPECT_GE(cases, 30);
  EXPECT_GE(rows, 60);
}

// The shape (T 16384, n 4, D 4096, bf16, the large case) against the float64 reference: 128 blocks, each
// walking all 16384 tokens in 4 ranges.
TEST(MhcSliceGpu, MatchesReferenceAtDeepseekShape) {
  KSPEC_REQUIRE_GPU();
  CheckOptions o;
  o.case_name = "deepseek_v4_16384x4x4096";
  o.include_large = true;
  o.dtypes = {DType::bf16};
  o.configs = {slice_config(32)};
  const auto got = check_op("mhc.pre.bwd", o);
  EXPECT_EQ(got.size(), 1u);
  kspec::testing::report(got);
}

namespace {

using Buf = kspec::testing::DeviceBuffer<0xFF>;  // poison(): every unwritten float a NaN

// Normal floats (fp32), and as bf16 bits (the top half: truncation is as good an input as rounding).
std::vector<float> normals(std::mt19937_64& rng, size_t count, float scale) {
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(count);
  for (auto& e : v) e = nd(rng);
  return v;
}
std::vector<uint16_t> bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    out[i] = static_cast<uint16_t>(u >> 16);
  }
  return out;
}

// max |a - b| / max |b| over two outputs' bytes, fp32 or (bf16) bfloat16.
double rel_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, bool bf16 = false) {
  auto at = [bf16](const std::vector<uint8_t>& v, size_t i) {
    uint32_t u = 0;
    if (bf16) {
      uint16_t h;
      std::memcpy(&h, v.data() + 2 * i, 2);
      u = uint32_t(h) << 16;
    } else {
      std::memcpy(&u, v.data() + 4 * i, 4);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return double(f);
  };
  double err = 0, scale = 0;
  for (size_t i = 0; i < a.size() / (bf16 ? 2 : 4); ++i) {
    if (!std::isfinite(at(a, i))) return INFINITY;
    err = std::max(err, std::abs(at(a, i) - at(b, i)));
    scale = std::max(scale, std::abs(at(b, i)));
  }
  return err / std::max(scale, 1e-300);
}

// pre.bwd's outputs (dx, dphi, dalpha, dbias, dgamma: their bytes, poisoned before the call) at `config`, bf16 x,
// gamma and dx_post given, after pre.fwd on the same seeded inputs.
std::vector<std::vector<uint8_t>> pre_bwd_bytes(int64_t T, int64_t D, const Config& config) {
  jit::ContextGuard guard(0);
  const int64_t n = 4, M = n * n + 2 * n, nd = n * D;
  std::mt19937_64 rng(3411);
  const auto x = bf16_bits(normals(rng, T * nd, 1.f)), dy = bf16_bits(normals(rng, T * D, 1.f)),
             dxp = bf16_bits(normals(rng, T * nd, 1.f));
  const auto phi = normals(rng, M * nd, 1.f / std::sqrt(float(nd))), bias = normals(rng, M, 0.5f),
             gamma = normals(rng, nd, 1.f), dhp = normals(rng, T * n, 1.f), dr = normals(rng, T * n * n, 1.f);
  const float alpha[3] = {0.7f, -0.5f, 1.3f};
  auto tv = [](const Buf& b, DType dt, std::initializer_list<int64_t> shape) { return TensorView(b.ptr(), dt, shape, 0); };
  Buf xb(T * nd * 2), dyb(T * D * 2), dxpb(T * nd * 2), phib(M * nd * 4), ab(12), bb(M * 4), gb(nd * 4),
      dhpb(T * n * 4), drb(T * n * n * 4), yb(T * D * 2), hpre(T * n * 4), hpost(T * n * 4), rb(T * n * n * 4),
      invb(T * 4), hb(T * M * 4);
  xb.upload(x.data(), x.size() * 2);
  dyb.upload(dy.data(), dy.size() * 2);
  dxpb.upload(dxp.data(), dxp.size() * 2);
  phib.upload(phi.data(), phi.size() * 4);
  ab.upload(alpha, 12);
  bb.upload(bias.data(), bias.size() * 4);
  gb.upload(gamma.data(), gamma.size() * 4);
  dhpb.upload(dhp.data(), dhp.size() * 4);
  drb.upload(dr.data(), dr.size() * 4);
  const TensorView xv = tv(xb, DType::bf16, {T, n, D}), phiv = tv(phib, DType::f32, {M, nd}),
                   av = tv(ab, DType::f32, {3}), bv = tv(bb, DType::f32, {M}), gv = tv(gb, DType::f32, {nd}),
                   invv = tv(invb, DType::f32, {T}), hv = tv(hb, DType::f32, {T, M});
  call("mhc.pre.fwd", {xv, phiv, av, bv, gv},
       {tv(yb, DType::bf16, {T, D}), tv(hpre, DType::f32, {T, n}), tv(hpost, DType::f32, {T, n}),
        tv(rb, DType::f32, {T, n, n}), invv, hv});
  Buf dx(T * nd * 2), dphi(M * nd * 4), dalpha(12), dbias(M * 4), dgamma(nd * 4);
  for (Buf* o : {&dx, &dphi, &dalpha, &dbias, &dgamma}) o->poison();
  CallOptions opts;
  opts.config = &config;
  call("mhc.pre.bwd",
       {tv(dyb, DType::bf16, {T, D}), xv, phiv, av, bv, gv, invv, hv, TensorView(), tv(dhpb, DType::f32, {T, n}),
        tv(drb, DType::f32, {T, n, n}), tv(dxpb, DType::bf16, {T, n, D})},
       {tv(dx, DType::bf16, {T, n, D}), tv(dphi, DType::f32, {M, nd}), tv(dalpha, DType::f32, {3}),
        tv(dbias, DType::f32, {M}), tv(dgamma, DType::f32, {nd})},
       {}, nullptr, opts);
  CU_CHECK(cuCtxSynchronize());
  std::vector<std::vector<uint8_t>> out;
  for (const Buf* o : {&dx, &dphi, &dalpha, &dbias, &dgamma}) out.push_back(o->download(o->bytes));
  return out;
}

}  // namespace

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
