// mhc.post_pre.fwd with the projection on tensor cores (algo=mma / mma_warp_heads, sm_80+, 16-bit x in
// 16-byte groups). The SIMT kernel (mhc_post_pre.cuh) projects x_next with M fp32 FMAs per element and
// phi from L2 per 4 tokens, as the SIMT pre forward did (H100, T 16384, n 4, D 4096, bf16: post_pre fwd
// 2269 us against 428 + 573 for post then pre). Here a warp takes 32 columns d of all n streams at once
// (chunk dc, as mhc_pre_bwd_token_mma.cuh): it loads the n rows of x and the row of f of its kTok / 16 x 2
// token rows a lane, forms x_next[k] = H_post[k] f + sum_j R[j, k] x[j] stream by stream (the SIMT kernel's
// operations in its order, so the same bits), stores it once and feeds the rounded values, exactly what
// pre(l + 1) would read, to the forward's mma projection (mma.m16n8k8 TF32, phi * gamma split hi + lo, the
// same k slots) and sums of squares; then mhc_pre_fwd_mma_finish (heads, y from x_next with plain loads:
// this block wrote it).
#pragma once

#include "common/dtype.cuh"
#include "mhc/mhc_pre_mma.cuh"
#include "mhc/row8.cuh"

namespace kspec {

// Grid: ceil(T / kTok) blocks of kMhcMmaThreads. D % 8 == 0 and every pointer and row 16-byte aligned (the
// plan's rule). Registers: a lane keeps n x (kTok / 16) x 2 rows of 8 elements of x, its rows of f and
// (kTok / 16) x ceil(M / 8) accumulator tiles (api/ops/mhc/op.cpp bounds them as algo=mma_tokens').
// One block an SM named as the minimum: with the thread count alone ptxas capped n 1 at 16 tokens at 48 registers
// and spilled (nvcc 13, sm_80).
template <typename T, int N, int D, int kTMax, bool kHasGamma, int kTok, bool kWarpHeads>
__global__ void __launch_bounds__(kMhcMmaThreads, 1) mhc_post_pre_fwd_mma_kernel(const MhcPostPreParams p) {
  using Rows = MhcRows<N, false>;
  constexpr int kWarps = kMhcMmaThreads / 32;
  constexpr int kM = Rows::kM, kK = kM + 1, kNN = N * N;
  constexpr int kNt = (kM + 7) / 8, kMt = kTok / 16, kDChunks = (D + 31) / 32;
  static_assert(!IsSame<T, float>::value, "the mma projection takes 16-bit x only (exact in TF32)");
  static_assert(D % 8 == 0 && kTok % 16 == 0, "16-byte groups of a stream, whole m16 tiles of tokens");
  __shared__ float tot[kTok * kK];
  __shared__ float hq[kTok][N];
  __shared__ float rq[kTok][kNN];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const long long t0 = static_cast<long long>(blockIdx.x) * kTok;
  const int ntok = static_cast<int>(p.pre.T - t0 < kTok ? p.pre.T - t0 : kTok);
  // Layer l's H_post and R of the block's tokens (past T: token t0's, never written).
  for (int e = threadIdx.x; e < kTok * kNN; e += kMhcMmaThreads) {
    const int j = e / kNN;
    rq[j][e % kNN] = __ldg(p.r + (t0 + (j < ntok ? j : 0)) * kNN + e % kNN);
  }
  for (int e = threadIdx.x; e < kTok * N; e += kMhcMmaThreads) {
    const int j = e / N;
    hq[j][e % N] = __ldg(p.h_post + (t0 + (j < ntok ? j : 0)) * N + e % N);
  }
  __syncthreads();
  const T* x = static_cast<const T*>(p.x);
  const T* f = static_cast<const T*>(p.f);
  T* x_next = static_cast<T*>(p.x_next);

  float acc[kMt][kNt][4], ss[kMt][2];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
    ss[mt][0] = ss[mt][1] = 0.f;
#pragma unroll
    for (int j = 0; j < kNt; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
  }

  for (int dc = warp; dc < kDChunks; dc += kWarps) {
    const int d0 = dc * 32 + 8 * c, valid = D - d0;
    MhcRow8<T> xv[N][kMt][2], fv[kMt][2];
    mhc_load_chunk_rows<T, N, kMt, true>(xv, fv, x, p.x_row, f, p.f_row, t0, ntok, g, d0, valid);
    // Not unrolled: unrolled, the n streams' phi and o are hoisted together and spill (n 4, 32 tokens: 480 bytes).
#pragma unroll 1
    for (int k = 0; k < N; ++k) {
      // x_next[k] of the lane's rows, as stored; zeros past the tokens and D (their x and f are zeros).
      MhcRow8<T> o[kMt][2];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int tr = mt * 16 + g + 8 * h;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            float s = hq[tr][k] * to_float(fv[mt][h].v[e]);
#pragma unroll
            for (int i = 0; i < N; ++i) s += rq[tr][i * N + k] * to_float(xv[i][mt][h].v[e]);
            o[mt][h].v[e] = store_as<T>(s);
          }
          if (tr < ntok && valid > 0) mhc_store8(x_next + ((t0 + tr) * N + k) * p.pre.x_row + d0, o[mt][h]);
        }
      mhc_pre_fwd_mma_chunk<T, N, D, kHasGamma, false, kMt, true>(p.pre.phi, p.pre.gamma, k * D + d0, valid, o, acc,
                                                                  ss);
    }
  }
  // The finish's first barrier also orders this block's x_next stores before its y pass reads them back.
  mhc_pre_fwd_mma_finish<T, N, D, kTMax, false, kTok, true, kWarpHeads, true>(p.pre, t0, ntok, acc, ss, tot);
}

}  // namespace kspec
