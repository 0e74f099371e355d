// What the mLSTM kernels share: the log-sigmoid of the forget gate, a block-wide sum, and the debug
// poisoning of shared memory.
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"

namespace kspec {

// log(sigmoid(x)) as min(x, 0) - log1p(e^-|x|), in fp32 for every input dtype (gates are converted at
// the load): no overflow for any x, and full relative accuracy at both ends, where log(sigmoid(x))
// loses everything (x > 17: sigmoid rounds to 1) or overflows (e^-x for x < -88).
__device__ __forceinline__ float mlstm_log_sigmoid(float x) { return fminf(x, 0.0f) - log1pf(expf(-fabsf(x))); }

// The sum of v over the block's kThreads threads, returned to every thread. `scratch`: kThreads / 32
// floats of shared memory. Starts and ends with a barrier, so back-to-back calls may share scratch.
template <int kThreads>
__device__ __forceinline__ float mlstm_block_sum(float v, float* scratch) {
  static_assert(kThreads % kWarpSize == 0, "whole warps");
  constexpr int kWarps = kThreads / kWarpSize;
  v = warp_reduce_sum(v);
  __syncthreads();
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// Compiled with -DKSPEC_MLSTM_POISON_SMEM=1 (tests/cpp/test_mlstm.cpp, accumulators_initialized): the
// first n floats of dynamic shared memory start as NaN, so a read before a write reaches the outputs.
// Otherwise nothing.
template <int kThreads>
__device__ __forceinline__ void mlstm_poison_smem(float* smem, int n) {
#ifdef KSPEC_MLSTM_POISON_SMEM
  for (int j = threadIdx.x; j < n; j += kThreads) smem[j] = __int_as_float(0x7fffffff);
  __syncthreads();
#else
  (void)smem;
  (void)n;
#endif
}

}  // namespace kspec
