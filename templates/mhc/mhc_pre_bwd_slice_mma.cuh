// mhc.pre.bwd's dx and sums over tokens with each block owning a slice of columns for every token
// (algo=mma_slice, sm_80+, 16-bit x, M <= 24). algo=mma_fused's grid is (128-column blocks) x (32 parts of
// the tokens): each warp loads its own copy of every token's dm, c_v and H_pre (kAhead: 256 B a token, 2.1 GB
// of L2 reads at T 16384, n 4, D 4096, beside x and dy's 0.67 GB), writes its part's sums (52 MB) for a
// reduce kernel, and keeps 2-3 steps of rows in flight. Here block bx owns columns 128 bx .. + 127 and walks
// ALL tokens: its kGroups groups of 4 warps (one warp a 32-column stripe, as mma_fused's) take contiguous
// ranges of the tokens, and each group shares one copy of a step's dm, c_v and H_pre, copied by the group's
// 128 threads (cp.async, 928 B a step at n 4) into a kStages-deep ring (6, or 4 with dx_post) beside its rows of x, dy and dx_post
// (each thread's own slots, as mma_fused's): kStages - 1 steps in flight a group, ~80 KB an SM at 4 groups,
// one block barrier a step. The groups' S^T are added in group order through shared memory at the
// end and dphi = gamma S, dgamma = sum_r phi S go straight to the outputs: no partial sums in the workspace,
// no reduce over parts for them (db and dalpha keep mma_fused's per-part row sums and a one-block reduce).
// Per token and column the same operations as mma_fused (mhc_pre_bwd_fused_step): dx has the same bits; dphi
// and dgamma differ from it by the order of the sums over tokens only (deterministic: fixed ranges and order).
// At T 16384 and nD 16384: 128 blocks of 128 kGroups threads, one an SM, all resident.
#pragma once

#include "mhc/mhc_pre_bwd_fused_mma.cuh"

namespace kspec {

// mma_fused's step as device functions (its kernel keeps its own text: compiled from these, the pre_only n 8
// specialization of mhc_pre_bwd_fused_mma_kernel spilled 8 bytes with the GPU machine's NVRTC, run 34).
// A lane's rows of one step: x, dy and dx_post of tokens 8 j + 2 c + e at its 4 columns.
template <typename T, int kJ>
struct MhcFusedRows {
  MhcRow4<T> x[kJ][2], dy[kJ][2], dp[kJ][2];
};

// A lane's 4 columns from col: whether they lie in nD, their stream si, and its rows' addresses at token 0.
template <typename T, int N, int D>
struct MhcFusedLane {
  bool live;
  int si;
  const T *x, *dy, *dxp;
  T* dx;
  __device__ __forceinline__ MhcFusedLane(const MhcPreBwdParams& p, int col) {
    live = col < N * D;
    si = live ? col / D : 0;
    const int d = live ? col - si * D : 0;
    x = static_cast<const T*>(p.x) + si * p.x_row + d;
    dy = static_cast<const T*>(p.dy) + d;
    dxp = static_cast<const T*>(p.dx_post) + si * p.dx_post_row + d;
    dx = static_cast<T*>(p.dx) + si * p.dx_row + d;
  }
};

// phi^T, A of du: a0 (column row g, r c), a1 (row g + 8, r c), a2 (row g, r c + 4), a3 (row g + 8, r c + 4)
// of k step kk (r = 8 kk + ...), m-tile mt, as hi and lo, into `ph` when `write`; zero past M and past nD. gm:
// gamma at the lane's 4 columns (1 without gamma).
template <int kM, int kND, bool kHasGamma>
__device__ __forceinline__ void mhc_pre_bwd_fused_phi(const MhcPreBwdParams& p, float4 (&ph)[2][(kM + 7) / 8][2][32],
                                                      float (&gm)[4], int col, bool live, bool write) {
  const int lane = static_cast<int>(threadIdx.x) % 32, c = lane % 4;
  if (write) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int kk = 0; kk < (kM + 7) / 8; ++kk) {
        float hi[4], lo[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int r = 8 * kk + c + 4 * (q >> 1), cc = col + 2 * (q & 1) + mt;
          const float v = live && r < kM ? __ldg(p.phi + static_cast<long long>(r) * kND + cc) : 0.f;
          hi[q] = mhc_tf32(v);
          lo[q] = mhc_tf32(v - hi[q]);
        }
        ph[mt][kk][0][lane] = make_float4(hi[0], hi[1], hi[2], hi[3]);
        ph[mt][kk][1][lane] = make_float4(lo[0], lo[1], lo[2], lo[3]);
      }
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) gm[q] = kHasGamma && live ? __ldg(p.gamma + col + q) : 1.f;
}

// One step of kJ x 8 tokens from t (the range ends at t1) for the lane's 4 columns at col (stream si): du^T =
// phi^T dm^T, dx = du gamma - c_v v + H_pre[i] dy (+ dx_post) stored, S^T += x^T dm. dm: the step's dm
// [kJ 8][M] in shared memory, then under kAhead its c_v [kJ 8] and H_pre [kJ 8][n] (else those from global).
// kDuHiOnly (algo=mma_slice_du1): du from phi's and dm's TF32 hi parts alone, one mma instead of three (~2^-11
// relative on du, which only dx, a 16-bit output, takes; S and so dphi and dgamma as before).
template <typename T, int N, int kM, int kJ, bool kHasGamma, bool kHasDxPost, bool kAhead, bool kDuHiOnly = false>
__device__ __forceinline__ void mhc_pre_bwd_fused_step(const MhcPreBwdParams& p, const float* dm,
                                                       const float4 (&ph)[2][(kM + 7) / 8][2][32],
                                                       const MhcFusedRows<T, kJ>& cur, const float (&gm)[4],
                                                       float (&sacc)[2][(kM + 7) / 8][4], T* dx, long long ds,
                                                       long long t, long long t1, bool live, int si) {
  constexpr int kKt = (kM + 7) / 8, kStep = 8 * kJ, kDm = kStep * kM;
  const int lane = static_cast<int>(threadIdx.x) % 32, g = lane / 4, c = lane % 4;
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
        const float4 a = ph[mt][kk][0][lane];
        if constexpr (!kDuHiOnly) {
          const float4 al = ph[mt][kk][1][lane];
          mhc_mma_tf32(du[mt], al.x, al.y, al.z, al.w, h0, h1);
          mhc_mma_tf32(du[mt], a.x, a.y, a.z, a.w, l0, l1);
        }
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

// The sums of a range of tokens: dphi = gamma S into out_phi [M, nD] and dgamma = sum_r phi S into out_gamma
// [nD]: the lane's rows r = 8 nt + 2c + e of its 4 columns, then the four lanes of the same g (lane bits 0, 1)
// by shuffles in a fixed order.
template <int kM, int kND, bool kHasGamma>
__device__ __forceinline__ void mhc_pre_bwd_fused_store_sums(const MhcPreBwdParams& p,
                                                             const float (&sacc)[2][(kM + 7) / 8][4],
                                                             const float (&gm)[4], int col, bool live, float* out_phi,
                                                             float* out_gamma) {
  const int c = static_cast<int>(threadIdx.x) % 4;
  float dg[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < (kM + 7) / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 8 * nt + 2 * c + e;
      if (!live || r >= kM) continue;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float s = sacc[q & 1][nt][2 * (q >> 1) + e];
        out_phi[static_cast<long long>(r) * kND + col + q] = kHasGamma ? gm[q] * s : s;
        if (kHasGamma) dg[q] = fmaf(__ldg(p.phi + static_cast<long long>(r) * kND + col + q), s, dg[q]);
      }
    }
  if constexpr (kHasGamma) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      dg[q] += __shfl_xor_sync(0xffffffffu, dg[q], 1);
      dg[q] += __shfl_xor_sync(0xffffffffu, dg[q], 2);
      if (c == 0 && live) out_gamma[col + q] = dg[q];
    }
  }
}

// The dynamic shared memory of mhc_pre_bwd_slice_mma_kernel (op.cpp's bwd_slice_smem_bytes mirrors it): phi's
// fragments of 4 warps, then the ring of the groups' step values (dm, c_v, H_pre), then the ring of rows, whose
// bytes also hold the groups' S^T for the final sum.
template <int kM, int N, int kGroups, bool kHasDxPost>
struct MhcSliceSmem {
  // 6 steps (5 in flight); 4 with dx_post's rows, so that both fit sm_80's 163 KB.
  static constexpr int kStages = kHasDxPost ? 4 : 6, kKt = (kM + 7) / 8, kRowKinds = kHasDxPost ? 3 : 2;
  static constexpr int kCoef = 8 * (kM + 1 + N), kCoefPad = (kCoef + 3) / 4 * 4;
  static constexpr int kPhBytes = 4 * 2 * kKt * 2 * 32 * 16;
  static constexpr int kCoefBytes = kStages * kGroups * kCoefPad * 4;
  static constexpr int kRowBytes = kStages * kGroups * kRowKinds * 2 * 128 * 8;
  static constexpr int kRedBytes = (kGroups - 1) * 4 * 2 * kKt * 4 * 32 * 4;  // 4 warps a group
  static constexpr int kBytes = kPhBytes + kCoefBytes + (kRowBytes > kRedBytes ? kRowBytes : kRedBytes);
};

// A barrier of the `count` threads of one group on an mbarrier in shared memory (what cuda::barrier's
// arrive_and_wait does: arrive, then wait for the phase that arrival belongs to). mbarrier.arrive releases and the
// wait acquires at CTA scope, so a thread's shared-memory accesses before its arrival (its cp.async copies, once
// cp.async.wait_group has seen them land) happen before every other thread's accesses after its wait. Compute
// Sanitizer's racecheck models cuda::barrier (since 2021.2).
__device__ __forceinline__ void mhc_mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))),
               "r"(count)
               : "memory");
}
__device__ __forceinline__ void mhc_mbar_sync(unsigned long long* bar) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  unsigned long long state;
  asm volatile("mbarrier.arrive.shared.b64 %0, [%1];\n" : "=l"(state) : "r"(a) : "memory");
  unsigned done = 0;
  while (!done) {
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .pred q;\nmbarrier.try_wait.shared.b64 q, [%1], %2;\nselp.u32 %0, 1, 0, q;\n}\n"
                 : "=r"(done)
                 : "r"(a), "l"(state)
                 : "memory");
#else
    asm volatile("{\n.reg .pred q;\nmbarrier.test_wait.shared.b64 q, [%1], %2;\nselp.u32 %0, 1, 0, q;\n}\n"
                 : "=r"(done)
                 : "r"(a), "l"(state)
                 : "memory");
#endif
  }
}

// kDuHiOnly: algo=mma_slice_du1 (mhc_pre_bwd_fused_step's: du in one TF32 mma, for 16-bit dx).
// kGroupSync: how the 4 warps of a group agree that a step's ring slot is full and the last one free. 0: one block
// barrier a step for all groups (algo=mma_slice, mma_slice_du1). 1 (algo=mma_slice_du1_nb): a named barrier a group
// (bar.sync 1 + group, 128); 2 (algo=mma_slice_du1_mb): an mbarrier a group (mhc_mbar_sync). The
// groups share no shared memory in the loop (each its own ring slots [stage][grp]; phi's fragments are written before
// the first block barrier and only read after it), so under 1 and 2 no group waits on another's step; the block
// barrier stays where they share memory, after phi's fragments and before the S^T sums through the drained ring
// (which holds the other groups' slots). Run 33 vs 34 (H100, pre fwd+bwd): a group's own barrier was worth ~50 us
// (du1) to ~190 us (mma_slice) against the block barrier; run 35 (H200): du1 1512 us, 1420 named, 1422 mbarrier,
// racecheck 0 hazards for both. Every group still runs per / 8 steps (the last group's past
// its range skip the step): run 33's named barriers, with each group running its own range's steps only, drew
// racecheck hazards between the loop's ring reads and the S^T writes after the loop's block barrier, in other groups'
// slots. On the hardware that pair is ordered by the block barrier; a checker that counts each thread's barriers
// (barrier intervals) instead sees a group that passed fewer named barriers as still inside the loop. With the same
// count of group barriers in every group, every thread reaches the block barrier after as many barriers as the others.
template <typename T, int N, int D, bool kHasGamma, bool kPreOnly, bool kHasDxPost, int kGroups, bool kDuHiOnly,
          int kGroupSync = 0>
__global__ void __launch_bounds__(128 * kGroups, 1) mhc_pre_bwd_slice_mma_kernel(const MhcPreBwdParams p) {
  using Rows = MhcRows<N, kPreOnly>;
  using Smem = MhcSliceSmem<Rows::kM, N, kGroups, kHasDxPost>;
  constexpr int kM = Rows::kM, kND = N * D, kKt = Smem::kKt, kStages = Smem::kStages, kStep = 8;
  constexpr int kCoef = Smem::kCoef, kCoefPad = Smem::kCoefPad, kDm = kStep * kM, kRowKinds = Smem::kRowKinds;
  static_assert(sizeof(T) == 2, "algo=mma_slice takes 16-bit x only (exact in TF32, 8-byte rows of 4)");
  static_assert(kKt <= 3, "M <= 24: phi's fragments and the accumulators as algo=mma_fused's");
  static_assert(D % 8 == 0, "whole 8-element groups of a stream");
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int grp = warp / 4, stripe = warp % 4, gt = static_cast<int>(threadIdx.x) % 128;
  const int g = lane / 4, c = lane % 4;
  const int col = (static_cast<int>(blockIdx.x) * 4 + stripe) * 32 + 4 * g;  // the lane's 4 columns
  const MhcFusedLane<T, N, D> ln(p, col);
  const bool live = ln.live;
  // The group's tokens: whole steps, the last group's range the shortest.
  const long long per = ((p.T + kGroups - 1) / kGroups + kStep - 1) / kStep * kStep;
  const long long t0 = grp * per < p.T ? grp * per : p.T, t1 = t0 + per < p.T ? t0 + per : p.T;

  extern __shared__ __align__(16) unsigned char smem[];
  unsigned launched_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(launched_smem));
  if (launched_smem < Smem::kBytes) __trap();  // the plan's bwd_slice_smem_bytes disagrees with MhcSliceSmem
  auto* ph = reinterpret_cast<float4(*)[2][kKt][2][32]>(smem);
  auto* coef = reinterpret_cast<float(*)[kGroups][kCoefPad]>(smem + Smem::kPhBytes);
  auto* rows = reinterpret_cast<uint2(*)[kGroups][kRowKinds][2][128]>(smem + Smem::kPhBytes + Smem::kCoefBytes);
  auto* red = reinterpret_cast<float(*)[2 * kKt * 4][32]>(smem + Smem::kPhBytes + Smem::kCoefBytes);

  static_assert(kGroupSync >= 0 && kGroupSync <= 2, "0: block barrier, 1: named barrier, 2: mbarrier a group");
  __shared__ unsigned long long group_bar[kGroups];
  if (kGroupSync == 2 && gt == 0) mhc_mbar_init(&group_bar[grp], 128);
  float gm[4];
  mhc_pre_bwd_fused_phi<kM, kND, kHasGamma>(p, ph[stripe], gm, col, live, grp == 0);
  float sacc[2][kKt][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < kKt; ++nt) sacc[mt][nt][0] = sacc[mt][nt][1] = sacc[mt][nt][2] = sacc[mt][nt][3] = 0.f;
  __syncthreads();  // phi's fragments, written by group 0, read by every group; the groups' mbarriers initialised

  // A step at token t into ring slot `stage`: the thread's rows (tokens t + 2c + e, zeros past the range and
  // past nD) and its share of the group's step values, laid out as mhc_pre_bwd_fused_step's kAhead wants them:
  // dm [8][M], c_v [8], H_pre [8][n] (zeros past the range).
  const long long xs = N * p.x_row, ps = N * p.dx_post_row, ds = N * p.dx_row;
  auto issue = [&](int stage, long long t) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const long long tok = t + 2 * c + e;
      const bool ok = live && tok < t1;
      mhc_cp_async8(&rows[stage][grp][0][e][gt], ln.x + tok * xs, ok);
      mhc_cp_async8(&rows[stage][grp][1][e][gt], ln.dy + tok * p.dy_row, ok);
      if constexpr (kHasDxPost) mhc_cp_async8(&rows[stage][grp][2][e][gt], ln.dxp + tok * ps, ok);
    }
#pragma unroll
    for (int k = 0; k < (kCoef + 127) / 128; ++k) {
      const int q = gt + 128 * k;
      if (q < kCoef) {
        const float* src = p.ws_dm;
        bool ok;
        if (q < kDm) {
          src = p.ws_dm + t * kM + q;
          ok = t + q / kM < t1;
        } else if (q < kDm + kStep) {
          src = p.ws_cv + t + (q - kDm);
          ok = t + (q - kDm) < t1;
        } else {
          src = p.ws_hpre + t * N + (q - kDm - kStep);
          ok = t + (q - kDm - kStep) / N < t1;
        }
        mhc_cp_async4(&coef[stage][grp][q], ok ? src : p.ws_dm, ok);
      }
    }
    mhc_cp_async_commit();
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s, t0 + s * kStep);
  int stage = 0;
  // Every group runs per / 8 steps (the last group's past its range are all zeros and skip the step), so that under
  // kGroupSync 0 one block barrier a step serves all groups, and under 1 and 2 every group passes as many barriers
  // (see kGroupSync above).
#pragma unroll 1
  for (long long t = t0; t < t0 + per; t += kStep) {
    // This step's copies (the thread's own) landed; after the barrier, every thread's (of the group) have, and every
    // warp (of the group) is done with the slot the last step read, which the next copies refill.
    mhc_cp_async_wait<kStages - 2>();
    if constexpr (kGroupSync == 1) asm volatile("bar.sync %0, 128;\n" ::"r"(1 + grp) : "memory");
    else if constexpr (kGroupSync == 2) mhc_mbar_sync(&group_bar[grp]);
    else __syncthreads();
    issue(stage == 0 ? kStages - 1 : stage - 1, t + (kStages - 1) * kStep);
    MhcFusedRows<T, 1> cur;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      *reinterpret_cast<uint2*>(cur.x[0][e].v) = rows[stage][grp][0][e][gt];
      *reinterpret_cast<uint2*>(cur.dy[0][e].v) = rows[stage][grp][1][e][gt];
      if constexpr (kHasDxPost) *reinterpret_cast<uint2*>(cur.dp[0][e].v) = rows[stage][grp][2][e][gt];
    }
    if (t < t1)
      mhc_pre_bwd_fused_step<T, N, kM, 1, kHasGamma, kHasDxPost, true, kDuHiOnly>(p, coef[stage][grp], ph[stripe], cur, gm,
                                                                                 sacc, ln.dx, ds, t, t1, live, ln.si);
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }

  // The groups' S^T added in group order (the rows' ring, drained, holds groups 1.. of them), then group 0
  // stores dphi and dgamma.
  mhc_cp_async_wait<0>();
  __syncthreads();
  if (grp > 0) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < kKt; ++nt)
#pragma unroll
        for (int k = 0; k < 4; ++k) red[(grp - 1) * 4 + stripe][(mt * kKt + nt) * 4 + k][lane] = sacc[mt][nt][k];
  }
  __syncthreads();
  if (grp == 0) {
    for (int q = 1; q < kGroups; ++q)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < kKt; ++nt)
#pragma unroll
          for (int k = 0; k < 4; ++k) sacc[mt][nt][k] += red[(q - 1) * 4 + stripe][(mt * kKt + nt) * 4 + k][lane];
    mhc_pre_bwd_fused_store_sums<kM, kND, kHasGamma>(p, sacc, gm, col, live, p.dphi, p.dgamma);
  }
  // db and dalpha: the parts' row sums (as mma_fused's), added by the one-block reduce.
  for (int part = static_cast<int>(blockIdx.x); part < p.parts; part += static_cast<int>(gridDim.x)) {
    const long long a = static_cast<long long>(part) * p.tokens_per_part;
    mhc_pre_bwd_row_sums<N, D, kPreOnly>(p, part, a, a + p.tokens_per_part < p.T ? a + p.tokens_per_part : p.T);
  }
}

}  // namespace kspec
