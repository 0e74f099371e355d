// The wide kernel (algo 3) of the selective scan's forward: many channels, short sequences.
#pragma once

#include "selective_scan/packed.cuh"

namespace kspec {

// =============================================================================================
// The wide forward ("algo 3"): many channels (batch * dim past 8192) and short sequences, where the tile
// kernel (tile.cuh) pays for a time-parallel scan that the channels make unnecessary, and the
// sequential kernels (sequential_fwd.cuh) have no vector path (seqlen not a multiple of 512).
//
// Why the tile kernel is slow there (16x768x256 bf16 on the H100: 0.049 ms, 6.5x the byte floor):
//  - every step costs each state 8 FMA-pipe instructions (the sweep from a zero state with the product
//    of decays P and C P kept per step, then C P . h once the warps' maps are folded) where a walk from
//    the true state costs 5; ~7 warp instructions per channel-step in all;
//  - its 16 x 4 values of C P and 16 of y per lane need ~180 registers: 2 blocks of 4 warps per SM, 8
//    warps, 2 per scheduler, which hide little latency; the block's barrier and fold each 64 steps;
//  - 1536 blocks of 4 tiles each over 264 slots: 5.8 waves, each block's start (two loads, one after the
//    other) repaid over 4 tiles.
// Here each lane walks its states through the whole sequence in order, as the sequential kernels do,
// with the tile kernel's lane map and its prefetch of raw 16-byte vectors:
//  - a warp holds 8 channels of 4 lanes (lane = channel bit 0, state group of 4 states, channel bits
//    1-2: the tile kernel's map, so lanes n and n^1 share a B/C vector and n and n^2 a {dt, dt u});
//  - a block holds kWarps warps side by side (8 kWarps channels of one batch and B/C group), all at the
//    same chunk of kChunk = 32 steps; the chunk's variable B/C rows are staged once for the block
//    (double-buffered, loaded two chunks ahead), the block's one barrier per chunk;
//  - per chunk, a lane stages {dt, dt u} of 8 steps of its channel from raw u, delta (one 16-byte vector
//    each, loaded a chunk ahead, with z), the warp walks the 32 steps (per step and state one ex2 and 4
//    FMA-pipe instructions, y = C . x of its 4 states every step to shared memory), and each lane sums
//    the 4 state groups' y of its 8 steps and writes out = (y + D u) silu(z) as one 16-byte vector.
// Per channel-step ~4 warp instructions (the tile kernel's ~7); 128 registers (the launch bounds: 16
// warps per SM; ~160 without them, no spill at 128 on sm_80 and sm_90 with NVRTC 13.0). At 16x768x256:
// 384 blocks of 32 channels, one wave over 132 SMs (2-3 blocks each, 8-12 warps), each warp 256 steps in
// order. The SFU bounds it: one ex2 per channel, step and state, plus softplus and silu (two or three
// each per channel and step): ~16.5 us at 16x768x256, against the tile kernel's 0.049 ms. Not yet measured.
//
// Launch: gridDim = (ceil(dim / (8 kWarps)), batch), blockDim = 32 kWarps, dynamic shared memory
// wide_fwd_smem_floats() floats; the arguments of selective_scan_fwd_kernel. Requires kVec (seqlen a
// multiple of 8, 16-byte aligned pointers: a lane's 8 steps of u, delta, z, out and a B/C row's 8-step
// vectors are aligned, wholly inside or outside the sequence), dstate 16 and 16-bit u, delta, z and
// variable B/C. Steps past seqlen stage dt = 0 (a = 1, dt u = 0: the state passes through) and write
// nothing; channels past dim run with A = 0 and dt = 0 and write nothing. Both read inside the tensors
// (the row's last 8 steps, the last channel), so the loads need no predicate.
// =============================================================================================
template <typename Flags, int kWarps_>
struct WideScanTraits : Flags {
  static_assert(!Flags::kTimeMajor, "time-major tensors: the sequential kernels only");
  static_assert(Flags::kVectors, "the wide kernel needs whole 16-byte aligned vectors (kVec: seqlen a multiple of 8)");
  static_assert(Flags::kDstate == 16, "the wide kernel's lane map is for dstate 16");
  static_assert(sizeof(typename Flags::T) == 2, "the wide kernel takes 16-bit u, delta, z");
  // A variable B or C is 16-bit too, hence u's type (the schema: B and C are u's dtype or fp32).
  static_assert(!Flags::kVarB || sizeof(typename Flags::TB) == 2, "a variable B is 16-bit");
  static_assert(!Flags::kVarC || sizeof(typename Flags::TC) == 2, "a variable C is 16-bit");
  static constexpr int kWarps = kWarps_, kThreads = 32 * kWarps;
  // 4 or 8 warps: at 2, a thread stages two B/C vectors per chunk and spilled 8-16 bytes at 128 registers.
  static_assert(kWarps == 4 || kWarps == 8, "4 or 8 warps");
  static constexpr int kS = 4;                    // states per lane
  static constexpr int kG = Flags::kDstate / kS;  // state groups (lanes per channel)
  static constexpr int kCW = 32 / kG;             // channels per warp
  static constexpr int kChannels = kCW * kWarps;  // channels per block
  static constexpr int kChunk = 32;               // steps per chunk (one barrier each)
  static constexpr int kQ = kChunk / kG;          // steps a lane stages and writes: 16 bytes of 16-bit T
  static_assert(kQ == 8, "a lane stages one 16-byte vector of 8 steps");
  static constexpr int kNvar = (Flags::kVarB ? 1 : 0) + (Flags::kVarC ? 1 : 0);
  // s_y rows: a channel's kChunk steps + 4 floats, a state group's kCW channels + 8: the STS.128 of a
  // quarter warp (2 channels x 4 groups at one step) and the LDS.128 (2 channels x 4 lanes' 8 steps) fall
  // in 8 different 4-bank groups.
  static constexpr int kYc = kChunk + 4;
  static constexpr int kYg = kCW * kYc + 8;
  // 16 warps per SM: 128 registers a thread at most.
  static constexpr int kMinBlocks = 16 / kWarps;
};

template <typename Tr>
constexpr int wide_fwd_smem_floats() {
  return 2 * Tr::kNvar * Tr::kChunk * Tr::kDstate  // s_bc [buffer][variable B, C][step][state]
         + 2 * Tr::kWarps * Tr::kChunk * Tr::kCW    // s_q [warp][step][channel] float2 {dt, dt u}
         + Tr::kWarps * Tr::kG * Tr::kYg;           // s_y [warp][group][channel][step]
}

template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocks)
    selective_scan_fwd_wide_kernel(const typename Tr::T* __restrict__ u, const typename Tr::T* __restrict__ delta,
                                   const float* __restrict__ A, const typename Tr::TB* __restrict__ B,
                                   const typename Tr::TC* __restrict__ C, const float* __restrict__ D,
                                   const typename Tr::T* __restrict__ z, const float* __restrict__ delta_bias,
                                   const float* __restrict__ h0, typename Tr::T* __restrict__ out,
                                   float* __restrict__ last_state, int dim, int seqlen, int channels_per_group,
                                   int groups, float* __restrict__ states) {
  using namespace scan_detail;
  using T = typename Tr::T;
  constexpr int N = Tr::kDstate, S = Tr::kS, G = Tr::kG, CW = Tr::kCW, CH = Tr::kChunk, Q = Tr::kQ;
  constexpr int YC = Tr::kYc, YG = Tr::kYg;
  extern __shared__ __align__(16) float smem[];
  float* s_bc = smem;
  const int tid = static_cast<int>(threadIdx.x), w = tid / 32, lane = tid % 32;
  float2* sq = reinterpret_cast<float2*>(s_bc + 2 * Tr::kNvar * CH * N) + w * CH * CW;
  float* sy = smem + 2 * Tr::kNvar * CH * N + 2 * Tr::kWarps * CH * CW + w * G * YG;

  const int sg = (lane >> 1) & (G - 1), c = (lane & 1) | ((lane >> 3) << 1);
  const int b = static_cast<int>(blockIdx.y), d0 = static_cast<int>(blockIdx.x) * Tr::kChannels;
  const int dl = w * CW + c, d = d0 + dl;  // the lane's channel in the block, in the batch
  const bool live = d < dim;
  const long long chan = static_cast<long long>(b) * dim + d;
  const long long bc_base = (static_cast<long long>(b) * groups + d0 / channels_per_group) * N * seqlen;
  const int n0 = sg * S;
  float A2[S], Bf[S], Cf[S], x[S];
#pragma unroll
  for (int i = 0; i < S; ++i) {
    A2[i] = live ? A[d * N + n0 + i] * kLog2e : 0.0f;
    Bf[i] = !Tr::kVarB && live ? to_float(B[d * N + n0 + i]) : 0.0f;
    Cf[i] = !Tr::kVarC && live ? to_float(C[d * N + n0 + i]) : 0.0f;
    x[i] = Tr::kHasH0 && live ? h0[chan * N + n0 + i] : 0.0f;
  }
  const float bias = Tr::kHasDeltaBias && live ? delta_bias[d] : 0.0f;
  const float Dd = Tr::kHasD && live ? D[d] : 0.0f;
  const int nc = (seqlen + CH - 1) / CH;
  const int nst = nstates_of(seqlen);

  // This lane's Q steps of its channel in a chunk: t0 + tq. Addresses: the block's rows from one 64-bit
  // base and a lane's offset in 32 bits (the op's rules: 8 kWarps seqlen fits in an int); channels past
  // dim read the last channel, steps past seqlen the row's last Q.
  const long long blk = (static_cast<long long>(b) * dim + d0) * seqlen;
  const T* const u_blk = u + blk;
  const T* const delta_blk = delta + blk;
  const T* const z_blk = Tr::kHasZ ? z + blk : nullptr;
  T* const out_blk = out + blk;
  const int tq = sg * Q;
  const int lane_in = (live ? dl : dim - 1 - d0) * seqlen, lane_out = dl * seqlen + tq;
  LaneSteps<Tr, Q> pre;
  auto load_q = [&](int t0) { pre.load(u_blk, delta_blk, z_blk, lane_in, t0 + tq, seqlen); };
  BcRows<Tr, CH> rows;
  // The variable B/C rows of the block's group (16-bit: u's type T)
  const T* const Bv = Tr::kVarB ? reinterpret_cast<const T*>(B) + bc_base : nullptr;
  const T* const Cv = Tr::kVarC ? reinterpret_cast<const T*>(C) + bc_base : nullptr;
  float* const s_bc1 = s_bc + Tr::kNvar * CH * N;
  // The first chunk's u, delta, z are loaded before its B/C rows are staged (which waits on their loads).
  if constexpr (Tr::kNvar > 0) rows.load(Bv, Cv, seqlen, 0);
  load_q(0);
  if constexpr (Tr::kNvar > 0) {
    rows.stage(s_bc);
    if (nc > 1) rows.load(Bv, Cv, seqlen, CH);
  }
  __syncthreads();

  for (int it = 0; it < nc; ++it) {
    const int t0 = it * CH;
    const bool qrun = live && t0 + tq < seqlen;  // this lane's Q steps are inside the sequence (seqlen % Q == 0)
    // 1. {dt, dt u} of this lane's Q steps (dt = 0 past seqlen and dim: the state passes through); u kept
    // as floats for the outputs, z as raw words (copied: the next chunk's prefetch overwrites it)
    const RawSteps<T, Q> rz = pre.z;
    float uq[Q];
#pragma unroll
    for (int k = 0; k < Q; ++k) {
      float dt = pre.delta.at(k) + bias;
      if constexpr (Tr::kSoftplus) dt = softplus_sfu(dt);
      dt = qrun ? dt : 0.0f;
      uq[k] = pre.u.at(k);
      sq[(tq + k) * CW + c] = make_float2(dt, dt * uq[k]);
    }
    if (it + 1 < nc) load_q(t0 + CH);
    __syncwarp();
    // 2. the chunk's steps in order from the carried state, a group of 4 steps' shared-memory reads first;
    // y of the lane's 4 states to shared memory every 4 steps
    const float* sB = s_bc + (it & 1) * Tr::kNvar * CH * N + n0;
    const float* sC = sB + (Tr::kVarB ? CH * N : 0);
#pragma unroll
    for (int j0 = 0; j0 < CH; j0 += 4) {
      if (j0 % kStateStride == 0 && states && live && t0 + j0 < seqlen)  // the state entering step t0 + j0
        *reinterpret_cast<float4*>(states + (chan * nst + (t0 + j0) / kStateStride) * N + n0) =
            make_float4(x[0], x[1], x[2], x[3]);
      float2 q[4];
      float bv[4][S], cv[4][S], y[4];
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        q[g] = sq[(j0 + g) * CW + c];
        if constexpr (Tr::kVarB) {
          const float4 v = *reinterpret_cast<const float4*>(sB + (j0 + g) * N);
          bv[g][0] = v.x, bv[g][1] = v.y, bv[g][2] = v.z, bv[g][3] = v.w;
        } else {
#pragma unroll
          for (int i = 0; i < S; ++i) bv[g][i] = Bf[i];
        }
        if constexpr (Tr::kVarC) {
          const float4 v = *reinterpret_cast<const float4*>(sC + (j0 + g) * N);
          cv[g][0] = v.x, cv[g][1] = v.y, cv[g][2] = v.z, cv[g][3] = v.w;
        } else {
#pragma unroll
          for (int i = 0; i < S; ++i) cv[g][i] = Cf[i];
        }
      }
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        float y0 = 0.0f, y1 = 0.0f;
#pragma unroll
        for (int i = 0; i < S; ++i) {
          x[i] = fmaf(fast_exp2(q[g].x * A2[i]), x[i], q[g].y * bv[g][i]);
          if (i & 1) y1 = fmaf(cv[g][i], x[i], y1);
          else y0 = fmaf(cv[g][i], x[i], y0);
        }
        y[g] = y0 + y1;
      }
      *reinterpret_cast<float4*>(sy + sg * YG + c * YC + j0) = make_float4(y[0], y[1], y[2], y[3]);
    }
    // 3. the next chunk's B/C into the other buffer (its readers passed the last barrier), the loads of the
    // chunk after
    if constexpr (Tr::kNvar > 0) {
      if (it + 1 < nc) {
        rows.stage((it & 1) ? s_bc : s_bc1);
        if (it + 2 < nc) rows.load(Bv, Cv, seqlen, t0 + 2 * CH);
      }
    }
    __syncwarp();
    // 4. y over the state groups; this lane's Q steps out
    float yo[Q] = {};
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int h = 0; h < Q; h += 4) {
        const float4 v = *reinterpret_cast<const float4*>(sy + g * YG + c * YC + tq + h);
        yo[h] += v.x, yo[h + 1] += v.y, yo[h + 2] += v.z, yo[h + 3] += v.w;
      }
    }
    if (qrun) {
      unsigned o[Q / 2];
#pragma unroll
      for (int k = 0; k < Q; k += 2) {
        float o0 = fmaf(Dd, uq[k], yo[k]), o1 = fmaf(Dd, uq[k + 1], yo[k + 1]);
        if constexpr (Tr::kHasZ) {
          float g0 = rz.at(k), g1 = rz.at(k + 1);
          silu2_sfu(g0, g1);
          o0 *= g0;
          o1 *= g1;
        }
        o[k / 2] = pack2<T>(o0, o1);
      }
      *reinterpret_cast<uint4*>(out_blk + lane_out + t0) = make_uint4(o[0], o[1], o[2], o[3]);
    }
    __syncthreads();  // the next chunk's B/C staged; this chunk's buffer free for the chunk after
  }
  if (live) *reinterpret_cast<float4*>(last_state + chan * N + n0) = make_float4(x[0], x[1], x[2], x[3]);
}

}  // namespace kspec
