// math.cuh's device approximations against float64: fma_exp2 (2^x on the FMA pipe, the selective scan's
// local pass) must be as close to 2^x as the SFU's ex2.approx it stands in for.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "api/src/device_data.h"
#include "api/src/kernels.h"
#include "jit/driver.h"
#include "test_helpers.h"

namespace {

kspec::jit::KernelSpec probe_spec(const std::string& arch) {
  kspec::jit::KernelSpec s;
  s.header = "common/math_probe.cuh";
  s.kernel = "kspec::math_probe_exp2_kernel";
  s.arch = kspec::jit::resolve_arch(arch);
  return s;
}

TEST(Math, ProbeCompilesForEveryTunedArch) {
  for (const char* arch : {"sm_80", "sm_90"}) {
    kspec::Obtained ob = kspec::obtain_binary(probe_spec(arch));
    EXPECT_GT(ob.entry->binary.size(), 0u) << arch;
    EXPECT_EQ(ob.entry->resources.spill_bytes, 0) << arch;
  }
}

TEST(GpuMath, FmaExp2MatchesExp2AsCloselyAsTheSfu) {
  KSPEC_REQUIRE_GPU();
  // Every 1/64 over the clamp's range and beyond it, the decays' usual range densely, both ends' edges.
  std::vector<float> x;
  for (int k = -140 * 64; k <= 140 * 64; ++k) x.push_back(static_cast<float>(k) / 64.0f);
  for (int k = 0; k < 100000; ++k) x.push_back(-20.0f * static_cast<float>(k) / 100000.0f);
  for (float e : {-126.0f, -125.999f, -125.5f, -125.49f, -0.5f, 0.5f, 126.5f, 127.0f, 127.5f}) x.push_back(e);
  const int n = static_cast<int>(x.size());
  kspec::jit::ContextGuard ctx(0);
  kspec::LoadedKernel& k = kspec::load_kernel(probe_spec(kspec::device_arch(0)), 0);
  kspec::DeviceBuffer dx(n * sizeof(float)), dfma(n * sizeof(float)), dsfu(n * sizeof(float));
  CU_CHECK(cuMemcpyHtoD(dx.ptr, x.data(), n * sizeof(float)));
  void* args[] = {&dx.ptr, &dfma.ptr, &dsfu.ptr, const_cast<int*>(&n)};
  CU_CHECK(cuLaunchKernel(k.fn, static_cast<unsigned>((n + 255) / 256), 1, 1, 256, 1, 1, 0, nullptr, args, nullptr));
  CU_CHECK(cuCtxSynchronize());
  std::vector<float> fma(n), sfu(n);
  CU_CHECK(cuMemcpyDtoH(fma.data(), dfma.ptr, n * sizeof(float)));
  CU_CHECK(cuMemcpyDtoH(sfu.data(), dsfu.ptr, n * sizeof(float)));
  double worst_fma = 0, worst_sfu = 0;
  for (int i = 0; i < n; ++i) {
    const double xi = std::min(std::max(static_cast<double>(x[i]), -126.0), 127.0);  // fma_exp2's clamp
    const double ref = std::exp2(xi);
    ASSERT_TRUE(std::isfinite(fma[i]) && fma[i] > 0) << "fma_exp2(" << x[i] << ") = " << fma[i];
    worst_fma = std::max(worst_fma, std::abs(fma[i] - ref) / ref);
    if (x[i] > -126.0f && x[i] <= 127.0f) worst_sfu = std::max(worst_sfu, std::abs(sfu[i] - ref) / ref);
  }
  EXPECT_LT(worst_fma, 2.5e-7) << "SFU's worst on the same points: " << worst_sfu;
  EXPECT_LT(worst_fma, 2.0 * worst_sfu + 1e-7);
  std::printf("fma_exp2: worst relative error %.2e over %d points (ex2.approx: %.2e)\n", worst_fma, n, worst_sfu);
}

}  // namespace
