// mhc.pre.bwd's sums over tokens on tensor cores (algo=mma, sm_80+, 16-bit x). The SIMT columns kernel
// (mhc_pre.cuh) spends 2M fp32 FMAs per element of x and token: dphi[r, c] += dm[t, r] u[t, c], and
// du = dm phi recomputed for dgamma. Here one GEMM per part of the tokens, S = dm^T V ([M, tokens] x
// [tokens, nD], V = x as stored), gives both: dphi[r, c] = gamma[c] S[r, c] and
// dgamma[c] = sum_t du[t, c] v[t, c] = sum_r phi[r, c] S[r, c] (tools/bench/NOTES.md, "mhc pre: the
// projection on tensor cores"). mma.m16n8k8 with TF32 operands and fp32 accumulators: 16-bit x is exact
// in TF32, dm (fp32) is split into hi + lo TF32 parts (two mmas, relative error ~2^-22). The per-part
// sums go to the same workspace as the SIMT kernel's and mhc_pre_bwd_reduce_kernel adds the parts in
// order: deterministic, no atomics. mhc_pre_bwd_dx_mma_kernel below does the token kernel's other pass
// over x, du = dm phi for dx, on tensor cores too.
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

// dx of kTok tokens (grid: ceil(T / kTok) blocks of kMhcMmaThreads), after the token kernel ran with
// kDx = false: du = dm phi on tensor cores ([kTok, M] x [M, nD]: A = dm from the workspace, B = phi, both
// fp32 split hi + lo, three mmas: lo hi, hi lo, hi hi), then dx = du gamma - c_v v + H_pre[i] dy
// (+ dx_post). The warps take chunks of 64 flattened columns in turn; the n slots of a chunk's 8 n-tiles
// are a permutation of its columns (slot s of tile j = column 8 s + j), so lane (g, c) loads 8
// consecutive floats of phi per k row and ends with the 16 columns 16 c .. 16 c + 15 of its token rows g
// and g + 8: 16-byte loads and stores of x, dy, dx. dm of the block's tokens stays in registers (split
// once). kVec: D % 8 == 0 and every pointer and row 16-byte aligned.
template <typename T, int N, int D, bool kHasGamma, bool kPreOnly, bool kHasDxPost, int kTok, bool kVec>
__global__ void __launch_bounds__(kMhcMmaThreads) mhc_pre_bwd_dx_mma_kernel(const MhcPreBwdParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = N * D, kMt = kTok / 16, kKt = (kM + 7) / 8;
  constexpr int kWarps = kMhcMmaThreads / 32, kChunks = (kND + 63) / 64;
  static_assert(kTok % 16 == 0, "whole m16 tiles of tokens");
  static_assert(!IsSame<T, float>::value, "algo=mma takes 16-bit x only");
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const long long t0 = static_cast<long long>(blockIdx.x) * kTok;
  const int ntok = static_cast<int>(p.T - t0 < kTok ? p.T - t0 : kTok);

  // A = dm: a0 (token g, k c), a1 (token g + 8, k c), a2 (token g, k c + 4), a3 (token g + 8, k c + 4).
  float ah[kMt][kKt][4], al[kMt][kKt][4];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int kk = 0; kk < kKt; ++kk)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int tr = mt * 16 + g + 8 * (q & 1), r = kk * 8 + c + 4 * (q >> 1);
        const float v = tr < ntok && r < kM ? __ldg(p.ws_dm + (t0 + tr) * kM + r) : 0.f;
        ah[mt][kk][q] = mhc_tf32(v);
        al[mt][kk][q] = mhc_tf32(v - ah[mt][kk][q]);
      }

  for (int q = warp; q < kChunks; q += kWarps) {
    const int base = q * 64;
    float acc[kMt][8][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKt; ++kk) {
      // B = phi: b0 (k row kk 8 + c), b1 (row + 4), columns base + 8 g .. + 7 (n slot g of tiles 0 .. 7).
      float b[2][8];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = kk * 8 + c + 4 * h, col = base + 8 * g;
        const int valid = r < kM ? kND - col : 0;
        if (kVec) {
          mhc_load8f<true>(b[h], p.phi + static_cast<long long>(r < kM ? r : 0) * kND + col, valid);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e)
            b[h][e] = e < valid ? __ldg(p.phi + static_cast<long long>(r) * kND + col + e) : 0.f;
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float bh0 = mhc_tf32(b[0][j]), bh1 = mhc_tf32(b[1][j]);
        const float bl0 = mhc_tf32(b[0][j] - bh0), bl1 = mhc_tf32(b[1][j] - bh1);
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          const float* a = ah[mt][kk];
          const float* l = al[mt][kk];
          mhc_mma_tf32(acc[mt][j], l[0], l[1], l[2], l[3], bh0, bh1);
          mhc_mma_tf32(acc[mt][j], a[0], a[1], a[2], a[3], bl0, bl1);
          mhc_mma_tf32(acc[mt][j], a[0], a[1], a[2], a[3], bh0, bh1);
        }
      }
    }
    // acc[mt][j][2 h + e] = du of token mt 16 + g + 8 h at column base + 8 (2c + e) + j.
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int tr = mt * 16 + g + 8 * h;
        if (tr >= ntok) continue;
        const long long t = t0 + tr;
        const float cv = __ldg(p.ws_cv + t);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c0 = base + 8 * (2 * c + e);
          if (kVec) {
            if (c0 >= kND) continue;
            const int i = c0 / D, d = c0 - i * D;
            const float hp = __ldg(p.ws_hpre + t * N + i);
            MhcRow8<T> xv, dyv, dp, out;
            float gm[8];
            mhc_load8<T, true>(xv, static_cast<const T*>(p.x) + (t * N + i) * p.x_row + d, 8);
            mhc_load8<T, true>(dyv, static_cast<const T*>(p.dy) + t * p.dy_row + d, 8);
            if (kHasDxPost) mhc_load8<T, true>(dp, static_cast<const T*>(p.dx_post) + (t * N + i) * p.dx_post_row + d, 8);
            if (kHasGamma) mhc_load8f<true>(gm, p.gamma + c0, 8);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const float du = acc[mt][j][2 * h + e];
              float dv = (kHasGamma ? du * gm[j] : du) - cv * to_float(xv.v[j]) + hp * to_float(dyv.v[j]);
              if (kHasDxPost) dv += to_float(dp.v[j]);
              out.v[j] = store_as<T>(dv);
            }
            *reinterpret_cast<MhcRow8<T>*>(static_cast<T*>(p.dx) + (t * N + i) * p.dx_row + d) = out;
          } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const int cc = c0 + j;
              if (cc >= kND) continue;
              const int i = cc / D, d = cc - i * D;
              const float du = acc[mt][j][2 * h + e];
              const float v = to_float(static_cast<const T*>(p.x)[(t * N + i) * p.x_row + d]);
              const float dyv = to_float(static_cast<const T*>(p.dy)[t * p.dy_row + d]);
              float dv = (kHasGamma ? du * __ldg(p.gamma + cc) : du) - cv * v + __ldg(p.ws_hpre + t * N + i) * dyv;
              if (kHasDxPost) dv += to_float(static_cast<const T*>(p.dx_post)[(t * N + i) * p.dx_post_row + d]);
              static_cast<T*>(p.dx)[(t * N + i) * p.dx_row + d] = store_as<T>(dv);
            }
          }
        }
      }
  }
}

}  // namespace kspec
