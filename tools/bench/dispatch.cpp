// Host overhead of one kspec call from C++, against a raw cuLaunchKernel of the very same loaded
// function with the same argument block: a tiny fp32 norm_act.fwd (1 x 256) so that the GPU side never
// limits the launch rate, through kspec::call, the typed wrapper and a BoundCall; the raw launch with one
// piece of kspec's work added at a time (the context query, the argument written from views, a capture
// query); and an fp32 gemm (x [4, 64] · W [64, 64]ᵀ + bias, one cuBLASLt matmul) through kspec::call.
// Prints one JSON object to stdout ("methods" in order, each's µs and its per-round difference from raw);
// tools/bench/bench.py --dispatch-bin runs it and keeps the JSON.
//   kspec_dispatch_bench [--no-check]   --no-check: skip the float64 check of the outputs (on the mock
//                                        driver, tests/mock_cuda, whose launches compute nothing)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "api/src/kernels.h"
#include "jit/driver.h"
#include "jit/spec.h"
#include "kspec/kspec.h"
#include "norm_act/params.h"
#include "norm_act/reference.h"

namespace {

constexpr int kDevice = 0;
constexpr int kRows = 1;
constexpr int kHidden = 256;
// Many short rounds: a host whose speed drifts (another process, a clock change) moves every method of a
// round alike, and a row's figure is the median of its per-round differences from raw (run 22's host put
// kspec::call at +1.16 us by medians taken apart, where run 19's had +0.30).
constexpr int kLaunchesPerRep = 100;
constexpr int kReps = 200;
constexpr int kWarmupLaunches = 2000;
constexpr double kEps = 1e-5;

// Owns one cuMemAlloc'd buffer.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) { CU_CHECK(cuMemAlloc(&ptr_, bytes)); }
  ~DeviceBuffer() {
    if (ptr_) kspec::jit::driver().cuMemFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return reinterpret_cast<void*>(ptr_); }
  CUdeviceptr dptr() const { return ptr_; }

 private:
  CUdeviceptr ptr_ = 0;
};

// Owns one stream created with cuStreamCreate.
class OwnedStream {
 public:
  OwnedStream() { CU_CHECK(cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING)); }
  ~OwnedStream() {
    if (stream_) kspec::jit::driver().cuStreamDestroy(stream_);
  }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  CUstream get() const { return stream_; }

 private:
  CUstream stream_ = nullptr;
};

struct Stats {
  double median = 0, min = 0, p90 = 0;
};

Stats summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Stats s;
  s.min = v.front();
  s.median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  s.p90 = v[std::min(v.size() - 1, static_cast<size_t>(0.9 * static_cast<double>(v.size())))];
  return s;
}

std::vector<float> download(const DeviceBuffer& b, size_t n) {
  std::vector<float> h(n);
  CU_CHECK(cuMemcpyDtoH(h.data(), b.dptr(), n * sizeof(float)));
  return h;
}

double rel_error(const std::vector<float>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) o += c;
  }
  return o;
}

int run(bool check) {
  if (!kspec::jit::driver_available() || kspec::jit::device_count() == 0) {
    std::fprintf(stderr, "kspec_dispatch_bench: no CUDA driver or no GPU visible; nothing to measure\n");
    return 2;
  }
  // Keep the primary context current for the whole run, as an application's would be: the raw path
  // below assumes it, and kspec::call finds it already current.
  kspec::jit::ContextGuard context(kDevice);
  CUdevice dev;
  CU_CHECK(cuDeviceGet(&dev, kDevice));
  char name[256] = {};
  CU_CHECK(cuDeviceGetName(name, sizeof(name), dev));
  int major = 0, minor = 0;
  CU_CHECK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
  CU_CHECK(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));

  OwnedStream stream_owner;
  CUstream cu_stream = stream_owner.get();
  auto stream = reinterpret_cast<kspec::Stream>(cu_stream);

  // Random inputs (never zeros); weights near 1 so the output stays in a normal range.
  const size_t n = static_cast<size_t>(kRows) * kHidden;
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> hx(n), hw(kHidden), hb(kHidden);
  for (auto& v : hx) v = normal(rng);
  for (auto& v : hw) v = 1.f + 0.1f * normal(rng);
  for (auto& v : hb) v = 0.1f * normal(rng);
  DeviceBuffer x(n * 4), w(kHidden * 4), b(kHidden * 4), y(n * 4), mean(kRows * 4), rstd(kRows * 4);
  CU_CHECK(cuMemcpyHtoD(x.dptr(), hx.data(), n * 4));
  CU_CHECK(cuMemcpyHtoD(w.dptr(), hw.data(), kHidden * 4));
  CU_CHECK(cuMemcpyHtoD(b.dptr(), hb.data(), kHidden * 4));

  using kspec::DType;
  using kspec::TensorView;
  TensorView xv(x.get(), DType::f32, {kRows, kHidden}, kDevice), wv(w.get(), DType::f32, {kHidden}, kDevice),
      bv(b.get(), DType::f32, {kHidden}, kDevice), yv(y.get(), DType::f32, {kRows, kHidden}, kDevice),
      mv(mean.get(), DType::f32, {kRows}, kDevice), rv(rstd.get(), DType::f32, {kRows}, kDevice);
  const kspec::Params params{{"norm", std::string("layernorm")}, {"act", std::string("identity")}, {"eps", kEps}};
  const kspec::ops::NormActOptions options{"layernorm", "identity", kEps};

  // The specialization kspec's heuristic picks for fp32 layernorm+identity+bias at hidden 256:
  // 32 threads per row, 4 rows per block, 4-wide vectors (explain() below confirms it).
  kspec::jit::KernelSpec spec;
  spec.header = "norm_act/norm_act.cuh";
  spec.kernel = "kspec::norm_act_fwd_kernel";
  spec.targs = {"float", "float", std::to_string(kHidden), "0", "0", "true", "32", "4", "4"};
  spec.arch = kspec::jit::arch_for_compute_capability(major, minor);
  constexpr unsigned kRowsPerBlock = 4, kThreads = 32 * kRowsPerBlock;
  CUfunction fn = kspec::load_kernel(spec, kDevice).fn;
  const std::string explained = kspec::explain("norm_act.fwd", {xv, wv, bv}, {yv, mv, rv}, params);
  const bool same_kernel = explained.find(spec.name_expression()) != std::string::npos;

  // The kernel's one argument, as api/ops/norm_act/op.cpp fills it (templates/norm_act/params.h).
  kspec::NormActParams prm{};
  prm.x = x.get();
  prm.weight = w.get();
  prm.bias = b.get();
  prm.y = y.get();
  prm.mean = static_cast<float*>(mean.get());
  prm.rstd = static_cast<float*>(rstd.get());
  prm.x_row_stride = prm.y_row_stride = kHidden;
  prm.rows = kRows;
  prm.eps = static_cast<float>(kEps);
  void* args[] = {&prm};
  const unsigned grid = (kRows + kRowsPerBlock - 1) / kRowsPerBlock;

  auto raw = [&] { CU_CHECK(cuLaunchKernel(fn, grid, 1, 1, kThreads, 1, 1, 0, cu_stream, args, nullptr)); };
  // The breakdown: raw plus one piece of what kspec does around the same launch at a time, so that the GPU
  // host's own cost of each shows (a driver query there is not the mock's few instructions).
  // + the current-context query every kspec call makes (jit::ContextGuard):
  auto raw_ctx = [&] {
    CUcontext current = nullptr;
    CU_CHECK(cuCtxGetCurrent(&current));
    CU_CHECK(cuLaunchKernel(fn, grid, 1, 1, kThreads, 1, 1, 0, cu_stream, args, nullptr));
  };
  // + the kernel's argument written from the six views at each call, as norm_act's launcher does:
  const TensorView* pack_views[] = {&xv, &wv, &bv, &yv, &mv, &rv};
  auto raw_ctx_pack = [&] {
    CUcontext current = nullptr;
    CU_CHECK(cuCtxGetCurrent(&current));
    kspec::NormActParams p{};
    p.x = pack_views[0]->data;
    p.weight = pack_views[1]->data;
    p.bias = pack_views[2]->data;
    p.y = pack_views[3]->data;
    p.mean = static_cast<float*>(pack_views[4]->data);
    p.rstd = static_cast<float*>(pack_views[5]->data);
    p.x_row_stride = pack_views[0]->strides[0];
    p.y_row_stride = pack_views[3]->strides[0];
    p.rows = static_cast<int>(pack_views[0]->shape[0]);
    p.eps = static_cast<float>(kEps);
    void* a[] = {&p};
    CU_CHECK(cuLaunchKernel(fn, grid, 1, 1, kThreads, 1, 1, 0, cu_stream, a, nullptr));
  };
  // + a capture-status query (kspec makes one where a call needs a workspace, or a bound call has tables):
  auto raw_capture = [&] {
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    CU_CHECK(cuStreamIsCapturing(cu_stream, &status));
    CU_CHECK(cuLaunchKernel(fn, grid, 1, 1, kThreads, 1, 1, 0, cu_stream, args, nullptr));
  };
  // As a user writes it: the argument lists and Params built at the call.
  auto call = [&] {
    kspec::call("norm_act.fwd", {xv, wv, bv}, {yv, mv, rv},
                kspec::Params{{"norm", std::string("layernorm")}, {"act", std::string("identity")}, {"eps", kEps}},
                stream);
  };
  auto call_prebuilt = [&] { kspec::call("norm_act.fwd", {xv, wv, bv}, {yv, mv, rv}, params, stream); };
  auto typed = [&] { kspec::ops::norm_act_fwd(xv, wv, bv, yv, mv, rv, options, stream); };
  kspec::BoundCall bound_call("norm_act.fwd", {xv, wv, bv}, {yv, mv, rv}, params);
  const kspec::Params no_params;
  const std::vector<TensorView> bound_outs{yv, mv, rv};
  auto bound = [&] { bound_call.run(no_params, bound_outs, stream); };
  // A linear layer's GEMM (cuBLASLt), not compared with raw: its row is kspec's host cost around cuBLASLt's
  // (x and W zeros, the bias ones: y must be ones).
  constexpr int kGemmRows = 4, kGemmDim = 64;
  DeviceBuffer gx(kGemmRows * kGemmDim * 4), gw(kGemmDim * kGemmDim * 4), gb(kGemmDim * 4), gy(kGemmRows * kGemmDim * 4);
  CU_CHECK(cuMemsetD32Async(gx.dptr(), 0, kGemmRows * kGemmDim, cu_stream));
  CU_CHECK(cuMemsetD32Async(gw.dptr(), 0, kGemmDim * kGemmDim, cu_stream));
  CU_CHECK(cuMemsetD32Async(gb.dptr(), 0x3f800000u, kGemmDim, cu_stream));  // 1.0f
  const std::vector<TensorView> gemm_ins{TensorView(gx.get(), DType::f32, {kGemmRows, kGemmDim}, kDevice),
                                         TensorView(gw.get(), DType::f32, {kGemmDim, kGemmDim}, kDevice),
                                         TensorView(gb.get(), DType::f32, {kGemmDim}, kDevice)},
      gemm_outs{TensorView(gy.get(), DType::f32, {kGemmRows, kGemmDim}, kDevice), TensorView()};
  const kspec::Params gemm_params{{"act", std::string("none")}};
  auto gemm = [&] { kspec::call("gemm", gemm_ins, gemm_outs, gemm_params, stream); };

  struct Method {
    const char* name;
    std::function<void()> fn;
    std::vector<double> per_call_us;
  };
  std::vector<Method> methods = {{"raw", raw, {}},
                                 {"raw_ctx", raw_ctx, {}},
                                 {"raw_ctx_pack", raw_ctx_pack, {}},
                                 {"raw_capture", raw_capture, {}},
                                 {"bound", bound, {}},
                                 {"call_prebuilt_params", call_prebuilt, {}},
                                 {"call", call, {}},
                                 {"typed", typed, {}},
                                 {"gemm", gemm, {}}};
  const size_t n_norm_act = methods.size() - 1;  // the methods that write y (all but gemm)

  // Validate every path before timing it: each writes y from scratch, checked against the float64
  // reference; the raw launch and kspec's must agree bit for bit (the same kernel on the same data).
  const std::vector<double> hbd(hb.begin(), hb.end());
  const auto ref = kspec::ref::norm_act_fwd_ref(std::vector<double>(hx.begin(), hx.end()),
                                                std::vector<double>(hw.begin(), hw.end()), &hbd, kRows, kHidden,
                                                /*norm=*/0, /*act=*/0, kEps);
  double worst_error = 0;
  bool bitwise_equal = true;
  std::vector<float> first;
  for (size_t i = 0; i < n_norm_act && check; ++i) {
    Method& m = methods[i];
    CU_CHECK(cuMemsetD32Async(y.dptr(), 0x7fc00000u, n, cu_stream));  // NaN-poison the output
    m.fn();
    CU_CHECK(cuStreamSynchronize(cu_stream));
    std::vector<float> out = download(y, n);
    double err = rel_error(out, ref.y);
    worst_error = std::max(worst_error, std::isfinite(err) ? err : 1e30);
    if (first.empty()) first = out;
    else bitwise_equal = bitwise_equal && std::memcmp(first.data(), out.data(), n * sizeof(float)) == 0;
  }
  constexpr double kTolerance = 1e-5;  // fp32
  if (!(worst_error <= kTolerance)) {
    std::fprintf(stderr, "kspec_dispatch_bench: output differs from the float64 reference (rel. error %.3g)\n",
                 worst_error);
    return 1;
  }

  // The gemm's y = 0·Wᵀ + bias must be the bias (1.0) exactly.
  if (check) {
    CU_CHECK(cuMemsetD32Async(gy.dptr(), 0x7fc00000u, kGemmRows * kGemmDim, cu_stream));
    gemm();
    CU_CHECK(cuStreamSynchronize(cu_stream));
    for (float v : download(gy, kGemmRows * kGemmDim)) {
      if (v != 1.f) {
        std::fprintf(stderr, "kspec_dispatch_bench: the gemm wrote %g where the bias is 1\n", static_cast<double>(v));
        return 1;
      }
    }
  }
  for (auto& m : methods) {
    for (int i = 0; i < kWarmupLaunches; ++i) m.fn();
    CU_CHECK(cuStreamSynchronize(cu_stream));
  }
  // Methods interleaved round by round, each round starting at the next method (none always runs first
  // after the synchronize), so that clock or load drift hits all of them alike.
  for (int rep = 0; rep < kReps; ++rep) {
    for (size_t k = 0; k < methods.size(); ++k) {
      Method& m = methods[(static_cast<size_t>(rep) + k) % methods.size()];
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < kLaunchesPerRep; ++i) m.fn();
      auto t1 = std::chrono::steady_clock::now();
      CU_CHECK(cuStreamSynchronize(cu_stream));
      m.per_call_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kLaunchesPerRep);
    }
  }

  std::vector<Stats> stats, over_raw;
  for (auto& m : methods) {
    stats.push_back(summarize(m.per_call_us));
    std::vector<double> diff(m.per_call_us.size());
    for (size_t r = 0; r < diff.size(); ++r) diff[r] = m.per_call_us[r] - methods[0].per_call_us[r];
    over_raw.push_back(summarize(diff));
  }
  std::printf("{\"device\": \"%s\", \"arch\": \"%s\", \"kspec_version\": \"%s\", \"op\": \"norm_act.fwd\", "
              "\"problem\": \"float32[%d, %d] layernorm identity bias\", \"kernel\": \"%s\", "
              "\"launches_per_rep\": %d, \"reps\": %d, \"same_kernel\": %s, \"checked\": %s, "
              "\"outputs_bitwise_equal\": %s, \"max_rel_error\": %.3g, \"gemm_problem\": \"float32 x[%d, %d] W[%d, %d] bias\"",
              json_escape(name).c_str(), spec.arch.c_str(), kspec::version(), kRows, kHidden,
              json_escape(spec.name_expression()).c_str(), kLaunchesPerRep, kReps, same_kernel ? "true" : "false",
              check ? "true" : "false", bitwise_equal ? "true" : "false", worst_error, kGemmRows, kGemmDim, kGemmDim,
              kGemmDim);
  std::printf(", \"methods\": [");
  for (size_t i = 0; i < methods.size(); ++i) std::printf("%s\"%s\"", i ? ", " : "", methods[i].name);
  std::printf("]");
  for (size_t i = 0; i < methods.size(); ++i)
    std::printf(", \"%s_us\": %.4f, \"%s_min_us\": %.4f, \"%s_p90_us\": %.4f", methods[i].name, stats[i].median,
                methods[i].name, stats[i].min, methods[i].name, stats[i].p90);
  // Each round's difference from raw's same round, the median over rounds (and its 90th percentile).
  for (size_t i = 1; i < methods.size(); ++i)
    std::printf(", \"%s_minus_raw_us\": %.4f, \"%s_minus_raw_p90_us\": %.4f", methods[i].name, over_raw[i].median,
                methods[i].name, over_raw[i].p90);
  std::printf("}\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool check = !(argc == 2 && std::strcmp(argv[1], "--no-check") == 0);
  if (argc > 2 || (argc == 2 && check)) {
    std::fprintf(stderr, "usage: kspec_dispatch_bench [--no-check]\n");
    return 2;
  }
  try {
    return run(check);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kspec_dispatch_bench: %s\n", e.what());
    return 1;
  }
}
