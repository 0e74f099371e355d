// y[r, :] = bias for every row: the C operand of gemm's ReLU+bias in 16-bit types. cuBLASLt then computes
// y = relu(x·Wᵀ + 1·C) with the sum in fp32, so ReLU's sign (which the backward reads back from y) is the
// sign of the fp32 pre-activation. With kspec's fused RELU_BIAS path the bf16 gradients at [33,7]x[4097,7]
// were 4e-2 off (issue 33); see bias_through_c in api/ops/gemm/op.cpp for what is and is not known.
#pragma once

#include "common/dtype.cuh"
#include "gemm/params.h"

namespace kspec {

// y: rows x cols, unit column stride, row stride y_row_stride. Launch: blockDim = (kThreads); any grid
// (grid-stride loop).
template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads)
    gemm_fill_bias_kernel(const GemmEpilogueParams prm) {
  T* __restrict__ y = static_cast<T*>(prm.y);
  const T* __restrict__ bias = static_cast<const T*>(prm.bias);
  const long long rows = prm.rows;
  const long long cols = prm.cols;
  const long long y_row_stride = prm.y_row_stride;
  // (row, column) stepped by the grid's stride: no 64-bit division per element
  const long long total = rows * cols, step = static_cast<long long>(gridDim.x) * kThreads;
  const long long first = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  const long long dr = step / cols, dc = step - dr * cols;
  long long r = first / cols, c = first - r * cols;
  for (long long i = first; i < total; i += step) {
    y[r * y_row_stride + c] = bias[c];
    r += dr;
    c += dc;
    if (c >= cols) c -= cols, ++r;
  }
}

}  // namespace kspec
