// The sequential-state kernels (algo 1) of the selective scan: what their forward, backward and the
// segments' local passes share (traits, a thread's place, the chunk scan, the segments' flags and
// folds). The kernels are in sequential_fwd.cuh, sequential_bwd.cuh and sequential_segments.cuh, each
// its own include tree (a cache key hashes a template's whole tree); the backward's pass 2
// (selective_scan_bwd_reduce_kernel) is in reduce.cuh.
#pragma once

#include "selective_scan/common.cuh"

namespace kspec {

// =============================================================================================
// The sequential-state forward ("algo 1"): states in registers, time walked in order per thread.
//
// The warp-scan kernels (warp_scan.cuh) spend most of their time in per-state shuffle scans and the serial
// carry, not in the exponentials that bound the scan (one ex2 per step and state, 16 per SM and
// clock). Here a thread owns kSpt = ceil(dstate / kLanes) states of one channel in registers and walks
// the chunk's steps in order: per step and state one ex2, three FMA/FMUL and no shuffle; the kLanes
// threads of a channel (neighbouring lanes) add their C . x parts with log2(kLanes) xor shuffles per
// step. Parallelism is batch * dim * kLanes threads (32768 for the (8, 2048) Mamba shapes at kLanes 2),
// each with kSpt independent recurrences in flight.
//
// Per chunk of kChunk steps the block (kChannels = kThreads / kLanes neighbouring channels of one batch
// and group) stages through shared memory, transposed to [step][channel] so a step's values are one
// conflict-free read per warp:
//   s_dtu[t][c] = {dt after bias/softplus, dt u} (computed once per channel and step, not once per state)
//   s_u[t][c]  = u,   s_B[t][n], s_C[t][n] = a variable B/C row of the block's group,
// then the threads scan (writing y = C . x to s_y[t][c]) and the block writes out = (y + D u) silu(z)
// with coalesced stores. Padding steps past seqlen have dt = 0 and u = 0, so a = 1 and b = 0: every
// thread runs the whole chunk (a constant trip count) and the state passes through them unchanged.
// Padding states (n >= dstate) have A = B = C = 0 and stay 0.
//
// Launch: blockDim = kThreads; gridDim = (ceil(dim / kChannels), batch, nsegs). A block's channels lie
// in one group when B or C is variable (the host ensures groups == 1 or kChannels divides dim / groups).
// Dynamic shared memory: seq_fwd_smem_floats() floats. With kEven (seqlen a multiple of 512, hence of
// kChunk, and every pointer 16-byte aligned) the staging and the output use 16-byte accesses.
// Segments (nsegs > 1, after selective_scan_seg_fwd_kernel; see "segments" below): block z runs the
// chunks of segment z from the state folded over segments 0..z-1; nsegs = 1 is the whole sequence
// (seg_len >= seqlen rounded up to kChunk; seg_h, seg_dt unused).
// =============================================================================================
template <typename Flags, int kWarps_, int kLanes_, int kChunk_>
struct SeqScanTraits : Flags {
  static constexpr bool kEven = Flags::kVectors;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kLanes = kLanes_;
  static constexpr int kChunk = kChunk_;
  static constexpr int kChannels = kThreads / kLanes;
  static constexpr int kSpt = (Flags::kDstate + kLanes - 1) / kLanes;  // states per thread
  static constexpr int kNp = kSpt * kLanes;                     // dstate padded to whole threads
  static constexpr int kCs = kChannels + 1;                     // row stride of [step][channel] arrays
  static_assert(kLanes >= 1 && kLanes <= kWarpSize && (kLanes & (kLanes - 1)) == 0, "kLanes: power of two <= 32");
  static_assert(kSpt <= 32, "at most 32 states per thread");
  static_assert(kChunk % 16 == 0, "kChunk: a multiple of 16 steps");
  static_assert(kWarps >= 1 && kWarps <= 32, "1..32 warps per block");
  static_assert(!(Flags::kTimeMajor && kEven), "time-major tensors are staged element by element");

  // Element e of a chunk's [channel][step] elements: its channel (row) and step. Time-major, neighbouring
  // threads take neighbouring channels of one step, so a warp's loads and stores stay coalesced along the
  // channels (unit stride there); else neighbouring steps of one channel.
  static __device__ __forceinline__ int row_of(int e) { return Flags::kTimeMajor ? e % kChannels : e / kChunk; }
  static __device__ __forceinline__ int step_of(int e) { return Flags::kTimeMajor ? e / kChannels : e % kChunk; }
  // The same for a variable B/C chunk of kRows state rows: (n, t).
  template <int kRows>
  static __device__ __forceinline__ int bc_row_of(int e) { return Flags::kTimeMajor ? e % kRows : e / kChunk; }
  template <int kRows>
  static __device__ __forceinline__ int bc_step_of(int e) { return Flags::kTimeMajor ? e / kRows : e % kChunk; }
  // Offset of u, delta, z, out (and the backward's) at channel d0 + r, step t0 + t of batch b.
  static __device__ __forceinline__ long long seq_off(int b, int dim, int d0, int r, int seqlen, int t0, int t) {
    if constexpr (Flags::kTimeMajor)
      return (static_cast<long long>(b) * seqlen + t0 + t) * dim + d0 + r;
    else
      return (static_cast<long long>(b) * dim + d0 + r) * seqlen + t0 + t;
  }
  // Offset of a variable B/C (dB/dC) at state n, step t0 + t from its group's base (SeqPlace::bc_base).
  static __device__ __forceinline__ long long bc_off(long long bc_base, int n, int seqlen, int groups, int t0, int t) {
    if constexpr (Flags::kTimeMajor)
      return bc_base + static_cast<long long>(t0 + t) * groups * Flags::kDstate + n;
    else
      return bc_base + static_cast<long long>(n) * seqlen + t0 + t;
  }
};

namespace scan_detail {

// y of 4 consecutive steps from the kLanes threads of a channel (each holds its states' part of each):
// a transposing reduction (lanes exchange half their values per level) takes 1, 2 or 3 shuffles for
// the 4 steps instead of 4 * log2(kLanes), then plain xor levels above 4 lanes. Writes s_y[g * stride]
// for g = 0..3 (s_y points at step t, channel c).
template <int kLanes>
__device__ __forceinline__ void seq_store_y(float (&y)[4], int sl, float* s_y, int stride) {
  if constexpr (kLanes == 1) {
#pragma unroll
    for (int g = 0; g < 4; ++g) s_y[g * stride] = y[g];
  } else if constexpr (kLanes == 2) {
    const bool hi = sl & 1;  // lane 0 keeps steps 0, 1; lane 1 steps 2, 3
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float send = hi ? y[j] : y[j + 2];
      const float keep = hi ? y[j + 2] : y[j];
      s_y[((hi ? 2 : 0) + j) * stride] = keep + __shfl_xor_sync(kFull, send, 1);
    }
  } else {
    const bool h = (sl >> 1) & 1;  // level 1: lanes with bit 1 set keep steps 2, 3
    float k[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float send = h ? y[j] : y[j + 2];
      const float keep = h ? y[j + 2] : y[j];
      k[j] = keep + __shfl_xor_sync(kFull, send, 2);
    }
    const bool lo = sl & 1;  // level 2: bit 0 picks one of the two
    float v = (lo ? k[1] : k[0]) + __shfl_xor_sync(kFull, lo ? k[0] : k[1], 1);
#pragma unroll
    for (int off = 4; off < kLanes; off *= 2) v += __shfl_xor_sync(kFull, v, off);
    if (sl < 4) s_y[sl * stride] = v;  // step 2 * h + lo = sl
  }
}

// The raw global data of one chunk (kEven: whole, 16-byte aligned), held in registers between its
// loads and its staging: u, delta, z of the block's channels and the variable B/C rows of its group.
// Element e of a tensor's chunk is row e / kPerRow, steps (e % kPerRow) * V ..+V. kOut = false: only what
// the state's recurrence reads (u, delta, a variable B; no z, C, s_u, D), for the segments' local pass.
template <typename Tr, bool kOut = true>
struct SeqPrefetch {
  using T = typename Tr::T;
  using TB = typename Tr::TB;
  using TC = typename Tr::TC;
  static constexpr int kC = Tr::kChunk, NC = Tr::kChannels, NP = Tr::kNp, N = Tr::kDstate;
  static constexpr int V = 16 / static_cast<int>(sizeof(T));
  static constexpr int VB = 16 / static_cast<int>(sizeof(TB)), VC = 16 / static_cast<int>(sizeof(TC));
  static constexpr int kPerRow = kC / V, kPerRowB = kC / VB, kPerRowC = kC / VC;
  static constexpr int kRowVecs = NC * kPerRow;  // vectors per tensor and chunk
  static constexpr int PU = (kRowVecs + Tr::kThreads - 1) / Tr::kThreads;
  static constexpr int PB = Tr::kVarB ? (NP * kPerRowB + Tr::kThreads - 1) / Tr::kThreads : 0;
  static constexpr int PC = kOut && Tr::kVarC ? (NP * kPerRowC + Tr::kThreads - 1) / Tr::kThreads : 0;
  static constexpr bool kZ = kOut && Tr::kHasZ;
  uint4 u[PU], d[PU], z[kZ ? PU : 1];  // raw 16-byte vectors (see load_raw16)
  uint4 bv[PB > 0 ? PB : 1], cv[PC > 0 ? PC : 1];

  __device__ __forceinline__ void load(const T* __restrict__ gu, const T* __restrict__ gd, const T* __restrict__ gz,
                                       const TB* __restrict__ gB, const TC* __restrict__ gC, int b, int d0, int dim,
                                       int seqlen, long long bc_base, int t0) {
    const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
    for (int k = 0; k < PU; ++k) {
      const int e = tid + k * Tr::kThreads;
      const int r = e / kPerRow, tv = (e % kPerRow) * V;
      if (e < kRowVecs && d0 + r < dim) {
        const long long off = (static_cast<long long>(b) * dim + d0 + r) * seqlen + t0 + tv;
        u[k] = load_raw16(gu + off);
        d[k] = load_raw16(gd + off);
        if constexpr (kZ) z[k] = load_raw16(gz + off);
      }
    }
#pragma unroll
    for (int k = 0; k < PB; ++k) {
      const int e = tid + k * Tr::kThreads;
      const int n = e / kPerRowB, tv = (e % kPerRowB) * VB;
      if (n < N) bv[k] = load_raw16(gB + bc_base + static_cast<long long>(n) * seqlen + t0 + tv);
    }
#pragma unroll
    for (int k = 0; k < PC; ++k) {
      const int e = tid + k * Tr::kThreads;
      const int n = e / kPerRowC, tv = (e % kPerRowC) * VC;
      if (n < N) cv[k] = load_raw16(gC + bc_base + static_cast<long long>(n) * seqlen + t0 + tv);
    }
  }

  // delta_bias and D of the channel of this thread's vector k (fixed rows per k), loaded once.
  struct Rows {
    float bias[PU], D[PU];
    __device__ __forceinline__ Rows(const float* __restrict__ delta_bias, const float* __restrict__ Dp, int d0,
                                    int dim) {
#pragma unroll
      for (int k = 0; k < PU; ++k) {
        const int e = static_cast<int>(threadIdx.x) + k * Tr::kThreads, r = e / kPerRow;
        const bool ok = e < kRowVecs && d0 + r < dim;
        bias[k] = Tr::kHasDeltaBias && ok ? delta_bias[d0 + r] : 0.0f;
        D[k] = kOut && Tr::kHasD && ok ? Dp[d0 + r] : 0.0f;
      }
    }
  };

  // s_u[t][c] = u, s_dtu[t][c] = {dt (bias, softplus), dt u}, s_B/s_C[t][n]; zeros for rows past dim or
  // dstate.
  __device__ __forceinline__ void stage(float2* s_dtu, float* s_u, float* s_B, float* s_C, const Rows& rows, int d0,
                                        int dim) const {
    constexpr int CS = Tr::kCs;
    const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
    for (int k = 0; k < PU; ++k) {
      const int e = tid + k * Tr::kThreads;
      const int r = e / kPerRow, tv = (e % kPerRow) * V;
      if (e >= kRowVecs) continue;
      const bool ok = d0 + r < dim;
      const Vec<T, V> dv = as_vec<T, V>(d[k]), uv = as_vec<T, V>(u[k]);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float w = to_float(dv.v[j]) + rows.bias[k];
        if constexpr (Tr::kSoftplus) w = softplus_sfu(w);
        const float uu = ok ? to_float(uv.v[j]) : 0.0f;
        w = ok ? w : 0.0f;
        if constexpr (kOut) s_u[(tv + j) * CS + r] = uu;
        s_dtu[(tv + j) * CS + r] = make_float2(w, w * uu);
      }
    }
#pragma unroll
    for (int k = 0; k < PB; ++k) {
      const int e = tid + k * Tr::kThreads;
      const int n = e / kPerRowB, tv = (e % kPerRowB) * VB;
      if (n >= NP) continue;
      const Vec<TB, VB> v = as_vec<TB, VB>(bv[k]);
#pragma unroll
      for (int j = 0; j < VB; ++j) s_B[(tv + j) * NP + n] = n < N ? to_float(v.v[j]) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < PC; ++k) {
      const int e = tid + k * Tr::kThreads;
      const int n = e / kPerRowC, tv = (e % kPerRowC) * VC;
      if (n >= NP) continue;
      const Vec<TC, VC> v = as_vec<TC, VC>(cv[k]);
#pragma unroll
      for (int j = 0; j < VC; ++j) s_C[(tv + j) * NP + n] = n < N ? to_float(v.v[j]) : 0.0f;
    }
  }

  // out = (y + D u) * silu(z) for the vectors this thread staged (its z still in registers).
  __device__ __forceinline__ void write_out(T* __restrict__ gout, const Rows& rows, const float* s_u, const float* s_y,
                                            int b, int d0, int dim, int seqlen, int t0) const {
    static_assert(kOut, "the local pass writes no outputs");
    constexpr int CS = Tr::kCs;
    const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
    for (int k = 0; k < PU; ++k) {
      const int e = tid + k * Tr::kThreads;
      const int r = e / kPerRow, tv = (e % kPerRow) * V;
      if (e >= kRowVecs || d0 + r >= dim) continue;
      const float Dd = rows.D[k];
      const Vec<T, V> zv = as_vec<T, V>(z[k]);
      Vec<T, V> o;
      static_assert(V % 2 == 0, "silu2_sfu takes the steps in pairs");
#pragma unroll
      for (int j = 0; j < V; j += 2) {
        float v0 = fmaf(Dd, s_u[(tv + j) * CS + r], s_y[(tv + j) * CS + r]);
        float v1 = fmaf(Dd, s_u[(tv + j + 1) * CS + r], s_y[(tv + j + 1) * CS + r]);
        if constexpr (Tr::kHasZ) {
          float g0 = to_float(zv.v[j]), g1 = to_float(zv.v[j + 1]);
          silu2_sfu(g0, g1);
          v0 *= g0;
          v1 *= g1;
        }
        o.v[j] = from_float<T>(v0);
        o.v[j + 1] = from_float<T>(v1);
      }
      store_vec<V>(gout + (static_cast<long long>(b) * dim + d0 + r) * seqlen + t0 + tv, o);
    }
  }

  // The chunks [tb, te) in order (tb < te: a segment holds steps): each chunk's loads are issued a chunk
  // ahead into the other prefetch's registers, so their latency hides behind scan(t0) of the staged chunk
  // before. With kOut, out follows from s_y; without, only s_dtu and s_B are staged (gz, gC, gout, s_u,
  // s_C, s_y unused).
  template <typename Scan>
  static __device__ __forceinline__ void walk(const T* __restrict__ gu, const T* __restrict__ gd,
                                              const T* __restrict__ gz, const TB* __restrict__ gB,
                                              const TC* __restrict__ gC, T* __restrict__ gout, const Rows& rows,
                                              int b, int d0, int dim, int seqlen, long long bc_base, int tb, int te,
                                              float2* s_dtu, float* s_u, float* s_B, float* s_C, const float* s_y,
                                              Scan&& scan) {
    constexpr int kC = Tr::kChunk;
    SeqPrefetch cur, nxt;
    cur.load(gu, gd, gz, gB, gC, b, d0, dim, seqlen, bc_base, tb);
    for (int t0 = tb; t0 < te; t0 += kC) {
      cur.stage(s_dtu, s_u, s_B, s_C, rows, d0, dim);
      __syncthreads();
      if (t0 + kC < te) nxt.load(gu, gd, gz, gB, gC, b, d0, dim, seqlen, bc_base, t0 + kC);
      scan(t0);
      if constexpr (kOut) {
        __syncthreads();
        cur.write_out(gout, rows, s_u, s_y, b, d0, dim, seqlen, t0);
      }
      cur = nxt;
      __syncthreads();  // the chunk's shared memory is restaged next
    }
  }
};

// A thread's slice of one saved state: `row` holds a channel's kDstate floats, the thread's kSpt of them
// start at sl * kSpt. As 16-byte vectors when every slice is whole and 16-byte aligned (kEven: every
// pointer is, and rows of a multiple of 4 floats keep it), else element by element, past the padding
// states. A warp's scalar store put 4 bytes in each of 32 sectors: the forward's states (8 per thread)
// took 8 such stores per saved step, 4 times the L2 write transactions of 2 vectors.
template <typename Tr>
constexpr bool kSeqVecState = Tr::kEven && Tr::kSpt % 4 == 0 && Tr::kDstate % Tr::kSpt == 0;

template <typename Tr>
__device__ __forceinline__ void seq_put_state(float* row, const float (&x)[Tr::kSpt], int sl) {
  constexpr int S = Tr::kSpt, N = Tr::kDstate;
  if constexpr (kSeqVecState<Tr>) {
#pragma unroll
    for (int i = 0; i < S; i += 4)
      *reinterpret_cast<float4*>(row + sl * S + i) = make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < S; ++i)
      if (sl * S + i < N) row[sl * S + i] = x[i];
  }
}

// The inverse: zeros for the padding states and where !ok.
template <typename Tr>
__device__ __forceinline__ void seq_get_state(float (&x)[Tr::kSpt], const float* row, int sl, bool ok) {
  constexpr int S = Tr::kSpt, N = Tr::kDstate;
  if constexpr (kSeqVecState<Tr>) {
#pragma unroll
    for (int i = 0; i < S; i += 4) {
      const float4 v = ok ? *reinterpret_cast<const float4*>(row + sl * S + i) : make_float4(0.f, 0.f, 0.f, 0.f);
      x[i] = v.x;
      x[i + 1] = v.y;
      x[i + 2] = v.z;
      x[i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < S; ++i) x[i] = ok && sl * S + i < N ? row[sl * S + i] : 0.0f;
  }
}

// The scan of one staged chunk by one thread (kSpt states x of channel cl, slice sl), steps in groups
// of 4 with a group's shared-memory reads first. kY: y = C . x of each step to s_y[t][cl] (else C, s_C
// and s_y are not read). kSumDt: adds the chunk's dt to sdt (a segment's decay, see the segments below).
// ck, when not null: the channel's rows of the states for the backward, given the state entering each
// multiple of kStateStride steps. A function, not a lambda: NVRTC did not inline the lambda everywhere,
// and the call saved registers to the stack.
template <typename Tr, bool kY = true, bool kSumDt = false>
__device__ __forceinline__ void seq_scan_chunk(float (&x)[Tr::kSpt], const float (&A2)[Tr::kSpt],
                                               const float (&Bf)[Tr::kSpt], const float (&Cf)[Tr::kSpt],
                                               const float2* s_dtu, const float* s_B,
                                               const float* s_C, float* s_y, int cl, int sl, float& sdt,
                                               float* ck = nullptr, int t0 = 0, int seqlen = 0) {
  constexpr int S = Tr::kSpt, L = Tr::kLanes, CS = Tr::kCs, NP = Tr::kNp, kC = Tr::kChunk, N = Tr::kDstate;
#pragma unroll 2
  for (int t = 0; t < kC; t += 4) {
    if (ck && t % kStateStride == 0 && t0 + t < seqlen)  // the state entering step t0 + t
      seq_put_state<Tr>(ck + ((t0 + t) / kStateStride) * N, x, sl);
    float dt[4], du[4], Bv[4][S], Cv[4][S], y[4];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const float2 q = s_dtu[(t + g) * CS + cl];
      dt[g] = q.x;
      du[g] = q.y;
      if constexpr (kSumDt) sdt += dt[g];
#pragma unroll
      for (int i = 0; i < S; ++i) {
        Bv[g][i] = Tr::kVarB ? s_B[(t + g) * NP + sl * S + i] : Bf[i];
        if constexpr (kY) Cv[g][i] = Tr::kVarC ? s_C[(t + g) * NP + sl * S + i] : Cf[i];
      }
    }
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      y[g] = 0.0f;
#pragma unroll
      for (int i = 0; i < S; ++i) {
        // The segments' local pass (kSumDt) is bound by the SFU with room in the issue: from 8 states per
        // thread, one decay in 8 on the FMA pipe (SASS per step and state 6.3 -> 7.8 instructions, MUFU ops
        // 1.125 -> 1.0; H100 1x2048x65536 bf16 forward, 32 segments: 1.624 -> 1.595 ms).
        const float a = kSumDt && S >= 8 && i % 8 == 7 ? fma_exp2(dt[g] * A2[i]) : fast_exp2(dt[g] * A2[i]);
        x[i] = fmaf(a, x[i], du[g] * Bv[g][i]);
        if constexpr (kY) y[g] = fmaf(Cv[g][i], x[i], y[g]);
      }
    }
    if constexpr (kY) seq_store_y<L>(y, sl, s_y + t * CS + cl, CS);
  }
}

// ---- segments: one sequence cut along time into parallel pieces (few channels, long sequences) ----
// With nsegs > 1 the steps are cut into segments of seg_len steps (a multiple of kChunk; the last one
// may be shorter), run by blocks with blockIdx.z = segment. A segment's map of the state is affine:
// x_out = P x_in + X with P = prod a_t = exp2(A2 * sum dt) per state and X its end state from zero, so
// a local pass (selective_scan_seg_fwd_kernel) gives every segment but the last (X, sum dt), and the
// block of segment z folds segments 0..z-1 into its entering state in z steps. The backward's adjoint
// is affine over a segment too (H_in = P H_out + G, G from a zero end): selective_scan_seg_bwd_kernel
// gives every segment but the first G (and the last one's sum dt), folded from the end. The price: one
// more ex2 per step and state per local pass, for nsegs times the parallelism.
// seg_h, seg_g: [batch * dim, nsegs, dstate]; seg_dt: [batch * dim, nsegs] (fp32 workspace).

// The forward's two passes overlap (programmatic dependent launch, sm_90+): the main kernel is launched
// to start once every block of the local pass has begun (seq_allow_next_kernel), not once they all end,
// so its blocks fill the multiprocessors the local pass's last blocks leave idle. Each local block then
// publishes its segment in seg_ready[(batch, channel block), segment] (zeroed by the host before the local
// pass), and a main block of segment z waits for segments 0..z-1 of its channels (seq_wait_segments)
// before it folds them: no block waits for one that has not started, so nothing can hang. Before sm_90,
// and with a plain launch, the main kernel starts after the local pass and finds every flag set.
__device__ __forceinline__ void seq_allow_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Every thread's writes of the segment are visible on the GPU before the flag (call from all threads).
__device__ __forceinline__ void seq_publish_segment(unsigned* __restrict__ seg_ready, int nsegs, int z) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* f = seg_ready + (static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x) * nsegs + z;
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(f), "r"(1u) : "memory");
  }
}
__device__ __forceinline__ void seq_wait_segments(const unsigned* __restrict__ seg_ready, int nsegs, int z) {
  if (threadIdx.x == 0) {
    const unsigned* f = seg_ready + (static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x) * nsegs;
    for (int q = 0; q < z; ++q) {
      for (;;) {
        unsigned v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(f + q) : "memory");
        if (v) break;
        __nanosleep(200);
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// v carried over segments q = first, first + step, ... up to `end` (exclusive): v <- exp2(A2 * sum dt_q) v +
// seg_v[q]. The forward's entering state folds segments 0..z-1 from h0 (step 1); the adjoint leaving
// segment z folds nsegs-1..z+1 from dlast_state (step -1). Read past L1 (ld.global.cg): the forward's
// local pass may still be running beside this kernel.
template <typename Tr>
__device__ __forceinline__ void seq_fold(float (&v)[Tr::kSpt], const float (&A2)[Tr::kSpt],
                                         const float* __restrict__ seg_v, const float* __restrict__ seg_dt,
                                         long long chan, int nsegs, int first, int end, int step, int sl, bool live) {
  constexpr int S = Tr::kSpt, N = Tr::kDstate;
  if (!live) return;
  for (int q = first; q != end; q += step) {
    const long long s = chan * nsegs + q;
    const float sd = __ldcg(seg_dt + s);
#pragma unroll
    for (int i = 0; i < S; ++i) {
      const int n = sl * S + i;
      v[i] = fmaf(fast_exp2(sd * A2[i]), v[i], n < N ? __ldcg(seg_v + s * N + n) : 0.0f);
    }
  }
}

// Where a thread of the sequential kernels works: channel d = d0 + cl of batch b (cl: the block's
// channel, sl: the thread's slice of kSpt states), live when d < dim; chan = b * dim + d; bc_base: the
// offset of its B/C group's rows in the variable layout.
template <typename Tr>
struct SeqPlace {
  static constexpr int S = Tr::kSpt, N = Tr::kDstate;
  int tid, cl, sl, d0, b, d;
  bool live;
  long long chan, bc_base;
  __device__ __forceinline__ SeqPlace(int dim, int seqlen, int channels_per_group, int groups) {
    tid = static_cast<int>(threadIdx.x);
    cl = tid / Tr::kLanes;
    sl = tid % Tr::kLanes;
    d0 = static_cast<int>(blockIdx.x) * Tr::kChannels;
    b = static_cast<int>(blockIdx.y);
    d = d0 + cl;
    live = d < dim;
    chan = static_cast<long long>(b) * dim + d;
    if constexpr (Tr::kTimeMajor)
      bc_base = static_cast<long long>(b) * seqlen * groups * N + static_cast<long long>(d0 / channels_per_group) * N;
    else
      bc_base = (static_cast<long long>(b) * groups + d0 / channels_per_group) * N * seqlen;
  }
  // The thread's states of a [dim, dstate] row (A, or a fixed B or C) times `scale`, when kUse; zeros
  // past dim and dstate, and without kUse.
  template <bool kUse, typename X>
  __device__ __forceinline__ void row(const X* __restrict__ p, float scale, float (&v)[S]) const {
#pragma unroll
    for (int i = 0; i < S; ++i) v[i] = kUse && live && sl * S + i < N ? to_float(p[d * N + sl * S + i]) * scale : 0.0f;
  }
  // The thread's states of a [batch, dim, dstate] state (h0, dlast_state), zeros when p is null.
  __device__ __forceinline__ void state(const float* __restrict__ p, float (&v)[S]) const {
#pragma unroll
    for (int i = 0; i < S; ++i) v[i] = p && live && sl * S + i < N ? p[chan * N + sl * S + i] : 0.0f;
  }
};

// The chunks [cb, ce) of segment z: seg_len / kChunk chunks from z * seg_len, cut at seqlen.
struct SeqSegment {
  int z, cb, ce;
  __device__ __forceinline__ SeqSegment(int z_, int kC, int seqlen, int seg_len) {
    z = z_;
    const int per = seg_len / kC, nchunks = (seqlen + kC - 1) / kC;
    cb = z * per;
    ce = min(cb + per, nchunks);
  }
};

}  // namespace scan_detail

}  // namespace kspec
