// Test probe of math.cuh's device approximations: each thread evaluates one of them at x[i], so a test
// can hold them to a float64 reference over a range (fma_exp2 against exp2; ex2.approx beside it).
#pragma once

#include "common/math.cuh"

namespace kspec {

__global__ void math_probe_exp2_kernel(const float* __restrict__ x, float* __restrict__ fma_out,
                                       float* __restrict__ sfu_out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  fma_out[i] = fma_exp2(x[i]);
  sfu_out[i] = fast_exp2(x[i]);
}

}  // namespace kspec
