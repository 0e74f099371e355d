// mhc.pre.bwd's token pass split in two kernels (algo=mma_split_du1, sm_80+, 16-bit x). The one-kernel token pass
// (mhc_pre_bwd_token_mma.cuh, kWarpHeads) held a chunk's rows of all n streams at once (64 registers at n 4 and 32
// tokens) beside dy's, the accumulators, phi's fragments and the per-warp Sinkhorn-Knopp heads: 242 registers, 2
// blocks an SM, and run 28's ncu measured it at 470 us for 671 MB (43% of DRAM, H100, T 16384, n 4, D 4096).
// Here (a) mhc_pre_bwd_proj_mma_kernel streams the projection and the sums <dy, x[i]> alone over (token tile x
// column slice) items: grid (ceil(T / kTok), kSplits), block (bx, s) taking every kSplits-th group of 4 chunks of 32
// columns d from s (the forward's mma_split order), one stream's rows at a time (the next stream's loaded before this
// one's mmas, dy's rows kept for the chunk), and writing its tile's partial totals (n + M floats a token) to
// ws_tok; (b) mhc_pre_bwd_split_heads_kernel adds a tile's kSplits partials in split order and runs each token's
// heads on one warp (mhc_pre_bwd_heads_warp), writing g, dm, c_v, H_pre, ga as the token pass did. Deterministic: a
// token's sums run over fixed chunks in a fixed order (the lanes', the warps', then the splits'), no atomics. Not
// the one-kernel pass's bits (the chunks are summed in another order): within fp32 rounding of them.
#pragma once

#include "mhc/mhc_pre_bwd_token_mma.cuh"

namespace kspec {

// Grid (ceil(T / kTok), kSplits) of kMhcMmaThreads. kVec: D % 8 == 0 and 16-byte aligned rows (the plan's mma_vec).
// 16 tokens: at most 128 registers, 4 blocks an SM (96-105 at n 4, NVRTC 13); 32 tokens (phi read from L2 half as
// often): ptxas spilled ~400 bytes at n 4 under 128 registers and 32-80 under 168 (sm_90, gamma), so at most 255, 2
// blocks an SM; 64 tokens spilled under 168 too (the plan refuses them).
template <int kTok>
constexpr int mhc_pre_bwd_proj_min_blocks() {
  return kTok <= 16 ? 4 : 2;
}
template <typename T, int N, int D, bool kHasGamma, bool kPreOnly, int kTok, bool kVec, int kSplits>
__global__ void __launch_bounds__(kMhcMmaThreads, mhc_pre_bwd_proj_min_blocks<kTok>())
    mhc_pre_bwd_proj_mma_kernel(const MhcPreBwdParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kWarps = kMhcMmaThreads / 32, kM = Rows::kM, kK = N + kM, kNt = (kM + 7) / 8, kMt = kTok / 16;
  constexpr int kDChunks = (D + 31) / 32;
  static_assert(!IsSame<T, float>::value, "16-bit x only (exact in TF32)");
  static_assert(kTok % 16 == 0, "whole m16 tiles of tokens");
  __shared__ float tot[kTok * kK];
  const MhcBlockTile tile = mhc_block_tile<kTok>(p.T);  // a structured binding: no lambda (C++17) may capture it
  const long long t0 = tile.t0;
  const int ntok = tile.ntok, warp = static_cast<int>(threadIdx.x) / 32, g = static_cast<int>(threadIdx.x) % 32 / 4;
  const int c = static_cast<int>(threadIdx.x) % 4;
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);
  float acc[kMt][kNt][4], dxy[kMt][2][N];
  mhc_pre_bwd_zero_sums(acc, dxy);
  // The lane's rows of chunk d0 from `base` (stream i: x + i x_row, rows N x_row apart; dy: rows dy_row apart):
  // tokens mt * 16 + g + 8 h, zeros past the tile and past D.
  auto load_rows = [&](MhcRow8<T>(&r)[kMt][2], const T* base, long long stride, int d0, int valid) {
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const MhcTileRow row = mhc_tile_row(t0, ntok, mt, g, h);
        mhc_load8<T, kVec>(r[mt][h], base + row.t * stride + d0, row.in ? valid : 0);
      }
  };
  // The streams in a loop that is not unrolled: unrolled, ptxas hoisted every stream's phi loads and spilled 92-1132
  // bytes under 128 registers (NVRTC 13, sm_80, n 4, 16 and 32 tokens). The next stream's rows are loaded before
  // this one's mmas (a second buffer of kMt x 2 rows), so a warp keeps loads in flight while it computes.
#pragma unroll 1
  for (int dc = static_cast<int>(blockIdx.y) * kWarps + warp; dc < kDChunks; dc += kWarps * kSplits) {
    const int d0 = dc * 32 + 8 * c, valid = D - d0;
    MhcRow8<T> yv[kMt][2], xi[kMt][2];
    load_rows(yv, dy, p.dy_row, d0, valid);
    load_rows(xi, x, N * p.x_row, d0, valid);
#pragma unroll 1
    for (int i = 0; i < N; ++i) {
      MhcRow8<T> xn[kMt][2];
      if (i + 1 < N) load_rows(xn, x + (i + 1) * p.x_row, N * p.x_row, d0, valid);
      float dot[kMt][2];
      auto dots = [&] {
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            dot[mt][h] = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) dot[mt][h] = fmaf(to_float(xi[mt][h].v[e]), to_float(yv[mt][h].v[e]), dot[mt][h]);
          }
      };
      mhc_pre_mma_project<T, N, D, kHasGamma, kPreOnly, kMt, kVec>(p.phi, p.gamma, i * D + d0, valid, xi, acc, dots);
      // Into stream i's sums (constant indices: a register array indexed by i went to local memory).
#pragma unroll
      for (int q = 0; q < N; ++q)
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (q == i) dxy[mt][h][q] += dot[mt][h];
      if (i + 1 < N) {
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) xi[mt][0] = xn[mt][0], xi[mt][1] = xn[mt][1];
      }
    }
  }
  mhc_pre_bwd_tot_reduce<N, kPreOnly, kTok>(acc, dxy, tot);
  float* part = p.ws_tok + (static_cast<long long>(blockIdx.x) * kSplits + blockIdx.y) * (kTok * kK);
  for (int e = threadIdx.x; e < kTok * kK; e += kMhcMmaThreads) part[e] = tot[e];
}

// Grid ceil(T / kTok) of kMhcMmaThreads: tile bx's kSplits partials added in split order, then each warp runs the
// heads of its tokens (j = warp, warp + 4, ...) as the one-kernel token pass's kWarpHeads does.
template <int N, int D, int kTMax, bool kPreOnly, int kTok, int kSplits>
__global__ void __launch_bounds__(kMhcMmaThreads) mhc_pre_bwd_split_heads_kernel(const MhcPreBwdParams p) {
  constexpr int kWarps = kMhcMmaThreads / 32, kK = N + MhcRows<N, kPreOnly>::kM;
  __shared__ float tot[kTok * kK];
  __shared__ float iter[kWarps][kPreOnly ? 1 : 2 * kTMax * N * N];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const auto [t0, ntok] = mhc_block_tile<kTok>(p.T);
  mhc_add_split_partials<kTok * kK, kSplits>(p.ws_tok + static_cast<long long>(blockIdx.x) * kSplits * (kTok * kK), tot);
  for (int j = warp; j < ntok; j += kWarps)
    mhc_pre_bwd_heads_warp<N, D, kTMax, kPreOnly>(p, t0 + j, tot + j * kK, iter[warp], lane);
}

}  // namespace kspec
