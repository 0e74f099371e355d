// mHC's pre op: per token, inv = 1/sqrt(mean(v^2) + eps_rms), m = (v * gamma) phi^T, h = inv alpha_s m + b,
// H_pre = sigma(h[0:n]) + eps_pre, H_post = 2 sigma(h[n:2n]), R = Sinkhorn-Knopp(h[2n:]), and the sublayer
// input y = sum_i H_pre[i] x[i]; and its exact backward. First correct version: one block per token,
// the M + 1 dot products over nD kept per thread and reduced across the block in a fixed order; sums
// over tokens (dphi, dgamma, dbias, dalpha) go part by part through a workspace, never float atomics,
// so results are bitwise reproducible for a given config.
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "mhc/params.h"
#include "mhc/sinkhorn.cuh"

namespace kspec {

__device__ __forceinline__ float mhc_sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

template <int N, bool kPreOnly>
struct MhcRows {
  static constexpr int kM = kPreOnly ? N : N * N + 2 * N;  // projection rows
  static constexpr int kA = kPreOnly ? 1 : 3;              // alphas
  static __device__ __forceinline__ int alpha_of(int r) { return r < N ? 0 : r < 2 * N ? 1 : 2; }
};

// Shared memory of the pre forward's second half (mhc_pre_finish, mhc_pre_y).
template <int N, int kTMax, bool kPreOnly>
struct MhcPreFinishSmem {
  float hs[MhcRows<N, kPreOnly>::kM];
  float h_pre[N];
  typename MhcSinkhorn<N, kTMax>::Smem sk;
};

// The pre forward of token t once acc (acc[0] = sum v^2, acc[1 + r] = m[r]) is reduced across the block:
// writes inv, h, H_pre, H_post, R and leaves H_pre in sm.h_pre for mhc_pre_y. Ends with every thread
// past a barrier.
template <int N, int kTMax, bool kPreOnly, int kK>
__device__ __forceinline__ void mhc_pre_finish(const MhcPreParams& p, long long t, const float (&acc)[kK],
                                               MhcPreFinishSmem<N, kTMax, kPreOnly>& sm) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = kK - 1;
  static_assert(kK == kM + 1, "acc holds sum v^2 and the M rows");
  const float inv = rsqrtf(acc[0] / static_cast<float>(kND) + p.eps_rms);
  if (threadIdx.x == 0) p.inv[t] = inv;
  if (threadIdx.x < kM) {
    const int r = threadIdx.x;
    float m = 0.f;
#pragma unroll
    for (int q = 0; q < kM; ++q) m = q == r ? acc[1 + q] : m;  // a register array: no dynamic index
    const float h = inv * __ldg(p.alpha + Rows::alpha_of(r)) * m + __ldg(p.bias + r);
    sm.hs[r] = h;
    p.h[t * kM + r] = h;
    if (r < N) {
      sm.h_pre[r] = mhc_sigmoid(h) + p.eps_pre;
      p.h_pre[t * N + r] = sm.h_pre[r];
    } else if (r < 2 * N) {
      p.h_post[t * N + r - N] = 2.f * mhc_sigmoid(h);
    }
  }
  __syncthreads();
  if constexpr (!kPreOnly) {
    using SK = MhcSinkhorn<N, kTMax>;
    const float* rr = SK::forward(sm.hs + 2 * N, p.eps_sk, sm.sk, false);
    if (threadIdx.x < N * N) p.r[t * N * N + threadIdx.x] = rr[threadIdx.x];
  }
}

// y = sum_i H_pre[i] x[i] of token t, reading x again (plain loads: in post_pre, x is what this block
// has just written).
template <typename T, int N, int D, int kThreads>
__device__ __forceinline__ void mhc_pre_y(const MhcPreParams& p, long long t, const float* h_pre) {
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y) + t * p.y_row;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) s += h_pre[i] * to_float(x[(t * N + i) * p.x_row + d]);
    y[d] = store_as<T>(s);
  }
}

// Block of kThreads threads per token; grid.x = T.
template <typename T, int N, int D, int kTMax, bool kHasGamma, bool kPreOnly, int kThreads>
__global__ void __launch_bounds__(kThreads) mhc_pre_fwd_kernel(const MhcPreParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = N * D, kK = kM + 1;
  static_assert(kThreads >= kM && kThreads >= N * N, "a row of h and a Sinkhorn element per thread");
  __shared__ float scratch[RowReduceScratch<kThreads, kThreads, kK>::value + 1];
  __shared__ MhcPreFinishSmem<N, kTMax, kPreOnly> sm;
  const long long t = blockIdx.x;
  const T* x = static_cast<const T*>(p.x);

  // acc[0] = sum v^2, acc[1 + r] = m[r].
  float acc[kK];
#pragma unroll
  for (int r = 0; r < kK; ++r) acc[r] = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const T* xr = x + (t * N + i) * p.x_row;
    for (int d = threadIdx.x; d < D; d += kThreads) {
      const float v = to_float(xr[d]);
      const int c = i * D + d;
      const float u = kHasGamma ? v * __ldg(p.gamma + c) : v;
      acc[0] += v * v;
#pragma unroll
      for (int r = 0; r < kM; ++r) acc[1 + r] += u * __ldg(p.phi + static_cast<long long>(r) * kND + c);
    }
  }
  row_group_reduce_sum<kThreads, kThreads, kK>(acc, scratch);
  mhc_pre_finish<N, kTMax, kPreOnly>(p, t, acc, sm);
  mhc_pre_y<T, N, D, kThreads>(p, t, sm.h_pre);
}

// Backward, per token: g = dL/dh (the <dy, x[i]> and m reduced across the block; the Sinkhorn backward
// on chip), then dx = du * gamma - dinv inv^3 / nD * v + H_pre[i] dy (+ dx_post), du = dm phi.
// Writes g, dm and inv * sum_s g m to the workspace for the sums over tokens.
template <typename T, int N, int D, int kTMax, bool kHasGamma, bool kPreOnly, bool kHasDxPost, int kThreads>
__global__ void __launch_bounds__(kThreads) mhc_pre_bwd_token_kernel(const MhcPreBwdParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  using SK = MhcSinkhorn<N, kTMax>;
  constexpr int kM = Rows::kM, kND = N * D, kK = N + kM;
  static_assert(kThreads >= kM && kThreads >= N * N, "a row of h per thread");
  __shared__ float scratch[RowReduceScratch<kThreads, kThreads, kK>::value + 1];
  __shared__ float g[kM];
  __shared__ float dm[kM];
  __shared__ float h_pre[N];
  __shared__ float dinv_s;
  __shared__ typename SK::Smem sk;
  const long long t = blockIdx.x;
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy) + t * p.dy_row;

  // acc[i] = <dy, x[i]> (i < n), acc[n + r] = m[r].
  float acc[kK];
#pragma unroll
  for (int r = 0; r < kK; ++r) acc[r] = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const T* xr = x + (t * N + i) * p.x_row;
    for (int d = threadIdx.x; d < D; d += kThreads) {
      const float v = to_float(xr[d]);
      const int c = i * D + d;
      const float u = kHasGamma ? v * __ldg(p.gamma + c) : v;
      acc[i] += v * to_float(dy[d]);
#pragma unroll
      for (int r = 0; r < kM; ++r) acc[N + r] += u * __ldg(p.phi + static_cast<long long>(r) * kND + c);
    }
  }
  row_group_reduce_sum<kThreads, kThreads, kK>(acc, scratch);
  const float inv = __ldg(p.inv + t);
  const int e = threadIdx.x;
  if (e < kM) {
    const float h_e = __ldg(p.h + t * kM + e);
    const float sg = mhc_sigmoid(h_e);
    if (e < N) {
      float dyx = 0.f;
#pragma unroll
      for (int q = 0; q < N; ++q) dyx = q == e ? acc[q] : dyx;
      const float up = dyx + (p.dh_pre ? __ldg(p.dh_pre + t * N + e) : 0.f);
      g[e] = up * sg * (1.f - sg);
      h_pre[e] = sg + p.eps_pre;
    } else if (e < 2 * N) {
      g[e] = p.dh_post ? 2.f * __ldg(p.dh_post + t * N + e - N) * sg * (1.f - sg) : 0.f;
    } else {
      g[e] = p.dr ? __ldg(p.dr + t * N * N + e - 2 * N) : 0.f;  // dR, turned into dZ below
    }
  }
  __syncthreads();
  if constexpr (!kPreOnly) {
    if (p.dr) {
      __shared__ float z[N * N];
      if (e < N * N) z[e] = __ldg(p.h + t * kM + 2 * N + e);
      __syncthreads();
      SK::forward(z, p.eps_sk, sk, true);
      SK::backward(g + 2 * N, p.eps_sk, sk);
    }
  }
  if (e < kM) {
    const float a = __ldg(p.alpha + Rows::alpha_of(e));
    dm[e] = inv * a * g[e];
    p.ws_g[t * kM + e] = g[e];
    p.ws_dm[t * kM + e] = dm[e];
  }
  __syncthreads();
  if (e == 0) {
    // Fixed-order sums over the M rows: dinv = sum alpha_s g m, and inv * sum_{rows of s} g m.
    float dinv = 0.f, ga[3] = {0.f, 0.f, 0.f};
    for (int r = 0; r < kM; ++r) {
      float m = 0.f;
#pragma unroll
      for (int q = 0; q < kM; ++q) m = q == r ? acc[N + q] : m;
      const float gm = g[r] * m;
      dinv += __ldg(p.alpha + Rows::alpha_of(r)) * gm;
      ga[Rows::alpha_of(r)] += gm;
    }
    dinv_s = dinv;
#pragma unroll
    for (int s = 0; s < Rows::kA; ++s) p.ws_ga[t * 3 + s] = inv * ga[s];
  }
  __syncthreads();
  const float c_v = dinv_s * inv * inv * inv / static_cast<float>(kND);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const T* xr = x + (t * N + i) * p.x_row;
    T* dxr = static_cast<T*>(p.dx) + (t * N + i) * p.dx_row;
    for (int d = threadIdx.x; d < D; d += kThreads) {
      const int c = i * D + d;
      float du = 0.f;
#pragma unroll
      for (int r = 0; r < kM; ++r) du += dm[r] * __ldg(p.phi + static_cast<long long>(r) * kND + c);
      const float v = to_float(xr[d]);
      float dv = (kHasGamma ? du * __ldg(p.gamma + c) : du) - c_v * v + h_pre[i] * to_float(dy[d]);
      if constexpr (kHasDxPost) dv += to_float(static_cast<const T*>(p.dx_post)[(t * N + i) * p.dx_post_row + d]);
      dxr[d] = store_as<T>(dv);
    }
  }
}

// Sums over tokens, part by part: block (bx, part) takes kThreads columns c of nD and the tokens
// [part * tokens_per_part, ...), in order: dphi[r, c] = sum_t dm[t, r] u[t, c] and
// dgamma[c] = sum_t (dm[t] phi[:, c]) v[t, c]; block (0, part) also sums g and inv g m (dbias, dalpha).
// Writes ws_part; mhc_pre_bwd_reduce_kernel adds the parts in order.
template <typename T, int N, int D, bool kHasGamma, bool kPreOnly, int kThreads>
__global__ void __launch_bounds__(kThreads) mhc_pre_bwd_columns_kernel(const MhcPreBwdParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = N * D;
  const int part = blockIdx.y;
  const long long t0 = static_cast<long long>(part) * p.tokens_per_part;
  const long long t1 = t0 + p.tokens_per_part < p.T ? t0 + p.tokens_per_part : p.T;
  const T* x = static_cast<const T*>(p.x);
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c < kND) {
    const int i = c / D, d = c % D;
    const float gam = kHasGamma ? __ldg(p.gamma + c) : 1.f;
    float dphi[kM];
#pragma unroll
    for (int r = 0; r < kM; ++r) dphi[r] = 0.f;
    float dgam = 0.f;
    for (long long t = t0; t < t1; ++t) {
      const float v = to_float(x[(t * N + i) * p.x_row + d]);
      float du = 0.f;
#pragma unroll
      for (int r = 0; r < kM; ++r) {
        const float dmr = __ldg(p.ws_dm + t * kM + r);
        dphi[r] += dmr * v * gam;
        du += dmr * __ldg(p.phi + static_cast<long long>(r) * kND + c);
      }
      dgam += du * v;
    }
    float* out = p.ws_part + static_cast<long long>(part) * (kM + 1) * kND;
#pragma unroll
    for (int r = 0; r < kM; ++r) out[static_cast<long long>(r) * kND + c] = dphi[r];
    out[static_cast<long long>(kM) * kND + c] = dgam;
  }
  if (blockIdx.x == 0 && threadIdx.x < kM + Rows::kA) {
    const int r = threadIdx.x;
    float s = 0.f;
    for (long long t = t0; t < t1; ++t) s += r < kM ? __ldg(p.ws_g + t * kM + r) : __ldg(p.ws_ga + t * 3 + r - kM);
    p.ws_part[static_cast<long long>(p.parts) * (kM + 1) * kND + static_cast<long long>(part) * (kM + 3) + r] = s;
  }
}

// The parts' sums added in part order: one thread per element of dphi, dgamma, dbias, dalpha.
template <int N, int D, bool kHasGamma, bool kPreOnly, int kThreads>
__global__ void __launch_bounds__(kThreads) mhc_pre_bwd_reduce_kernel(const MhcPreBwdParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = N * D;
  constexpr long long kCols = static_cast<long long>(kM + 1) * kND;
  const long long e = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  if (e < kCols) {
    if (e >= static_cast<long long>(kM) * kND && !kHasGamma) return;
    float s = 0.f;
    for (int q = 0; q < p.parts; ++q) s += p.ws_part[q * kCols + e];
    if (e < static_cast<long long>(kM) * kND) p.dphi[e] = s;
    else p.dgamma[e - static_cast<long long>(kM) * kND] = s;
  } else if (e < kCols + kM + Rows::kA) {
    const int r = static_cast<int>(e - kCols);
    const float* sums = p.ws_part + p.parts * kCols;
    float s = 0.f;
    for (int q = 0; q < p.parts; ++q) s += sums[q * (kM + 3) + r];
    if (r < kM) p.dbias[r] = s;
    else p.dalpha[r - kM] = s;
  }
}

}  // namespace kspec
