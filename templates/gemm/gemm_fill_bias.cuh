// y[r, :] = bias for every row: the C operand of gemm's ReLU+bias in 16-bit types. cuBLASLt then computes
// y = relu(x·Wᵀ + 1·C) with the sum in fp32, so ReLU's sign (which the backward reads back from y) is the
// sign of the fp32 pre-activation. Its fused RELU_BIAS epilogue adds the bias to the output rounded to
// bf16/fp16 instead, and flipped the sign wherever x·Wᵀ ≈ -b (bf16 [33,7]x[4097,7]: dx 4e-2 off).
#pragma once

#include "common/dtype.cuh"

namespace kspec {

// y: rows x cols, unit column stride, row stride y_row_stride. Launch: blockDim = (kThreads); any grid
// (grid-stride loop).
template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads)
    gemm_fill_bias_kernel(T* __restrict__ y, const T* __restrict__ bias, long long rows, long long cols,
                          long long y_row_stride) {
  const long long total = rows * cols;
  for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    const long long r = i / cols, c = i - r * cols;
    y[r * y_row_stride + c] = bias[c];
  }
}

}  // namespace kspec
