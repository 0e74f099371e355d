// Sinkhorn-Knopp for mHC's residual mixing, on one n x n matrix per thread block: thread e < n*n owns
// element (j, k) = (e / n, e % n), the row and column sums read from shared memory in a fixed order (so
// every run gives the same bits). The backward recomputes the iterates on chip (paper section 4.3.1)
// and differentiates each step: no implicit differentiation, no stored history in global memory.
//   A = softmax_k(Z) + eps;  A /= (sum_j A + eps);  t_max - 1 times: A /= (sum_k A + eps); A /= (sum_j A + eps)
#pragma once

#include "mhc/params.h"

namespace kspec {

// Largest t_max: the backward keeps 2 t_max + 1 iterates of n*n floats in shared memory (33 KB at n 8).
constexpr int kMhcMaxTMax = 64;

template <int N, int kTMax>
struct MhcSinkhorn {
  static constexpr int kNN = N * N;
  static constexpr int kSteps = 2 * kTMax - 1;  // normalizations; odd steps divide columns (sum over j)

  // Shared memory: P = softmax, then iterates 0..kSteps (0: P + eps). The forward alone keeps two.
  struct Smem {
    float p[kNN];
    float iter[kSteps + 1][kNN];
  };

  // Step s's divisor for element e: eps + the sum of X = iterate s - 1 along the step's axis.
  static __device__ __forceinline__ float divisor(const float* x, int e, int s, float eps) {
    const int j = e / N, k = e % N;
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < N; ++q) sum += (s & 1) ? x[q * N + k] : x[j * N + q];
    return sum + eps;
  }

  // R from the logits z (shared or global, n*n floats) into sm.iter[kSteps] (keep_all: every iterate,
  // for the backward; else two buffers in turn, and R is at iter[kSteps & 1]). Every thread of the
  // block must call it; it ends with a barrier. Returns a pointer to R.
  static __device__ const float* forward(const float* z, float eps, Smem& sm, bool keep_all) {
    return forward(z, eps, sm, keep_all, static_cast<int>(threadIdx.x));
  }
  // The same with the calling thread's element e of the matrix given (e >= n*n: the thread only meets the
  // barriers), so that one block can run several matrices side by side, each with its own Smem.
  static __device__ const float* forward(const float* z, float eps, Smem& sm, bool keep_all, int e) {
    if (e < kNN) {
      const int j = e / N;
      float mx = z[j * N];
#pragma unroll
      for (int q = 1; q < N; ++q) mx = fmaxf(mx, z[j * N + q]);
      float sum = 0.f;
#pragma unroll
      for (int q = 0; q < N; ++q) sum += expf(z[j * N + q] - mx);
      const float pv = expf(z[e] - mx) / sum;
      sm.p[e] = pv;
      sm.iter[0][e] = pv + eps;
    }
    for (int s = 1; s <= kSteps; ++s) {
      __syncthreads();
      const float* x = keep_all ? sm.iter[s - 1] : sm.iter[(s - 1) & 1];
      float* y = keep_all ? sm.iter[s] : sm.iter[s & 1];
      if (e < kNN) y[e] = x[e] / divisor(x, e, s, eps);
    }
    __syncthreads();
    return keep_all ? sm.iter[kSteps] : sm.iter[kSteps & 1];
  }

  // The forward on one warp, no shared memory and no barrier: lane e < n*n holds z[e] on entry and gets R's
  // element e (lanes past n*n compute a copy of element 0; every lane of the warp must call it). The same
  // operations in the same order as forward(), the row and column sums gathered by shuffles, so the bits are
  // forward()'s. n*n <= 32.
  // iter (optional, the warp's own [kSteps + 1][n*n]): every iterate kept, for backward_warp; *p: the lane's
  // softmax element.
  static __device__ __forceinline__ float forward_warp(float z, float eps, int lane, float* iter = nullptr,
                                                       float* p = nullptr) {
    static_assert(kNN <= 32, "one element a lane");
    const int e = lane < kNN ? lane : 0, j = e / N, k = e % N;
    float mx = __shfl_sync(0xffffffffu, z, j * N);
#pragma unroll
    for (int q = 1; q < N; ++q) mx = fmaxf(mx, __shfl_sync(0xffffffffu, z, j * N + q));
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < N; ++q) sum += expf(__shfl_sync(0xffffffffu, z, j * N + q) - mx);
    const float pv = expf(__shfl_sync(0xffffffffu, z, e) - mx) / sum;
    if (p) *p = pv;
    float x = pv + eps;
    if (iter && lane < kNN) iter[e] = x;
#pragma unroll 1
    for (int s = 1; s <= kSteps; ++s) {
      float div = 0.f;
#pragma unroll
      for (int q = 0; q < N; ++q) div += __shfl_sync(0xffffffffu, x, (s & 1) ? q * N + k : j * N + q);
      x = x / (div + eps);
      if (iter && lane < kNN) iter[s * kNN + e] = x;
    }
    return x;
  }

  // backward() on one warp, after forward_warp's iterates were kept: `iter` is the warp's own [kSteps + 1][n*n]
  // (iterate s of element e at iter[s * n*n + e], each lane reading back only its own; lanes past n*n read
  // nothing and return garbage), p the lane's softmax
  // element, g its dR on entry; returns its dZ. The same operations in the same order as backward(), the sums
  // gathered by shuffles. Every lane of the warp must call it.
  static __device__ __forceinline__ float backward_warp(float g, float p, const float* iter, float eps, int lane) {
    static_assert(kNN <= 32, "one element a lane");
    const int e = lane < kNN ? lane : 0, j = e / N, k = e % N;
#pragma unroll 1
    for (int s = kSteps; s >= 1; --s) {
      const float y = lane < kNN ? iter[s * kNN + e] : 0.f, xp = lane < kNN ? iter[(s - 1) * kNN + e] : 0.f;
      float dot = 0.f, div = 0.f;
#pragma unroll
      for (int q = 0; q < N; ++q) {
        const int o = (s & 1) ? q * N + k : j * N + q;
        dot += __shfl_sync(0xffffffffu, g, o) * __shfl_sync(0xffffffffu, y, o);
      }
#pragma unroll
      for (int q = 0; q < N; ++q) div += __shfl_sync(0xffffffffu, xp, (s & 1) ? q * N + k : j * N + q);
      g = (g - dot) / (div + eps);
    }
    float dot = 0.f;
#pragma unroll
    for (int q = 0; q < N; ++q) dot += __shfl_sync(0xffffffffu, g, j * N + q) * __shfl_sync(0xffffffffu, p, j * N + q);
    return p * (g - dot);
  }

  // d/dZ of sum(dR * R) after forward(.., keep_all = true): g (shared, n*n) holds dR on entry and
  // dZ on return. Y = X / (sum X + eps): dX = (dY - sum(dY * Y)) / (sum X + eps);
  // softmax: dZ = P * (dP - sum_k dP * P). Every thread of the block must call it.
  static __device__ void backward(float* g, float eps, Smem& sm) { backward(g, eps, sm, static_cast<int>(threadIdx.x)); }
  // The same with the calling thread's element e given (e >= n*n: only the barriers), as forward's.
  static __device__ void backward(float* g, float eps, Smem& sm, int e) {
    const int j = e / N, k = e % N;
    for (int s = kSteps; s >= 1; --s) {
      float ng = 0.f;
      if (e < kNN) {
        const float* y = sm.iter[s];
        float dot = 0.f;
#pragma unroll
        for (int q = 0; q < N; ++q) {
          const int o = (s & 1) ? q * N + k : j * N + q;
          dot += g[o] * y[o];
        }
        ng = (g[e] - dot) / divisor(sm.iter[s - 1], e, s, eps);
      }
      __syncthreads();
      if (e < kNN) g[e] = ng;
      __syncthreads();
    }
    float dz = 0.f;
    if (e < kNN) {
      float dot = 0.f;
#pragma unroll
      for (int q = 0; q < N; ++q) dot += g[j * N + q] * sm.p[j * N + q];
      dz = sm.p[e] * (g[e] - dot);
    }
    __syncthreads();
    if (e < kNN) g[e] = dz;
    __syncthreads();
  }
};

// mhc.sinkhorn.fwd: one block of kThreads >= n*n threads per matrix.
template <int N, int kTMax, int kThreads>
__global__ void __launch_bounds__(kThreads) mhc_sinkhorn_fwd_kernel(const MhcSinkhornParams p) {
  using SK = MhcSinkhorn<N, kTMax>;
  __shared__ typename SK::Smem sm;
  const long long t = blockIdx.x;
  const float* r = SK::forward(p.logits + t * SK::kNN, p.eps, sm, false);
  if (threadIdx.x < SK::kNN) p.out[t * SK::kNN + threadIdx.x] = r[threadIdx.x];
}

// mhc.sinkhorn.bwd: dlogits from logits and dR, one block per matrix.
template <int N, int kTMax, int kThreads>
__global__ void __launch_bounds__(kThreads) mhc_sinkhorn_bwd_kernel(const MhcSinkhornParams p) {
  using SK = MhcSinkhorn<N, kTMax>;
  __shared__ typename SK::Smem sm;
  __shared__ float g[SK::kNN];
  const long long t = blockIdx.x;
  if (threadIdx.x < SK::kNN) g[threadIdx.x] = __ldg(p.dr + t * SK::kNN + threadIdx.x);
  SK::forward(p.logits + t * SK::kNN, p.eps, sm, true);
  SK::backward(g, p.eps, sm);
  if (threadIdx.x < SK::kNN) p.out[t * SK::kNN + threadIdx.x] = g[threadIdx.x];
}

}  // namespace kspec
