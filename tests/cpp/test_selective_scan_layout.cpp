// selective_scan's layout "bld": u, delta, z, out (and the gradients) as [batch, seqlen, dim] memory, a
// variable B/C as [batch, seqlen, groups, dstate], read and written in place by the sequential kernels'
// time-major staging. Without a GPU: validation of the strides each layout takes, the plan (the
// sequential algorithm, one segment) and the kernels' compilation; on a GPU: the bld kernels against the
// bdl ones at the same config.
#include <cuda.h>

#include <array>
#include <cmath>
#include <functional>
#include <random>
#include <tuple>

#include "api/src/op.h"
#include "jit/driver.h"
#include "jit/handles.h"
#include "kspec/kspec.h"
#include "kspec/tune.h"
#include "test_helpers.h"

using namespace kspec;
using kspec::testing::fake;

namespace {

// A [batch, dim, seqlen] view of [batch, seqlen, dim] memory, and a variable B/C likewise.
TensorView time_major(void* p, DType dt, int64_t b, int64_t d, int64_t l) {
  return TensorView::strided(p, dt, {b, d, l}, {l * d, 1, d}, 0);
}
TensorView time_major_bc(void* p, DType dt, int64_t b, int64_t g, int64_t n, int64_t l) {
  return TensorView::strided(p, dt, {b, g, n, l}, {l * g * n, n, 1, g * n}, 0);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

Problem request(const char* op, const char* layout, int64_t batch, int64_t dim, int64_t seqlen) {
  CompileRequest r;
  r.op = op;
  r.dtype = DType::bf16;
  r.params = {{"dstate", int64_t(16)}, {"batch", batch},         {"dim", dim},
              {"seqlen", seqlen},      {"delta_softplus", true}, {"layout", std::string(layout)}};
  return problem_from_request(Registry::global().get(op), r);
}

}  // namespace

TEST(SelectiveScanLayout, EachLayoutTakesItsStrides) {
  const int64_t b = 2, d = 8, l = 100, n = 4;
  TensorView A(fake(2 << 20), DType::f32, {d, n}, 0);
  TensorView u = time_major(fake(), DType::bf16, b, d, l), delta = time_major(fake(1 << 20), DType::bf16, b, d, l);
  TensorView B = time_major_bc(fake(3 << 20), DType::bf16, b, 1, n, l),
             C = time_major_bc(fake(4 << 20), DType::bf16, b, 1, n, l);
  const Params bld = {{"layout", std::string("bld")}};
  auto outs = infer_outputs("selective_scan.fwd", {u, delta, A, B, C}, bld);
  EXPECT_EQ(outs[0].shape, (std::vector<int64_t>{b, d, l}));
  // The same views without the param: bdl wants them contiguous and says bld takes them.
  std::string m = error_of([&] {
    call("selective_scan.fwd", {u, delta, A, B, C},
         {TensorView(fake(5 << 20), DType::bf16, {b, d, l}, 0), TensorView(fake(6 << 20), DType::f32, {b, d, n}, 0)});
  });
  EXPECT_NE(m.find("input 'u': expected a contiguous tensor (layout \"bdl\""), std::string::npos) << m;
  // bld with a contiguous output, or a contiguous B: each named, with the strides it expects.
  m = error_of([&] {
    call("selective_scan.fwd", {u, delta, A, B, C},
         {TensorView(fake(5 << 20), DType::bf16, {b, d, l}, 0), TensorView(fake(6 << 20), DType::f32, {b, d, n}, 0)},
         bld);
  });
  EXPECT_NE(m.find("output 'out': layout \"bld\" expects a [batch, seqlen, dim] buffer"), std::string::npos) << m;
  m = error_of([&] {
    call("selective_scan.fwd", {u, delta, A, TensorView(fake(3 << 20), DType::bf16, {b, 1, n, l}, 0), C},
         {time_major(fake(5 << 20), DType::bf16, b, d, l), TensorView(fake(6 << 20), DType::f32, {b, d, n}, 0)}, bld);
  });
  EXPECT_NE(m.find("input 'B': layout \"bld\" expects a [batch, seqlen, groups, dstate] buffer"), std::string::npos)
      << m;
  // A fixed B/C and the states stay contiguous in both layouts; a bad layout name is refused.
  m = error_of([&] { infer_outputs("selective_scan.fwd", {u, delta, A, B, C}, {{"layout", std::string("lbd")}}); });
  EXPECT_NE(m.find("layout"), std::string::npos) << m;
}

TEST(SelectiveScanLayout, PlanTakesTheSequentialKernelsInOneSegment) {
  for (const char* name : {"selective_scan.fwd", "selective_scan.bwd"}) {
    const OpDef& op = Registry::global().get(name);
    // 1x8x65536 and 1x2048x65536 take segments (or the tile kernel) in bdl.
    for (auto [b, d, l] :
         std::vector<std::array<int64_t, 3>>{{2, 64, 300}, {1, 8, 65536}, {8, 2048, 2048}, {1, 2048, 65536}}) {
      Problem bld = request(name, "bld", b, d, l), bdl = request(name, "bdl", b, d, l);
      EXPECT_NE(bld.signature(), bdl.signature());
      Config c = op.tuning.heuristic(bld);
      EXPECT_EQ(c.get("algo"), 1) << name << " " << c.str();
      EXPECT_EQ(c.get("segs"), 1) << name << " " << c.str();
      std::string why;
      EXPECT_TRUE(op.tuning.valid(bld, c, &why)) << why;
      auto k = op.kernels(bld, c)[0].name_expression();
      EXPECT_NE(k.find(", true>"), std::string::npos) << k;  // kTimeMajor
      // bdl keeps the spec text it had (no kTimeMajor argument), so its kernels are unchanged.
      auto kd = op.kernels(bdl, op.tuning.heuristic(bdl))[0].name_expression();
      EXPECT_EQ(kd.find("ScanFlags<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 16, true, true, true, true, true, "
                        "true, true, false, true>"),
                std::string::npos)
          << kd;
      Config warp = c;
      for (auto& [axis, v] : warp.values)
        if (axis == "algo") v = 0;
      EXPECT_FALSE(op.tuning.valid(bld, warp, &why));
      EXPECT_NE(why.find("sequential algorithm only"), std::string::npos) << why;
    }
  }
}

// explain (kspec explain, kspec.explain) names the path: the layout in the specialization, the sequential
// algorithm, the time-major kernel.
TEST(SelectiveScanLayout, ExplainSaysWhichPath) {
  CompileRequest r;
  r.op = "selective_scan.fwd";
  r.dtype = DType::bf16;
  r.params = {{"dstate", int64_t(16)}, {"seqlen", int64_t(65536)}, {"layout", std::string("bld")}};
  PlanInfo bld = explain_request(r);
  EXPECT_NE(bld.signature.find("layout=bld"), std::string::npos) << bld.signature;
  EXPECT_NE(bld.config.find("algo=sequential"), std::string::npos) << bld.config;
  EXPECT_NE(bld.config.find("segs=1"), std::string::npos) << bld.config;
  ASSERT_FALSE(bld.kernels.empty());
  EXPECT_NE(bld.kernels[0].name.find(", true>"), std::string::npos) << bld.kernels[0].name;
  r.params.set("layout", std::string("bdl"));
  EXPECT_EQ(explain_request(r).config.find("segs=1"), std::string::npos);  // bdl: segments at this length
}

// Where the sequential backward takes no config (dstate 1: its prefetched chunk needs too many registers),
// bld is refused as Unsupported with the reason, not given to a kernel that cannot read it.
TEST(SelectiveScanLayout, NoSequentialConfigIsUnsupported) {
  CompileRequest r;
  r.op = "selective_scan.bwd";
  r.dtype = DType::bf16;
  r.params = {{"dstate", int64_t(1)}, {"seqlen", int64_t(300)}, {"layout", std::string("bld")}};
  try {
    explain_request(r);
    ADD_FAILURE() << "no error";
  } catch (const Unsupported& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("layout \"bld\" runs the sequential algorithm"), std::string::npos) << m;
    EXPECT_NE(m.find("dstate 1"), std::string::npos) << m;
    EXPECT_NE(m.find("pass layout \"bdl\""), std::string::npos) << m;
  }
}

TEST(SelectiveScanLayout, TimeMajorKernelsCompile) {
  for (const char* name : {"selective_scan.fwd", "selective_scan.bwd"}) {
    CompileRequest r;
    r.op = name;
    r.dtype = DType::bf16;
    r.params = {{"dstate", int64_t(16)}, {"delta_softplus", true}, {"layout", std::string("bld")}};
    auto reports = compile(r);
    ASSERT_FALSE(reports.empty());
    EXPECT_NE(reports[0].kernel.find(", true>"), std::string::npos) << reports[0].kernel;
    EXPECT_NE(reports[0].config.find("algo=sequential"), std::string::npos) << reports[0].config;
    EXPECT_GT(reports[0].registers, 0);
    EXPECT_EQ(reports[0].spill_bytes, 0) << reports[0].kernel;
  }
}

// ---- GPU ----

namespace {

struct Dev {
  jit::DeviceBuffer mem;
  size_t n;
  explicit Dev(size_t count) : mem(std::max<size_t>(count, 1) * 4), n(count) {}
  void* ptr() const { return mem.data(); }
  void up(const std::vector<float>& v) { CU_CHECK(cuMemcpyHtoD(mem.ptr, v.data(), v.size() * 4)); }
  std::vector<float> down() const {
    std::vector<float> v(n);
    CU_CHECK(cuMemcpyDtoH(v.data(), mem.ptr, n * 4));
    return v;
  }
};

// [b, r, l] -> [b, l, r]
std::vector<float> swap_last(const std::vector<float>& v, int64_t b, int64_t r, int64_t l) {
  std::vector<float> o(v.size());
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < r; ++j)
      for (int64_t t = 0; t < l; ++t) o[(i * l + t) * r + j] = v[(i * r + j) * l + t];
  return o;
}

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return den > 0 ? num / den : num;
}

}  // namespace

// fp32, variable B/C, D, z, delta_bias, softplus, seqlen not a multiple of any chunk: the bld kernels read
// the transposed buffers and give the bdl kernels' numbers at the same config (the forward bit for bit:
// each thread walks the same steps in the same order; the backward's atomics reorder dB/dC sums).
TEST(GpuSelectiveScanLayout, TimeMajorMatchesBdlAtTheSameConfig) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard context(0);  // the buffers below are allocated before any kspec call makes one current
  for (auto [b, d, l] : std::vector<std::array<int64_t, 3>>{{2, 40, 300}, {8, 1024, 130}, {1, 8, 1}, {2, 24, 2}}) {
    const int64_t n = 16;
    std::mt19937_64 rng(b * 1000 + d + l);
    std::normal_distribution<float> nd;
    auto rnd = [&](size_t k, float scale = 1.0f, float shift = 0.0f) {
      std::vector<float> v(k);
      for (auto& x : v) x = shift + scale * nd(rng);
      return v;
    };
    auto seq = [&] { return rnd(size_t(b * d * l)); };
    std::vector<float> u = seq(), delta = rnd(size_t(b * d * l), 0.5f, -1.0f), z = seq(), dout = seq();
    std::vector<float> A = rnd(size_t(d * n)), Bv = rnd(size_t(b * n * l)), Cv = rnd(size_t(b * n * l));
    for (auto& a : A) a = -0.25f - std::fabs(a);
    std::vector<float> D = rnd(size_t(d)), bias = rnd(size_t(d), 0.1f);
    const int64_t ns = (l + 15) / 16;
    const Params bdl_p = {{"delta_softplus", true}}, bld_p = {{"delta_softplus", true}, {"layout", std::string("bld")}};
    const Problem pb = request("selective_scan.fwd", "bld", b, d, l),
                  qb = request("selective_scan.bwd", "bld", b, d, l);
    const Config cf = Registry::global().get("selective_scan.fwd").tuning.heuristic(pb);
    const Config cb = Registry::global().get("selective_scan.bwd").tuning.heuristic(qb);
    struct Run {
      std::vector<float> out, last, du, ddelta, dz, dA, dB, dC, dD, dbias;
    };
    auto run = [&](bool bld) {
      const size_t S = size_t(b * d * l), BC = size_t(b * n * l);
      Dev gu(S), gd(S), gz(S), go(S), gA(A.size()), gB(BC), gC(BC), gD(static_cast<size_t>(d)),
          gbias(static_cast<size_t>(d)), gout(S), glast(size_t(b * d * n)), gst(size_t(b * d * ns * n)), gdu(S), gdd(S),
          gdz(S), gdA(A.size()), gdB(BC), gdC(BC), gdD(static_cast<size_t>(d)), gdbias(static_cast<size_t>(d));
      gu.up(bld ? swap_last(u, b, d, l) : u);
      gd.up(bld ? swap_last(delta, b, d, l) : delta);
      gz.up(bld ? swap_last(z, b, d, l) : z);
      go.up(bld ? swap_last(dout, b, d, l) : dout);
      gB.up(bld ? swap_last(Bv, b, n, l) : Bv);
      gC.up(bld ? swap_last(Cv, b, n, l) : Cv);
      gA.up(A);
      gD.up(D);
      gbias.up(bias);
      auto sv = [&](const Dev& m) {
        return bld ? time_major(m.ptr(), DType::f32, b, d, l) : TensorView(m.ptr(), DType::f32, {b, d, l}, 0);
      };
      auto bcv = [&](const Dev& m) {
        return bld ? time_major_bc(m.ptr(), DType::f32, b, 1, n, l) : TensorView(m.ptr(), DType::f32, {b, 1, n, l}, 0);
      };
      TensorView Av(gA.ptr(), DType::f32, {d, n}, 0), Dv(gD.ptr(), DType::f32, {d}, 0),
          biasv(gbias.ptr(), DType::f32, {d}, 0), lastv(glast.ptr(), DType::f32, {b, d, n}, 0),
          stv(gst.ptr(), DType::f32, {b, d, ns, n}, 0);
      CallOptions of{&cf}, ob{&cb};
      call("selective_scan.fwd", {sv(gu), sv(gd), Av, bcv(gB), bcv(gC), Dv, sv(gz), biasv, {}}, {sv(gout), lastv, stv},
           bld ? bld_p : bdl_p, nullptr, of);
      call("selective_scan.bwd", {sv(go), sv(gu), sv(gd), Av, bcv(gB), bcv(gC), Dv, sv(gz), biasv, {}, {}, stv},
           {sv(gdu),
            sv(gdd),
            TensorView(gdA.ptr(), DType::f32, {d, n}, 0),
            bcv(gdB),
            bcv(gdC),
            TensorView(gdD.ptr(), DType::f32, {d}, 0),
            sv(gdz),
            TensorView(gdbias.ptr(), DType::f32, {d}, 0),
            {}},
           bld ? bld_p : bdl_p, nullptr, ob);
      CU_CHECK(cuCtxSynchronize());
      auto back = [&](const Dev& m, int64_t r) { return bld ? swap_last(m.down(), b, l, r) : m.down(); };
      return Run{back(gout, d), glast.down(), back(gdu, d), back(gdd, d), back(gdz, d),
                 gdA.down(),    back(gdB, n), back(gdC, n), gdD.down(),   gdbias.down()};
    };
    const Run x = run(false), y = run(true);
    const std::string at = std::to_string(b) + "x" + std::to_string(d) + "x" + std::to_string(l);
    EXPECT_EQ(y.out, x.out) << at;
    EXPECT_EQ(y.last, x.last) << at;
    for (auto [name, got, want] :
         std::vector<std::tuple<const char*, const std::vector<float>*, const std::vector<float>*>>{
             {"du", &y.du, &x.du},
             {"ddelta", &y.ddelta, &x.ddelta},
             {"dz", &y.dz, &x.dz},
             {"dA", &y.dA, &x.dA},
             {"dB", &y.dB, &x.dB},
             {"dC", &y.dC, &x.dC},
             {"dD", &y.dD, &x.dD},
             {"ddelta_bias", &y.dbias, &x.dbias}})
      EXPECT_LE(max_rel(*got, *want), 1e-5) << at << " " << name;
  }
}
