// mHC's post op: the next layer's streams out[k] = H_post[k] f + sum_j R[j, k] x[j] per token, and its
// backward (dx[j] = sum_k R[j, k] dO[k], df = sum_k H_post[k] dO[k], dH_post[k] = <dO[k], f>,
// dR[j, k] = <dO[k], x[j]>, the last two reduced across one block per token in a fixed order). kVec = 8
// (the `vec` tuning axis; D % 8 == 0, every pointer and row 16-byte aligned): each thread takes 8
// consecutive d with 16-byte loads and stores instead of one d with 2-byte ones, so a thread has n + 1
// (forward) or 2n + 1 (backward) 16-byte loads in flight instead of as many 2-byte ones. out, dx and df are
// the same bits either way; dH_post and dR's sums over D are split among the threads differently (each
// thread's elements in d order, then the block's fixed-order reduction: deterministic for a given kVec).
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "mhc/params.h"
#include "mhc/row8.cuh"

namespace kspec {

// grid = (T, ceil(D / (kThreads kVec))): each thread kVec consecutive d of one token, all n output streams.
template <typename T, int N, int D, int kThreads, int kVec = 1>
__global__ void __launch_bounds__(kThreads) mhc_post_fwd_kernel(const MhcPostParams p) {
  static_assert(kVec == 1 || (kVec == 8 && D % 8 == 0), "one element or 8-element groups inside the row");
  __shared__ float hp[N];
  __shared__ float r[N * N];
  const long long t = blockIdx.x;
  if (threadIdx.x < N) hp[threadIdx.x] = __ldg(p.h_post + t * N + threadIdx.x);
  for (int e = threadIdx.x; e < N * N; e += kThreads) r[e] = __ldg(p.r + t * N * N + e);
  __syncthreads();
  const int d = (blockIdx.y * kThreads + threadIdx.x) * kVec;
  if (d >= D) return;
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  if constexpr (kVec == 8) {
    MhcRow8<T> xv[N], fv;
#pragma unroll
    for (int j = 0; j < N; ++j) mhc_load8<T, true>(xv[j], x + (t * N + j) * p.x_row + d, 8);
    mhc_load8<T, true>(fv, static_cast<const T*>(p.f) + t * p.f_row + d, 8);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      MhcRow8<T> o;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float s = hp[k] * to_float(fv.v[e]);
#pragma unroll
        for (int j = 0; j < N; ++j) s += r[j * N + k] * to_float(xv[j].v[e]);
        o.v[e] = store_as<T>(s);
      }
      mhc_store8(out + (t * N + k) * p.out_row + d, o);
    }
  } else {
    float xv[N];
#pragma unroll
    for (int j = 0; j < N; ++j) xv[j] = to_float(x[(t * N + j) * p.x_row + d]);
    const float f = to_float(static_cast<const T*>(p.f)[t * p.f_row + d]);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float s = hp[k] * f;
#pragma unroll
      for (int j = 0; j < N; ++j) s += r[j * N + k] * xv[j];
      out[(t * N + k) * p.out_row + d] = store_as<T>(s);
    }
  }
}

// One element of post.bwd: df and dx[0 .. n) from dO[k], x[k] and f, and its terms of the n + n^2 sums
// (acc[k] += dO[k] f, acc[n + j n + k] += dO[k] x[j]).
template <int N>
__device__ __forceinline__ void mhc_post_bwd_element(const float* hp, const float* r, const float (&go)[N],
                                                     const float (&xv)[N], float f, float (&acc)[N + N * N],
                                                     float& dfv, float (&dxv)[N]) {
  dfv = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    dfv += hp[k] * go[k];
    acc[k] += go[k] * f;
  }
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      s += r[j * N + k] * go[k];
      acc[N + j * N + k] += go[k] * xv[j];
    }
    dxv[j] = s;
  }
}

// One block per token: dx and df elementwise, dH_post and dR as n + n^2 sums over D; kVec consecutive d a
// thread per step.
template <typename T, int N, int D, int kThreads, int kVec = 1>
__global__ void __launch_bounds__(kThreads) mhc_post_bwd_kernel(const MhcPostBwdParams p) {
  static_assert(kVec == 1 || (kVec == 8 && D % 8 == 0), "one element or 8-element groups inside the row");
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
  for (int d = threadIdx.x * kVec; d < D; d += kThreads * kVec) {
    float go[N], xv[N], dfv, dxv[N];
    if constexpr (kVec == 8) {
      // This step's 8 elements of each dO[k], x[k] and f, all loaded before any is used.
      MhcRow8<T> gr[N], xr[N], fr, dfr, dxr[N];
#pragma unroll
      for (int k = 0; k < N; ++k) {
        mhc_load8<T, true>(gr[k], dout + (t * N + k) * p.dout_row + d, 8);
        mhc_load8<T, true>(xr[k], x + (t * N + k) * p.x_row + d, 8);
      }
      mhc_load8<T, true>(fr, fp + d, 8);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
#pragma unroll
        for (int k = 0; k < N; ++k) go[k] = to_float(gr[k].v[e]), xv[k] = to_float(xr[k].v[e]);
        mhc_post_bwd_element<N>(hp, r, go, xv, to_float(fr.v[e]), acc, dfv, dxv);
        dfr.v[e] = store_as<T>(dfv);
#pragma unroll
        for (int j = 0; j < N; ++j) dxr[j].v[e] = store_as<T>(dxv[j]);
      }
      mhc_store8(df + d, dfr);
#pragma unroll
      for (int j = 0; j < N; ++j) mhc_store8(dx + (t * N + j) * p.dx_row + d, dxr[j]);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        go[k] = to_float(dout[(t * N + k) * p.dout_row + d]);
        xv[k] = to_float(x[(t * N + k) * p.x_row + d]);
      }
      mhc_post_bwd_element<N>(hp, r, go, xv, to_float(fp[d]), acc, dfv, dxv);
      df[d] = store_as<T>(dfv);
#pragma unroll
      for (int j = 0; j < N; ++j) dx[(t * N + j) * p.dx_row + d] = store_as<T>(dxv[j]);
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
