// What the mhc pre backward suites (test_mhc_slice.cpp, test_mhc_slice_sync.cpp) share: a config and compile request at
// an algo, every kernel of a list of requests compiled without spills, and on a GPU pre.bwd's outputs as bytes at a
// config on seeded inputs and the relative difference of two outputs.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "api/src/op.h"
#include "jit/driver.h"
#include "jit/handles.h"
#include "kspec/kspec.h"
#include "device_buffer_test_util.h"
#include "test_helpers.h"

namespace kspec::testing {

inline Config bwd_algo_config(int64_t algo, int64_t tokens) {
  return Config{{{"algo", algo}, {"threads", 128}, {"tokens", tokens}}};
}

// A request for `op` at n, D (without gamma and dx_post when `bare`), at `algo` with `tokens`.
inline CompileRequest bwd_request(const char* op, DType dt, const char* arch, int64_t n, int64_t D, bool bare,
                                  int64_t tokens, int64_t algo) {
  CompileRequest r;
  r.op = op;
  r.dtype = dt;
  r.arch = arch;
  r.params = {{"n", n}, {"D", D}};
  if (bare) r.without = {"gamma", "dx_post"};
  r.config = bwd_algo_config(algo, tokens);
  return r;
}

// The problem of `op` at n, D (gamma given), as the plan sees it.
inline Problem bwd_problem(const char* op, DType dt, const char* arch, int64_t n, int64_t D) {
  return problem_from_request(Registry::global().get(op), bwd_request(op, dt, arch, n, D, false, 32, 8));
}

struct BwdCompileRow {
  const char* op;
  DType dt;
  int64_t n, D, tokens;
  bool bare;
  int64_t algo;
};
struct BwdCompiled {
  std::string arch;
  BwdCompileRow row;
  CompileReport rep;
};
// Every row's kernels for sm_80 and sm_90 (each row's config valid for its problem), expecting no spill and no
// stack; the reports.
inline std::vector<BwdCompiled> compile_bwd_rows_without_spills(const std::vector<BwdCompileRow>& rows) {
  std::vector<BwdCompiled> out;
  std::string why;
  for (const char* arch : {"sm_80", "sm_90"})
    for (const BwdCompileRow& r : rows) {
      const CompileRequest q = bwd_request(r.op, r.dt, arch, r.n, r.D, r.bare, r.tokens, r.algo);
      const OpDef& o = Registry::global().get(r.op);
      if (!o.tuning.valid(problem_from_request(o, q), *q.config, &why)) {
        ADD_FAILURE() << r.op << " n " << r.n << " D " << r.D << " algo " << r.algo << ": " << why;
        continue;
      }
      for (const auto& rep : compile(q)) {
        EXPECT_EQ(rep.spill_bytes, 0) << arch << " " << rep.kernel;
        EXPECT_EQ(rep.stack_bytes, 0) << arch << " " << rep.kernel;
        out.push_back({arch, r, rep});
      }
    }
  return out;
}

using MhcBwdBuf = DeviceBuffer<0xFF>;  // poison(): every unwritten float a NaN

// Every small case of mhc.pre.bwd and mhc.pre_only.bwd that has one of `algos` (its first config of each: the first
// token tile), f16 and bf16, against the float64 reference (dtype bounds; dx is 16-bit; outputs poisoned before each
// run, check_op); at least min_cases cases and min_rows rows. Cases without such a config: D % 8 != 0, M > 24.
inline void check_bwd_algos_on_every_case(const std::vector<int64_t>& algos, int min_cases, int min_rows) {
  int cases = 0, rows = 0;
  for (const char* name : {"mhc.pre.bwd", "mhc.pre_only.bwd"})
    for (const Case& cs : Registry::global().get(name).cases)
      for (DType dt : {DType::f16, DType::bf16}) {
        if (cs.large) continue;  // check_bwd_at_deepseek_shape takes the large one
        CheckOptions o;
        o.case_name = cs.name;
        o.dtypes = {dt};
        std::vector<int64_t> left = algos;
        for (const Config& c : configs_for_case(name, cs.name, dt))
          for (auto it = left.begin(); it != left.end(); ++it)
            if (*it == c.get("algo")) {
              o.configs.push_back(c);
              left.erase(it);
              break;
            }
        if (o.configs.empty()) continue;
        const auto got = check_op(name, o);
        EXPECT_EQ(got.size(), o.configs.size()) << name << " " << cs.name;
        report(got);
        rows += static_cast<int>(got.size());
        ++cases;
      }
  EXPECT_GE(cases, min_cases);
  EXPECT_GE(rows, min_rows);
}

// The shape (T 16384, n 4, D 4096, bf16, the large case) of mhc.pre.bwd at `configs` against the float64
// reference.
inline void check_bwd_at_deepseek_shape(const std::vector<Config>& configs) {
  CheckOptions o;
  o.case_name = "deepseek_v4_16384x4x4096";
  o.include_large = true;
  o.dtypes = {DType::bf16};
  o.configs = configs;
  const auto got = check_op("mhc.pre.bwd", o);
  EXPECT_EQ(got.size(), configs.size());
  report(got);
}

// Normal floats (fp32), and as bf16 bits (the top half: truncation is as good an input as rounding).
inline std::vector<float> normals(std::mt19937_64& rng, size_t count, float scale) {
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(count);
  for (auto& e : v) e = nd(rng);
  return v;
}
inline std::vector<uint16_t> bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    out[i] = static_cast<uint16_t>(u >> 16);
  }
  return out;
}

// max |a - b| / max |b| over two outputs' bytes, fp32 or (bf16) bfloat16.
inline double rel_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, bool bf16 = false) {
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
inline std::vector<std::vector<uint8_t>> pre_bwd_bytes(int64_t T, int64_t D, const Config& config) {
  jit::ContextGuard guard(0);
  const int64_t n = 4, M = n * n + 2 * n, nd = n * D;
  std::mt19937_64 rng(3411);
  const auto x = bf16_bits(normals(rng, T * nd, 1.f)), dy = bf16_bits(normals(rng, T * D, 1.f)),
             dxp = bf16_bits(normals(rng, T * nd, 1.f));
  const auto phi = normals(rng, M * nd, 1.f / std::sqrt(float(nd))), bias = normals(rng, M, 0.5f),
             gamma = normals(rng, nd, 1.f), dhp = normals(rng, T * n, 1.f), dr = normals(rng, T * n * n, 1.f);
  const float alpha[3] = {0.7f, -0.5f, 1.3f};
  auto tv = [](const MhcBwdBuf& b, DType dt, std::initializer_list<int64_t> shape) { return TensorView(b.ptr(), dt, shape, 0); };
  MhcBwdBuf xb(T * nd * 2), dyb(T * D * 2), dxpb(T * nd * 2), phib(M * nd * 4), ab(12), bb(M * 4), gb(nd * 4),
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
  MhcBwdBuf dx(T * nd * 2), dphi(M * nd * 4), dalpha(12), dbias(M * 4), dgamma(nd * 4);
  for (MhcBwdBuf* o : {&dx, &dphi, &dalpha, &dbias, &dgamma}) o->poison();
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
  for (const MhcBwdBuf* o : {&dx, &dphi, &dalpha, &dbias, &dgamma}) out.push_back(o->download(o->bytes));
  return out;
}


}  // namespace kspec::testing
