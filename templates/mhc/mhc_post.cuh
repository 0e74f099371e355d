// mHC's post op: the next layer's streams out[k] = H_post[k] f + sum_j R[j, k] x[j] per token, and its
// backward (dx[j] = sum_k R[j, k] dO[k], df = sum_k H_post[k] dO[k], dH_post[k] = <dO[k], f>,
// dR[j, k] = <dO[k], x[j]>, the last two reduced across one block per token in a fixed order).
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "mhc/params.h"

namespace kspec {

// grid = (T, ceil(D / kThreads)): each thread one d of one token, all n output streams.
template <typename T, int N, int D, int kThreads>
__global__ void __launch_bounds__(kThreads) mhc_post_fwd_kernel(const MhcPostParams p) {
  __shared__ float hp[N];
  __shared__ float r[N * N];
  const long long t = blockIdx.x;
  if (threadIdx.x < N) hp[threadIdx.x] = __ldg(p.h_post + t * N + threadIdx.x);
  for (int e = threadIdx.x; e < N * N; e += kThreads) r[e] = __ldg(p.r + t * N * N + e);
  __syncthreads();
  const int d = blockIdx.y * kThreads + threadIdx.x;
  if (d >= D) return;
  const T* x = static_cast<const T*>(p.x);
  float xv[N];
#pragma unroll
  for (int j = 0; j < N; ++j) xv[j] = to_float(x[(t * N + j) * p.x_row + d]);
  const float f = to_float(static_cast<const T*>(p.f)[t * p.f_row + d]);
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float s = hp[k] * f;
#pragma unroll
    for (int j = 0; j < N; ++j) s += r[j * N + k] * xv[j];
    out[(t * N + k) * p.out_row + d] = store_as<T>(s);
  }
}

// One block per token: dx and df elementwise, dH_post and dR as n + n^2 sums over D.
template <typename T, int N, int D, int kThreads>
__global__ void __launch_bounds__(kThreads) mhc_post_bwd_kernel(const MhcPostBwdParams p) {
  constexpr int kK = N + N * N;
  __shared__ float scratch[RowReduceScratch<kThreads, kThreads, kK>::value + 1];
  __shared__ float hp[N];
  __shared__ float r[N * N];
  const long long t = blockIdx.x;
  if (threadIdx.x < N) hp[threadIdx.x] = __ldg(p.h_post + t * N + threadIdx.x);
  for (int e = threadIdx.x; e < N * N; e += kThreads) r[e] = __ldg(p.r + t * N * N + e);
  __syncthreads();
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  const T* fp = static_cast<const T*>(p.f) + t * p.f_row;
  T* dx = static_cast<T*>(p.dx);
  T* df = static_cast<T*>(p.df) + t * p.df_row;
  // acc[k] = <dO[k], f>, acc[n + j n + k] = <dO[k], x[j]>.
  float acc[kK];
#pragma unroll
  for (int q = 0; q < kK; ++q) acc[q] = 0.f;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float go[N], xv[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      go[k] = to_float(dout[(t * N + k) * p.dout_row + d]);
      xv[k] = to_float(x[(t * N + k) * p.x_row + d]);
    }
    const float f = to_float(fp[d]);
    float dfv = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      dfv += hp[k] * go[k];
      acc[k] += go[k] * f;
    }
    df[d] = store_as<T>(dfv);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        s += r[j * N + k] * go[k];
        acc[N + j * N + k] += go[k] * xv[j];
      }
      dx[(t * N + j) * p.dx_row + d] = store_as<T>(s);
    }
  }
  row_group_reduce_sum<kThreads, kThreads, kK>(acc, scratch);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) p.dh_post[t * N + k] = acc[k];
#pragma unroll
    for (int q = 0; q < N * N; ++q) p.dr[t * N * N + q] = acc[N + q];
  }
}

}  // namespace kspec
