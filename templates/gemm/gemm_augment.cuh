// gemm's ReLU + bias in fp16/bf16 with a small K: the bias as one more column of the product. x' = [x, 1, 0…]
// and W' = [W, b, 0…] (K padded to a multiple of 8), so x'·W'ᵀ = x·Wᵀ + b is summed in fp32 inside the GEMM
// and the plain RELU epilogue takes the sign of that sum (what the backward reads back from y). The copies
// are (rows of x + rows of W) x K' elements, against two passes over y for the bias through C
// (gemm_fill_bias.cuh): H100 bf16, 16384x4096x64 relu+bias, the fill path 0.178 ms, torch's F.linear then
// F.relu 0.148. Any strides in, contiguous [batches, rows, kp] out; a K that is not a multiple of 8 comes out
// 16-byte aligned, which cuBLASLt's fast kernels want.
#pragma once

#include "common/dtype.cuh"

namespace kspec {

// dst: rows x kp, contiguous. Row r of src is batch r / rows_per_batch, row r % rows_per_batch, at
// batch_stride, row_stride and col_stride (elements). Column k is last[r % rows_per_batch] (the bias, on
// the weight's side) or 1 (last == nullptr, on x's side); columns past k are 0. Launch: blockDim =
// (kThreads); any grid (grid-stride loop). A division per element: the copy is small beside y.
template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads)
    gemm_augment_kernel(T* __restrict__ dst, const T* __restrict__ src, const T* __restrict__ last,
                        long long rows, long long rows_per_batch, long long k, long long kp,
                        long long batch_stride, long long row_stride, long long col_stride) {
  const long long total = rows * kp, step = static_cast<long long>(gridDim.x) * kThreads;
  for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += step) {
    const long long r = i / kp, c = i - r * kp;
    const long long b = r / rows_per_batch, rr = r - b * rows_per_batch;
    T v;
    if (c < k) v = src[b * batch_stride + rr * row_stride + c * col_stride];
    else if (c == k) v = last ? last[rr] : store_as<T>(1.f);
    else v = store_as<T>(0.f);
    dst[i] = v;
  }
}

}  // namespace kspec
