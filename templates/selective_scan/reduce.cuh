// The selective scan backward's helper kernels, shared by the warp-scan (warp_scan.cuh) and the
// sequential (sequential.cuh) backward: zeroing the variable dB/dC accumulators, and pass 2.
#pragma once

#include "common/dtype.cuh"

namespace kspec {

// Zeroes the variable dB/dC accumulators where they are not kept zero between calls (a workspace inside a
// CUDA graph capture; elsewhere pass 2 leaves them zero). Launch: any 1-D grid; n floats each (0 when fixed).
__global__ void selective_scan_bwd_zero_kernel(float* __restrict__ a, long long na, float* __restrict__ b,
                                               long long nb) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < na; i += stride) a[i] = 0.0f;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < nb; i += stride) b[i] = 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Backward, pass 2 of 2: sums the per-channel partials over the batch in order b = 0, 1, ... (dA,
// fixed dB/dC per (d, n); dD, ddelta_bias per d) and rounds the variable dB/dC accumulators to their
// dtypes, writing zeros back: the next backward on the stream finds them zero without a zeroing launch of
// its own (op.cpp, VarAccumulators). Launch: 1-D, any grid (grid-stride loops), no shared memory.
// ---------------------------------------------------------------------------------------------
template <typename TB, typename TC, int kDstate, bool kVarB, bool kVarC, bool kHasD, bool kHasDeltaBias>
__global__ void selective_scan_bwd_reduce_kernel(const float* __restrict__ partials,
                                                 float* __restrict__ dB_acc,
                                                 float* __restrict__ dC_acc, float* __restrict__ dA,
                                                 TB* __restrict__ dB, TC* __restrict__ dC, float* __restrict__ dD,
                                                 float* __restrict__ ddelta_bias, int batch, int dim,
                                                 long long var_elems) {
  constexpr int N = kDstate;
  constexpr int kStride = 3 * N + 2;
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (long long i = first; i < static_cast<long long>(dim) * N; i += step) {
    const long long d = i / N, n = i % N;
    float sa = 0.0f, sb = 0.0f, sc = 0.0f;
    for (int b = 0; b < batch; ++b) {
      const float* part = partials + (static_cast<long long>(b) * dim + d) * kStride;
      sa += part[n];
      sb += part[N + n];
      sc += part[2 * N + n];
    }
    dA[i] = sa;
    if constexpr (!kVarB) dB[i] = from_float<TB>(sb);
    if constexpr (!kVarC) dC[i] = from_float<TC>(sc);
  }
  for (long long d = first; d < dim; d += step) {
    float sd = 0.0f, sbias = 0.0f;
    for (int b = 0; b < batch; ++b) {
      const float* part = partials + (static_cast<long long>(b) * dim + d) * kStride;
      sd += part[3 * N];
      sbias += part[3 * N + 1];
    }
    if constexpr (kHasD) dD[d] = sd;
    if constexpr (kHasDeltaBias) ddelta_bias[d] = sbias;
  }
  for (long long i = first; i < var_elems; i += step) {
    if constexpr (kVarB) {
      dB[i] = from_float<TB>(dB_acc[i]);
      dB_acc[i] = 0.0f;
    }
    if constexpr (kVarC) {
      dC[i] = from_float<TC>(dC_acc[i]);
      dC_acc[i] = 0.0f;
    }
  }
}

}  // namespace kspec
