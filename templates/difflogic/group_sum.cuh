// difflogic GroupSum (api/ops/difflogic/reference.h: difflogic_group_sum_ref, difflogic_packed_group_sum_ref
// are the spec): k groups of m = n / k consecutive columns. First versions, correct before fast; every sum
// in a fixed order (no atomics), so a rerun gives the same bits:
//   difflogic_group_sum_fwd_kernel  one warp per (sample, group), groups fastest: lane l sums columns
//                                   l, l + 32, ... of the group, then a fixed shuffle tree; y = sum / tau.
//                                   x: [batch, n_in]; y: [batch, groups].
//   difflogic_group_sum_bwd_kernel  one thread per (sample, group, column): dx = dy / tau, dy read
//                                   through its strides (0 along the group when expanded from [batch, k]).
//                                   dout (dy): [batch, groups, m]; dx: [batch, n_in] contiguous.
//   difflogic_packed_group_sum_kernel  one thread per (group, sample), samples fastest (the 32 lanes of
//                                   a warp read one word, a broadcast): the count of the sample's set bits
//                                   over the group's m rows. x: words [n_in, words]; y: int32 [batch, groups].
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "difflogic/params.h"
#include "difflogic/word.cuh"

namespace kspec {

template <typename TIn, typename TOut, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_group_sum_fwd_kernel(const DiffLogicParams p) {
  static_assert(kThreads % kWarpSize == 0, "whole warps");
  constexpr int kWarps = kThreads / kWarpSize;
  const TIn* x = static_cast<const TIn*>(p.x);
  TOut* y = static_cast<TOut*>(p.y);
  const long long m = p.n_in / p.groups, total = p.batch * p.groups;
  const int lane = threadIdx.x % kWarpSize;
  for (long long e = blockIdx.x * static_cast<long long>(kWarps) + threadIdx.x / kWarpSize; e < total;
       e += static_cast<long long>(gridDim.x) * kWarps) {
    const long long s = e / p.groups, c = e - s * p.groups;
    const TIn* xs = x + s * p.n_in + c * m;
    float sum = 0.0f;
    for (long long j = lane; j < m; j += kWarpSize) sum += to_float(xs[j]);
    sum = warp_reduce_sum(sum);
    if (lane == 0) y[e] = from_float<TOut>(sum / p.tau);
  }
}

template <typename TIn, typename TOut, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_group_sum_bwd_kernel(const DiffLogicParams p) {
  const TIn* dy = static_cast<const TIn*>(p.dout);
  TOut* dx = static_cast<TOut*>(p.dx);
  const long long m = p.n_in / p.groups, total = p.batch * p.n_in;
  for (long long e = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    const long long s = e / p.n_in, j = e - s * p.n_in, c = j / m;
    dx[e] = from_float<TOut>(to_float(dy[s * p.strides[0] + c * p.strides[1] + (j - c * m) * p.strides[2]]) / p.tau);
  }
}

template <int kWidth, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_packed_group_sum_kernel(const DiffLogicParams p) {
  using W = typename DiffLogicWord<kWidth>::type;
  const W* words = static_cast<const W*>(p.x);
  int* counts = static_cast<int*>(p.y);
  const long long m = p.n_in / p.groups, total = p.groups * p.batch;
  for (long long e = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    const long long c = e / p.batch, s = e - c * p.batch, q = s / kWidth;
    const int bit = static_cast<int>(s - q * kWidth);
    const W* rows = words + c * m * p.words + q;
    int count = 0;
    for (long long j = 0; j < m; ++j) count += static_cast<int>((rows[j * p.words] >> bit) & W(1));
    counts[s * p.groups + c] = count;
  }
}

}  // namespace kspec
