// mhc.pre.fwd with the projection on tensor cores (algo=mma, sm_80+). The SIMT kernel (mhc_pre.cuh) spends
// M = n*n + 2n fp32 FMAs per element of x on m = (v * gamma) phi^T and re-reads phi (1.5 MB at n 4,
// D 4096) per 4 tokens: 14% of the H100's bandwidth. Here a block of 128 threads takes kTok = 16..64 tokens
// (1..4 m16 tiles) and splits the nD columns among its 4 warps in chunks of 32; each lane loads 8
// consecutive elements of x per token row (16-byte loads) and the same 8 columns of phi and gamma, so a
// block reads phi once per kTok tokens. The k slots of mma.m16n8k8 are a permutation of the chunk's
// columns (slot c of step s is column 8c + 2s, slot c + 4 column 8c + 2s + 1), the same for A and B.
// TF32 operands, fp32 accumulation, exact enough for the fp32 reference: bf16/fp16 x is exact in TF32,
// phi * gamma is split into hi + lo TF32 parts (two mmas, relative error ~2^-22); fp32 x stays on the
// SIMT kernel (a 3-part split of x and phi missed fp32's 1e-5 on the H100). The sum of squares comes from the same registers. The warps'
// partial sums are added in warp order (deterministic), the heads (inv, h, H, Sinkhorn-Knopp) run as in
// mhc_pre.cuh a few tokens at a time, and y = sum_i H_pre[i] x[i] reads x a second time (a 64-token tile
// is 2 MB at n 4, D 4096: no shared memory holds it), 8 elements per thread and several items in flight.
// kWarpHeads (algo=mma_warp_heads, n*n and M <= 32): each warp instead takes whole tokens, its heads on the
// warp alone (the Sinkhorn-Knopp iterates by shuffles: MhcSinkhorn::forward_warp) and then that token's y,
// so no block barrier separates heads from y and one warp's Sinkhorn-Knopp hides behind the others' loads
// (the block's heads ran 39 barriers a round, 16 rounds a 64-token tile, with no load in flight). Same
// operations in the same order: the same bits as the block's heads.
#pragma once

#include "common/dtype.cuh"
#include "mhc/mhc_pre.cuh"
#include "mhc/row8.cuh"

namespace kspec {

constexpr int kMhcMmaThreads = 128;

__device__ __forceinline__ float mhc_tf32(float v) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
  return __uint_as_float(r);
}

// 8 bytes from global to shared memory without passing through registers (cp.async, sm_80+), or zeros stored
// at once. The calling thread alone reads dst back, after mhc_cp_async_wait.
__device__ __forceinline__ void mhc_cp_async8(uint2* dst, const void* src, bool ok) {
  if (ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))),
                 "l"(src)
                 : "memory");
  } else {
    *dst = make_uint2(0u, 0u);
  }
}
// The same for 16 bytes (dst and src 16-byte aligned); zeros when not `ok` (src-size 0: the source is not read).
__device__ __forceinline__ void mhc_cp_async16(uint4* dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(src), "r"(ok ? 16 : 0)
               : "memory");
}
// The same for 4 bytes (dst and src 4-byte aligned); zeros when not `ok` (src-size 0: the source is not read).
__device__ __forceinline__ void mhc_cp_async4(float* dst, const float* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
               ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(src), "r"(ok ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void mhc_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void mhc_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// D += A * B, A 16x8 row-major, B 8x8 column-major, TF32 inputs, fp32 accumulators. Lane (g, c) =
// (lane / 4, lane % 4): a0 (row g, k c), a1 (row g + 8, k c), a2 (row g, k c + 4), a3 (row g + 8, k c + 4);
// b0 (k c, n g), b1 (k c + 4, n g); d as mma.m16n8k16's (rows g, g + 8; cols 2c, 2c + 1).
__device__ __forceinline__ void mhc_mma_tf32(float (&d)[4], float a0, float a1, float a2, float a3, float b0,
                                             float b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(a2)), "r"(__float_as_uint(a3)),
        "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// mhc_pre_fwd_heads' arithmetic for token t on the calling warp (lane r holding row r of h; tj: the token's
// totals, tj[0] = sum v^2, tj[1 + r] = m[r]; the Sinkhorn-Knopp iterates by shuffles), its outputs written
// where `write` (the split kernel's other blocks recompute them), then y of the token's 8-element groups
// [i0, i1) with H_pre through wh, the warp's own shared row (a register array indexed in the y loop went to
// the stack: 8-16 bytes at n 6-8, 32 tokens). Every lane of the warp calls it.
template <typename T, int N, int D, int kTMax, bool kPreOnly, bool kVec, bool kCoherent>
__device__ __forceinline__ void mhc_pre_fwd_token_warp(const MhcPreParams& p, long long t, const float* tj, float* wh,
                                                       int lane, int i0, int i1, bool write) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = N * D, kNN = N * N, kBatch = N >= 8 ? 2 : 4;
  static_assert(kM <= 32 && (kPreOnly || kNN <= 32), "a row of h and a Sinkhorn element a lane");
  const float inv = rsqrtf(tj[0] / static_cast<float>(kND) + p.eps_rms);
  const int r = lane < kM ? lane : 0;
  const float h = inv * __ldg(p.alpha + Rows::alpha_of(r)) * tj[1 + r] + __ldg(p.bias + r);
  const float hp = mhc_sigmoid(h) + p.eps_pre;
  if (write && lane < kM) {
    if (lane == 0) p.inv[t] = inv;
    p.h[t * kM + lane] = h;
    if (lane < N) p.h_pre[t * N + lane] = hp;
    else if (lane < 2 * N) p.h_post[t * N + lane - N] = 2.f * mhc_sigmoid(h);
  }
  if constexpr (!kPreOnly) {
    if (write) {
      const float z = __shfl_sync(0xffffffffu, h, 2 * N + (lane < kNN ? lane : 0));
      const float rr = MhcSinkhorn<N, kTMax>::forward_warp(z, p.eps_sk, lane);
      if (lane < kNN) p.r[t * kNN + lane] = rr;
    }
  }
  __syncwarp();  // the last token's y reads of wh are done
  if (lane < N) wh[lane] = hp;
  __syncwarp();
  const T* xt = static_cast<const T*>(p.x) + t * N * p.x_row;
  T* yt = static_cast<T*>(p.y) + t * p.y_row;
#pragma unroll 1
  for (int base = i0 + lane; base < i1; base += kBatch * 32) {
    MhcRow8<T> v[kBatch][N];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int it = base + b * 32, d = (it < i1 ? it : 0) * 8;
#pragma unroll
      for (int i = 0; i < N; ++i) mhc_load8<T, kVec, !kCoherent>(v[b][i], xt + i * p.x_row + d, it < i1 ? D - d : 0);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int it = base + b * 32, d = it * 8;
      if (it >= i1) continue;
      MhcRow8<T> out;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < N; ++i) s += wh[i] * to_float(v[b][i].v[e]);
        out.v[e] = store_as<T>(s);
      }
      if (kVec) {
        mhc_store8(yt + d, out);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (d + e < D) yt[d + e] = out.v[e];
      }
    }
  }
}

// A token tile's rows' kLead leading sums (lead(mt, h, i): the lane's part for row mt * 16 + g + 8 h) over the quad's
// four lanes, then the warps' partials of them and of the accumulators (acc: m of the same rows at rows 8 j + 2 c + e)
// added in warp order into tot (shared, rows of kLead + M floats: the leading sums, then m); ends with a barrier.
template <int kLead, int kM, int kMt, typename Lead>
__device__ __forceinline__ void mhc_mma_add_warp_partials(float (&acc)[kMt][(kM + 7) / 8][4], Lead&& lead, float* tot) {
  constexpr int kWarps = kMhcMmaThreads / 32, kK = kLead + kM, kNt = (kM + 7) / 8;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < kLead; ++i) {
        lead(mt, h, i) += __shfl_xor_sync(0xffffffffu, lead(mt, h, i), 1);
        lead(mt, h, i) += __shfl_xor_sync(0xffffffffu, lead(mt, h, i), 2);
      }
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float* row = tot + (mt * 16 + g + 8 * h) * kK;
          if (c == 0) {
#pragma unroll
            for (int i = 0; i < kLead; ++i) row[i] = w == 0 ? lead(mt, h, i) : row[i] + lead(mt, h, i);
          }
#pragma unroll
          for (int j = 0; j < kNt; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int r = 8 * j + 2 * c + e;
              if (r < kM) row[kLead + r] = w == 0 ? acc[mt][j][2 * h + e] : row[kLead + r] + acc[mt][j][2 * h + e];
            }
        }
    }
    __syncthreads();
  }
}

// The forward's: a row's sum of squares (ss, as the finish's) leads, tot is kTok x (M + 1).
template <int N, bool kPreOnly, int kTok>
__device__ __forceinline__ void mhc_pre_fwd_mma_reduce(float (&acc)[kTok / 16][(MhcRows<N, kPreOnly>::kM + 7) / 8][4],
                                                       float (&ss)[kTok / 16][2], float* tot) {
  mhc_mma_add_warp_partials<1, MhcRows<N, kPreOnly>::kM, kTok / 16>(
      acc, [&](int mt, int h, int) -> float& { return ss[mt][h]; }, tot);
}

// The end of the mma forward once a warp's accumulators hold its chunks' sums (acc: m of the lane's token
// rows mt * 16 + g + 8 h at rows 8 j + 2 c + e; ss: their sums of squares): the warps' partials added in
// warp order into tot (shared, kTok x (M + 1)), the heads, then y from p.x. kCoherent: p.x was written by
// this block (mhc_post_pre_mma.cuh's x_next), so y reads it with plain loads, not the read-only path.
template <typename T, int N, int D, int kTMax, bool kPreOnly, int kTok, bool kVec, bool kWarpHeads, bool kCoherent>
__device__ __forceinline__ void mhc_pre_fwd_mma_finish(const MhcPreParams& p, long long t0, int ntok,
                                                       float (&acc)[kTok / 16][(MhcRows<N, kPreOnly>::kM + 7) / 8][4],
                                                       float (&ss)[kTok / 16][2], float* tot) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kThreads = kMhcMmaThreads, kWarps = kThreads / 32;
  constexpr int kM = Rows::kM, kK = kM + 1, kNN = N * N;
  constexpr int kSub = (4 * kM <= kThreads && (kPreOnly || 4 * kNN <= kThreads)) ? 4
                       : (2 * kM <= kThreads && (kPreOnly || 2 * kNN <= kThreads)) ? 2 : 1;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const T* x = static_cast<const T*>(p.x);
  mhc_pre_fwd_mma_reduce<N, kPreOnly, kTok>(acc, ss, tot);

  // y: items of 8 elements (it / kRow8 a token's, it % kRow8 its group of 8 d), this thread's from `first`
  // in steps of `stride`, kBatch loaded before any is stored; token_of(it) is its token in the tile,
  // weight(j, i) token j's H_pre[i].
  constexpr int kRow8 = (D + 7) / 8, kBatch = N >= 8 ? 2 : 4;
  auto y_items = [&](int items, int first, int stride, auto&& token_of, auto&& weight) {
    for (int base = first; base < items; base += kBatch * stride) {
      MhcRow8<T> v[kBatch][N];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int it = base + b * stride;
        const int j = it < items ? token_of(it) : 0, d = (it < items ? it % kRow8 : 0) * 8;
#pragma unroll
        for (int i = 0; i < N; ++i)
          mhc_load8<T, kVec, !kCoherent>(v[b][i], x + ((t0 + j) * N + i) * p.x_row + d, it < items ? D - d : 0);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int it = base + b * stride;
        if (it >= items) continue;
        const int j = token_of(it), d = it % kRow8 * 8;
        MhcRow8<T> out;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float s = 0.f;
#pragma unroll
          for (int i = 0; i < N; ++i) s += weight(j, i) * to_float(v[b][i].v[e]);
          out.v[e] = store_as<T>(s);
        }
        T* y = static_cast<T*>(p.y) + (t0 + j) * p.y_row + d;
        if (kVec) {
#pragma unroll
          for (int w = 0; w < static_cast<int>(sizeof(out) / 16); ++w)
            reinterpret_cast<uint4*>(y)[w] = reinterpret_cast<const uint4*>(out.v)[w];
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e)
            if (d + e < D) y[e] = out.v[e];
        }
      }
    }
  };

  if constexpr (kWarpHeads) {
    static_assert(kM <= 32 && (kPreOnly || kNN <= 32), "a row of h and a Sinkhorn element a lane");
    __shared__ float wh[kWarps][N];
    for (int j = warp; j < ntok; j += kWarps)
      mhc_pre_fwd_token_warp<T, N, D, kTMax, kPreOnly, kVec, kCoherent>(p, t0 + j, tot + j * kK, wh[warp], lane, 0,
                                                                         kRow8, true);
  } else {
    __shared__ float h_pre[kTok][N];
    for (int s0 = 0; s0 < ntok; s0 += kSub) {
      mhc_pre_fwd_heads<N, D, kTMax, kPreOnly, kSub>(p, t0 + s0, ntok - s0 < kSub ? ntok - s0 : kSub, tot + s0 * kK,
                                                     h_pre + s0);
      __syncthreads();
    }
    y_items(ntok * kRow8, static_cast<int>(threadIdx.x), kThreads, [&](int it) { return it / kRow8; },
            [&](int j, int i) { return h_pre[j][i]; });
  }
}

// Row h of m16 tile mt of the lane's token rows (g = lane / 4) in a tile of ntok tokens from t0: its token (t0
// itself past the tile: an address inside x for a masked load) and whether it is one of the tile's.
struct MhcTileRow {
  long long t;
  bool in;
};
__device__ __forceinline__ MhcTileRow mhc_tile_row(long long t0, int ntok, int mt, int g, int h) {
  const int tr = mt * 16 + g + 8 * h;
  return {t0 + (tr < ntok ? tr : 0), tr < ntok};
}

// The lane's rows of one chunk of 32 columns d (d0 = 32 dc + 8 c), loaded before any is used: the n streams of
// x and one other row of the same tokens (f or dy); tokens mt * 16 + g + 8 h of the block's from t0, zeros past
// its ntok tokens and past D (valid = D - d0).
template <typename T, int N, int kMt, bool kVec>
__device__ __forceinline__ void mhc_load_chunk_rows(MhcRow8<T> (&xv)[N][kMt][2], MhcRow8<T> (&ov)[kMt][2], const T* x,
                                                    long long x_row, const T* o, long long o_row, long long t0,
                                                    int ntok, int g, int d0, int valid) {
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const MhcTileRow row = mhc_tile_row(t0, ntok, mt, g, h);
      const int v = row.in ? valid : 0;
      mhc_load8<T, kVec>(ov[mt][h], o + row.t * o_row + d0, v);
#pragma unroll
      for (int i = 0; i < N; ++i) mhc_load8<T, kVec>(xv[i][mt][h], x + (row.t * N + i) * x_row + d0, v);
    }
}

// m += (x * gamma) phi^T over one chunk: the lane's rows xr (tokens mt * 16 + g + 8 h, columns col .. col + 7
// of the flattened streams, valid of them inside the stream) into the m16n8k8 accumulators of every row tile,
// phi (times gamma) split into hi + lo TF32 parts (two mmas each). load(gm, ph) fills the lane's 8 columns of
// gamma (when kHasGamma) and of phi's rows 8 j + g (zeros past M and past the stream). between(): the caller's
// own sums over the rows, run after phi's loads are issued and before the mmas (the order ptxas kept without
// spills: with the sums first, the token pass spilled 152-184 bytes at n 4, 32 tokens on sm_90).
template <typename T, int N, bool kHasGamma, bool kPreOnly, int kMt, typename Load, typename Between>
__device__ __forceinline__ void mhc_pre_mma_project_with(Load&& load, const MhcRow8<T> (&xr)[kMt][2],
                                                         float (&acc)[kMt][(MhcRows<N, kPreOnly>::kM + 7) / 8][4],
                                                         Between&& between) {
  constexpr int kM = MhcRows<N, kPreOnly>::kM, kNt = (kM + 7) / 8;
  float gm[8], ph[kNt][8];
  load(gm, ph);
  between();
#pragma unroll
  for (int j = 0; j < kNt; ++j) {
    float bh[8], bl[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float w = kHasGamma ? ph[j][e] * gm[e] : ph[j][e];
      bh[e] = mhc_tf32(w);
      bl[e] = mhc_tf32(w - bh[e]);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        const float a0 = to_float(xr[mt][0].v[2 * s]), a1 = to_float(xr[mt][1].v[2 * s]);
        const float a2 = to_float(xr[mt][0].v[2 * s + 1]), a3 = to_float(xr[mt][1].v[2 * s + 1]);
        mhc_mma_tf32(acc[mt][j], a0, a1, a2, a3, bl[2 * s], bl[2 * s + 1]);
        mhc_mma_tf32(acc[mt][j], a0, a1, a2, a3, bh[2 * s], bh[2 * s + 1]);
      }
  }
}
// The same with phi and gamma loaded from global memory (read-only path).
template <typename T, int N, int D, bool kHasGamma, bool kPreOnly, int kMt, bool kVec, typename Between>
__device__ __forceinline__ void mhc_pre_mma_project(const float* phi, const float* gamma, int col, int valid,
                                                    const MhcRow8<T> (&xr)[kMt][2],
                                                    float (&acc)[kMt][(MhcRows<N, kPreOnly>::kM + 7) / 8][4],
                                                    Between&& between) {
  constexpr int kM = MhcRows<N, kPreOnly>::kM, kND = N * D, kNt = (kM + 7) / 8;
  mhc_pre_mma_project_with<T, N, kHasGamma, kPreOnly, kMt>(
      [&](float (&gm)[8], float (&ph)[kNt][8]) {
        const int g = static_cast<int>(threadIdx.x) % 32 / 4;
        if (kHasGamma) mhc_load8f<kVec>(gm, gamma + col, valid);
#pragma unroll
        for (int j = 0; j < kNt; ++j) {
          const int r = 8 * j + g;
          mhc_load8f<kVec>(ph[j], phi + static_cast<long long>(r < kM ? r : 0) * kND + col, r < kM ? valid : 0);
        }
      },
      xr, acc, between);
}

// The forward's step of one chunk (pre.fwd's and post_pre.fwd's): the projection, with the rows' sums of
// squares.
template <typename T, int N, int D, bool kHasGamma, bool kPreOnly, int kMt, bool kVec>
__device__ __forceinline__ void mhc_pre_fwd_mma_chunk(const float* phi, const float* gamma, int col, int valid,
                                                      const MhcRow8<T> (&xr)[kMt][2],
                                                      float (&acc)[kMt][(MhcRows<N, kPreOnly>::kM + 7) / 8][4],
                                                      float (&ss)[kMt][2]) {
  mhc_pre_mma_project<T, N, D, kHasGamma, kPreOnly, kMt, kVec>(phi, gamma, col, valid, xr, acc, [&] {
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float v = to_float(xr[mt][h].v[e]);
          ss[mt][h] = fmaf(v, v, ss[mt][h]);
        }
  });
}

// Grid: ceil(T / kTok) blocks of kMhcMmaThreads. kVec: D % 8 == 0 and every pointer and row stride
// 16-byte aligned (the plan's choice).
// kWarpHeads names a minimum of one block an SM: without it ptxas capped some 32-token tiles at 72-80
// registers and spilled 4-20 bytes (pre_only n 2-8, n 2 at D 96; nvcc 13), with it 96 and none. Without
// kWarpHeads (0: none named) the kernel is compiled as before.
// kSplits > 1 (algo=mma_split, for few tokens): grid (ceil(T / kTok), kSplits), block (bx, s) projecting every
// kSplits-th group of 4 chunks from s and leaving its tile's totals in the workspace (MhcPreSplitParams) for
// mhc_pre_fwd_split_heads_kernel below.
// kRing (algo=mma_ring, with kWarpHeads): the projection's rows of x come through a ring of kMhcFwdRingStages
// chunks in shared memory (cp.async), 3 chunks ahead instead of 1 in registers: at 32 tokens 3 x 8 KB a block
// in flight (4 KB before), and the 16-32 registers of the next chunk's rows freed. The same loads, mmas and
// order of sums: the same bits as kWarpHeads alone.
constexpr int kMhcFwdRingStages = 4;
template <int kSplits>
struct MhcPreFwdArgs {
  using Type = MhcPreSplitParams;
  static __device__ __forceinline__ const MhcPreParams& pre(const MhcPreSplitParams& a) { return a.pre; }
  static __device__ __forceinline__ float* ws(const MhcPreSplitParams& a) { return a.ws; }
};
template <>
struct MhcPreFwdArgs<1> {
  using Type = MhcPreParams;
  static __device__ __forceinline__ const MhcPreParams& pre(const MhcPreParams& a) { return a; }
  static __device__ __forceinline__ float* ws(const MhcPreParams&) { return nullptr; }
};

template <typename T, int N, int D, int kTMax, bool kHasGamma, bool kPreOnly, int kTok, bool kVec, int kSplits,
          bool kRing, bool kWarpHeads>
__global__ void __launch_bounds__(kMhcMmaThreads, kWarpHeads || kSplits > 1 ? 1 : 0)
    mhc_pre_fwd_mma_kernel(const typename MhcPreFwdArgs<kSplits>::Type args) {
  const MhcPreParams& p = MhcPreFwdArgs<kSplits>::pre(args);
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kThreads = kMhcMmaThreads, kWarps = kThreads / 32;
  constexpr int kM = Rows::kM, kK = kM + 1, kNN = N * N;
  constexpr int kNt = (kM + 7) / 8, kMt = kTok / 16;
  constexpr int kChunksPerStream = (D + 31) / 32, kChunks = N * kChunksPerStream;
  // fp32 x is algo=simt's (api/ops/mhc/op.cpp, mma_unsupported): split into TF32 parts it missed the fp32
  // tolerance on the H100 (h 1.1e-5 to 2.2e-5 at D 2560 to 7168).
  static_assert(!IsSame<T, float>::value, "algo=mma takes 16-bit x only");
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

  float acc[kMt][kNt][4];
  float ss[kMt][2];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
    ss[mt][0] = ss[mt][1] = 0.f;
#pragma unroll
    for (int j = 0; j < kNt; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
  }

  // Chunk q (32 columns of stream q / kChunksPerStream) of the lane's rows xc into ss and acc.
  auto chunk = [&](int q, const MhcRow8<T> (&xc)[kMt][2]) {
    const int d0 = (q % kChunksPerStream) * 32 + 8 * c;
    mhc_pre_fwd_mma_chunk<T, N, D, kHasGamma, kPreOnly, kMt, kVec>(p.phi, p.gamma, q / kChunksPerStream * D + d0,
                                                                   D - d0, xc, acc, ss);
  };
  constexpr int kStep = kWarps * kSplits;
  const int q0 = (kSplits == 1 ? 0 : static_cast<int>(blockIdx.y) * kWarps) + warp;
  if constexpr (kRing) {
    // A ring of kStages chunks of this lane's rows in shared memory, each lane reading back only its own
    // slots (no barrier): chunk k + kStages - 1's copies are issued before chunk k's mmas.
    static_assert(kVec && kSplits == 1, "algo=mma_ring: x in 16-byte groups, one block a tile");
    constexpr int kStages = kMhcFwdRingStages;
    __shared__ uint4 ring[kStages][kMt * 2][kThreads];
    auto issue = [&](int stage, int q) {
      const bool in = q < kChunks;
      const int i = in ? q / kChunksPerStream : 0, d0 = in ? (q % kChunksPerStream) * 32 + 8 * c : 0;
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const MhcTileRow row = mhc_tile_row(t0, ntok, mt, g, h);
          mhc_cp_async16(&ring[stage][mt * 2 + h][threadIdx.x], x + (row.t * N + i) * p.x_row + d0,
                         in && row.in && d0 < D);
        }
      mhc_cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue(s, q0 + s * kStep);
    for (int q = q0, k = 0; q < kChunks; q += kStep, ++k) {
      mhc_cp_async_wait<kStages - 2>();  // chunk k's copies landed
      MhcRow8<T> xc[kMt][2];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          xc[mt][h] = *reinterpret_cast<const MhcRow8<T>*>(&ring[k % kStages][mt * 2 + h][threadIdx.x]);
      // Into the slot chunk k - 1 was read from (its values are in use since the last step).
      issue((k + kStages - 1) % kStages, q + (kStages - 1) * kStep);
      chunk(q, xc);
    }
    mhc_cp_async_wait<0>();
  } else {
    // This lane's rows of x in chunk q: tokens mt * 16 + g + 8 h, columns d0 .. d0 + 7 of stream i (zeros past
    // the block's tokens and past D).
    auto load_x = [&](MhcRow8<T> (&buf)[kMt][2], int q) {
      const int i = q / kChunksPerStream, d0 = (q % kChunksPerStream) * 32 + 8 * c;
  #pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
  #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const MhcTileRow row = mhc_tile_row(t0, ntok, mt, g, h);
          mhc_load8<T, kVec>(buf[mt][h], x + (row.t * N + i) * p.x_row + d0, row.in ? D - d0 : 0);
        }
    };
    MhcRow8<T> xc[kMt][2];
    if (q0 < kChunks) load_x(xc, q0);
    for (int q = q0; q < kChunks; q += kStep) {
      // The next chunk's x in flight while this one's mmas run.
      MhcRow8<T> xn[kMt][2];
      if (q + kStep < kChunks) load_x(xn, q + kStep);
      chunk(q, xc);
      if (q + kStep < kChunks) {
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) xc[mt][0] = xn[mt][0], xc[mt][1] = xn[mt][1];
      }
    }
  }
  if constexpr (kSplits > 1) {
    mhc_pre_fwd_mma_reduce<N, kPreOnly, kTok>(acc, ss, tot);
    float* part = MhcPreFwdArgs<kSplits>::ws(args) + (static_cast<long long>(blockIdx.x) * kSplits + blockIdx.y) * (kTok * kK);
    for (int e = threadIdx.x; e < kTok * kK; e += kThreads) part[e] = tot[e];
    return;
  }

  mhc_pre_fwd_mma_finish<T, N, D, kTMax, kPreOnly, kTok, kVec, kWarpHeads, false>(p, t0, ntok, acc, ss, tot);
}

// algo=mma_split's second kernel: grid (ceil(T / kTok), y blocks). Block (bx, by) adds tile bx's kSplits
// partial totals in split order (deterministic), then each warp runs its tokens' heads (block by == 0 writes
// them) and y of the 8-element groups of the by-th of gridDim.y ranges of D.
template <typename T, int N, int D, int kTMax, bool kPreOnly, int kTok, bool kVec, int kSplits>
__global__ void __launch_bounds__(kMhcMmaThreads, 1) mhc_pre_fwd_split_heads_kernel(const MhcPreSplitParams args) {
  const MhcPreParams& p = args.pre;
  static_assert(kSplits > 1, "the partials of mhc_pre_fwd_mma_kernel<..., kSplits > 1, ...>");
  constexpr int kWarps = kMhcMmaThreads / 32, kK = MhcRows<N, kPreOnly>::kM + 1, kRow8 = (D + 7) / 8;
  __shared__ float tot[kTok * kK];
  __shared__ float wh[kWarps][N];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const long long t0 = static_cast<long long>(blockIdx.x) * kTok;
  const int ntok = static_cast<int>(p.T - t0 < kTok ? p.T - t0 : kTok);
  const float* part = args.ws + static_cast<long long>(blockIdx.x) * kSplits * (kTok * kK);
  for (int e = threadIdx.x; e < kTok * kK; e += kMhcMmaThreads) {
    float s = 0.f;
    for (int q = 0; q < kSplits; ++q) s += part[q * (kTok * kK) + e];
    tot[e] = s;
  }
  __syncthreads();
  const int i0 = static_cast<int>(blockIdx.y * kRow8 / gridDim.y), i1 = static_cast<int>((blockIdx.y + 1) * kRow8 / gridDim.y);
  for (int j = warp; j < ntok; j += kWarps)
    mhc_pre_fwd_token_warp<T, N, D, kTMax, kPreOnly, kVec, false>(p, t0 + j, tot + j * kK, wh[warp], lane, i0, i1,
                                                                   blockIdx.y == 0);
}

}  // namespace kspec
