// mhc.pre.bwd's token pass on tensor cores (algo=mma_tokens, sm_80+, 16-bit x). The SIMT token kernel
// (mhc_pre.cuh) recomputes m = (v * gamma) phi^T with M fp32 FMAs per element of x and re-reads phi (1.5 MB
// at n 4, D 4096) from L2 once per 4 tokens: 6.4 GB of L2 reads per call at T 16384, as the SIMT forward
// (1.66 ms on the H100, where the tensor-core forward took 0.57). Here the projection is the forward's
// (mhc_pre_mma.cuh: mma.m16n8k8, TF32, phi * gamma split hi + lo, the same permuted k slots), a block of
// 128 threads takes kTok = 16..64 tokens and reads phi once per kTok tokens, and the n sums <dy, x[i]>
// come from the same registers: a warp takes 32 columns d of all n streams at once (chunk dc: its n rows of
// x and the one row of dy, loaded before any mma), so dy is read once. The lanes' and then the warps'
// partial sums are added in a fixed order (quad shuffles, warps in turn through shared memory), the heads
// (g, the Sinkhorn backward, dm) run kSub tokens side by side as the SIMT kernel's, and dx is left to
// mhc_pre_bwd_dx_mma_kernel (the workspace gets H_pre and c_v). kWarpHeads (algo=mma_fused_warp_heads, M <= 32):
// each warp instead runs whole tokens' heads on its own (mhc_pre_bwd_heads_warp: the Sinkhorn-Knopp forward and
// backward by shuffles, the iterates in the warp's own shared slots), 4 tokens at a time in the block with no
// block barrier, where the block's heads ran ~125 barriers a round of 4 tokens.
#pragma once

#include "common/dtype.cuh"
#include "mhc/mhc_pre.cuh"
#include "mhc/mhc_pre_mma.cuh"

namespace kspec {

// mhc_pre_bwd_heads (kSaveDx) for token t0 + j on the calling warp alone, tj = its row of the block's totals
// (tj[i] = <dy, x[i]>, tj[n + r] = m[r]); lane r < M holds row r. iter: the warp's own [2 t_max][n*n] floats.
// The same operations in the same order as the block's heads, so the same bits.
template <int N, int D, int kTMax, bool kPreOnly>
__device__ __forceinline__ void mhc_pre_bwd_heads_warp(const MhcPreBwdParams& p, long long t, const float* tj,
                                                       float* iter, int lane) {
  using Rows = MhcRows<N, kPreOnly>;
  using SK = MhcSinkhorn<N, kTMax>;
  constexpr int kM = Rows::kM, kND = N * D, kNN = N * N;
  static_assert(kM <= 32 && (kPreOnly || kNN <= 32), "a row of h and a Sinkhorn element a lane");
  const int r = lane < kM ? lane : 0;
  const float h_e = __ldg(p.h + t * kM + r);
  const float sg = mhc_sigmoid(h_e);
  float g;
  if (r < N) {
    const float up = tj[r] + (p.dh_pre ? __ldg(p.dh_pre + t * N + r) : 0.f);
    g = up * sg * (1.f - sg);
    if (lane < N) p.ws_hpre[t * N + r] = sg + p.eps_pre;
  } else if (r < 2 * N) {
    g = p.dh_post ? 2.f * __ldg(p.dh_post + t * N + r - N) * sg * (1.f - sg) : 0.f;
  } else {
    g = p.dr ? __ldg(p.dr + t * kNN + r - 2 * N) : 0.f;  // dR, turned into dZ below
  }
  if constexpr (!kPreOnly) {
    if (p.dr) {
      const int src = 2 * N + (lane < kNN ? lane : 0);
      const float z = __shfl_sync(0xffffffffu, h_e, src), dr = __shfl_sync(0xffffffffu, g, src);
      float pv;
      SK::forward_warp(z, p.eps_sk, lane, iter, &pv);
      const float dz = SK::backward_warp(dr, pv, iter, p.eps_sk, lane);
      const float back = __shfl_sync(0xffffffffu, dz, r >= 2 * N ? r - 2 * N : 0);
      if (r >= 2 * N) g = back;
    }
  }
  const float inv = __ldg(p.inv + t);
  const float dm = inv * __ldg(p.alpha + Rows::alpha_of(r)) * g;
  if (lane < kM) {
    p.ws_g[t * kM + r] = g;
    p.ws_dm[t * kM + r] = dm;
  }
  // Fixed-order sums over the M rows (every lane the same): dinv = sum alpha_s g m, inv * sum_{rows of s} g m.
  float dinv = 0.f, ga[3] = {0.f, 0.f, 0.f};
#pragma unroll
  for (int q = 0; q < kM; ++q) {
    const float gm = __shfl_sync(0xffffffffu, g, q) * tj[N + q];
    dinv += __ldg(p.alpha + Rows::alpha_of(q)) * gm;
    ga[Rows::alpha_of(q)] += gm;
  }
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < Rows::kA; ++s) p.ws_ga[t * 3 + s] = inv * ga[s];
    p.ws_cv[t] = dinv * inv * inv * inv / static_cast<float>(kND);
  }
}

// The backward's: a row's <dy, x[i]> lead (tot[row * (n + M)]: <dy, x[i]> at i, m[r] at n + r, mhc_pre_bwd_heads'
// layout); acc and dxy as the token pass's (the lane's token rows mt * 16 + g + 8 h). Ends with a barrier.
template <int N, bool kPreOnly, int kTok>
__device__ __forceinline__ void mhc_pre_bwd_tot_reduce(float (&acc)[kTok / 16][(MhcRows<N, kPreOnly>::kM + 7) / 8][4],
                                                       float (&dxy)[kTok / 16][2][N], float* tot) {
  mhc_mma_add_warp_partials<N, MhcRows<N, kPreOnly>::kM, kTok / 16>(
      acc, [&](int mt, int h, int i) -> float& { return dxy[mt][h][i]; }, tot);
}

// Grid: ceil(T / kTok) blocks of kMhcMmaThreads. kVec: D % 8 == 0 and every pointer and row 16-byte
// aligned. Registers: a lane keeps n x (kTok / 16) x 2 rows of 8 elements of x, its rows of dy, kMt x kNt
// accumulator tiles and kMt x 2 x n sums <dy, x[i]> (api/ops/mhc/op.cpp bounds kMt n and kMt kNt).
// kWarpHeads names a minimum of one block an SM (as mhc_pre_fwd_mma_kernel's: ptxas capped n 1-2 at 64-80
// registers and spilled without it); without kWarpHeads the kernel is compiled as before.
// kRing (algo=mma_fused_ring, with kWarpHeads): a chunk's rows come through a ring of 2 chunks in dynamic shared
// memory (cp.async, mhc_pre_bwd_ring_bytes of it), the next chunk's copies issued before this one's mmas, so
// loads stay in flight while a warp computes (without it a warp loads its 20 rows, then computes with nothing
// in flight: registers leave no room for a prefetch). The same rows into the same operations: the same bits.
// kPhiRing (algo=mma_fused_phi_ring, with kWarpHeads, not kRing): phi's and gamma's columns of each (chunk, stream)
// step come through a ring of kMhcBwdPhiStages slots a warp in dynamic shared memory (cp.async, 3 steps ahead;
// mhc_pre_bwd_phi_ring_bytes), where they were loaded from L2 just before that step's mmas. Run 28 (H100, T 16384,
// n 4, D 4096, bf16, ncu): the token pass took 470 us at 43% of DRAM, 2 blocks an SM at 242 registers, ~1600
// instructions a warp a chunk but ~7 us a chunk: four L2 round trips for phi (one a stream) after the chunk's rows.
// A slot holds kNt x 8 rows of 32 columns (padded to 36 floats: the 8 rows g of a quarter warp's 16-byte reads
// fall in different banks) and gamma's 32. The same values into the same operations: the same bits.
constexpr int kMhcBwdRingStages = 2;
template <int N, int kTok>
constexpr int mhc_pre_bwd_ring_bytes() {
  return kMhcBwdRingStages * (N + 1) * (kTok / 16) * 2 * kMhcMmaThreads * 16;
}
constexpr int kMhcBwdPhiStages = 4, kMhcBwdPhiRow = 36;
// Eight floats of a slot (16-byte aligned shared memory).
__device__ __forceinline__ void mhc_load8s(float (&o)[8], const float* src) {
  const float4 a = reinterpret_cast<const float4*>(src)[0], b = reinterpret_cast<const float4*>(src)[1];
  o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
}
template <int kM>
constexpr int mhc_pre_bwd_phi_slot() {
  return (kM + 7) / 8 * 8 * kMhcBwdPhiRow + 32;  // floats
}
template <int kM>
constexpr int mhc_pre_bwd_phi_ring_bytes() {
  return kMhcMmaThreads / 32 * kMhcBwdPhiStages * mhc_pre_bwd_phi_slot<kM>() * 4;
}
template <typename T, int N, int D, int kTMax, bool kHasGamma, bool kPreOnly, int kTok, bool kVec, bool kPhiRing,
          bool kRing, bool kWarpHeads>
__global__ void __launch_bounds__(kMhcMmaThreads, kWarpHeads ? 1 : 0) mhc_pre_bwd_token_mma_kernel(const MhcPreBwdParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kThreads = kMhcMmaThreads, kWarps = kThreads / 32;
  constexpr int kM = Rows::kM, kK = N + kM, kNN = N * N;
  constexpr int kNt = (kM + 7) / 8, kMt = kTok / 16, kDChunks = (D + 31) / 32;
  static_assert(!IsSame<T, float>::value, "algo=mma_tokens takes 16-bit x only (exact in TF32)");
  // Tokens whose heads run side by side: a row of h and a Sinkhorn element per thread for each.
  constexpr int kSub = (4 * kM <= kThreads && (kPreOnly || 4 * kNN <= kThreads)) ? 4
                       : (2 * kM <= kThreads && (kPreOnly || 2 * kNN <= kThreads)) ? 2 : 1;
  static_assert(kTok % 16 == 0 && kTok % kSub == 0 && kM <= kThreads && (kPreOnly || kNN <= kThreads),
                "whole m16 tiles of tokens, and a row of h per thread");
  __shared__ float tot[kTok * kK];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const long long t0 = static_cast<long long>(blockIdx.x) * kTok;
  const int ntok = static_cast<int>(p.T - t0 < kTok ? p.T - t0 : kTok);
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);

  // acc: m of the lane's token rows mt * 16 + g + 8 h (accumulator layout, rows 8 j + 2 c + e); dxy[mt][h][i]:
  // the lane's part of <dy, x[i]> of the same rows.
  float acc[kMt][kNt][4], dxy[kMt][2][N];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int j = 0; j < kNt; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < N; ++i) dxy[mt][h][i] = 0.f;
  }

  // kRing: the lane's slots of stage s, row r (dy's kMt x 2 rows, then x's n x kMt x 2), kThreads apart.
  extern __shared__ uint4 ring[];
  constexpr int kRows = (N + 1) * kMt * 2;
  auto slot = [&](int stage, int r) { return ring + (stage * kRows + r) * kThreads + threadIdx.x; };
  auto issue = [&](int stage, int dc) {
    const bool in = dc < kDChunks;
    const int d0 = (in ? dc : 0) * 32 + 8 * c;
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const MhcTileRow row = mhc_tile_row(t0, ntok, mt, g, h);
        const bool ok = in && row.in && d0 < D;
        mhc_cp_async16(slot(stage, mt * 2 + h), dy + row.t * p.dy_row + d0, ok);
#pragma unroll
        for (int i = 0; i < N; ++i)
          mhc_cp_async16(slot(stage, kMt * 2 + (i * kMt + mt) * 2 + h), x + (row.t * N + i) * p.x_row + d0, ok);
      }
    mhc_cp_async_commit();
  };
  if constexpr (kRing) {
    static_assert(kVec && kWarpHeads, "algo=mma_fused_ring: x in 16-byte groups, the heads per warp");
    issue(0, warp);
  }

  // kPhiRing: the warp's slots; step s (chunk warp + kWarps (s / N), stream s % N) goes to slot s % kPhiStages.
  constexpr int kPhiStages = kMhcBwdPhiStages, kPhiRow = kMhcBwdPhiRow, kPhiRows = kNt * 8;
  constexpr int kPhiSlot = mhc_pre_bwd_phi_slot<kM>(), kND = N * D;
  [[maybe_unused]] float* const phs = reinterpret_cast<float*>(ring) + warp * kPhiStages * kPhiSlot;
  // 16-byte pieces: the lane copies columns e .. e + 3 of rows lane / 8 + 4 k (row kPhiRows: gamma's); zeros past
  // M and past the stream.
  const int e = 4 * (lane % 8), r0 = lane / 8;
  auto issue_phi = [&](int s) {
    const int dc = warp + kWarps * (s / N), i = s % N;
    const bool in = dc < kDChunks;
    const int col = i * D + (in ? dc : 0) * 32 + e;
    const bool ok = in && (in ? dc : 0) * 32 + e < D;
    float* dst = phs + (s % kPhiStages) * kPhiSlot + r0 * kPhiRow + e;
#pragma unroll
    for (int k = 0; 4 * k < kPhiRows + 1; ++k) {
      const int r = r0 + 4 * k;
      if (r < kPhiRows)
        mhc_cp_async16(reinterpret_cast<uint4*>(dst + 4 * k * kPhiRow),
                       p.phi + static_cast<long long>(r < kM ? r : 0) * kND + col, ok && r < kM);
      else if (kHasGamma && r == kPhiRows)
        mhc_cp_async16(reinterpret_cast<uint4*>(dst + 4 * k * kPhiRow), p.gamma + col, ok);
    }
    mhc_cp_async_commit();
  };
  [[maybe_unused]] int step = 0;
  if constexpr (kPhiRing) {
    static_assert(kVec && kWarpHeads && !kRing, "algo=mma_fused_phi_ring: x in 16-byte groups, the heads per warp");
#pragma unroll
    for (int s = 0; s < kPhiStages - 1; ++s) issue_phi(s);
  }

  for (int dc = warp, k = 0; dc < kDChunks; dc += kWarps, ++k) {
    const int d0 = dc * 32 + 8 * c, valid = D - d0;
    MhcRow8<T> xv[N][kMt][2], yv[kMt][2];
    if constexpr (kRing) {
      // Into the stage chunk k - 1 was read from (its rows are in registers since the last step).
      issue((k + 1) % kMhcBwdRingStages, dc + kWarps);
      mhc_cp_async_wait<1>();  // chunk k's copies landed
      const int st = k % kMhcBwdRingStages;
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          yv[mt][h] = *reinterpret_cast<const MhcRow8<T>*>(slot(st, mt * 2 + h));
#pragma unroll
          for (int i = 0; i < N; ++i)
            xv[i][mt][h] = *reinterpret_cast<const MhcRow8<T>*>(slot(st, kMt * 2 + (i * kMt + mt) * 2 + h));
        }
    } else {
      mhc_load_chunk_rows<T, N, kMt, kVec>(xv, yv, x, p.x_row, dy, p.dy_row, t0, ntok, g, d0, valid);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
      auto dots = [&] {
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 8; ++e)
              dxy[mt][h][i] = fmaf(to_float(xv[i][mt][h].v[e]), to_float(yv[mt][h].v[e]), dxy[mt][h][i]);
      };
      if constexpr (kPhiRing) {
        mhc_cp_async_wait<kPhiStages - 2>();  // this step's slot landed (this lane's copies)
        __syncwarp();                         // ... and every lane's; the last step's reads are done
        issue_phi(step + kPhiStages - 1);     // into the slot the last step read
        const float* sl = phs + (step % kPhiStages) * kPhiSlot + 8 * c;
        ++step;
        mhc_pre_mma_project_with<T, N, kHasGamma, kPreOnly, kMt>(
            [&](float (&gm)[8], float (&ph)[kNt][8]) {
              if (kHasGamma) mhc_load8s(gm, sl + kPhiRows * kPhiRow);
#pragma unroll
              for (int j = 0; j < kNt; ++j) mhc_load8s(ph[j], sl + (8 * j + g) * kPhiRow);
            },
            xv[i], acc, dots);
      } else {
        mhc_pre_mma_project<T, N, D, kHasGamma, kPreOnly, kMt, kVec>(p.phi, p.gamma, i * D + d0, valid, xv[i], acc,
                                                                     dots);
      }
    }
  }

  if constexpr (kRing || kPhiRing) mhc_cp_async_wait<0>();

  mhc_pre_bwd_tot_reduce<N, kPreOnly, kTok>(acc, dxy, tot);

  if constexpr (kWarpHeads) {
    __shared__ float iter[kWarps][kPreOnly ? 1 : 2 * kTMax * kNN];
    for (int j = warp; j < ntok; j += kWarps)
      mhc_pre_bwd_heads_warp<N, D, kTMax, kPreOnly>(p, t0 + j, tot + j * kK, iter[warp], lane);
  } else {
    __shared__ float dm[kSub][kM];
    __shared__ float h_pre[kSub][N];
    __shared__ float c_v[kSub];
    for (int s0 = 0; s0 < ntok; s0 += kSub)
      mhc_pre_bwd_heads<N, D, kTMax, kPreOnly, kSub, true>(p, t0 + s0, ntok - s0 < kSub ? ntok - s0 : kSub,
                                                           tot + s0 * kK, dm, h_pre, c_v);
  }
}

}  // namespace kspec
