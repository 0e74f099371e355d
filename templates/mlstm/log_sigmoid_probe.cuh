// Test probe of mlstm_log_sigmoid (common.cuh) as the kernels use it: a gate of type T converted to fp32,
// then the log-sigmoid, so a test can hold it to float64 over x in [-40, 40] for every input dtype.
#pragma once

#include "mlstm/common.cuh"

namespace kspec {

template <typename T>
__global__ void mlstm_log_sigmoid_probe_kernel(const T* __restrict__ x, float* __restrict__ out, int n) {
  const int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (j < n) out[j] = mlstm_log_sigmoid(to_float(x[j]));
}

}  // namespace kspec
