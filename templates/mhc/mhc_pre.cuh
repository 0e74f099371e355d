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

// The pre forward's heads of the block's tokens t0 .. t0 + ntok - 1 once `tot` (shared) holds their
// totals, tot[j * (M + 1)] = sum v^2 of token t0 + j and tot[j * (M + 1) + 1 + r] its m[r]: inv, h, H_pre
// (also into the shared h_pre[j], for the y pass), H_post and R. Every thread of the block calls it.
template <int N, int D, int kTMax, bool kPreOnly, int kTok>
__device__ __forceinline__ void mhc_pre_fwd_heads(const MhcPreParams& p, long long t0, int ntok, const float* tot,
                                                  float (*h_pre)[N]) {
  using Rows = MhcRows<N, kPreOnly>;
  using SK = MhcSinkhorn<N, kTMax>;
  constexpr int kM = Rows::kM, kND = N * D, kK = kM + 1, kNN = N * N;
  __shared__ float hs[kTok][kM];
  __shared__ typename SK::Smem sk[kPreOnly ? 1 : kTok];
  if (threadIdx.x < kTok * kM) {
    const int j = threadIdx.x / kM, r = threadIdx.x % kM;
    const float m = tot[j * kK + 1 + r], ss = tot[j * kK];
    const float inv = rsqrtf(ss / static_cast<float>(kND) + p.eps_rms);
    const float h = inv * __ldg(p.alpha + Rows::alpha_of(r)) * m + __ldg(p.bias + r);
    hs[j][r] = h;
    if (j < ntok) {
      const long long t = t0 + j;
      if (r == 0) p.inv[t] = inv;
      p.h[t * kM + r] = h;
      if (r < N) {
        h_pre[j][r] = mhc_sigmoid(h) + p.eps_pre;
        p.h_pre[t * N + r] = h_pre[j][r];
      } else if (r < 2 * N) {
        p.h_post[t * N + r - N] = 2.f * mhc_sigmoid(h);
      }
    }
  }
  __syncthreads();
  if constexpr (!kPreOnly) {
    const int j = static_cast<int>(threadIdx.x) / kNN;
    const int e = j < kTok ? static_cast<int>(threadIdx.x) % kNN : kNN;  // threads past the tokens' elements idle
    const int js = j < kTok ? j : 0;
    const float* rr = SK::forward(hs[js] + 2 * N, p.eps_sk, sk[js], false, e);
    if (e < kNN && j < ntok) p.r[(t0 + j) * kNN + e] = rr[e];
  }
}

// The heads, then y = sum_i H_pre[i] x[i] with x read again from p.x (plain loads: in
// mhc_post_pre_fwd_kernel, p.x is the x_next this block has just written, each thread reading back its
// own elements).
template <typename T, int N, int D, int kTMax, bool kPreOnly, int kThreads, int kTok>
__device__ __forceinline__ void mhc_pre_fwd_rows(const MhcPreParams& p, long long t0, int ntok, const float* tot) {
  __shared__ float h_pre[kTok][N];
  mhc_pre_fwd_heads<N, D, kTMax, kPreOnly, kTok>(p, t0, ntok, tot, h_pre);
  const T* x = static_cast<const T*>(p.x);
  for (int j = 0; j < ntok; ++j) {
    const long long t = t0 + j;
    T* y = static_cast<T*>(p.y) + t * p.y_row;
    for (int d = threadIdx.x; d < D; d += kThreads) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i) s += h_pre[j][i] * to_float(x[(t * N + i) * p.x_row + d]);
      y[d] = store_as<T>(s);
    }
  }
}

// Block of kThreads threads per kTok tokens; grid.x = ceil(T / kTok). The tokens of a block share each
// load of phi (phi is M x nD fp32, 1.5 MB at n = 4, D = 4096: one block per token read it from L2 once per
// token, 25 GB at T = 16384 and 2.6 ms on the H100). Each token's sums run in the same order whatever kTok
// (thread k adds the elements k, k + kThreads, ... of each stream, then the block's fixed-order reduction),
// so every kTok gives the same bits.
template <typename T, int N, int D, int kTMax, bool kHasGamma, bool kPreOnly, int kThreads, int kTok>
__global__ void __launch_bounds__(kThreads) mhc_pre_fwd_kernel(const MhcPreParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = N * D, kK = kM + 1, kNN = N * N;
  static_assert(kTok >= 1 && kThreads >= kTok * kM && (kPreOnly || kThreads >= kTok * kNN),
                "a row of h and a Sinkhorn element per thread for each token of the block");
  __shared__ float scratch[RowReduceScratch<kThreads, kThreads, kTok * kK>::value + 1];
  const long long t0 = static_cast<long long>(blockIdx.x) * kTok;
  const int ntok = static_cast<int>(p.T - t0 < kTok ? p.T - t0 : kTok);
  const T* x = static_cast<const T*>(p.x);

  // acc[j * kK] = sum v^2 of token t0 + j, acc[j * kK + 1 + r] = its m[r]. Tokens past T (a partial last
  // block) read token t0's rows again and are never written.
  float acc[kTok * kK];
#pragma unroll
  for (int r = 0; r < kTok * kK; ++r) acc[r] = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    for (int d = threadIdx.x; d < D; d += kThreads) {
      const int c = i * D + d;
      const float gm = kHasGamma ? __ldg(p.gamma + c) : 1.f;
      float ph[kM];
#pragma unroll
      for (int r = 0; r < kM; ++r) ph[r] = __ldg(p.phi + static_cast<long long>(r) * kND + c);
#pragma unroll
      for (int j = 0; j < kTok; ++j) {
        const long long tj = t0 + (j < ntok ? j : 0);
        const float v = to_float(x[(tj * N + i) * p.x_row + d]);
        const float u = kHasGamma ? v * gm : v;
        acc[j * kK] += v * v;
#pragma unroll
        for (int r = 0; r < kM; ++r) acc[j * kK + 1 + r] += u * ph[r];
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
  mhc_pre_fwd_rows<T, N, D, kTMax, kPreOnly, kThreads, kTok>(p, t0, ntok, tot);
}

// The backward's heads of the kTok tokens t0 .. t0 + ntok - 1 once tot (shared) holds their totals,
// tot[j * (n + M) + i] = <dy, x[i]> and tot[j * (n + M) + n + r] = m[r] of token t0 + j: g = dL/dh (the
// Sinkhorn backward on chip), dm = inv alpha_s g, H_pre and c_v = dinv inv^3 / nD into the caller's shared
// dm, h_pre, c_v (rows past ntok: token t0's values), and g, dm, inv * sum_s g m into the workspace; with
// kSaveDx, H_pre and c_v too (the dx kernel's, mhc_pre_bwd_mma.cuh). Every thread of the block calls it;
// it ends with a barrier. Threads: kTok * M and kTok * n * n at least.
template <int N, int D, int kTMax, bool kPreOnly, int kTok, bool kSaveDx>
__device__ __forceinline__ void mhc_pre_bwd_heads(const MhcPreBwdParams& p, long long t0, int ntok, const float* tot,
                                                  float (*dm)[MhcRows<N, kPreOnly>::kM], float (*h_pre)[N],
                                                  float* c_v) {
  using Rows = MhcRows<N, kPreOnly>;
  using SK = MhcSinkhorn<N, kTMax>;
  constexpr int kM = Rows::kM, kND = N * D, kK = N + kM, kNN = N * N;
  __shared__ float g[kTok][kM];
  __shared__ typename SK::Smem sk[kPreOnly ? 1 : kTok];
  if (threadIdx.x < kTok * kM) {
    const int j = threadIdx.x / kM, e = threadIdx.x % kM;
    const long long t = t0 + (j < ntok ? j : 0);
    const float h_e = __ldg(p.h + t * kM + e);
    const float sg = mhc_sigmoid(h_e);
    if (e < N) {
      const float up = tot[j * kK + e] + (p.dh_pre ? __ldg(p.dh_pre + t * N + e) : 0.f);
      g[j][e] = up * sg * (1.f - sg);
      h_pre[j][e] = sg + p.eps_pre;
      if (kSaveDx && j < ntok) p.ws_hpre[t * N + e] = h_pre[j][e];
    } else if (e < 2 * N) {
      g[j][e] = p.dh_post ? 2.f * __ldg(p.dh_post + t * N + e - N) * sg * (1.f - sg) : 0.f;
    } else {
      g[j][e] = p.dr ? __ldg(p.dr + t * kNN + e - 2 * N) : 0.f;  // dR, turned into dZ below
    }
  }
  __syncthreads();
  if constexpr (!kPreOnly) {
    if (p.dr) {
      __shared__ float z[kTok][kNN];
      const int j = static_cast<int>(threadIdx.x) / kNN;
      const int e = j < kTok ? static_cast<int>(threadIdx.x) % kNN : kNN;  // threads past the elements idle
      const int js = j < kTok ? j : 0;
      if (e < kNN) z[js][e] = __ldg(p.h + (t0 + (js < ntok ? js : 0)) * kM + 2 * N + e);
      __syncthreads();
      SK::forward(z[js], p.eps_sk, sk[js], true, e);
      SK::backward(g[js] + 2 * N, p.eps_sk, sk[js], e);
    }
  }
  if (threadIdx.x < kTok * kM) {
    const int j = threadIdx.x / kM, e = threadIdx.x % kM;
    const long long t = t0 + j;
    dm[j][e] = __ldg(p.inv + t0 + (j < ntok ? j : 0)) * __ldg(p.alpha + Rows::alpha_of(e)) * g[j][e];
    if (j < ntok) {
      p.ws_g[t * kM + e] = g[j][e];
      p.ws_dm[t * kM + e] = dm[j][e];
    }
  }
  __syncthreads();
  if (threadIdx.x < kTok) {
    // Fixed-order sums over the M rows: dinv = sum alpha_s g m, and inv * sum_{rows of s} g m.
    const int j = threadIdx.x;
    const float inv = __ldg(p.inv + t0 + (j < ntok ? j : 0));
    float dinv = 0.f, ga[3] = {0.f, 0.f, 0.f};
    // Unrolled, so that ga's index is a constant (a register array indexed at run time lives in local
    // memory).
#pragma unroll
    for (int r = 0; r < kM; ++r) {
      const float gm = g[j][r] * tot[j * kK + N + r];
      dinv += __ldg(p.alpha + Rows::alpha_of(r)) * gm;
      ga[Rows::alpha_of(r)] += gm;
    }
    c_v[j] = dinv * inv * inv * inv / static_cast<float>(kND);
    if (j < ntok) {
#pragma unroll
      for (int s = 0; s < Rows::kA; ++s) p.ws_ga[(t0 + j) * 3 + s] = inv * ga[s];
      if (kSaveDx) p.ws_cv[t0 + j] = c_v[j];
    }
  }
  __syncthreads();
}

// Backward, per token: g = dL/dh (the <dy, x[i]> and m reduced across the block; the heads above), then
// dx = du * gamma - dinv inv^3 / nD * v + H_pre[i] dy (+ dx_post), du = dm phi. kTok tokens per block share
// each load of phi, as in the forward (the same per-token order of every sum, whatever kTok). !kDx
// (algo=mma): no dx pass; the token's dinv inv^3 / nD and H_pre go to the workspace for
// mhc_pre_bwd_dx_mma_kernel (mhc_pre_bwd_mma.cuh).
template <typename T, int N, int D, int kTMax, bool kHasGamma, bool kPreOnly, bool kHasDxPost, int kThreads,
          int kTok, bool kDx = true>
__global__ void __launch_bounds__(kThreads) mhc_pre_bwd_token_kernel(const MhcPreBwdParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = N * D, kK = N + kM, kNN = N * N;
  static_assert(kTok >= 1 && kThreads >= kTok * kM && (kPreOnly || kThreads >= kTok * kNN),
                "a row of h and a Sinkhorn element per thread for each token of the block");
  __shared__ float scratch[RowReduceScratch<kThreads, kThreads, kTok * kK>::value + 1];
  __shared__ float tot[kTok * kK];
  __shared__ float dm[kTok][kM];
  __shared__ float h_pre[kTok][N];
  __shared__ float c_v[kTok];
  const long long t0 = static_cast<long long>(blockIdx.x) * kTok;
  const int ntok = static_cast<int>(p.T - t0 < kTok ? p.T - t0 : kTok);
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);

  // acc[j * kK + i] = <dy, x[i]> (i < n), acc[j * kK + n + r] = m[r] of token t0 + j (past T: token t0's
  // values again, never written).
  float acc[kTok * kK];
#pragma unroll
  for (int r = 0; r < kTok * kK; ++r) acc[r] = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    for (int d = threadIdx.x; d < D; d += kThreads) {
      const int c = i * D + d;
      const float gm = kHasGamma ? __ldg(p.gamma + c) : 1.f;
      float ph[kM];
#pragma unroll
      for (int r = 0; r < kM; ++r) ph[r] = __ldg(p.phi + static_cast<long long>(r) * kND + c);
#pragma unroll
      for (int j = 0; j < kTok; ++j) {
        const long long tj = t0 + (j < ntok ? j : 0);
        const float v = to_float(x[(tj * N + i) * p.x_row + d]);
        const float u = kHasGamma ? v * gm : v;
        acc[j * kK + i] += v * to_float(dy[tj * p.dy_row + d]);
#pragma unroll
        for (int r = 0; r < kM; ++r) acc[j * kK + N + r] += u * ph[r];
      }
    }
  }
  row_group_reduce_sum<kThreads, kThreads, kTok * kK>(acc, scratch);
  // Every thread holds the totals; one publishes them (a register array takes no dynamic index).
  if (threadIdx.x == 0) {
#pragma unroll
    for (int q = 0; q < kTok * kK; ++q) tot[q] = acc[q];
  }
  __syncthreads();
  mhc_pre_bwd_heads<N, D, kTMax, kPreOnly, kTok, !kDx>(p, t0, ntok, tot, dm, h_pre, c_v);
  if constexpr (!kDx) return;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    for (int d = threadIdx.x; d < D; d += kThreads) {
      const int c = i * D + d;
      const float gm = kHasGamma ? __ldg(p.gamma + c) : 1.f;
      float ph[kM];
#pragma unroll
      for (int r = 0; r < kM; ++r) ph[r] = __ldg(p.phi + static_cast<long long>(r) * kND + c);
#pragma unroll
      for (int j = 0; j < kTok; ++j) {
        if (j >= ntok) break;
        const long long t = t0 + j;
        float du = 0.f;
#pragma unroll
        for (int r = 0; r < kM; ++r) du += dm[j][r] * ph[r];
        const float v = to_float(x[(t * N + i) * p.x_row + d]);
        float dv = (kHasGamma ? du * gm : du) - c_v[j] * v + h_pre[j][i] * to_float(dy[t * p.dy_row + d]);
        if constexpr (kHasDxPost)
          dv += to_float(static_cast<const T*>(p.dx_post)[(t * N + i) * p.dx_post_row + d]);
        static_cast<T*>(p.dx)[(t * N + i) * p.dx_row + d] = store_as<T>(dv);
      }
    }
  }
}

// The part's sums over its tokens [t0, t1) of g and inv g m (dbias, dalpha), one thread per row, in token
// order; threads kM + kA and up idle. Block (0, part) of each columns kernel runs it.
template <int N, int D, bool kPreOnly>
__device__ __forceinline__ void mhc_pre_bwd_row_sums(const MhcPreBwdParams& p, int part, long long t0, long long t1) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = N * D;
  if (threadIdx.x < kM + Rows::kA) {
    const int r = threadIdx.x;
    float s = 0.f;
    for (long long t = t0; t < t1; ++t) s += r < kM ? __ldg(p.ws_g + t * kM + r) : __ldg(p.ws_ga + t * 3 + r - kM);
    p.ws_part[static_cast<long long>(p.parts) * (kM + 1) * kND + static_cast<long long>(part) * (kM + 3) + r] = s;
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
  if (blockIdx.x == 0) mhc_pre_bwd_row_sums<N, D, kPreOnly>(p, part, t0, t1);
}

// The parts' sums added in part order: one thread per element of dphi, dgamma, dbias, dalpha. kRowsOnly
// (algo=mma_slice, whose columns kernel writes dphi and dgamma itself): dbias and dalpha only, one block.
template <int N, int D, bool kHasGamma, bool kPreOnly, int kThreads, bool kRowsOnly>
__global__ void __launch_bounds__(kThreads) mhc_pre_bwd_reduce_kernel(const MhcPreBwdParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = N * D;
  constexpr long long kCols = static_cast<long long>(kM + 1) * kND;
  const long long e = (kRowsOnly ? kCols : 0) + static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
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
