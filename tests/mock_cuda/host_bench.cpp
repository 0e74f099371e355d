// The host path of one kspec call with no GPU: a loop of N calls of one method through the mock driver
// (KSPEC_LIBCUDA=libkspec_cuda_mock.so), for `valgrind --tool=callgrind` (instructions per call: the
// difference of two N over their difference) or a wall clock (ns per call, printed). The problem is
// kspec_dispatch_bench's: fp32 norm_act.fwd [1, 256], layernorm, identity, bias; `gemm` is an fp32 linear
// layer x [4, 64] · W [64, 64]ᵀ + bias through cuBLASLt (KSPEC_LIBCUBLASLT=the same mock library), and
// prints the mock cuBLASLt's setup calls (descriptors, attributes, heuristic) per call beside the time.
//   kspec_host_bench METHOD N      METHOD: raw | call | call_prebuilt_params | typed | bound | gemm
#include <cuda.h>
#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "jit/driver.h"
#include "kspec/kspec.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: kspec_host_bench raw|call|call_prebuilt_params|typed|bound|gemm N\n");
    return 2;
  }
  const std::string method = argv[1];
  const long n = std::atol(argv[2]);
  try {
    constexpr int kRows = 1, kHidden = 256;
    constexpr double kEps = 1e-5;
    kspec::jit::ContextGuard context(0);
    std::vector<CUdeviceptr> bufs(10);
    for (auto& b : bufs) CU_CHECK(cuMemAlloc(&b, 64 * 64 * 4));
    auto p = [&](int i) { return reinterpret_cast<void*>(bufs[i]); };
    using kspec::DType;
    using kspec::TensorView;
    TensorView x(p(0), DType::f32, {kRows, kHidden}, 0), w(p(1), DType::f32, {kHidden}, 0),
        b(p(2), DType::f32, {kHidden}, 0), y(p(3), DType::f32, {kRows, kHidden}, 0),
        mean(p(4), DType::f32, {kRows}, 0), rstd(p(5), DType::f32, {kRows}, 0);
    const std::vector<TensorView> ins{x, w, b}, outs{y, mean, rstd};
    TensorView gx(p(6), DType::f32, {4, 64}, 0), gw(p(7), DType::f32, {64, 64}, 0), gb(p(8), DType::f32, {64}, 0),
        gy(p(9), DType::f32, {4, 64}, 0);
    const std::vector<TensorView> gemm_ins{gx, gw, gb}, gemm_outs{gy, TensorView()};
    const kspec::Params gemm_params{{"act", std::string("none")}};
    const kspec::Params params{{"norm", std::string("layernorm")}, {"act", std::string("identity")}, {"eps", kEps}};
    const kspec::ops::NormActOptions options{"layernorm", "identity", kEps};
    auto stream = reinterpret_cast<kspec::Stream>(uintptr_t(0x100));
    CUfunction fn = nullptr;
    int token = 0;
    fn = reinterpret_cast<CUfunction>(&token);
    unsigned char prm[144] = {};
    void* args[] = {prm};
    kspec::BoundCall bound("norm_act.fwd", ins, outs, params);
    const kspec::Params no_params;

    // The method resolved once: comparing its name on every call would count the bench's own string compares.
    enum Method { kRaw, kCall, kPrebuilt, kTyped, kBound, kGemm };
    const char* const names[] = {"raw", "call", "call_prebuilt_params", "typed", "bound", "gemm"};
    int chosen = -1;
    for (int i = 0; i < 6; ++i)
      if (method == names[i]) chosen = i;
    if (chosen < 0) throw kspec::InvalidArgument("unknown method '" + method + "'");
    auto once = [&] {
      switch (chosen) {
        case kRaw:
          CU_CHECK(cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, reinterpret_cast<CUstream>(stream), args, nullptr));
          break;
        case kCall:
          kspec::call("norm_act.fwd", {x, w, b}, {y, mean, rstd},
                      kspec::Params{{"norm", std::string("layernorm")}, {"act", std::string("identity")}, {"eps", kEps}},
                      stream);
          break;
        case kPrebuilt: kspec::call("norm_act.fwd", ins, outs, params, stream); break;
        case kTyped: kspec::ops::norm_act_fwd(x, w, b, y, mean, rstd, options, stream); break;
        case kBound: bound.run(no_params, outs, stream); break;
        default: kspec::call("gemm", gemm_ins, gemm_outs, gemm_params, stream); break;
      }
    };
    // The mock cuBLASLt's count of setup calls, where KSPEC_LIBCUBLASLT names it (-1 otherwise).
    const char* lt_path = std::getenv("KSPEC_LIBCUBLASLT");
    void* lt = lt_path ? dlopen(lt_path, RTLD_NOW | RTLD_NOLOAD) : nullptr;
    auto lt_setup = lt ? reinterpret_cast<long long (*)()>(dlsym(lt, "kspec_mock_lt_setup_calls")) : nullptr;
    once();  // the first call validates, plans and loads (compiles on a cold cache)
    const long long setup0 = lt_setup ? lt_setup() : -1;
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) once();
    auto t1 = std::chrono::steady_clock::now();
    const double setup_per_call =
        lt_setup && n ? static_cast<double>(lt_setup() - setup0) / static_cast<double>(n) : -1.0;
    std::printf("%s: %.1f ns per call over %ld calls; cuBLASLt setup calls per call %.2f\n", method.c_str(),
                n ? std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(n) : 0.0, n,
                setup_per_call);
    for (auto bb : bufs) CU_CHECK(cuMemFree(bb));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kspec_host_bench: %s\n", e.what());
    return 1;
  }
}
