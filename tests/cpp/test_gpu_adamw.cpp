// GPU tests of the fused AdamW op (skipped without a GPU). The generic checker cannot drive it (its inputs
// are TensorLists), so this file does what the checker does for the other ops: fresh random lists of odd
// sizes, outputs poisoned with NaN, one kspec::call, every tensor against the float64 reference
// (api/ops/adamw/reference.h) by relative error with the dtype tolerances — for fp32 parameters and for
// bf16 parameters with an fp32 master copy, over the options (weight decay, maximize, AMSGrad, clipping,
// gradient unscaling, an inf gradient that skips the step), with 16-byte aligned tensors (vector path)
// and tensors packed end to end at odd offsets (scalar path).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "adamw/reference.h"
#include "api/src/device_data.h"
#include "api/src/op.h"
#include "jit/driver.h"
#include "jit/handles.h"
#include "kspec/kspec.h"
#include "test_helpers.h"

using namespace kspec;

namespace {

// Host bf16 <-> float, round to nearest even (what __float2bfloat16 does on the GPU).
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double round_to(DType dt, double v) {
  return dt == DType::bf16 ? from_bf16(to_bf16(static_cast<float>(v))) : static_cast<float>(v);
}

// One device allocation holding a list's tensors: each at its own 256-byte aligned offset, or packed end
// to end (odd sizes then leave most tensors 4- or 2-byte aligned: the op must take its scalar path).
class DeviceList {
 public:
  DeviceList(DType dt, const std::vector<int64_t>& sizes, bool packed) : dt_(dt), sizes_(sizes) {
    size_t es = dtype_size(dt), off = 0;
    for (int64_t n : sizes) {
      offsets_.push_back(off);
      off += packed ? n * es : (n * es + 255) / 256 * 256;
    }
    bytes_ = std::max<size_t>(off, 16);
    mem_ = jit::DeviceBuffer(bytes_);
    base_ = mem_.ptr;
    for (size_t i = 0; i < sizes.size(); ++i)
      items_.emplace_back(reinterpret_cast<void*>(base_ + offsets_[i]), dt, std::initializer_list<int64_t>{sizes[i]}, 0);
  }
  DeviceList(const DeviceList&) = delete;
  DeviceList& operator=(const DeviceList&) = delete;

  TensorView view() const { return TensorView::list(items_.data(), static_cast<int64_t>(items_.size())); }
  void upload(const std::vector<std::vector<double>>& v) {
    std::vector<unsigned char> host(bytes_, 0);
    for (size_t t = 0; t < v.size(); ++t)
      for (size_t i = 0; i < v[t].size(); ++i) {
        unsigned char* at = host.data() + offsets_[t] + i * dtype_size(dt_);
        if (dt_ == DType::bf16) {
          uint16_t h = to_bf16(static_cast<float>(v[t][i]));
          std::memcpy(at, &h, 2);
        } else {
          float f = static_cast<float>(v[t][i]);
          std::memcpy(at, &f, 4);
        }
      }
    CU_CHECK(cuMemcpyHtoD(base_, host.data(), bytes_));
  }
  std::vector<std::vector<double>> download() const {
    std::vector<unsigned char> host(bytes_);
    CU_CHECK(cuMemcpyDtoH(host.data(), base_, bytes_));
    std::vector<std::vector<double>> v(sizes_.size());
    for (size_t t = 0; t < sizes_.size(); ++t)
      for (int64_t i = 0; i < sizes_[t]; ++i) {
        const unsigned char* at = host.data() + offsets_[t] + i * dtype_size(dt_);
        if (dt_ == DType::bf16) {
          uint16_t h;
          std::memcpy(&h, at, 2);
          v[t].push_back(from_bf16(h));
        } else {
          float f;
          std::memcpy(&f, at, 4);
          v[t].push_back(f);
        }
      }
    return v;
  }
  void poison() { CU_CHECK(cuMemsetD8(base_, 0xFF, bytes_)); }  // NaN in fp32 and bf16

 private:
  DType dt_;
  std::vector<int64_t> sizes_;
  std::vector<size_t> offsets_;
  std::vector<TensorView> items_;
  jit::DeviceBuffer mem_;
  CUdeviceptr base_ = 0;  // mem_.ptr
  size_t bytes_ = 0;
};

struct Scalar {  // a one-float output (found_inf, grad_norm), poisoned with NaN
  jit::DeviceBuffer mem{4};
  CUdeviceptr p = mem.ptr;
  Scalar() { CU_CHECK(cuMemsetD8(p, 0xFF, 4)); }
  TensorView view() const { return TensorView(reinterpret_cast<void*>(p), DType::f32, {1}, 0); }
  float get() const {
    float f;
    CU_CHECK(cuMemcpyDtoH(&f, p, 4));
    return f;
  }
};

struct AdamwCase {
  std::string name;
  DType params = DType::f32;  // bf16: with an fp32 master copy (and bf16 gradients)
  double weight_decay = 1e-2;
  bool maximize = false, amsgrad = false, bias_correction = true;
  double max_norm = 0;     // > 0: clip to this global norm
  double grad_scale = 0;   // > 0: gradients are stored multiplied by it, the op divides
  bool inf_grad = false;   // one gradient element is inf: the step must be skipped
  bool outputs = true;     // pass found_inf and grad_norm (absent: the op may skip its norm pass)
  bool packed = false;     // tensors end to end at odd offsets (scalar path)
};

void PrintTo(const AdamwCase& c, std::ostream* os) { *os << c.name; }  // gtest/ctest names, not bytes

// Sizes: a single element, sizes not a multiple of the 4-wide vectors, one just over a 64 K chunk and
// one just over two.
const std::vector<int64_t> kSizes = {1, 7, 4097, 65537, 3, 131073};

class GpuAdamw : public ::testing::TestWithParam<AdamwCase> {};

TEST_P(GpuAdamw, MatchesFloat64Reference) {
  KSPEC_REQUIRE_GPU();
  const AdamwCase& c = GetParam();
  jit::ContextGuard guard(0);
  const bool low = c.params != DType::f32;
  const uint64_t seed = 1000 + std::hash<std::string>{}(c.name) % 1000;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uniform(1e-4, 1e-2);
  const size_t nt = kSizes.size();
  std::vector<std::vector<double>> p(nt), g(nt), m(nt), v(nt), vmax(nt);
  for (size_t t = 0; t < nt; ++t)
    for (int64_t i = 0; i < kSizes[t]; ++i) {
      // What the GPU holds: parameters and gradients rounded to their dtype (the master copy starts as
      // the bf16 parameter), gradients stored scaled.
      p[t].push_back(round_to(c.params, normal(rng)));
      g[t].push_back(round_to(c.params, normal(rng) * (c.grad_scale > 0 ? c.grad_scale : 1.0)));
      m[t].push_back(round_to(DType::f32, 0.1 * normal(rng)));
      v[t].push_back(round_to(DType::f32, uniform(rng)));
      vmax[t].push_back(round_to(DType::f32, 2 * v[t].back()));
    }
  if (c.inf_grad) g[3][17] = INFINITY;

  DeviceList dp(c.params, kSizes, c.packed), dg(c.params, kSizes, c.packed), dm(DType::f32, kSizes, c.packed),
      dv(DType::f32, kSizes, c.packed), dmaster(DType::f32, kSizes, c.packed), dvmax(DType::f32, kSizes, c.packed);
  dp.upload(p);
  dg.upload(g);
  dm.upload(m);
  dv.upload(v);
  dmaster.upload(p);
  dvmax.upload(vmax);
  // With a master copy the op only writes the bf16 parameters: poisoned, every element must come back
  // as the master's rounding (not for a skipped step, which must leave them as they were).
  if (low && !c.inf_grad) dp.poison();
  Scalar found, norm, scale;
  if (c.grad_scale > 0) {
    float s = static_cast<float>(c.grad_scale);
    CU_CHECK(cuMemcpyHtoD(scale.p, &s, 4));
  }

  ref::AdamwRefOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.9;
  o.beta2 = 0.99;
  o.eps = 1e-8;
  o.weight_decay = c.weight_decay;
  o.step = 3;
  o.maximize = c.maximize;
  o.bias_correction = c.bias_correction;
  o.max_norm = c.max_norm;
  o.grad_scale = c.grad_scale > 0 ? c.grad_scale : 1.0;
  Params params{{"lr", o.lr},           {"beta1", o.beta1},
                {"beta2", o.beta2},     {"eps", o.eps},
                {"weight_decay", o.weight_decay}, {"step", int64_t(o.step)},
                {"maximize", o.maximize},         {"bias_correction", o.bias_correction},
                {"max_norm", o.max_norm}};
  call("adamw",
       {dp.view(), dg.view(), dm.view(), dv.view(), low ? dmaster.view() : TensorView(),
        c.amsgrad ? dvmax.view() : TensorView(), c.grad_scale > 0 ? scale.view() : TensorView()},
       {c.outputs ? found.view() : TensorView(), c.outputs ? norm.view() : TensorView()}, params);
  CU_CHECK(cuCtxSynchronize());

  auto rp = p, rm = m, rv = v, rvmax = vmax;
  auto r = ref::adamw_ref(rp, g, rm, rv, c.amsgrad ? &rvmax : nullptr, o);
  ASSERT_EQ(r.found_inf, c.inf_grad);
  SCOPED_TRACE(c.name + " (seed " + std::to_string(seed) + ")");
  if (c.outputs) {
    EXPECT_EQ(found.get(), c.inf_grad ? 1.f : 0.f);
    if (!c.inf_grad) { EXPECT_NEAR(norm.get(), r.grad_norm, 1e-5 * r.grad_norm); }
  }
  auto gp = dp.download(), gm = dm.download(), gv = dv.download(), gmaster = dmaster.download(),
       gvmax = dvmax.download();
  if (c.inf_grad) {  // nothing moved, bit for bit (the inputs were exactly representable)
    EXPECT_EQ(gp, p);
    EXPECT_EQ(gm, m);
    EXPECT_EQ(gv, v);
    if (low) { EXPECT_EQ(gmaster, p); }
    if (c.amsgrad) { EXPECT_EQ(gvmax, vmax); }
    return;
  }
  const double tol32 = tolerance_for(DType::f32), tolp = tolerance_for(c.params);
  for (size_t t = 0; t < nt; ++t) {
    SCOPED_TRACE("tensor " + std::to_string(t) + " of " + std::to_string(kSizes[t]) + " elements");
    EXPECT_LE(rel_error(gm[t], rm[t]), tol32) << "exp_avg";
    EXPECT_LE(rel_error(gv[t], rv[t]), tol32) << "exp_avg_sq";
    if (c.amsgrad) { EXPECT_LE(rel_error(gvmax[t], rvmax[t]), tol32) << "max_exp_avg_sq"; }
    EXPECT_LE(rel_error(gp[t], rp[t]), tolp) << "params";
    if (low) {
      EXPECT_LE(rel_error(gmaster[t], rp[t]), tol32) << "master";
      for (size_t i = 0; i < gp[t].size(); ++i)
        ASSERT_EQ(gp[t][i], round_to(DType::bf16, gmaster[t][i])) << "param " << i << " is not its master's rounding";
    }
  }
}

AdamwCase make(std::string name, DType dt) {
  AdamwCase c;
  c.name = std::move(name);
  c.params = dt;
  return c;
}

std::vector<AdamwCase> adamw_cases() {
  std::vector<AdamwCase> out;
  for (DType dt : {DType::f32, DType::bf16}) {
    std::string d = dtype_short(dt);
    AdamwCase c = make(d + "_plain", dt);
    out.push_back(c);
    c = make(d + "_plain_no_outputs", dt);
    c.outputs = false;
    out.push_back(c);
    c = make(d + "_packed_odd_offsets", dt);
    c.packed = true;
    out.push_back(c);
    c = make(d + "_weight_decay_maximize", dt);
    c.weight_decay = 0.1;
    c.maximize = true;
    out.push_back(c);
    c = make(d + "_amsgrad", dt);
    c.amsgrad = true;
    out.push_back(c);
    c = make(d + "_clip", dt);
    c.max_norm = 1.0;
    out.push_back(c);
    c = make(d + "_grad_scale", dt);
    c.grad_scale = 1024;
    out.push_back(c);
    c = make(d + "_inf_grad_skips_step", dt);
    c.grad_scale = 1024;
    c.amsgrad = true;
    out.push_back(c);
    c = make(d + "_everything_packed", dt);
    c.weight_decay = 0.1;
    c.maximize = true;
    c.amsgrad = true;
    c.max_norm = 0.5;
    c.grad_scale = 65536;
    c.bias_correction = false;
    c.packed = true;
    out.push_back(c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Options, GpuAdamw, ::testing::ValuesIn(adamw_cases()),
                         [](const ::testing::TestParamInfo<AdamwCase>& i) { return i.param.name; });

}  // namespace

// A BoundCall (validated and uploaded once, as kspec.optim.AdamW's steps use it) computes what kspec::call
// computes, step after step with a new step count; it refuses a compiled param and an output laid out
// unlike the bound one. Without a GPU: its construction validates every tensor first, as call() does.
TEST(GpuAdamwBound, RunsMatchPlainCallsAndRefuseWhatWasCompiledIn) {
  KSPEC_REQUIRE_GPU();
  jit::ContextGuard guard(0);
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal;
  auto fill = [&](double scale) {
    std::vector<std::vector<double>> v(kSizes.size());
    for (size_t t = 0; t < kSizes.size(); ++t)
      for (int64_t i = 0; i < kSizes[t]; ++i) v[t].push_back(scale * normal(rng));
    return v;
  };
  auto p0 = fill(1), g0 = fill(1), m0 = fill(0.1), v0 = fill(0.0);
  for (auto& t : v0)
    for (auto& x : t) x = x * x + 1e-3;
  DeviceList pa(DType::f32, kSizes, false), ga(DType::f32, kSizes, false), ma(DType::f32, kSizes, false),
      va(DType::f32, kSizes, false), pb(DType::f32, kSizes, false), gb(DType::f32, kSizes, false),
      mb(DType::f32, kSizes, false), vb(DType::f32, kSizes, false);
  for (auto* l : {&pa, &pb}) l->upload(p0);
  for (auto* l : {&ga, &gb}) l->upload(g0);
  for (auto* l : {&ma, &mb}) l->upload(m0);
  for (auto* l : {&va, &vb}) l->upload(v0);
  Scalar na, nb;
  Params hyper{{"lr", 1e-2}, {"weight_decay", 0.1}, {"step", int64_t(1)}};
  BoundCall bound("adamw", {pa.view(), ga.view(), ma.view(), va.view(), TensorView(), TensorView(), TensorView()},
                  {TensorView(), na.view()}, hyper);
  for (int64_t step = 1; step <= 3; ++step) {
    bound.run({{"lr", 1e-2}, {"weight_decay", 0.1}, {"step", step}}, {TensorView(), na.view()});
    call("adamw", {pb.view(), gb.view(), mb.view(), vb.view(), TensorView(), TensorView(), TensorView()},
         {TensorView(), nb.view()}, {{"lr", 1e-2}, {"weight_decay", 0.1}, {"step", step}});
  }
  CU_CHECK(cuCtxSynchronize());
  EXPECT_EQ(bound.runs(), 3);
  EXPECT_TRUE(bound.idle());
  EXPECT_EQ(pa.download(), pb.download());
  EXPECT_EQ(ma.download(), mb.download());
  EXPECT_EQ(va.download(), vb.download());
  EXPECT_EQ(na.get(), nb.get());
  EXPECT_THROW(bound.run({{"maximize", true}}, {TensorView(), na.view()}), InvalidArgument);
  EXPECT_THROW(bound.run({}, {na.view(), na.view()}), InvalidArgument);
  EXPECT_THROW(bound.run({}, {TensorView(), TensorView(reinterpret_cast<void*>(na.p), DType::f32, {1, 1}, 0)}),
               InvalidArgument);
  EXPECT_THROW(bound.run({{"lr", -1.0}}, {TensorView(), na.view()}), InvalidArgument);  // check_call's rules
}

TEST(AdamwBound, ConstructionValidatesEveryTensorBeforeAnythingElse) {
  // No GPU needed: validation comes first (fake device pointers, never dereferenced).
  alignas(16) static float host[64];
  auto list_of = [](std::vector<TensorView>& items) { return TensorView::list(items.data(), static_cast<int64_t>(items.size())); };
  std::vector<TensorView> cpu = {TensorView(host, DType::f32, {4}, kCpuDevice)};
  try {
    BoundCall b("adamw", {list_of(cpu), list_of(cpu), list_of(cpu), list_of(cpu), TensorView(), TensorView(), TensorView()},
                {TensorView(), TensorView()});
    FAIL() << "host tensors were bound";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("host memory"), std::string::npos) << e.what();
  }
  auto fake = [](uintptr_t at, int64_t n) { return TensorView(reinterpret_cast<void*>(at), DType::f32, {n}, 0); };
  std::vector<TensorView> p = {fake(1 << 20, 4), fake(2 << 20, 8)}, g = {fake(3 << 20, 4), fake(4 << 20, 9)};
  try {
    BoundCall b("adamw", {list_of(p), list_of(g), list_of(p), list_of(p), TensorView(), TensorView(), TensorView()},
                {TensorView(), TensorView()});
    FAIL() << "lists of different shapes were bound";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'grads'[1] has shape"), std::string::npos) << e.what();
  }
}
