// mhc.pre.bwd's sums over tokens on tensor cores (algo=mma, sm_80+, 16-bit x). The SIMT columns kernel
// (mhc_pre.cuh) spends 2M fp32 FMAs per element of x and token: dphi[r, c] += dm[t, r] u[t, c], and
// du = dm phi recomputed for dgamma. Here one GEMM per part of the tokens, S = dm^T V ([M, tokens] x
// [tokens, nD], V = x as stored), gives both: dphi[r, c] = gamma[c] S[r, c] and
// dgamma[c] = sum_t du[t, c] v[t, c] = sum_r phi[r, c] S[r, c] (tools/bench/NOTES.md, "mhc pre: the
// projection on tensor cores"). mma.m16n8k8 with TF32 operands and fp32 accumulators: 16-bit x is exact
// in TF32, dm (fp32) is split into hi + lo TF32 parts (two mmas, relative error ~2^-22). The per-part
// sums go to the same workspace as the SIMT kernel's and mhc_pre_bwd_reduce_kernel adds the parts in
// order: deterministic, no atomics.
#pragma once

#include "common/dtype.cuh"
#include "mhc/mhc_pre.cuh"
#include "mhc/mhc_pre_mma.cuh"

namespace kspec {

// kK consecutive elements of a row, as stored (kK * sizeof(T) bytes, aligned as a whole).
template <typename T, int kK>
struct alignas(kK * sizeof(T)) MhcRowK {
  T v[kK];
};

// The columns of a part of the tokens on tensor cores. Block (bx, part) of kMhcMmaThreads: warp w takes
// kWarpCols = 8 kNt consecutive flattened columns (of nD) from bx * 4 kWarpCols + w kWarpCols, all M rows
// (kMt m16 tiles of dm^T, rows past M zero), the part's tokens 8 at a time (the k of an mma). The n slots
// of the warp's kNt n-tiles are a permutation of its columns (slot s of tile j is column kNt s + j), so
// lane (g, c) loads the kNt consecutive elements kNt g .. kNt g + kNt - 1 of token rows c and c + 4 and
// feeds b0, b1 of every n-tile from them. kNt = 8 (16-byte loads) while the accumulators fit (kMt <= 3:
// n <= 6), else 4. kVec: D % kNt == 0 and x 16-byte aligned (whole groups inside one stream).
template <typename T, int N, int D, bool kHasGamma, bool kPreOnly, bool kVec>
__global__ void __launch_bounds__(kMhcMmaThreads) mhc_pre_bwd_columns_mma_kernel(const MhcPreBwdParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = N * D, kMt = (kM + 15) / 16;
  constexpr int kNt = kMt <= 3 ? 8 : 4, kWarpCols = 8 * kNt, kWarps = kMhcMmaThreads / 32;
  static_assert(!IsSame<T, float>::value, "algo=mma takes 16-bit x only (exact in TF32)");
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const int part = blockIdx.y;
  const long long t0 = static_cast<long long>(part) * p.tokens_per_part;
  const long long t1 = t0 + p.tokens_per_part < p.T ? t0 + p.tokens_per_part : p.T;
  const T* x = static_cast<const T*>(p.x);
  const int wcol = (static_cast<int>(blockIdx.x) * kWarps + warp) * kWarpCols;  // the warp's first column
  const int col = wcol + kNt * g;                                                 // this lane's first column

  float acc[kMt][kNt][4];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int j = 0; j < kNt; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;

  // This lane's columns of tokens tk and tk + 4 (b0 and b1 of every n-tile); zeros past nD and the part.
  auto load_x = [&](MhcRowK<T, kNt> (&rows)[2], long long tk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long tr = tk + 4 * h;
      if (kVec) {
        if (tr < t1 && col < kND) {
          const int i = col / D, d = col - i * D;
          rows[h] = *reinterpret_cast<const MhcRowK<T, kNt>*>(x + (tr * N + i) * p.x_row + d);
        } else {
#pragma unroll
          for (int e = 0; e < kNt; ++e) rows[h].v[e] = from_float<T>(0.f);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kNt; ++e) {
          const int cc = col + e, i = cc / D, d = cc - i * D;
          rows[h].v[e] = tr < t1 && cc < kND ? x[(tr * N + i) * p.x_row + d] : from_float<T>(0.f);
        }
      }
    }
  };

  MhcRowK<T, kNt> xc[2];
  load_x(xc, t0 + c);
  for (long long t = t0; t < t1; t += 8) {
    // The next 8 tokens' x in flight while this step's mmas run.
    MhcRowK<T, kNt> xn[2];
    if (t + 8 < t1) load_x(xn, t + 8 + c);
    // A = dm^T: a0 (row g, token c), a1 (row g + 8, token c), a2 (row g, token c + 4), a3 (row g + 8,
    // token c + 4) of each m16 tile; zero past M and past the part's tokens.
    float ah[kMt][4], al[kMt][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = mt * 16 + g + 8 * (q & 1);
        const long long tk = t + c + 4 * (q >> 1);
        const float v = r < kM && tk < t1 ? __ldg(p.ws_dm + tk * kM + r) : 0.f;
        ah[mt][q] = mhc_tf32(v);
        al[mt][q] = mhc_tf32(v - ah[mt][q]);
      }
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
      const float b0 = to_float(xc[0].v[j]), b1 = to_float(xc[1].v[j]);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        mhc_mma_tf32(acc[mt][j], al[mt][0], al[mt][1], al[mt][2], al[mt][3], b0, b1);
        mhc_mma_tf32(acc[mt][j], ah[mt][0], ah[mt][1], ah[mt][2], ah[mt][3], b0, b1);
      }
    }
    if (t + 8 < t1) xc[0] = xn[0], xc[1] = xn[1];
  }

  // acc[mt][j][2 h + e]: row mt * 16 + g + 8 h, n slot 2c + e of tile j, i.e. column wcol + kNt (2c + e) + j.
  // dphi = gamma S per element; dgamma = sum_r phi S: the lane's rows, then the 8 lanes of the same c
  // (lane bits 2..4) by shuffles in a fixed order.
  float* out = p.ws_part + static_cast<long long>(part) * (kM + 1) * kND;
  float dg[2][kNt];
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
      const int cc = wcol + kNt * (2 * c + e) + j;
      const float gam = kHasGamma && cc < kND ? __ldg(p.gamma + cc) : 1.f;
      dg[e][j] = 0.f;
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = mt * 16 + g + 8 * h;
          if (r < kM && cc < kND) {
            const float s = acc[mt][j][2 * h + e];
            out[static_cast<long long>(r) * kND + cc] = kHasGamma ? gam * s : s;
            if (kHasGamma) dg[e][j] = fmaf(__ldg(p.phi + static_cast<long long>(r) * kND + cc), s, dg[e][j]);
          }
        }
    }
  if constexpr (kHasGamma) {
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int j = 0; j < kNt; ++j) {
        dg[e][j] += __shfl_xor_sync(0xffffffffu, dg[e][j], 4);
        dg[e][j] += __shfl_xor_sync(0xffffffffu, dg[e][j], 8);
        dg[e][j] += __shfl_xor_sync(0xffffffffu, dg[e][j], 16);
        const int cc = wcol + kNt * (2 * c + e) + j;
        if (g == 0 && cc < kND) out[static_cast<long long>(kM) * kND + cc] = dg[e][j];
      }
  }
  if (blockIdx.x == 0) mhc_pre_bwd_row_sums<N, D, kPreOnly>(p, part, t0, t1);
}

}  // namespace kspec
