// mHC's post op of layer l fused with the pre op of layer l + 1: per token, x_next[k] = H_post[k] f +
// sum_j R[j, k] x[j] is written once and, from registers, fed to the next layer's RMS and projection;
// then H_pre, H_post, R of layer l + 1 and y = sum_i H_pre[i] x_next[i] (mhc_pre_fwd_rows, as
// mhc_pre_fwd_kernel). Unfused, pre(l + 1) reads x_next from memory again: this saves one read of the n
// streams (537 MB at T 16384, n 4, D 4096 bf16). As in mhc_pre_fwd_kernel, kTok tokens per block share
// each load of phi.
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "mhc/mhc_pre.cuh"
#include "mhc/params.h"

namespace kspec {

// Block of kThreads threads per kTok tokens; grid.x = ceil(T / kTok).
template <typename T, int N, int D, int kTMax, bool kHasGamma, int kThreads, int kTok>
__global__ void __launch_bounds__(kThreads) mhc_post_pre_fwd_kernel(const MhcPostPreParams p) {
  using Rows = MhcRows<N, false>;
  constexpr int kM = Rows::kM, kND = N * D, kK = kM + 1, kNN = N * N;
  static_assert(kTok >= 1 && kThreads >= kTok * kM && kThreads >= kTok * kNN,
                "a row of h and a Sinkhorn element per thread for each token of the block");
  __shared__ float scratch[RowReduceScratch<kThreads, kThreads, kTok * kK>::value + 1];
  __shared__ float hp[kTok][N];
  __shared__ float r[kTok][kNN];
  const long long t0 = static_cast<long long>(blockIdx.x) * kTok;
  const int ntok = static_cast<int>(p.pre.T - t0 < kTok ? p.pre.T - t0 : kTok);
  // Tokens past T (a partial last block) take token t0's inputs again and write nothing.
  for (int e = threadIdx.x; e < kTok * kNN; e += kThreads) {
    const int j = e / kNN;
    r[j][e % kNN] = __ldg(p.r + (t0 + (j < ntok ? j : 0)) * kNN + e % kNN);
  }
  for (int e = threadIdx.x; e < kTok * N; e += kThreads) {
    const int j = e / N;
    hp[j][e % N] = __ldg(p.h_post + (t0 + (j < ntok ? j : 0)) * N + e % N);
  }
  __syncthreads();
  const T* x = static_cast<const T*>(p.x);
  const T* f = static_cast<const T*>(p.f);
  T* x_next = static_cast<T*>(p.x_next);
  const long long xn_row = p.pre.x_row;

  // acc[j * kK] = sum v^2 of token t0 + j, acc[j * kK + 1 + q] = its m[q], v = x_next as stored (what
  // pre(l + 1) would read).
  float acc[kTok * kK];
#pragma unroll
  for (int q = 0; q < kTok * kK; ++q) acc[q] = 0.f;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float xv[kTok][N], fv[kTok];
#pragma unroll
    for (int j = 0; j < kTok; ++j) {
      const long long tj = t0 + (j < ntok ? j : 0);
#pragma unroll
      for (int i = 0; i < N; ++i) xv[j][i] = to_float(x[(tj * N + i) * p.x_row + d]);
      fv[j] = to_float(f[tj * p.f_row + d]);
    }
    // Not unrolled: unrolled, ptxas hoists the n columns' phi loads (n x M registers) and spills.
#pragma unroll 1
    for (int k = 0; k < N; ++k) {
      const int c = k * D + d;
      const float gm = kHasGamma ? __ldg(p.pre.gamma + c) : 1.f;
      float ph[kM];
#pragma unroll
      for (int q = 0; q < kM; ++q) ph[q] = __ldg(p.pre.phi + static_cast<long long>(q) * kND + c);
#pragma unroll
      for (int j = 0; j < kTok; ++j) {
        float s = hp[j][k] * fv[j];
#pragma unroll
        for (int i = 0; i < N; ++i) s += r[j][i * N + k] * xv[j][i];
        const T o = store_as<T>(s);
        if (j < ntok) x_next[((t0 + j) * N + k) * xn_row + d] = o;
        const float v = to_float(o);
        const float u = kHasGamma ? v * gm : v;
        acc[j * kK] += v * v;
#pragma unroll
        for (int q = 0; q < kM; ++q) acc[j * kK + 1 + q] += u * ph[q];
      }
    }
  }
  row_group_reduce_sum<kThreads, kThreads, kTok * kK>(acc, scratch);
  // Every thread holds the totals; one publishes them (a register array takes no dynamic index).
  __shared__ float tot[kTok * kK];
  if (threadIdx.x == 0) {
#pragma unroll
    for (int q = 0; q < kTok * kK; ++q) tot[q] = acc[q];
  }
  __syncthreads();
  mhc_pre_fwd_rows<T, N, D, kTMax, false, kThreads, kTok>(p.pre, t0, ntok, tot);
}

}  // namespace kspec
