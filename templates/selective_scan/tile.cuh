// The one-pass tile kernel (algo 2) of the selective scan's forward.
#pragma once

#include "selective_scan/packed.cuh"

namespace kspec {

// =============================================================================================
// The one-pass forward ("algo 2", the tile kernel): few channels and long sequences, where the
// sequential kernels (sequential.cuh) need segments and so two ex2 per step and state (the local pass and the
// main pass). Here the warps of a block run along time and pay one.
//
// Layout: a block holds kCW = 8 channels of one batch and B/C group (dstate 16); lane = (channel, state
// group of 4 states) with bit 0 a channel bit, bits 1-2 the group and bits 3-4 the other channel bits.
// So lanes n and n^1 read the same B/C vector and lanes n and n^2 the same {dt, dt u}, which halves
// their shared-memory wavefronts (an LDS.128 takes 4 unless such pairs share an address, then 2).
// Measured on the H100 (prototype, design D of tools/bench/NOTES.md): 1.93 -> 1.60 ms at 1x2048x65536.
// The block's kWarps warps take kRun = 16 consecutive steps each of a tile of kTile = 16 kWarps steps
// (kRun = 8 at 8 warps, below).
// Per tile:
//  1. each lane stages {dt, dt u} of 4 of its warp's steps of its channel (its raw u, delta and z
//     were loaded a tile ahead into registers);
//  2. sweep 1: each lane runs its warp's 16 steps from a zero state: x, P (the product of the decays
//     so far), yl_t = C_t . x_t and CP_t = C_t * P_t kept in registers for each step. One ex2 per step
//     and state;
//  3. the warp's map (P, x) goes to shared memory; the block stages the next tile's variable B/C
//     (double-buffered, loaded a tile ahead) and meets at its one barrier;
//  4. warp w folds the maps of warps 0..w-1 into the carried state: h, the true state entering its
//     steps (written to `states` for the backward: a run starts at a multiple of kStateStride). The
//     last warp also writes the next tile's carry;
//  5. sweep 2: y_t = yl_t + CP_t . h, no recurrence and no shared-memory reads;
//  6. the 4 state groups' parts of y are summed through shared memory (each lane sums its 4 steps),
//     and out = (y + D u) * silu(z).
// 6 warps per block, because the grid is one block per 8 channels (256 at 1x2048x65536) and 4-warp
// blocks left a third of the 3-per-SM slots empty. Measured on the H100 (1x2048x65536 bf16): 1.437 ms,
// against 1.53-1.56 ms for the two passes of algo 1. The steps from the prototype to that figure
// (y through shared memory, packed conversions, the unpredicated prefetch; z loaded late, dropped):
// tools/bench/NOTES.md, "The tile kernel's attempts".
//
// 8 warps of 8-step runs (64-step tiles, as 4 warps of 16): for short sequences of few channels
// (1x2048x512: 256 blocks, one per 8 channels) the grid is too small to give an SM more than 2 blocks, so
// 4-warp blocks leave 8 warps per SM, 2 per scheduler, to hide the latencies of each tile's ex2, shared
// memory reads and barrier; 8 warps of half the registers (C P and y of 8 steps: 128 registers, 2 blocks
// per SM) double that, at the cost of twice the per-tile work per step (fold, staging, y's sum).
// A lane then stages and writes 2 steps, and only the even warps' runs start at a multiple of
// kStateStride (their entering state goes to `states`). Measured (H100, run 25): 0.0194 ms against 0.0178
// at 4 warps: slower.
//
// 2 states per lane (kStates = 2, config lanes=8: 8 lanes a channel, 4 channels a block; 4 warps): the same
// grid problem from the other side. 1x2048x512 gets 512 blocks instead of 256, and a lane holds half the
// C P values of its 16-step run (about 110 registers against 171-187), so 4 blocks of 4 warps fit an SM at
// 128 registers: 16 warps per SM, each walking the 16-step runs of the 4-warp kernel, at ~1.3x the
// instructions per channel-step (the per-step shared-memory reads of q and B/C, the fold and y's sum are
// paid per 2 states instead of per 4; the ex2 count is the same). The lane map keeps its pairs: lanes n and
// n^1 read the same B/C vector (bits 1-3 are the state group, bits 0 and 4 the channel). At 2 warps (32-step
// tiles, 8 blocks per SM) a barrier waits for one other warp and the fold reads at most one map, for twice the
// tiles. Not yet measured.
//
// Lean (kLean 1 and 2, configs items=8 and items=16; 4 warps of 4 states a lane only): the same arithmetic with
// fewer instructions on each tile's path, for 1x2048x512, where 8 warps an SM (the grid's 2 blocks of 4 warps at
// 185-187 registers) leave each scheduler 2 warps and the kernel is latency-bound (run 28's ncu: SM 42% busy,
// occupancy 12%; the loop is 902 SASS instructions a warp and tile on sm_90, MUFU about a third busy).
// kLean 1: y's sum over a lane's states in one FMA chain a step, in both sweeps (the two accumulators and their
// add a step were for a chain that the unrolled sweep's other steps already hide): 870 instructions a tile at
// the same 185 registers (nvcc 13.0, sm_90). kLean 2 also reads every map the fold needs before its FMAs
// (predicated, no early exit): the last warp's state waits one shared-memory latency instead of two on the way
// to the next tile's barrier; 864 instructions, but 237 registers (still 2 blocks of 4 warps an SM). y is summed
// in another order: not bitwise the kernel above, within its tolerance. Not yet measured.
//
// Launch: gridDim = (ceil(dim / 8), batch), blockDim = 32 kWarps, dynamic shared memory
// tile_fwd_smem_floats() floats; the arguments of selective_scan_fwd_kernel. Requires kVec (seqlen a
// multiple of 8, 16-byte aligned pointers: a variable B/C row's 8-step vectors and a lane's 4 (2) steps are
// aligned vectors, wholly inside or outside the sequence) and dstate 16. Steps past seqlen stage dt = 0
// (a = 1, dt u = 0: the carry passes through), by a lane's 4 steps, so a run may end inside a tile and
// inside a warp's 16 steps; channels past dim run with A = 0 and dt = 0 and write nothing. Both read
// inputs inside the tensors (the row's last steps, the last channel).
// =============================================================================================
template <typename Flags, int kWarps_, int kStates = 4, int kLean_ = 0>
struct TileScanTraits : Flags {
  static_assert(!Flags::kTimeMajor, "time-major tensors: the sequential kernels only");
  static constexpr int kWarps = kWarps_, kThreads = 32 * kWarps;
  static constexpr int kLean = kLean_;  // 0: as measured; 1: y in one chain; 2: and the fold's maps read ahead
  static_assert(kLean == 0 || (kLean <= 2 && kWarps == 4 && kStates == 4),
                "the lean tile kernel (1 or 2): 4 warps of 4 states a lane");
  static constexpr int kS = kStates;           // states per lane
  static constexpr int kG = Flags::kDstate / kS;  // state groups (lanes per channel)
  static constexpr int kCW = 32 / kG;          // channels per block
  // Steps per warp and tile: 16 (kStateStride), or 8 at 8 warps, whose runs' C P and y values (half of
  // them) leave the 128 registers of 2 blocks of 8 warps per SM.
  static constexpr int kRun = kWarps == 8 ? scan_detail::kStateStride / 2 : scan_detail::kStateStride;
  static constexpr int kTile = kWarps * kRun;  // steps per tile
  static constexpr int kQ = kRun / kG;         // steps a lane stages and writes
  static constexpr int kNvar = (Flags::kVarB ? 1 : 0) + (Flags::kVarC ? 1 : 0);
  static constexpr int kYRow = kCW * kRun + 4;  // a state group's row of partial y (+4: 8 bank groups)
  static_assert(Flags::kVectors, "the tile kernel needs whole 16-byte aligned vectors (kVec: seqlen a multiple of 8)");
  static_assert(Flags::kDstate == 16, "the tile kernel's lane map is for dstate 16");
  static_assert(kQ == 4 || kQ == 2, "a lane stages 4 steps (2 at 8 warps)");
  static_assert(kS == 4 ? kWarps == 4 || kWarps == 6 || kWarps == 8 : kS == 2 && (kWarps == 2 || kWarps == 4),
                "4 states per lane at 4, 6 or 8 warps; 2 at 2 or 4 warps");
  // Blocks per SM the registers are bounded for: 2 (see the kernel); with 2 states per lane 16 warps per SM at
  // 128 registers (4 blocks of 4 warps, 8 of 2).
  static constexpr int kMinBlocks = kS == 2 ? 16 / kWarps : 2;
};

namespace scan_detail {
// A lane's S consecutive floats of shared memory (S = 4: one 16-byte access, S = 2: one 8-byte access).
template <int S>
__device__ __forceinline__ void lds_states(const float* p, float (&v)[S]) {
  if constexpr (S == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
  } else {
    const float2 t = *reinterpret_cast<const float2*>(p);
    v[0] = t.x, v[1] = t.y;
  }
}
template <int S>
__device__ __forceinline__ void sts_states(float* p, const float (&v)[S]) {
  if constexpr (S == 4)
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  else
    *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
}
}  // namespace scan_detail

template <typename Tr>
constexpr int tile_fwd_smem_floats() {
  return 2 * Tr::kNvar * Tr::kTile * Tr::kDstate  // s_bc [buffer][B, C][step][state]
         + 2 * Tr::kTile * Tr::kCW                 // s_q [step][channel] float2 {dt, dt u}
         + 2 * Tr::kWarps * 2 * Tr::kCW * Tr::kDstate  // s_px [slot][warp][P, X][channel][state]
         + 2 * Tr::kCW * Tr::kDstate                   // s_carry [slot][channel][state]
         + Tr::kWarps * Tr::kG * Tr::kYRow;            // s_y [warp][group][channel * kRun + step]
}

// Two blocks per SM (168 registers at 6 warps, 122-128 at 8, no spill). At 4 warps, 3 blocks (168 registers) ran the
// prototype 1.50 ms against 1.53 at 2, but NVRTC spilled 8 bytes there for fp16 on sm_90. Four with 2 states a lane.
template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocks)
    selective_scan_fwd_tile_kernel(const typename Tr::T* __restrict__ u, const typename Tr::T* __restrict__ delta,
                                   const float* __restrict__ A, const typename Tr::TB* __restrict__ B,
                                   const typename Tr::TC* __restrict__ C, const float* __restrict__ D,
                                   const typename Tr::T* __restrict__ z, const float* __restrict__ delta_bias,
                                   const float* __restrict__ h0, typename Tr::T* __restrict__ out,
                                   float* __restrict__ last_state, int dim, int seqlen, int channels_per_group,
                                   int groups, float* __restrict__ states) {
  using namespace scan_detail;
  using T = typename Tr::T;
  constexpr int N = Tr::kDstate, S = Tr::kS, G = Tr::kG, CW = Tr::kCW, W = Tr::kWarps, R = Tr::kRun;
  constexpr int TL = Tr::kTile, Q = Tr::kQ, YR = Tr::kYRow;
  extern __shared__ __align__(16) float smem[];
  float* s_bc = smem;
  float2* s_q = reinterpret_cast<float2*>(s_bc + 2 * Tr::kNvar * TL * N);
  float* s_px = reinterpret_cast<float*>(s_q + TL * CW);
  float* s_carry = s_px + 2 * W * 2 * CW * N;
  float* s_y = s_carry + 2 * CW * N;

  const int tid = static_cast<int>(threadIdx.x), w = tid / 32, lane = tid % 32;
  const int sg = (lane >> 1) & (G - 1), c = (lane & 1) | ((lane / (2 * G)) << 1);
  const int b = static_cast<int>(blockIdx.y), d0 = static_cast<int>(blockIdx.x) * CW, d = d0 + c;
  const bool live = d < dim;
  const long long chan = static_cast<long long>(b) * dim + d;
  const long long bc_base = (static_cast<long long>(b) * groups + d0 / channels_per_group) * N * seqlen;
  const int n0 = sg * S;
  float A2[S], Bf[S], Cf[S];
#pragma unroll
  for (int i = 0; i < S; ++i) {
    A2[i] = live ? A[d * N + n0 + i] * kLog2e : 0.0f;
    Bf[i] = !Tr::kVarB && live ? to_float(B[d * N + n0 + i]) : 0.0f;
    Cf[i] = !Tr::kVarC && live ? to_float(C[d * N + n0 + i]) : 0.0f;
  }
  const float bias = Tr::kHasDeltaBias && live ? delta_bias[d] : 0.0f;
  const float Dd = Tr::kHasD && live ? D[d] : 0.0f;
  const int nt = (seqlen + TL - 1) / TL;

  // This lane's Q steps of its channel in a tile: t0 + w R + sg Q. The loads never leave the tensors, so
  // they need no predicate and no zeroing: channels past dim read the last channel and steps past seqlen
  // the row's last Q (step 1 gives them dt = 0; nothing is written from them). Addresses: the block's
  // rows from one 64-bit base (uniform registers) and a lane's offset in 32 bits (tile_valid: dstate
  // seqlen fits in an int).
  const long long blk = (static_cast<long long>(b) * dim + d0) * seqlen;
  const T* const u_blk = u + blk;
  const T* const delta_blk = delta + blk;
  const T* const z_blk = Tr::kHasZ ? z + blk : nullptr;
  T* const out_blk = out + blk;
  const int tq = w * R + sg * Q;
  const int lane_in = (live ? c : dim - 1 - d0) * seqlen, lane_out = c * seqlen + tq;
  LaneSteps<Tr, Q> pre;
  auto load_q = [&](int t0) { pre.load(u_blk, delta_blk, z_blk, lane_in, t0 + tq, seqlen); };
  BcRows<Tr, TL> rows;
  const T* const Bv = Tr::kVarB ? reinterpret_cast<const T*>(B) + bc_base : nullptr;  // u's type (BcRows)
  const T* const Cv = Tr::kVarC ? reinterpret_cast<const T*>(C) + bc_base : nullptr;
  auto load_bc = [&](int t0) {
    if constexpr (Tr::kNvar > 0) rows.load(Bv, Cv, seqlen, t0);
  };
  auto stage_bc = [&](int buf) {
    if constexpr (Tr::kNvar > 0) rows.stage(s_bc + buf * Tr::kNvar * TL * N);
  };
  // The first tile's u, delta, z are loaded before its B/C rows are staged (which waits on their loads), so
  // the two loads' latencies overlap: a block of a short sequence runs few tiles after this start.
  load_bc(0);
  load_q(0);
  stage_bc(0);
  if (nt > 1) load_bc(TL);
  if (w == 0) {
#pragma unroll
    for (int i = 0; i < S; ++i) s_carry[c * N + n0 + i] = Tr::kHasH0 && live ? h0[chan * N + n0 + i] : 0.0f;
  }
  __syncthreads();

  for (int it = 0; it < nt; ++it) {
    const int t0 = it * TL, tr = t0 + w * R;  // the tile's first step, this warp's
    const bool run = live && tr < seqlen;            // the warp's run starts inside the sequence
    const bool qrun = live && tr + sg * Q < seqlen;  // this lane's Q steps are inside it (seqlen % Q == 0)
    // 1. {dt, dt u} of this lane's Q steps (dt = 0, u = 0 past seqlen and dim: the state passes through).
    // u is kept as floats for the outputs, z as raw words (copied: the next tile's prefetch overwrites it).
    const RawSteps<T, Q> rz = pre.z;
    float uq[Q];
#pragma unroll
    for (int k = 0; k < Q; ++k) {
      float dt = pre.delta.at(k) + bias;
      if constexpr (Tr::kSoftplus) dt = softplus_sfu(dt);
      dt = qrun ? dt : 0.0f;
      uq[k] = pre.u.at(k);
      s_q[(w * R + sg * Q + k) * CW + c] = make_float2(dt, dt * uq[k]);
    }
    if (it + 1 < nt) load_q(t0 + TL);
    __syncwarp();
    // 2. sweep 1 from a zero state, a group of 4 steps' shared-memory reads first
    const float* sB = s_bc + (it & 1) * Tr::kNvar * TL * N + w * R * N + n0;
    const float* sC = sB + (Tr::kVarB ? TL * N : 0);
    const float2* sq = s_q + w * R * CW + c;
    float CP[R][S], yl[R], x[S], P[S];
#pragma unroll
    for (int i = 0; i < S; ++i) x[i] = 0.0f, P[i] = 1.0f;
#pragma unroll
    for (int j0 = 0; j0 < R; j0 += 4) {
      float2 q[4];
      float bv[4][S], cv[4][S];
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        q[g] = sq[(j0 + g) * CW];
        if constexpr (Tr::kVarB) {
          lds_states<S>(sB + (j0 + g) * N, bv[g]);
        } else {
#pragma unroll
          for (int i = 0; i < S; ++i) bv[g][i] = Bf[i];
        }
        if constexpr (Tr::kVarC) {
          lds_states<S>(sC + (j0 + g) * N, cv[g]);
        } else {
#pragma unroll
          for (int i = 0; i < S; ++i) cv[g][i] = Cf[i];
        }
      }
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        const int j = j0 + g;
        float y0 = 0.0f, y1 = 0.0f;
#pragma unroll
        for (int i = 0; i < S; ++i) {
          const float a = fast_exp2(q[g].x * A2[i]);
          x[i] = fmaf(a, x[i], q[g].y * bv[g][i]);
          P[i] *= a;
          CP[j][i] = cv[g][i] * P[i];
          if (Tr::kLean > 0 || !(i & 1)) y0 = fmaf(cv[g][i], x[i], y0);
          else y1 = fmaf(cv[g][i], x[i], y1);
        }
        if constexpr (Tr::kLean > 0) yl[j] = y0;
        else yl[j] = y0 + y1;
      }
    }
    // 3. this warp's map; the next tile's B/C; the block's barrier
    float* px = s_px + ((it & 1) * W + w) * 2 * CW * N + c * N + n0;
    sts_states<S>(px, P);
    sts_states<S>(px + CW * N, x);
    if (it + 1 < nt) {
      stage_bc((it + 1) & 1);
      if (it + 2 < nt) load_bc(t0 + 2 * TL);
    }
    __syncthreads();
    // 4. the state entering this warp's steps: the carry folded over warps 0..w-1
    float h[S];
    {
      lds_states<S>(s_carry + (it & 1) * CW * N + c * N + n0, h);
      if constexpr (Tr::kLean == 2) {
        float Pv[W - 1][S], Xv[W - 1][S];
#pragma unroll
        for (int v = 0; v < W - 1; ++v)
          if (v < w) {
            const float* pv = s_px + ((it & 1) * W + v) * 2 * CW * N + c * N + n0;
            lds_states<S>(pv, Pv[v]);
            lds_states<S>(pv + CW * N, Xv[v]);
          }
#pragma unroll
        for (int v = 0; v < W - 1; ++v)
          if (v < w) {
#pragma unroll
            for (int i = 0; i < S; ++i) h[i] = fmaf(Pv[v][i], h[i], Xv[v][i]);
          }
      } else {
#pragma unroll
        for (int v = 0; v < W - 1; ++v) {
          if (v >= w) break;
          const float* pv = s_px + ((it & 1) * W + v) * 2 * CW * N + c * N + n0;
          float Pv[S], Xv[S];
          lds_states<S>(pv, Pv);
          lds_states<S>(pv + CW * N, Xv);
#pragma unroll
          for (int i = 0; i < S; ++i) h[i] = fmaf(Pv[i], h[i], Xv[i]);
        }
      }
      if (states && run && (R % kStateStride == 0 || tr % kStateStride == 0))
        sts_states<S>(states + (chan * nstates_of(seqlen) + tr / kStateStride) * N + n0, h);
      if (w == W - 1) {
        float nc[S];
#pragma unroll
        for (int i = 0; i < S; ++i) nc[i] = fmaf(P[i], h[i], x[i]);
        sts_states<S>(s_carry + ((it + 1) & 1) * CW * N + c * N + n0, nc);
        if (it + 1 == nt && live) sts_states<S>(last_state + chan * N + n0, nc);
      }
    }
    // 5. sweep 2
    float y[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if constexpr (Tr::kLean > 0) {
        float yj = yl[j];
#pragma unroll
        for (int i = 0; i < S; ++i) yj = fmaf(CP[j][i], h[i], yj);
        y[j] = yj;
      } else {
        float y0 = fmaf(CP[j][0], h[0], yl[j]), y1 = CP[j][1] * h[1];
#pragma unroll
        for (int i = 2; i < S; i += 2) {
          y0 = fmaf(CP[j][i], h[i], y0);
          y1 = fmaf(CP[j][i + 1], h[i + 1], y1);
        }
        y[j] = y0 + y1;
      }
    }
    // 6. y over the state groups through shared memory; this lane's Q steps out
    float* sy = s_y + w * G * YR;
#pragma unroll
    for (int j = 0; j < R; j += 4)
      *reinterpret_cast<float4*>(sy + sg * YR + c * R + j) = make_float4(y[j], y[j + 1], y[j + 2], y[j + 3]);
    __syncwarp();
    float yo[Q] = {};
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if constexpr (Q == 4) {
        const float4 v = *reinterpret_cast<const float4*>(sy + g * YR + c * R + sg * Q);
        yo[0] += v.x, yo[1] += v.y, yo[2] += v.z, yo[3] += v.w;
      } else {
        const float2 v = *reinterpret_cast<const float2*>(sy + g * YR + c * R + sg * Q);
        yo[0] += v.x, yo[1] += v.y;
      }
    }
    if (qrun) {
      float o[Q];
#pragma unroll
      for (int k = 0; k < Q; k += 2) {
        o[k] = fmaf(Dd, uq[k], yo[k]);
        o[k + 1] = fmaf(Dd, uq[k + 1], yo[k + 1]);
        if constexpr (Tr::kHasZ) {
          float g0 = rz.at(k), g1 = rz.at(k + 1);
          silu2_sfu(g0, g1);
          o[k] *= g0;
          o[k + 1] *= g1;
        }
      }
      if constexpr (Q == 4)
        *reinterpret_cast<uint2*>(out_blk + lane_out + t0) = make_uint2(pack2<T>(o[0], o[1]), pack2<T>(o[2], o[3]));
      else
        *reinterpret_cast<unsigned*>(out_blk + lane_out + t0) = pack2<T>(o[0], o[1]);
    }
  }
}

}  // namespace kspec
