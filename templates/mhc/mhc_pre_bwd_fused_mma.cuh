// mhc.pre.bwd's dx and sums over tokens in one pass over x (algo=mma_fused, sm_80+, 16-bit x, M <= 24).
// algo=mma_tokens reads x three times (the token pass, the columns kernel's S = dm^T x, the dx kernel's
// dx = du gamma - c_v v + H_pre dy); here, once the token pass has written dm, c_v and H_pre, block
// (bx, part) takes 128 columns of nD and walks its part's tokens 8 at a time, and from the same registers
// of x computes both du = dm phi (dx, stored at once) and S^T += x^T dm (the part's dphi = gamma S and
// dgamma = sum_r phi S, as mhc_pre_bwd_columns_mma_kernel leaves them): x is read twice per backward instead
// of three times, and phi is loaded once per block (split hi + lo into shared memory, each lane's own
// fragments: in registers they spilled 84 bytes at n 4 on sm_90).
// Both products are mma.m16n8k8 with TF32 operands and fp32 accumulators, rows = columns of nD:
//   du^T = phi^T dm^T: A = phi^T (16 columns x 8 rows r), B = dm^T (8 r x 8 tokens); both fp32, split hi + lo,
//                      three mmas (lo hi, hi lo, hi hi; ~2^-21 relative), as mhc_pre_bwd_dx_mma_kernel.
//   S^T += x^T dm:     A = x^T (16 columns x 8 tokens, exact in TF32), B = dm (8 tokens x 8 r) split hi + lo.
// Layouts: row g + 8h of m-tile mt is column col + 2h + mt (col = the lane's first column, 4 g from the
// warp's), so a lane's 4 columns are consecutive (8-byte loads of x, dy, dx_post and stores of dx); du's
// output has tokens 2c, 2c + 1 of each 8, which are exactly the k slots c, c + 4 that S's A fragment wants
// (k slot c = token 2c, slot c + 4 = token 2c + 1), so no shuffle or shared memory sits between the two.
// The per-part sums go to the same workspace as the other algos' and mhc_pre_bwd_reduce_kernel adds the
// parts in order: deterministic, no atomics.
// kAhead (algo=mma_fused_ahead): run 28 (H100, T 16384, n 4, D 4096, bf16, ncu) had this kernel at 941 us, 42% of
// DRAM and 43% of the SM, 4 warps a scheduler, ~350 instructions a step but ~3300 cycles a step: each step's
// epilogue loaded c_v and H_pre per token from L2 and used them at once (a round trip a step, nothing to
// overlap it), and stored dx as four 2-byte stores a token (the row's struct copy went element by element).
// With kAhead the step's c_v and H_pre come a step ahead with its dm (the same registers and shared slot), dx
// goes out as one 8-byte store, and the parts run from the last (the token pass's last tiles are the ones still
// in L2). The same values into the same operations: the same bits.
#pragma once

#include "common/dtype.cuh"
#include "mhc/mhc_pre.cuh"
#include "mhc/mhc_pre_mma.cuh"

namespace kspec {

// Four consecutive 16-bit elements of a row (8 bytes).
template <typename T>
struct alignas(8) MhcRow4 {
  T v[4];
};

// Grid: (ceil(nD / 128), parts) blocks of kMhcMmaThreads; warp w of block bx takes the 32 columns
// 128 bx + 32 w .. + 31. D % 8 == 0 and every pointer and row 16-byte aligned (the plan's rule), so a
// lane's 4 columns lie in one stream and its loads are whole.
template <typename T, int N, int D, bool kHasGamma, bool kPreOnly, bool kHasDxPost, bool kAhead>
__global__ void __launch_bounds__(kMhcMmaThreads) mhc_pre_bwd_fused_mma_kernel(const MhcPreBwdParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  constexpr int kM = Rows::kM, kND = N * D, kKt = (kM + 7) / 8;  // du's k steps = S^T's n-tiles
  // 8 tokens a step: 16 a step (rows prefetched in registers) came to 222-255 registers and spilled.
  constexpr int kWarps = kMhcMmaThreads / 32, kWarpCols = 32, kStep = 8, kJ = kStep / 8;
  static_assert(sizeof(T) == 2, "algo=mma_fused takes 16-bit x only (exact in TF32, 8-byte rows of 4)");
  static_assert(kKt <= 3, "M <= 24: phi's fragments (8 KB a k step) and the ring fit 48 KB of shared memory");
  static_assert(D % 8 == 0, "whole 8-element groups of a stream");
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const int part = kAhead ? static_cast<int>(gridDim.y - 1 - blockIdx.y) : static_cast<int>(blockIdx.y);
  const long long t0 = static_cast<long long>(part) * p.tokens_per_part;
  const long long t1 = t0 + p.tokens_per_part < p.T ? t0 + p.tokens_per_part : p.T;
  const int col = (static_cast<int>(blockIdx.x) * kWarps + warp) * kWarpCols + 4 * g;  // the lane's 4 columns
  const bool live = col < kND;
  const int si = live ? col / D : 0, d = live ? col - si * D : 0;
  const T* x = static_cast<const T*>(p.x) + si * p.x_row + d;
  const T* dy = static_cast<const T*>(p.dy) + d;
  const T* dxp = static_cast<const T*>(p.dx_post) + si * p.dx_post_row + d;
  T* dx = static_cast<T*>(p.dx) + si * p.dx_row + d;

  // phi^T, A of du: a0 (column row g, r c), a1 (row g + 8, r c), a2 (row g, r c + 4), a3 (row g + 8, r c + 4)
  // of k step kk (r = 8 kk + ...), m-tile mt, as hi and lo; zero past M and past nD. A lane reads back only
  // what it wrote: no barrier.
  __shared__ float4 ph[kWarps][2][kKt][2][32];
  float gm[4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int kk = 0; kk < kKt; ++kk) {
      float hi[4], lo[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = 8 * kk + c + 4 * (q >> 1), cc = col + 2 * (q & 1) + mt;
        const float v = live && r < kM ? __ldg(p.phi + static_cast<long long>(r) * kND + cc) : 0.f;
        hi[q] = mhc_tf32(v);
        lo[q] = mhc_tf32(v - hi[q]);
      }
      ph[warp][mt][kk][0][lane] = make_float4(hi[0], hi[1], hi[2], hi[3]);
      ph[warp][mt][kk][1][lane] = make_float4(lo[0], lo[1], lo[2], lo[3]);
    }
#pragma unroll
  for (int q = 0; q < 4; ++q) gm[q] = kHasGamma && live ? __ldg(p.gamma + col + q) : 1.f;

  // S^T: sacc[mt][nt][2h + e] = sum over the part's tokens of x[., col + 2h + mt] dm[., 8 nt + 2c + e].
  float sacc[2][kKt][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < kKt; ++nt) sacc[mt][nt][0] = sacc[mt][nt][1] = sacc[mt][nt][2] = sacc[mt][nt][3] = 0.f;

  // dm of a step's tokens (kStep x M floats, contiguous in the workspace): kDmLane coalesced loads a lane, held
  // in registers a step ahead, then through the warp's own shared slot to the fragments (zeros past the part).
  // kAhead: then the step's c_v (kStep floats) and H_pre (kStep x n), contiguous in theirs, the same way.
  constexpr int kDm = kStep * kM, kCoef = kAhead ? kStep * (1 + N) : 0, kDmLane = (kDm + kCoef + 31) / 32;
  __shared__ float dms[kWarps][kDm + kCoef];
  auto load_dm = [&](float (&v)[kDmLane], long long t) {
    const long long left = (t1 - t) * kM;
    const float* src = p.ws_dm + t * kM;
#pragma unroll
    for (int k = 0; k < kDmLane; ++k) {
      const int q = lane + 32 * k;
      if (!kAhead || q < kDm) {
        v[k] = q < kDm && q < left ? __ldg(src + q) : 0.f;
      } else if (q < kDm + kStep) {
        v[k] = t + (q - kDm) < t1 ? __ldg(p.ws_cv + t + (q - kDm)) : 0.f;
      } else {
        const int e = q - kDm - kStep;
        v[k] = e < kStep * N && t + e / N < t1 ? __ldg(p.ws_hpre + t * N + e) : 0.f;
      }
    }
  };
  // The lane's rows of a step at token t: tokens t + 8 j + 2 c + e (zeros past the part and past nD), copied
  // into the thread's own slots of a ring of kStages steps, kStages - 1 steps ahead (cp.async: 2 steps of x,
  // dy, dx_post in flight a lane, without the registers; held in registers one step ahead, 18 KB an SM were in
  // flight at 3 blocks an SM).
  // kAhead without dx_post: 4 steps, 3 ahead, in the 6 KB dx_post's rows took (the 48 KB of static shared memory
  // hold no more): at a faster step, 2 steps ahead cover less of DRAM's latency.
  constexpr int kStages = kAhead && !kHasDxPost ? 4 : 3, kRowKinds = kAhead && !kHasDxPost ? 2 : 3;
  __shared__ uint2 ring[kStages][kRowKinds][kJ][2][kMhcMmaThreads];
  const long long xs = N * p.x_row, ps = N * p.dx_post_row, ds = N * p.dx_row;
  auto issue = [&](int stage, long long t) {
    const long long tl = t + 2 * c;
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const long long tok = tl + 8 * j + e;
        const bool ok = live && tok < t1;
        mhc_cp_async8(&ring[stage][0][j][e][threadIdx.x], x + tok * xs, ok);
        mhc_cp_async8(&ring[stage][1][j][e][threadIdx.x], dy + tok * p.dy_row, ok);
        if constexpr (kHasDxPost) mhc_cp_async8(&ring[stage][2][j][e][threadIdx.x], dxp + tok * ps, ok);
      }
    mhc_cp_async_commit();
  };

  float dmv[kDmLane];
  load_dm(dmv, t0);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s, t0 + s * kStep);
  int stage = 0;
#pragma unroll 1
  for (long long t = t0; t < t1; t += kStep) {
    __syncwarp();  // the last step's reads of dms are done
#pragma unroll
    for (int k = 0; k < kDmLane; ++k)
      if (lane + 32 * k < kDm + kCoef) dms[warp][lane + 32 * k] = dmv[k];
    __syncwarp();
    // kStages - 1 steps ahead into the slot the last step read (its values are used, so read); then this
    // step's group is complete once at most kStages - 1 are pending. dm one step ahead in registers.
    issue(stage == 0 ? kStages - 1 : stage - 1, t + (kStages - 1) * kStep);
    if (t + kStep < t1) load_dm(dmv, t + kStep);
    mhc_cp_async_wait<kStages - 1>();
    struct {
      MhcRow4<T> x[kJ][2], dy[kJ][2], dp[kJ][2];
    } cur;
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        *reinterpret_cast<uint2*>(cur.x[j][e].v) = ring[stage][0][j][e][threadIdx.x];
        *reinterpret_cast<uint2*>(cur.dy[j][e].v) = ring[stage][1][j][e][threadIdx.x];
        if constexpr (kHasDxPost) *reinterpret_cast<uint2*>(cur.dp[j][e].v) = ring[stage][2][j][e][threadIdx.x];
      }
    stage = stage == kStages - 1 ? 0 : stage + 1;
    const float* dm = dms[warp];
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      // du^T of tokens t + 8 j .. + 7: B = dm^T, b0 (r 8 kk + c, token slot g), b1 (r + 4, token slot g).
      float du[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) du[mt][0] = du[mt][1] = du[mt][2] = du[mt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kKt; ++kk) {
        const int r0 = 8 * kk + c, r1 = r0 + 4;
        const float v0 = r0 < kM ? dm[(8 * j + g) * kM + r0] : 0.f;
        const float v1 = r1 < kM ? dm[(8 * j + g) * kM + r1] : 0.f;
        const float h0 = mhc_tf32(v0), h1 = mhc_tf32(v1);
        const float l0 = mhc_tf32(v0 - h0), l1 = mhc_tf32(v1 - h1);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const float4 a = ph[warp][mt][kk][0][lane], al = ph[warp][mt][kk][1][lane];
          mhc_mma_tf32(du[mt], al.x, al.y, al.z, al.w, h0, h1);
          mhc_mma_tf32(du[mt], a.x, a.y, a.z, a.w, l0, l1);
          mhc_mma_tf32(du[mt], a.x, a.y, a.z, a.w, h0, h1);
        }
      }
      // S^T += x^T dm over these 8 tokens: A = x^T, a0 (column row g, token slot c = 8 j + 2c), a1 (row g + 8),
      // a2 (row g, slot c + 4 = token 8 j + 2c + 1), a3 (row g + 8, slot c + 4); B = dm, b0 (token 8 j + 2c,
      // r 8 nt + g), b1 (token 8 j + 2c + 1, r 8 nt + g).
#pragma unroll
      for (int nt = 0; nt < kKt; ++nt) {
        const int r = 8 * nt + g;
        const float w0 = r < kM ? dm[(8 * j + 2 * c) * kM + r] : 0.f;
        const float w1 = r < kM ? dm[(8 * j + 2 * c + 1) * kM + r] : 0.f;
        const float h0 = mhc_tf32(w0), h1 = mhc_tf32(w1);
        const float l0 = mhc_tf32(w0 - h0), l1 = mhc_tf32(w1 - h1);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const float a0 = to_float(cur.x[j][0].v[mt]), a1 = to_float(cur.x[j][0].v[2 + mt]);
          const float a2 = to_float(cur.x[j][1].v[mt]), a3 = to_float(cur.x[j][1].v[2 + mt]);
          mhc_mma_tf32(sacc[mt][nt], a0, a1, a2, a3, l0, l1);
          mhc_mma_tf32(sacc[mt][nt], a0, a1, a2, a3, h0, h1);
        }
      }
      // du[mt][2h + e] = du of token t + 8 j + 2c + e at column col + 2h + mt: dx = du gamma - c_v v +
      // H_pre[i] dy (+ dx_post).
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const long long tok = t + 8 * j + 2 * c + e;
        if (!live || tok >= t1) continue;
        const int ts = 8 * j + 2 * c + e;  // the token's place in the step
        const float cv = kAhead ? dm[kDm + ts] : __ldg(p.ws_cv + tok);
        const float hp = kAhead ? dm[kDm + kStep + ts * N + si] : __ldg(p.ws_hpre + tok * N + si);
        MhcRow4<T> out;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float u = du[q & 1][2 * (q >> 1) + e];
          float dv = (kHasGamma ? u * gm[q] : u) - cv * to_float(cur.x[j][e].v[q]) + hp * to_float(cur.dy[j][e].v[q]);
          if (kHasDxPost) dv += to_float(cur.dp[j][e].v[q]);
          out.v[q] = store_as<T>(dv);
        }
        if (kAhead) {
          // One 8-byte store (a uint2 store through a cast still came out as two 4-byte ones).
          const uint2 w = *reinterpret_cast<const uint2*>(out.v);
          asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(dx + tok * ds), "r"(w.x), "r"(w.y) : "memory");
        } else {
          *reinterpret_cast<MhcRow4<T>*>(dx + tok * ds) = out;
        }
      }
    }
  }

  // The part's dphi = gamma S and dgamma = sum_r phi S: the lane's rows r = 8 nt + 2c + e of its 4 columns,
  // then the four lanes of the same g (lane bits 0, 1) by shuffles in a fixed order.
  float* out = p.ws_part + static_cast<long long>(part) * (kM + 1) * kND;
  float dg[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < kKt; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 8 * nt + 2 * c + e;
      if (!live || r >= kM) continue;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float s = sacc[q & 1][nt][2 * (q >> 1) + e];
        out[static_cast<long long>(r) * kND + col + q] = kHasGamma ? gm[q] * s : s;
        if (kHasGamma) dg[q] = fmaf(__ldg(p.phi + static_cast<long long>(r) * kND + col + q), s, dg[q]);
      }
    }
  if constexpr (kHasGamma) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      dg[q] += __shfl_xor_sync(0xffffffffu, dg[q], 1);
      dg[q] += __shfl_xor_sync(0xffffffffu, dg[q], 2);
      if (c == 0 && live) out[static_cast<long long>(kM) * kND + col + q] = dg[q];
    }
  }
  if (blockIdx.x == 0) mhc_pre_bwd_row_sums<N, D, kPreOnly>(p, part, t0, t1);
}

}  // namespace kspec
