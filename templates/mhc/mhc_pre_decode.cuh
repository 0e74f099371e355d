// mhc.pre.fwd for few tokens (decode) in one launch (algo=decode). The split plan (mhc_pre_mma.cuh) took two
// launches and 18.8 us of GPU on the H100 at T 8, n 4, D 4096 (run 26; F.rms_norm over the same x 15.6): its
// heads kernel summed 64 partials in each of its 8 blocks and ran every token's Sinkhorn-Knopp there again.
// Here the work is handed out as items by an atomic ticket, in one global order:
//   items [0, P):      projection item q: columns [256 q, 256 q + 256) of the flattened streams for every token
//                      (warp w the tokens w, w + 8, ...; lane l 8 consecutive columns), exact fp32 FMAs, the
//                      lanes' sums reduce-scattered by shuffles; the token's M + 1 totals (sum v^2, m) into the
//                      workspace. The block finishing the last of them (a counter) adds the P totals of every
//                      token in item order, runs the heads (inv, h, H_pre, H_post), publishes H_pre (a flag),
//                      then runs every token's Sinkhorn-Knopp (a warp a token where n*n <= 32).
//   items [P, P + Y):  y item: 256 groups of 8 elements of y; x is loaded first, then the item waits for the flag.
// An item waits only for items with smaller tickets, all taken by blocks already running: nothing hangs,
// whatever the grid size or how many blocks are resident. Each total is summed in a fixed order, whichever
// block runs which item: the same bits at every run. The counters (MhcPreDecodeParams::sync) are zero at launch;
// the last block out puts them back to zero, so the next launch on the stream, or the next replay of a graph,
// finds them so (api/ops/mhc/op.cpp: a buffer per device and stream, zeroed once; in a graph, zeroed by a memset
// node before the kernel). inv and h are written only where the call keeps them (non-null).
#pragma once

#include "common/dtype.cuh"
#include "mhc/decode_params.h"
#include "mhc/mhc_pre.cuh"
#include "mhc/row8.cuh"

namespace kspec {

constexpr int kMhcDecodeThreads = 256;
constexpr int kMhcDecodeItemCols = 256;   // a warp's 32 lanes x 8 columns
constexpr int kMhcDecodeHeadTokens = 8;   // tokens whose totals and heads the last block holds at once

// The 32 lanes' sums of 32 values reduce-scattered: a leaves with a[0] = the warp's total of value `lane`. Each
// step hands half of the values to the partner lane (31 shuffles in all, against 160 for a butterfly of every
// value); every total is added in one fixed order.
template <int kL, int kO>
__device__ __forceinline__ void mhc_decode_scatter_step(float (&a)[32], int lane) {
  const bool up = (lane & kO) != 0;
#pragma unroll
  for (int i = 0; i < kL / 2; ++i) {
    const float send = up ? a[i] : a[i + kL / 2];
    const float keep = up ? a[i + kL / 2] : a[i];
    a[i] = keep + __shfl_xor_sync(0xffffffffu, send, kO);
  }
}
__device__ __forceinline__ void mhc_decode_reduce_scatter(float (&a)[32], int lane) {
  mhc_decode_scatter_step<32, 16>(a, lane);
  mhc_decode_scatter_step<16, 8>(a, lane);
  mhc_decode_scatter_step<8, 4>(a, lane);
  mhc_decode_scatter_step<4, 2>(a, lane);
  mhc_decode_scatter_step<2, 1>(a, lane);
}

// Element c (of the flattened n*D columns) of token t's streams, 0 past n*D.
template <typename T, int N, int D>
__device__ __forceinline__ float mhc_decode_x(const MhcPreParams& p, long long t, int c) {
  if (c >= N * D) return 0.f;
  const T* x = static_cast<const T*>(p.x);
  return to_float(x[(t * N + c / D) * p.x_row + c % D]);
}

// kRowSplit (algo=decode_rows): the projection items' warps split the values (rows of phi), not the tokens.
// Grid: any number of blocks of kMhcDecodeThreads (the launcher: at most the resident ones, and no more than the
// items); a minimum of one block an SM named (without it ptxas held n 8 to 128 registers and spilled 2.5 KB).
// kVec: D % 8 == 0 and x, y, their rows, phi and gamma 16-byte aligned (8 columns never straddle streams).
template <typename T, int N, int D, int kTMax, bool kHasGamma, bool kPreOnly, bool kVec, bool kRowSplit = false>
__global__ void __launch_bounds__(kMhcDecodeThreads, 1) mhc_pre_fwd_decode_kernel(const MhcPreDecodeParams a) {
  using Rows = MhcRows<N, kPreOnly>;
  using SK = MhcSinkhorn<N, kTMax>;
  constexpr int kThreads = kMhcDecodeThreads, kWarps = kThreads / 32, kHT = kMhcDecodeHeadTokens;
  constexpr int kM = Rows::kM, kK = kM + 1, kND = N * D, kNN = N * N, kRow8 = (D + 7) / 8;
  constexpr int kCK = kK <= 32 ? kK : 16, kPasses = (kK + kCK - 1) / kCK;
  static_assert(kHT * kK <= 4 * kThreads, "a 4-float group of the heads' totals a thread");
  const MhcPreParams& p = a.pre;
  const int tokens = static_cast<int>(p.T), tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const unsigned items = static_cast<unsigned>(a.items), total = items + static_cast<unsigned>(a.y_items);
  // an item's totals, [tokens, M + 1], padded to whole float4s (the heads read them 16 bytes at a time)
  const long long stride = (static_cast<long long>(tokens) * kK + 3) / 4 * 4;
  unsigned* ticket = a.sync;
  unsigned* done = a.sync + 1;
  volatile unsigned* heads_done = a.sync + 2;
  unsigned* out = a.sync + 3;
  __shared__ unsigned s_item;
  __shared__ bool s_last;

  for (;;) {
    if (tid == 0) s_item = atomicAdd(ticket, 1u);
    __syncthreads();
    const unsigned item = s_item;
    __syncthreads();  // every thread has read s_item before the next ticket overwrites it
    if (item >= total) break;

    if (item < items) {
      // ---- projection item: 8 columns a lane, a token a warp at a time ----
      const int c0 = static_cast<int>(item) * kMhcDecodeItemCols + lane * 8;
      const int valid = kND - c0;
      float gm[8];
      if (kHasGamma) {
        mhc_load8f<kVec>(gm, p.gamma + (valid > 0 ? c0 : 0), valid);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) gm[e] = 1.f;
      }
      // The lane's 8 columns of token t's streams (zeros past n*D).
      auto load_x = [&](int t, float (&xv)[8]) {
        if (kVec) {
          MhcRow8<T> r8;
          const T* x = static_cast<const T*>(p.x);
          const int c = valid > 0 ? c0 : 0;
          mhc_load8<T, true>(r8, x + (static_cast<long long>(t) * N + c / D) * p.x_row + c % D, valid);
#pragma unroll
          for (int e = 0; e < 8; ++e) xv[e] = to_float(r8.v[e]);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) xv[e] = mhc_decode_x<T, N, D>(p, t, c0 + e);
        }
      };
      if constexpr (kRowSplit) {
        // algo=decode_rows: warp w the values k = w, w + 8, ... (0: sum v^2, 1 + r: m[r]) of kTC tokens at once,
        // so that the block reads each row of phi once (a warp a token read the item's phi 8 times through L1);
        // kVW x kTC <= 32 accumulators, reduce-scattered as below: the same sums in the same order, the same bits.
        // (at most 8 tokens at once: 16 or 32 spilled at n 3, n 1, their x * gamma in registers)
        constexpr int kVW = (kK + kWarps - 1) / kWarps, kTC = 32 / kVW < 8 ? 32 / kVW : 8;
        static_assert(kVW <= 32, "at most 32 values a warp");
        for (int t0 = 0; t0 < tokens; t0 += kTC) {
          float acc[32];
#pragma unroll
          for (int q = 0; q < 32; ++q) acc[q] = 0.f;
          float u[kTC][8];
#pragma unroll
          for (int tc = 0; tc < kTC; ++tc) {
            float xv[8];
            load_x(t0 + tc < tokens ? t0 + tc : t0, xv);
            float ss = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              ss = fmaf(xv[e], xv[e], ss);
              u[tc][e] = kHasGamma ? xv[e] * gm[e] : xv[e];
            }
            if (warp == 0) acc[tc] = ss;  // value 0 is warp 0's first
          }
#pragma unroll
          for (int v = 0; v < kVW; ++v) {
            const int k = warp + kWarps * v;
            if (k == 0 || k >= kK) continue;
            float ph[8];
            mhc_load8f<kVec>(ph, p.phi + static_cast<long long>(k - 1) * kND + (valid > 0 ? c0 : 0), valid);
#pragma unroll
            for (int tc = 0; tc < kTC; ++tc)
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[v * kTC + tc] = fmaf(u[tc][e], ph[e], acc[v * kTC + tc]);
          }
          mhc_decode_reduce_scatter(acc, lane);
          const int v = lane / kTC, t = t0 + lane % kTC, k = warp + kWarps * v;
          if (v < kVW && k < kK && t < tokens)
            a.part[static_cast<long long>(item) * stride + static_cast<long long>(t) * kK + k] = acc[0];
        }
      }
      for (int t = kRowSplit ? tokens : warp; t < tokens; t += kWarps) {
        float xv[8];
        load_x(t, xv);
        float ss = 0.f, u[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          ss = fmaf(xv[e], xv[e], ss);
          u[e] = kHasGamma ? xv[e] * gm[e] : xv[e];
        }
        // The token's values (0: sum v^2, 1 + r: m[r]) kCK at a time: up to 32 (n <= 4) at once, every row's loads
        // in flight (255 registers on sm_90, no spill); more in passes of 16 (all at once, n 8 spilled 2 KB).
        float* part = a.part + static_cast<long long>(item) * stride + static_cast<long long>(t) * kK;
#pragma unroll 1
        for (int b = 0; b < kPasses; ++b) {
          float acc[32];
#pragma unroll
          for (int q = 0; q < 32; ++q) acc[q] = 0.f;
          if (b == 0) acc[0] = ss;
          if (kVec) {
#pragma unroll
            for (int q = 0; q < kCK; ++q) {
              const int k = b * kCK + q;
              if (k == 0 || k >= kK) continue;
              float ph[8];
              mhc_load8f<true>(ph, p.phi + static_cast<long long>(k - 1) * kND + (valid > 0 ? c0 : 0), valid);
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[q] = fmaf(u[e], ph[e], acc[q]);
            }
          } else {
            // A column at a time (the same order of sums), u again from x and gamma (a register array takes no
            // dynamic index): 8 x M element loads in flight spilled.
#pragma unroll 1
            for (int e = 0; e < 8; ++e) {
              const int c = c0 + e < kND ? c0 + e : 0;
              const float xe = mhc_decode_x<T, N, D>(p, t, c0 + e);
              const float ue = kHasGamma ? xe * __ldg(p.gamma + c) : xe;
#pragma unroll
              for (int q = 0; q < kCK; ++q) {
                const int k = b * kCK + q;
                if (k == 0 || k >= kK) continue;
                acc[q] = fmaf(ue, __ldg(p.phi + static_cast<long long>(k - 1) * kND + c), acc[q]);
              }
            }
          }
          mhc_decode_reduce_scatter(acc, lane);
          if (lane < kCK && b * kCK + lane < kK) part[b * kCK + lane] = acc[0];
        }
      }
      // The row's padding to whole float4s (at most 3 floats), which the totals' float4 loads read and drop:
      // written, so no load reads uninitialized memory (compute-sanitizer initcheck, H100 run 32).
      if (tid < stride - tokens * kK) a.part[static_cast<long long>(item) * stride + tokens * kK + tid] = 0.f;
      __threadfence();  // every thread's totals of this item before its count
      __syncthreads();
      if (tid == 0) {
        s_last = atomicAdd(done, 1u) == items - 1;
      }
      __syncthreads();
      if (!s_last) continue;
      __threadfence();  // every item's totals, counted before ours, are read after it

      // ---- the heads, kHT tokens at a time: the items' totals in item order, then inv, h, H_pre, H_post ----
      __shared__ __align__(16) float tot[kHT][kK];
      __shared__ float hs[kHT][kM];
      __shared__ float4 sub[kThreads];
      for (int t0 = 0; t0 < tokens; t0 += kHT) {
        // The chunk's totals are 4-float groups g of each item's row from t0 * kK (a multiple of 4: t0 is one
        // of 8), every group's items in `split` consecutive ranges, a thread's each (float4 loads: 2 rounds of
        // L2 latency at T 8, n 4, 64 items, against 8 with a float a thread), then the ranges added in order.
        const int nt = tokens - t0 < kHT ? tokens - t0 : kHT, outs = nt * kK, groups = (outs + 3) / 4;
        const int split = groups < kThreads ? kThreads / groups : 1;
        for (int w = tid; w < split * groups; w += kThreads) {
          const int g = w % groups, s = w / groups;
          const int q0 = static_cast<int>(static_cast<long long>(s) * a.items / split);
          const int q1 = static_cast<int>(static_cast<long long>(s + 1) * a.items / split);
          const float4* src = reinterpret_cast<const float4*>(a.part + static_cast<long long>(t0) * kK) + g;
          float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
          for (int q = q0; q < q1; ++q) {
            const float4 v = __ldcg(src + q * (stride / 4));
            sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
          }
          sub[w] = sum;
        }
        __syncthreads();
        for (int g = tid; g < groups; g += kThreads) {
          float4 sum = sub[g];
          for (int s = 1; s < split; ++s) {
            const float4 v = sub[s * groups + g];
            sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
          }
          const float e[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
          for (int i = 0; i < 4; ++i)
            if (4 * g + i < outs) (&tot[0][0])[4 * g + i] = e[i];
        }
        __syncthreads();
        // mhc_pre_fwd_heads' arithmetic
        for (int w = tid; w < nt * kM; w += kThreads) {
          const int j = w / kM, r = w % kM;
          const long long t = t0 + j;
          const float inv = rsqrtf(tot[j][0] / static_cast<float>(kND) + p.eps_rms);
          const float h = inv * __ldg(p.alpha + Rows::alpha_of(r)) * tot[j][1 + r] + __ldg(p.bias + r);
          hs[j][r] = h;
          if (p.inv != nullptr && r == 0) p.inv[t] = inv;
          if (p.h != nullptr) p.h[t * kM + r] = h;
          if (r < N) p.h_pre[t * N + r] = mhc_sigmoid(h) + p.eps_pre;
          else if (r < 2 * N) p.h_post[t * N + r - N] = 2.f * mhc_sigmoid(h);
          if (!kPreOnly && tokens > kHT && r >= 2 * N) a.z[t * kNN + r - 2 * N] = h;
        }
        __syncthreads();
      }
      __threadfence();  // every thread's H_pre before the flag
      __syncthreads();
      if (tid == 0) atomicExch(a.sync + 2, 1u);
      // ---- Sinkhorn-Knopp of every token, while the y items run ----
      if constexpr (!kPreOnly) {
        // z of token t: hs while every token fits at once, else written above (this block's own writes,
        // before a barrier: plain loads see them)
        auto logits = [&](int t) -> const float* {
          return tokens <= kHT ? hs[t] + 2 * N : a.z + static_cast<long long>(t) * kNN;
        };
        if constexpr (kNN <= 32) {
          for (int t = warp; t < tokens; t += kWarps) {
            const float z = logits(t)[lane < kNN ? lane : 0];
            const float r = SK::forward_warp(z, p.eps_sk, lane);
            if (lane < kNN) p.r[static_cast<long long>(t) * kNN + lane] = r;
          }
        } else {
          constexpr int kFit = static_cast<int>(24 * 1024 / sizeof(typename SK::Smem));
          constexpr int kSlots = kThreads / kNN < kFit ? kThreads / kNN : (kFit > 0 ? kFit : 1);
          __shared__ typename SK::Smem sk[kSlots];
          const int j = tid / kNN, js = j < kSlots ? j : 0;
          const int e = j < kSlots ? tid % kNN : kNN;  // threads past the slots' elements only meet the barriers
          for (int t0 = 0; t0 < tokens; t0 += kSlots) {
            const int t = t0 + js < tokens ? t0 + js : t0;
            const float* rr = SK::forward(logits(t), p.eps_sk, sk[js], false, e);
            if (e < kNN && t0 + j < tokens) p.r[static_cast<long long>(t) * kNN + e] = rr[e];
          }
        }
      }
    } else {
      // ---- y item: its 256 groups of 8 elements, x loaded before the wait for H_pre ----
      const int g = (static_cast<int>(item - items)) * kThreads + tid;
      const bool on = g < tokens * kRow8;
      const int t = on ? g / kRow8 : 0, d = on ? g % kRow8 * 8 : 0;
      const T* xt = static_cast<const T*>(p.x) + static_cast<long long>(t) * N * p.x_row;
      MhcRow8<T> v[N];
#pragma unroll
      for (int i = 0; i < N; ++i) mhc_load8<T, kVec>(v[i], xt + i * p.x_row + d, on ? D - d : 0);
      if (tid == 0) {
        while (*heads_done == 0) {
#if __CUDA_ARCH__ >= 700
          __nanosleep(32);
#endif
        }
        __threadfence();
      }
      __syncthreads();
      if (on) {
        float wh[N];
#pragma unroll
        for (int i = 0; i < N; ++i) wh[i] = __ldcg(p.h_pre + static_cast<long long>(t) * N + i);
        MhcRow8<T> o;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float s = 0.f;
#pragma unroll
          for (int i = 0; i < N; ++i) s += wh[i] * to_float(v[i].v[e]);
          o.v[e] = store_as<T>(s);
        }
        T* y = static_cast<T*>(p.y) + static_cast<long long>(t) * p.y_row + d;
        if (kVec) {
          mhc_store8(y, o);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e)
            if (d + e < D) y[e] = o.v[e];
        }
      }
    }
  }

  // The last block out puts the counters back to zero: every block has taken its last ticket and passed every
  // wait by then.
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(out, 1u) == gridDim.x - 1) {
      volatile unsigned* s = a.sync;
      s[0] = 0u;
      s[1] = 0u;
      s[2] = 0u;
      s[3] = 0u;
    }
  }
}

}  // namespace kspec
