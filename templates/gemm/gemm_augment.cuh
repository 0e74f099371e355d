// gemm's ReLU + bias in fp16/bf16 with a small K: the bias as one more column of the product. x' = [x, 1, 0…]
// and W' = [W, b, 0…] (K padded to a multiple of 8), so x'·W'ᵀ = x·Wᵀ + b is summed in fp32 inside the GEMM
// and the plain RELU epilogue takes the sign of that sum (what the backward reads back from y). The copies
// are (rows of x + rows of W) x K' elements, against two passes over y for the bias through C
// (gemm_fill_bias.cuh): H100 bf16, 16384x4096x64 relu+bias, the fill path 0.178 ms, torch's F.linear then
// F.relu 0.148. Any strides in, contiguous [batches, rows, kp] out; a K that is not a multiple of 8 comes out
// 16-byte aligned, which cuBLASLt's fast kernels want.
#pragma once

#include "common/dtype.cuh"
#include "gemm/params.h"

namespace kspec {

// Both copies in one launch (x' then W'): blockDim = (kThreads); any grid (grid-stride loop). A division
// per element: the copies are small beside y.
template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads) gemm_augment_kernel(const AugmentParams p) {
  const long long kp = p.kp, nx = p.x.rows * kp, total = nx + p.w.rows * kp;
  const long long step = static_cast<long long>(gridDim.x) * kThreads;
  for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += step) {
    const bool on_x = i < nx;
    const AugmentOperand& o = on_x ? p.x : p.w;
    const long long j = on_x ? i : i - nx;
    const long long r = j / kp, c = j - r * kp;
    const long long b = r / o.rows_per_batch, rr = r - b * o.rows_per_batch;
    T v;
    if (c < p.k) v = static_cast<const T*>(o.src)[b * o.batch_stride + rr * o.row_stride + c * o.col_stride];
    else if (c == p.k) v = o.last ? static_cast<const T*>(o.last)[rr] : store_as<T>(1.f);
    else v = store_as<T>(0.f);
    static_cast<T*>(o.dst)[j] = v;
  }
}

}  // namespace kspec
