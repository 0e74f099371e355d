// The sequential-state kernels (algo 1) of the selective scan: forward, backward and the segments'
// local passes. The backward's pass 2 (selective_scan_bwd_reduce_kernel) is in reduce.cuh.
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
template <typename T_, typename TB_, typename TC_, int kDstate_, bool kVarB_, bool kVarC_, bool kHasD_,
          bool kHasZ_, bool kHasDeltaBias_, bool kSoftplus_, bool kHasH0_, bool kEven_, int kWarps_,
          int kLanes_, int kChunk_>
struct SeqScanTraits {
  using T = T_;
  using TB = TB_;
  using TC = TC_;
  static constexpr int kDstate = kDstate_;
  static constexpr bool kVarB = kVarB_, kVarC = kVarC_, kHasD = kHasD_, kHasZ = kHasZ_;
  static constexpr bool kHasDeltaBias = kHasDeltaBias_, kSoftplus = kSoftplus_, kHasH0 = kHasH0_;
  static constexpr bool kEven = kEven_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kLanes = kLanes_;
  static constexpr int kChunk = kChunk_;
  static constexpr int kChannels = kThreads / kLanes;
  static constexpr int kSpt = (kDstate + kLanes - 1) / kLanes;  // states per thread
  static constexpr int kNp = kSpt * kLanes;                     // dstate padded to whole threads
  static constexpr int kCs = kChannels + 1;                     // row stride of [step][channel] arrays
  static_assert(kLanes >= 1 && kLanes <= kWarpSize && (kLanes & (kLanes - 1)) == 0, "kLanes: power of two <= 32");
  static_assert(kSpt <= 32, "at most 32 states per thread");
  static_assert(kChunk % 16 == 0, "kChunk: a multiple of 16 steps");
  static_assert(kWarps >= 1 && kWarps <= 32, "1..32 warps per block");
};

// Shared memory of the sequential forward, in floats: s_dtu (float2 {dt, dt u}), s_u, s_y, then s_B and s_C
// when variable.
template <typename Tr>
constexpr int seq_fwd_smem_floats() {
  return 4 * Tr::kChunk * Tr::kCs + ((Tr::kVarB ? 1 : 0) + (Tr::kVarC ? 1 : 0)) * Tr::kChunk * Tr::kNp;
}

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

// Launch bounds with a minimum of one block per SM: without it ptxas capped some configs at 56-72
// registers and spilled.
// At 8 states per thread in blocks of 4 warps, 3 blocks per SM (170 registers): ptxas chose 174 once
// the states for the backward were written, and 2 blocks ran 8x5120x2048 bf16 in 0.89 ms against 0.69.
template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kSpt == 8 && Tr::kThreads == 128 ? 3 : 1)
    selective_scan_fwd_seq_kernel(const typename Tr::T* __restrict__ u, const typename Tr::T* __restrict__ delta,
                                  const float* __restrict__ A, const typename Tr::TB* __restrict__ B,
                                  const typename Tr::TC* __restrict__ C, const float* __restrict__ D,
                                  const typename Tr::T* __restrict__ z, const float* __restrict__ delta_bias,
                                  const float* __restrict__ h0, typename Tr::T* __restrict__ out,
                                  float* __restrict__ last_state, int dim, int seqlen, int channels_per_group,
                                  int groups, const float* __restrict__ seg_h, const float* __restrict__ seg_dt,
                                  int seg_len, int nsegs, float* __restrict__ states,
                                  const unsigned* __restrict__ seg_ready) {
  using namespace scan_detail;
  using T = typename Tr::T;
  constexpr int N = Tr::kDstate, S = Tr::kSpt, NC = Tr::kChannels, CS = Tr::kCs;
  constexpr int kC = Tr::kChunk, NP = Tr::kNp;
  extern __shared__ float smem[];
  float2* s_dtu = reinterpret_cast<float2*>(smem);
  float* s_u = smem + 2 * kC * CS;
  float* s_y = s_u + kC * CS;
  float* s_B = s_y + kC * CS;
  float* s_C = s_B + (Tr::kVarB ? kC * NP : 0);

  const SeqPlace<Tr> at(dim, seqlen, channels_per_group, groups);
  const int tid = at.tid, cl = at.cl, sl = at.sl, d0 = at.d0, b = at.b, d = at.d;
  const bool live = at.live;
  const long long chan = at.chan, bc_base = at.bc_base;
  float A2[S], x[S], Bf[S], Cf[S];
  at.template row<true>(A, kLog2e, A2);
  at.template row<!Tr::kVarB>(B, 1.0f, Bf);
  at.template row<!Tr::kVarC>(C, 1.0f, Cf);
  at.state(Tr::kHasH0 ? h0 : nullptr, x);
  const SeqSegment seg(static_cast<int>(blockIdx.z), kC, seqlen, seg_len);
  if (seg_ready && seg.z > 0) seq_wait_segments(seg_ready, nsegs, seg.z);
  seq_fold<Tr>(x, A2, seg_h, seg_dt, chan, nsegs, 0, seg.z, 1, sl, live);
  const int tb = seg.cb * kC, te = min(seg.ce * kC, seqlen);
  float unused = 0.0f;
  // The states for the backward: this channel's rows of [batch, dim, nstates, dstate].
  float* ck = states && live ? states + chan * nstates_of(seqlen) * N : nullptr;
  if constexpr (Tr::kEven) {
    // Every chunk whole and 16-byte aligned: the next chunk's global loads are issued before this
    // chunk's scan (registers), so their latency hides behind it.
    using Pf = SeqPrefetch<Tr>;
    Pf::walk(u, delta, z, B, C, out, typename Pf::Rows(delta_bias, D, d0, dim), b, d0, dim, seqlen, bc_base, tb, te,
             s_dtu, s_u, s_B, s_C, s_y, [&](int t0) {
               seq_scan_chunk<Tr>(x, A2, Bf, Cf, s_dtu, s_B, s_C, s_y, cl, sl, unused, ck, t0, seqlen);
             });
  } else {
    for (int t0 = tb; t0 < te; t0 += kC) {
      // Element by element, zeros past seqlen, dim and dstate (a partial last chunk, odd alignments).
      for (int e = tid; e < NC * kC; e += Tr::kThreads) {
        const int r = e / kC, t = e % kC;
        const bool ok = d0 + r < dim && t0 + t < seqlen;
        const long long off = (static_cast<long long>(b) * dim + d0 + r) * seqlen + t0 + t;
        float w = ok ? to_float(delta[off]) + (Tr::kHasDeltaBias ? delta_bias[d0 + r] : 0.0f) : 0.0f;
        if constexpr (Tr::kSoftplus) w = softplus_sfu(w);
        const float uu = ok ? to_float(u[off]) : 0.0f;
        w = ok ? w : 0.0f;
        s_u[t * CS + r] = uu;
        s_dtu[t * CS + r] = make_float2(w, w * uu);
      }
      for (int e = tid; e < NP * kC; e += Tr::kThreads) {
        const int n = e / kC, t = e % kC;
        const bool ok = n < N && t0 + t < seqlen;
        const long long off = bc_base + static_cast<long long>(n) * seqlen + t0 + t;
        if constexpr (Tr::kVarB) s_B[t * NP + n] = ok ? to_float(B[off]) : 0.0f;
        if constexpr (Tr::kVarC) s_C[t * NP + n] = ok ? to_float(C[off]) : 0.0f;
      }
      __syncthreads();
      seq_scan_chunk<Tr>(x, A2, Bf, Cf, s_dtu, s_B, s_C, s_y, cl, sl, unused, ck, t0, seqlen);
      __syncthreads();
      for (int e = tid; e < NC * kC; e += Tr::kThreads) {
        const int r = e / kC, t = e % kC;
        if (d0 + r >= dim || t0 + t >= seqlen) continue;
        const long long off = (static_cast<long long>(b) * dim + d0 + r) * seqlen + t0 + t;
        float o = fmaf(Tr::kHasD ? D[d0 + r] : 0.0f, s_u[t * CS + r], s_y[t * CS + r]);
        if constexpr (Tr::kHasZ) o *= silu_sfu(to_float(z[off]));
        out[off] = from_float<T>(o);
      }
      __syncthreads();  // s_u, s_y are restaged next
    }
  }
  if (live && seg.z == nsegs - 1) {
#pragma unroll
    for (int i = 0; i < S; ++i)
      if (sl * S + i < N) last_state[chan * N + sl * S + i] = x[i];
  }
}

// =============================================================================================
// The sequential-state backward ("algo 1"): the forward's thread layout (kSpt states of one channel
// per thread, kLanes threads per channel, kChannels channels of one batch and group per block), time
// walked in order forward and then in reverse.
//
// 1. Checkpoints: a forward walk over every chunk but the last writes the state entering each chunk
//    of kChunk steps to `states` ([batch * dim, nchunks, dstate] fp32; one ex2 per step and state).
//    Skipped when the forward's states are `given` (training): chunk c starts from given[c * kChunk /
//    16]. H100, 8x2048x2048 bf16: 1.77 ms with this pass, 1.44 without; 1x2048x65536 (16 segments,
//    whose local forward pass goes too): 10.35 -> 7.04 ms.
// 2. Chunks last to first. The block stages the chunk ([step][channel]: u, dt after bias/softplus,
//    gy = dout * silu(z); [step][state]: a variable B and C row) and each thread
//    a. recomputes the chunk's forward from its checkpoint, keeping x_{t-1} of every step in
//       shared memory (each thread its own; registers were tried: the fully unrolled chunk took 255
//       registers and spilled) and, on the way, y = C . x (for dz) and dC_t = gy_t x_t;
//    b. runs the adjoint backwards through the chunk, H_{t-1} = a_t (H_t + gy_t C_t) with
//       hx = H_t + gy_t C_t the adjoint of x_t, and forms
//         ddt_t = sum_n hx (A a_t x_{t-1} + B_t u_t) = sum_n A q + u_t hb,  du_t = dt_t hb + D gy_t,
//         dA += dt_t q,  dB_t = hx dt_t u_t,   with q = hx a_t x_{t-1} = H_{t-1} x_{t-1} and
//         hb = sum_n hx B_t.
//       a_t again by ex2, for a group of 4 steps before its chain (it was read from shared memory, saved
//       beside x_{t-1}: that traffic was a third of the backward's wavefronts; earlier still, an ex2
//       inside the chain: a third of ncu's stall samples were FMULs waiting on it). With q from x_{t-1}
//       (it was (x_t - dt_t B_t u_t) hx, a cancellation) the adjoint is 7 FMA/FMUL per state, was 10.
//    Sums over a channel's kLanes threads (ddt, du, y) and over the channels of a warp (a variable
//    dB_t, dC_t) are transposing shuffle reductions over groups of 4 steps (TransposeReduce); the
//    warps' dB/dC then go through shared memory and one fp32 atomicAdd per element, chunk and block
//    to dB_acc/dC_acc (run-order dependent, as in algo 0). Staging also keeps softplus'(pre) and
//    dout silu'(z) in shared memory, so the outputs du, ddelta, dz are written from there.
// 3. dA, a fixed dB/dC, dD and ddelta_bias go to `partials` per channel as in algo 0 (the same
//    reduce kernel sums them over the batch, deterministically), dh0 = the adjoint left at t = -1.
// Two ex2 per step and state in all, one with the forward's states (mamba_ssm's backward: one; its
// forward saves the checkpoints), no per-state scans. The next chunk's global loads are issued before
// this chunk's work.
// Measured (H100, 8x2048x2048 bf16): 2.35 ms at 8 lanes, against 2.63 for the warp scan's best and
// ~2.4 for mamba_ssm's backward; 2.00 ms with registers capped at 128 (see the launch bounds), 1.92 at
// 8 warps. ncu (8 warps, 8 lanes): 68 warp instructions per step and state slot, IPC 2.4, bound by the
// L1's shared-memory wavefronts (79% busy): a step's values were 3 scalar loads and B, C two more per
// thread and pass. Packed as below (one 16-byte load of {dt, dt u, gy, u}, B and C of the thread's
// states side by side, x_t as one vector per thread): 1.77 ms. With the forward's states: 1.44 ms at 8
// warps. ncu then: 49 warp instructions per step and state slot, of which 12 FSEL/SHFL/FADD of the
// sums, 13 per thread and chunk (staging, outputs, atomics), 17 the two passes' arithmetic. With a_t
// kept (below) and delta_bias, D loaded once: 1.39 ms at 4 warps (8 warps no longer fit 96 KiB).
//
// Launch: as the sequential forward (gridDim = (ceil(dim / kChannels), batch, nsegs), blockDim =
// kThreads), dynamic shared memory seq_bwd_smem_floats() floats; the arguments of
// selective_scan_bwd_kernel, with `states` holding ceil(seqlen / kChunk) states per channel and
// `partials` one row per (batch, segment, channel), then the segments'. Every thread of a block reaches
// every barrier and shuffle: channels past dim run on zeros (a = 1, b = 0, gy = 0) and write nothing.
// Segments (nsegs > 1, after both local passes): block z starts its checkpoints from the state folded
// over segments 0..z-1 and its adjoint from dlast_state folded back over segments nsegs-1..z+1; only
// segment 0 writes dh0.
// =============================================================================================

// Shared memory of the sequential backward, in floats, in this order (each part a whole number of
// 16-byte words, the first three read with vector loads):
//   s_st  [step][channel (+1 pad)] float4 {dt, dt u, gy, u}: one 16-byte read per step and thread;
//   s_bc  [step][thread slice][B of its kSpt states, C of them] (row padded by 4; when B or C is
//         variable): one or two vector reads per step and thread;
//   s_x   [step][thread][x_{t-1} of its kSpt states]: each thread its own;
//   s_ddt, s_du (s_sig with softplus; s_y, s_dzf with z) [step][channel]; the warps' variable dB, dC as
//   [warp][state][step (+1 pad)].
template <typename Tr>
constexpr int seq_bwd_bc_stride() {
  return 2 * Tr::kNp + 4;
}
template <typename Tr>
constexpr int seq_bwd_smem_floats() {
  constexpr int nvar = (Tr::kVarB ? 1 : 0) + (Tr::kVarC ? 1 : 0);
  return 4 * Tr::kChunk * (Tr::kChannels + 1) + (nvar ? Tr::kChunk * seq_bwd_bc_stride<Tr>() : 0) +
         Tr::kChunk * Tr::kSpt * Tr::kThreads +
         (2 + (Tr::kSoftplus ? 1 : 0) + (Tr::kHasZ ? 2 : 0)) * Tr::kChunk * Tr::kCs +
         nvar * Tr::kWarps * Tr::kNp * (Tr::kChunk + 1);
}

namespace scan_detail {

// What a chunk of the sequential backward stages: the forward walk's u, dt, a variable B (kStageWalk); all
// of the reverse walk's inputs (kStageAll); the adjoint alone's dt, gy and a variable C (kStageAdjoint).
enum SeqStage { kStageWalk = 0, kStageAll = 1, kStageAdjoint = 2 };

// One chunk's raw inputs, held in registers from their global loads (issued a chunk ahead) to their
// staging. Element e = tid + k * kThreads of a [channel][step] tensor is (r, t) = (e / kChunk,
// e % kChunk); of a B/C chunk, (n, t). Zeros past dim, seqlen and dstate.
template <typename Tr, int kMode>
struct SeqBwdChunk {
  using T = typename Tr::T;
  static constexpr int kC = Tr::kChunk, NC = Tr::kChannels, NP = Tr::kNp, N = Tr::kDstate, CS = Tr::kCs;
  static constexpr int PE = (NC * kC + Tr::kThreads - 1) / Tr::kThreads;
  static constexpr int PN = (NP * kC + Tr::kThreads - 1) / Tr::kThreads;
  static constexpr bool kU = kMode != kStageAdjoint, kG = kMode != kStageWalk, kZ = kG && Tr::kHasZ;
  static constexpr bool kB = kU && Tr::kVarB, kCv = kG && Tr::kVarC;
  // raw bits (load_raw; 0 past dim, seqlen and dstate), converted where staged: as floats, converted at
  // the load, the compiler waited for the loads there, at the top of the chunk's work
  unsigned u[kU ? PE : 1], dl[PE], g[kG ? PE : 1], zz[kZ ? PE : 1];
  unsigned bv[kB ? PN : 1], cv[kCv ? PN : 1];
  static __device__ __forceinline__ float f(unsigned r) { return raw_to_float<T>(r); }
  float bias[PE];  // delta_bias of element k's channel, loaded once (the rows are fixed per k)

  __device__ __forceinline__ SeqBwdChunk(const float* __restrict__ delta_bias, int d0, int dim) {
#pragma unroll
    for (int k = 0; k < PE; ++k) {
      const int r = (static_cast<int>(threadIdx.x) + k * Tr::kThreads) / kC;
      bias[k] = Tr::kHasDeltaBias && r < NC && d0 + r < dim ? delta_bias[d0 + r] : 0.0f;
    }
  }

  static __device__ __forceinline__ bool elem(int k, int d0, int dim, int seqlen, int t0, int* r, int* t) {
    const int e = static_cast<int>(threadIdx.x) + k * Tr::kThreads;
    *r = e / kC;
    *t = e % kC;
    return e < NC * kC && d0 + *r < dim && t0 + *t < seqlen;
  }

  __device__ __forceinline__ void load(const T* __restrict__ gu, const T* __restrict__ gd, const T* __restrict__ gout,
                                       const T* __restrict__ gz, const typename Tr::TB* __restrict__ gB,
                                       const typename Tr::TC* __restrict__ gC, int b, int d0, int dim, int seqlen,
                                       long long bc_base, int t0) {
#pragma unroll
    for (int k = 0; k < PE; ++k) {
      int r, t;
      const bool ok = elem(k, d0, dim, seqlen, t0, &r, &t);
      const long long off = (static_cast<long long>(b) * dim + d0 + r) * seqlen + t0 + t;
      if constexpr (kU) u[k] = 0u;
      dl[k] = 0u;
      if constexpr (kG) g[k] = 0u;
      if constexpr (kZ) zz[k] = 0u;
      if (ok) {
        if constexpr (kU) u[k] = load_raw(gu + off);
        dl[k] = load_raw(gd + off);
        if constexpr (kG) g[k] = load_raw(gout + off);
        if constexpr (kZ) zz[k] = load_raw(gz + off);
      }
    }
#pragma unroll
    for (int k = 0; k < PN; ++k) {
      const int e = static_cast<int>(threadIdx.x) + k * Tr::kThreads;
      const int n = e / kC, t = e % kC;
      const bool ok = n < N && t0 + t < seqlen;
      const long long off = bc_base + static_cast<long long>(n) * seqlen + t0 + t;
      if constexpr (kB) bv[k] = 0u;
      if constexpr (kCv) cv[k] = 0u;
      if (ok) {
        if constexpr (kB) bv[k] = load_raw(gB + off);
        if constexpr (kCv) cv[k] = load_raw(gC + off);
      }
    }
  }

  // Element k's dt after bias and softplus (0 past seqlen and dim), and in *sig softplus' there.
  __device__ __forceinline__ float dt_of(int k, bool ok, float* sig) const {
    const float pre = f(dl[k]) + bias[k];
    *sig = 1.0f;
    return ok ? (Tr::kSoftplus ? softplus_sfu(pre, sig) : pre) : 0.0f;
  }
  // Element k's gy = dout silu(z).
  __device__ __forceinline__ float gy_of(int k) const {
    return Tr::kHasZ ? f(g[k]) * silu_sfu(f(zz[k])) : f(g[k]);
  }

  // The main backward pass's staging (kStageAll), in the layout of seq_bwd_smem_floats: s_st[t][r] =
  // {dt, dt u, gy, u}, s_sig = softplus'(pre), s_dzf = dout silu'(z) [t][r]; a variable B, C to s_bc.
  __device__ __forceinline__ void stage_packed(float4* s_st, float* s_sig, float* s_dzf, float* s_bc, int d0,
                                               int dim, int seqlen, int t0) const {
    static_assert(kMode == kStageAll, "the packed layout is the main pass's");
#pragma unroll
    for (int k = 0; k < PE; ++k) {
      int r, t;
      const bool ok = elem(k, d0, dim, seqlen, t0, &r, &t);
      if (r >= NC) continue;
      float sig;
      const float dt = dt_of(k, ok, &sig);
      const int i = t * CS + r;
      if constexpr (Tr::kHasZ) {
        const float zk = f(zz[k]), gk = f(g[k]), uk = f(u[k]);
        const float sz = sigmoid_sfu(zk);  // silu(z) = z sz, silu'(z) = sz (1 + z (1 - sz))
        s_st[t * (NC + 1) + r] = make_float4(dt, dt * uk, gk * zk * sz, uk);
        s_dzf[i] = gk * sz * fmaf(zk, 1.0f - sz, 1.0f);
      } else {
        const float uk = f(u[k]);
        s_st[t * (NC + 1) + r] = make_float4(dt, dt * uk, f(g[k]), uk);
      }
      if constexpr (Tr::kSoftplus) s_sig[i] = sig;
    }
    constexpr int S = Tr::kSpt, RS = seq_bwd_bc_stride<Tr>();
#pragma unroll
    for (int k = 0; k < PN; ++k) {
      const int e = static_cast<int>(threadIdx.x) + k * Tr::kThreads;
      if (e >= NP * kC) continue;
      const int n = e / kC, t = e % kC;
      float* row = s_bc + t * RS + (n / S) * 2 * S + n % S;
      if constexpr (kB) row[0] = raw_to_float<typename Tr::TB>(bv[k]);
      if constexpr (kCv) row[S] = raw_to_float<typename Tr::TC>(cv[k]);
    }
  }

  // The walks' staging: kStageWalk s_dtu = {dt, dt u} (bias, softplus; 0 past seqlen) and s_B[t][n];
  // kStageAdjoint s_dt, s_gy = dout silu(z) and s_C[t][n].
  __device__ __forceinline__ void stage(float2* s_dtu, float* s_dt, float* s_gy, float* s_B, float* s_C, int d0,
                                        int dim, int seqlen, int t0) const {
    static_assert(kMode != kStageAll, "the main pass stages with stage_packed");
#pragma unroll
    for (int k = 0; k < PE; ++k) {
      int r, t;
      const bool ok = elem(k, d0, dim, seqlen, t0, &r, &t);
      if (r >= NC) continue;
      float sig;
      const int i = t * CS + r;
      const float dt = dt_of(k, ok, &sig);
      if constexpr (kU) s_dtu[i] = make_float2(dt, dt * f(u[k]));
      else s_dt[i] = dt;
      if constexpr (kG) s_gy[i] = gy_of(k);
    }
#pragma unroll
    for (int k = 0; k < PN; ++k) {
      const int e = static_cast<int>(threadIdx.x) + k * Tr::kThreads;
      if (e >= NP * kC) continue;
      const int n = e / kC, t = e % kC;
      if constexpr (kB) s_B[t * NP + n] = raw_to_float<typename Tr::TB>(bv[k]);
      if constexpr (kCv) s_C[t * NP + n] = raw_to_float<typename Tr::TC>(cv[k]);
    }
  }
};

// The forward over chunks [cb, ce) from x, staged as kStageWalk (s_dtu, s_B). kCkpt: writes the state
// entering each chunk to ckpt[c * dstate + n] and stops before the last chunk's scan (the backward
// recomputes it from there); else scans every chunk and adds their dt to sdt.
template <typename Tr, bool kCkpt>
__device__ __forceinline__ void seq_forward_walk(float (&x)[Tr::kSpt], const float (&A2)[Tr::kSpt],
                                                 const float (&Bf)[Tr::kSpt], const typename Tr::T* __restrict__ u,
                                                 const typename Tr::T* __restrict__ delta,
                                                 const typename Tr::TB* __restrict__ B,
                                                 const float* __restrict__ delta_bias, float* __restrict__ ckpt,
                                                 float& sdt, float2* s_dtu, float* s_B, int b, int d0,
                                                 int dim, int seqlen, long long bc_base, int cb, int ce, int cl,
                                                 int sl, bool live) {
  constexpr int S = Tr::kSpt, N = Tr::kDstate, kC = Tr::kChunk;
  SeqBwdChunk<Tr, kStageWalk> cur(delta_bias, d0, dim);  // reloaded once staged: registers free during the scan
  const int last = kCkpt ? ce - 1 : ce;  // chunks [cb, last) are scanned
  if (cb < last) cur.load(u, delta, nullptr, nullptr, B, nullptr, b, d0, dim, seqlen, bc_base, cb * kC);
  for (int c = cb; c < ce; ++c) {
    if constexpr (kCkpt) {
      if (live) seq_put_state<Tr>(ckpt + c * N, x, sl);
    }
    if (c == last) break;
    cur.stage(s_dtu, nullptr, nullptr, s_B, nullptr, d0, dim, seqlen, c * kC);
    __syncthreads();
    if (c + 1 < last) cur.load(u, delta, nullptr, nullptr, B, nullptr, b, d0, dim, seqlen, bc_base, (c + 1) * kC);
    seq_scan_chunk<Tr, false, !kCkpt>(x, A2, Bf, Bf, s_dtu, s_B, nullptr, nullptr, cl, sl, sdt);
    __syncthreads();  // s_dtu, s_B are restaged next
  }
}

// The backward's outputs of one chunk from shared memory: du = dt * (sum_n hx B) + D gy, ddelta = ddt *
// softplus'(pre), dz = dout silu'(z) (y + D u), for the elements e = tid + k * kThreads (fixed rows per
// k, as in SeqBwdChunk; Dk[k] = D of element k's channel), whose gy u and ddelta are added to dD[k],
// dbias[k].
template <typename Tr, int PE>
__device__ __forceinline__ void seq_bwd_write(typename Tr::T* __restrict__ gdu, typename Tr::T* __restrict__ gddelta,
                                              typename Tr::T* __restrict__ gdz, const float (&Dk)[PE],
                                              const float4* s_st, const float* s_sig, const float* s_dzf,
                                              const float* s_ddt, const float* s_du, const float* s_y, int b, int d0,
                                              int dim, int seqlen, int t0, float (&dD)[PE], float (&dbias)[PE]) {
  using T = typename Tr::T;
  constexpr int kC = Tr::kChunk, NC = Tr::kChannels, CS = Tr::kCs;
#pragma unroll
  for (int k = 0; k < PE; ++k) {
    const int e = static_cast<int>(threadIdx.x) + k * Tr::kThreads;
    const int r = e / kC, t = e % kC;
    if (e >= NC * kC || d0 + r >= dim || t0 + t >= seqlen) continue;
    const long long off = (static_cast<long long>(b) * dim + d0 + r) * seqlen + t0 + t;
    const int i = t * CS + r;
    const float Dd = Dk[k];
    const float4 st = s_st[t * (NC + 1) + r];  // dt, dt u, gy, u
    const float dd = Tr::kSoftplus ? s_ddt[i] * s_sig[i] : s_ddt[i];
    gdu[off] = from_float<T>(fmaf(st.x, s_du[i], Dd * st.z));
    gddelta[off] = from_float<T>(dd);
    if constexpr (Tr::kHasZ) gdz[off] = from_float<T>(s_dzf[i] * fmaf(Dd, st.w, s_y[i]));
    dD[k] = fmaf(st.z, st.w, dD[k]);
    dbias[k] += dd;
  }
}

// K consecutive floats of shared memory with the widest loads (or stores) K and the alignment allow: p
// is aligned to 4 * (the largest power of two up to 4 dividing K) bytes.
template <int K>
__device__ __forceinline__ void lds_vec(const float* p, float* v) {
  if constexpr (K % 4 == 0) {
#pragma unroll
    for (int j = 0; j < K; j += 4) {
      const float4 q = *reinterpret_cast<const float4*>(p + j);
      v[j] = q.x, v[j + 1] = q.y, v[j + 2] = q.z, v[j + 3] = q.w;
    }
  } else if constexpr (K % 2 == 0) {
#pragma unroll
    for (int j = 0; j < K; j += 2) {
      const float2 q = *reinterpret_cast<const float2*>(p + j);
      v[j] = q.x, v[j + 1] = q.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) v[j] = p[j];
  }
}
template <int K>
__device__ __forceinline__ void sts_vec(float* p, const float* v) {
  if constexpr (K % 4 == 0) {
#pragma unroll
    for (int j = 0; j < K; j += 4) *reinterpret_cast<float4*>(p + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
  } else if constexpr (K % 2 == 0) {
#pragma unroll
    for (int j = 0; j < K; j += 2) *reinterpret_cast<float2*>(p + j) = make_float2(v[j], v[j + 1]);
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) p[j] = v[j];
  }
}

// One step's values read from the packed shared memory by thread (cl, sl): dt, dt u, gy, u, and B and
// C of its states (the fixed values when not variable).
template <typename Tr>
struct SeqStep {
  static constexpr int S = Tr::kSpt, NC = Tr::kChannels, RS = seq_bwd_bc_stride<Tr>();
  float dt, u, dtu, gy, B[S], C[S];
  __device__ __forceinline__ void read(int t, const float4* s_st, const float* s_bc, const float (&Bf)[S],
                                       const float (&Cf)[S], int cl, int sl) {
    const float4 st = s_st[t * (NC + 1) + cl];
    dt = st.x, dtu = st.y, gy = st.z, u = st.w;
    const float* row = s_bc + t * RS + sl * 2 * S;
    if constexpr (Tr::kVarB && Tr::kVarC) {
      float v[2 * S];
      lds_vec<2 * S>(row, v);
#pragma unroll
      for (int i = 0; i < S; ++i) B[i] = v[i], C[i] = v[S + i];
    } else {
      if constexpr (Tr::kVarB) lds_vec<S>(row, B);
      if constexpr (Tr::kVarC) lds_vec<S>(row + S, C);
#pragma unroll
      for (int i = 0; i < S; ++i) {
        if constexpr (!Tr::kVarB) B[i] = Bf[i];
        if constexpr (!Tr::kVarC) C[i] = Cf[i];
      }
    }
  }
};

// Sums a group's per-state values v[g * S + i] over the warp's channels and writes the warp's totals
// to s_r[(warp * NP + n) * (kChunk + 1) + t + g].
template <typename Tr>
__device__ __forceinline__ void seq_channel_sum(float (&v)[4 * Tr::kSpt], float* s_r, int warp, int lane, int sl,
                                                int t) {
  constexpr int S = Tr::kSpt, P = kWarpSize / Tr::kLanes;
  using R = TransposeReduce<4 * S, P, Tr::kLanes>;
  bool writer;
  const int base = R::run(v, lane, &writer);
  if (writer) {
#pragma unroll
    for (int j = 0; j < R::kOut; ++j) {
      const int g = (base + j) / S, i = (base + j) % S;
      s_r[(warp * Tr::kNp + sl * S + i) * (Tr::kChunk + 1) + t + g] = v[j];
    }
  }
}

// Sums a group's per-step values v[q * 4 + g] (q < Q quantities) over the channel's kLanes threads and
// writes them to dst[q * kChunk * kCs + (t + g) * kCs + cl] (the quantities' [step][channel] arrays side
// by side; an array of pointers indexed by the lane's q went to local memory).
template <typename Tr, int Q>
__device__ __forceinline__ void seq_lane_sum(float (&v)[4 * Q], float* dst, int lane, int cl, int t) {
  using R = TransposeReduce<4 * Q, Tr::kLanes, 1>;
  bool writer;
  const int base = R::run(v, lane, &writer);
  if (writer) {
#pragma unroll
    for (int j = 0; j < R::kOut; ++j) {
      const int q = (base + j) / 4, g = (base + j) % 4;
      dst[(q * Tr::kChunk + t + g) * Tr::kCs + cl] = v[j];
    }
  }
}

}  // namespace scan_detail

// At most 2 states per thread, chunks of 16 and blocks of 4 or 8 warps, registers are capped at 128 (4
// blocks of 4 warps per SM, against 3 at the 140 ptxas chose): H100, 8x2048x2048 bf16, 8 lanes: 2.00 ms
// against 2.33. Elsewhere the cap spilled (4 states per thread; chunks of 32; one warp on sm_80), and on
// sm_80 when a_t was kept in shared memory beside x_{t-1} (16 bytes with h0 and odd lengths): there 3
// blocks of 4 warps (168 registers).
// 4 states per thread in blocks of 4 warps and chunks of 16 (the heuristic's choice from 16k channels),
// sm_90: 3 blocks per SM (168 registers, against 214 and 2 blocks uncapped): H100 bf16, the backward alone,
// 8x2048x2048 1.216 -> 1.196 ms, 8x5120x2048 2.991 -> 2.698, 8x2048x8192 4.767 -> 4.700. (sm_80's 164 KiB
// of shared memory hold only 2 such blocks of ~62 KiB: uncapped there.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kSeqBwdCappedThreadsPerSm = 384;
constexpr int kSeqBwdSpt4Blocks = 1;
#else
constexpr int kSeqBwdCappedThreadsPerSm = 512;
constexpr int kSeqBwdSpt4Blocks = 3;
#endif
// The backward's minimum blocks per SM for its launch bounds (the register cap), by the rules above.
template <typename Tr>
constexpr int seq_bwd_min_blocks() {
  if (Tr::kChunk != 16) return 1;
  if (Tr::kSpt == 4 && Tr::kThreads == 128) return kSeqBwdSpt4Blocks;
  if (Tr::kSpt <= 2 && Tr::kThreads >= 128 && kSeqBwdCappedThreadsPerSm / Tr::kThreads > 0)
    return kSeqBwdCappedThreadsPerSm / Tr::kThreads;
  return 1;
}
template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, seq_bwd_min_blocks<Tr>())
    selective_scan_bwd_seq_kernel(const typename Tr::T* __restrict__ u, const typename Tr::T* __restrict__ delta,
                                  const float* __restrict__ A, const typename Tr::TB* __restrict__ B,
                                  const typename Tr::TC* __restrict__ C, const float* __restrict__ D,
                                  const typename Tr::T* __restrict__ z, const float* __restrict__ delta_bias,
                                  const float* __restrict__ h0, const typename Tr::T* __restrict__ dout,
                                  const float* __restrict__ dlast_state, typename Tr::T* __restrict__ du,
                                  typename Tr::T* __restrict__ ddelta, typename Tr::T* __restrict__ dz,
                                  float* __restrict__ dh0, float* __restrict__ dB_acc, float* __restrict__ dC_acc,
                                  float* __restrict__ states, float* __restrict__ partials, int dim, int seqlen,
                                  int channels_per_group, int groups, const float* __restrict__ seg_h,
                                  const float* __restrict__ seg_g, const float* __restrict__ seg_dt, int seg_len,
                                  int nsegs, const float* __restrict__ given) {
  using namespace scan_detail;
  constexpr int N = Tr::kDstate, S = Tr::kSpt, NC = Tr::kChannels, CS = Tr::kCs;
  constexpr int kC = Tr::kChunk, NP = Tr::kNp, W = Tr::kWarps, kRs = kC + 1;
  extern __shared__ float4 smem4[];  // the layout of seq_bwd_smem_floats
  float4* s_st = smem4;
  float* s_bc = reinterpret_cast<float*>(s_st + kC * (NC + 1));
  float* s_x = s_bc + (Tr::kVarB || Tr::kVarC ? kC * seq_bwd_bc_stride<Tr>() : 0);
  float* s_ddt = s_x + kC * S * Tr::kThreads;
  float* s_du = s_ddt + kC * CS;
  float* s_sig = s_du + kC * CS;
  float* s_y = s_sig + (Tr::kSoftplus ? kC * CS : 0);
  float* s_dzf = s_y + (Tr::kHasZ ? kC * CS : 0);
  float* s_rB = s_dzf + (Tr::kHasZ ? kC * CS : 0);
  float* s_rC = s_rB + (Tr::kVarB ? W * NP * kRs : 0);
  // the chunk-walk's staging (pass 1) overlays the packed arrays: s_dtu [step][channel], s_B [step][state]
  float2* s_dtu = reinterpret_cast<float2*>(s_st);
  float* s_B = reinterpret_cast<float*>(s_dtu + kC * CS);
  static_assert(2 * kC * CS + kC * NP <= 4 * kC * (NC + 1) + kC * seq_bwd_bc_stride<Tr>(), "walk staging fits");

  const SeqPlace<Tr> at(dim, seqlen, channels_per_group, groups);
  const int tid = at.tid, cl = at.cl, sl = at.sl, d0 = at.d0, b = at.b, d = at.d;
  const bool live = at.live;
  const long long chan = at.chan, bc_base = at.bc_base;
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int nchunks = (seqlen + kC - 1) / kC;
  // The state entering chunk c: ckpt[c * ck_step * N + n], the forward's (given) or pass 1's.
  static_assert(kC % kStateStride == 0, "a chunk is a whole number of state strides");
  const float* ckpt = given ? given + (live ? chan : 0) * nstates_of(seqlen) * N
                            : states + (live ? chan : 0) * nchunks * N;
  const int ck_step = given ? kC / kStateStride : 1;

  float An[S], A2[S], Bf[S], Cf[S], x[S];
  at.template row<true>(A, 1.0f, An);
#pragma unroll
  for (int i = 0; i < S; ++i) A2[i] = An[i] * kLog2e;
  at.template row<!Tr::kVarB>(B, 1.0f, Bf);
  at.template row<!Tr::kVarC>(C, 1.0f, Cf);
  at.state(Tr::kHasH0 ? h0 : nullptr, x);

  // ---- 1: checkpoints (unless the forward gave them) ----
  const SeqSegment seg(static_cast<int>(blockIdx.z), kC, seqlen, seg_len);
  if (!given) {
    seq_fold<Tr>(x, A2, seg_h, seg_dt, chan, nsegs, 0, seg.z, 1, sl, live);
    float unused = 0.0f;
    seq_forward_walk<Tr, true>(x, A2, Bf, u, delta, B, delta_bias, states + (live ? chan : 0) * nchunks * N, unused,
                               s_dtu, s_B, b, d0, dim, seqlen, bc_base, seg.cb, seg.ce, cl, sl, live);
  }

  // ---- 2: chunks in reverse ----
  using Ck = SeqBwdChunk<Tr, kStageAll>;
  float H[S], dA[S], dBf[S], dCf[S];
  float dDk[Ck::PE], dbk[Ck::PE];
  at.state(dlast_state, H);
#pragma unroll
  for (int i = 0; i < S; ++i) dA[i] = dBf[i] = dCf[i] = 0.0f;
  seq_fold<Tr>(H, A2, seg_g, seg_dt, chan, nsegs, nsegs - 1, seg.z, -1, sl, live);
  float Dk[Ck::PE];  // D of element k's channel (see seq_bwd_write)
#pragma unroll
  for (int k = 0; k < Ck::PE; ++k) {
    const int r = (tid + k * Tr::kThreads) / kC;
    dDk[k] = dbk[k] = 0.0f;
    Dk[k] = Tr::kHasD && r < NC && d0 + r < dim ? D[d0 + r] : 0.0f;
  }
  Ck cur(delta_bias, d0, dim);  // reloaded once staged: its registers are free during the chunk's work
  float xn[S];  // the next chunk's checkpoint, loaded a chunk ahead like its inputs
  cur.load(u, delta, dout, z, B, C, b, d0, dim, seqlen, bc_base, (seg.ce - 1) * kC);
  seq_get_state<Tr>(xn, ckpt + (seg.ce - 1) * ck_step * N, sl, live);
  for (int c = seg.ce - 1; c >= seg.cb; --c) {
    const int t0 = c * kC;
#pragma unroll
    for (int i = 0; i < S; ++i) x[i] = xn[i];
    cur.stage_packed(s_st, s_sig, s_dzf, s_bc, d0, dim, seqlen, t0);
    __syncthreads();
    if (c > seg.cb) {
      cur.load(u, delta, dout, z, B, C, b, d0, dim, seqlen, bc_base, t0 - kC);
      seq_get_state<Tr>(xn, ckpt + (c - 1) * ck_step * N, sl, live);
    }

    // a. the chunk's forward from its checkpoint: x_t kept, y and dC on the way
#pragma unroll 2
    for (int t = 0; t < kC; t += 4) {
      float y[4], dCv[4 * S];
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        SeqStep<Tr> st;
        st.read(t + g, s_st, s_bc, Bf, Cf, cl, sl);
        y[g] = 0.0f;
        float xp[S];  // x_{t-1} for the adjoint
#pragma unroll
        for (int i = 0; i < S; ++i) {
          const float a = fast_exp2(st.dt * A2[i]);
          xp[i] = x[i];
          x[i] = fmaf(a, x[i], st.dtu * st.B[i]);
          y[g] = fmaf(st.C[i], x[i], y[g]);
          if constexpr (Tr::kVarC) dCv[g * S + i] = st.gy * x[i];
          else dCf[i] = fmaf(st.gy, x[i], dCf[i]);
        }
        sts_vec<S>(s_x + ((t + g) * Tr::kThreads + tid) * S, xp);
      }
      if constexpr (Tr::kHasZ) seq_lane_sum<Tr, 1>(y, s_y, lane, cl, t);
      if constexpr (Tr::kVarC) seq_channel_sum<Tr>(dCv, s_rC, warp, lane, sl, t);
    }

    // b. the adjoint, steps last to first
#pragma unroll 2
    for (int t = kC - 4; t >= 0; t -= 4) {
      float v[8], dBv[4 * S];  // v: ddt of the 4 steps, then sum_n hx B
      SeqStep<Tr> st4[4];
      float xp[4][S], a4[4][S];  // x_{t-1} from the forward pass; a_t again (ex2 off the chain)
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        st4[g].read(t + g, s_st, s_bc, Bf, Cf, cl, sl);
        lds_vec<S>(s_x + ((t + g) * Tr::kThreads + tid) * S, xp[g]);
#pragma unroll
        for (int i = 0; i < S; ++i) a4[g][i] = fast_exp2(st4[g].dt * A2[i]);
      }
#pragma unroll
      for (int g = 3; g >= 0; --g) {
        const SeqStep<Tr>& st = st4[g];
        float ddt = 0.0f, hb = 0.0f;
#pragma unroll
        for (int i = 0; i < S; ++i) {
          const float hx = fmaf(st.gy, st.C[i], H[i]);
          H[i] = a4[g][i] * hx;      // H_{t-1} = a_t hx
          const float q = H[i] * xp[g][i];  // hx a_t x_{t-1}
          ddt = fmaf(An[i], q, ddt);  // the hx B u part of ddt is u * hb, added once per step below
          hb = fmaf(hx, st.B[i], hb);
          dA[i] = fmaf(st.dt, q, dA[i]);
          if constexpr (Tr::kVarB) dBv[g * S + i] = hx * st.dtu;
          else dBf[i] = fmaf(hx, st.dtu, dBf[i]);
        }
        v[g] = fmaf(st.u, hb, ddt);
        v[4 + g] = hb;
      }
      seq_lane_sum<Tr, 2>(v, s_ddt, lane, cl, t);  // s_ddt, then s_du
      if constexpr (Tr::kVarB) seq_channel_sum<Tr>(dBv, s_rB, warp, lane, sl, t);
    }
    __syncthreads();

    // c. outputs of the chunk; the variable dB, dC summed over the warps, added to the accumulators
    seq_bwd_write<Tr, Ck::PE>(du, ddelta, dz, Dk, s_st, s_sig, s_dzf, s_ddt, s_du, s_y, b, d0, dim, seqlen, t0, dDk,
                              dbk);
    if constexpr (Tr::kVarB || Tr::kVarC) {
      for (int e = tid; e < N * kC; e += Tr::kThreads) {
        const int n = e / kC, t = e % kC;
        if (t0 + t >= seqlen) continue;
        const long long idx = bc_base + static_cast<long long>(n) * seqlen + t0 + t;
        if constexpr (Tr::kVarB) {
          float s = 0.0f;
#pragma unroll
          for (int w = 0; w < W; ++w) s += s_rB[(w * NP + n) * kRs + t];
          atomicAdd(dB_acc + idx, s);
        }
        if constexpr (Tr::kVarC) {
          float s = 0.0f;
#pragma unroll
          for (int w = 0; w < W; ++w) s += s_rC[(w * NP + n) * kRs + t];
          atomicAdd(dC_acc + idx, s);
        }
      }
    }
    __syncthreads();  // the next chunk is staged over these
  }

  // ---- 3: per-channel results ----
  // partials of segment z: [batch * nsegs, dim, 3 * dstate + 2] (the reduce kernel's batch is batch * nsegs)
  const long long pchan = (static_cast<long long>(b) * nsegs + seg.z) * dim;
  if (live) {
    float* part = partials + (pchan + d) * (3 * N + 2);
#pragma unroll
    for (int i = 0; i < S; ++i) {
      const int n = sl * S + i;
      if (n >= N) continue;
      if constexpr (Tr::kHasH0)
        if (seg.z == 0) dh0[chan * N + n] = H[i];
      part[n] = dA[i];
      part[N + n] = dBf[i];
      part[2 * N + n] = dCf[i];
    }
  }
  // dD and ddelta_bias: each thread's elements are fixed rows; their sums meet in shared memory (over the
  // staging arrays) and are added in step order per channel (deterministic).
  float* s_sD = reinterpret_cast<float*>(s_st);
  float* s_sb = s_sD + NC * kC;
#pragma unroll
  for (int k = 0; k < Ck::PE; ++k) {
    const int e = tid + k * Tr::kThreads;
    if (e < NC * kC) {
      s_sD[e] = dDk[k];
      s_sb[e] = dbk[k];
    }
  }
  __syncthreads();
  if (tid < NC && d0 + tid < dim) {
    float sD = 0.0f, sb = 0.0f;
    for (int t = 0; t < kC; ++t) {
      sD += s_sD[tid * kC + t];
      sb += s_sb[tid * kC + t];
    }
    float* part = partials + (pchan + d0 + tid) * (3 * N + 2);
    part[3 * N] = sD;
    part[3 * N + 1] = sb;
  }
}

// ---------------------------------------------------------------------------------------------
// The segments' local passes (see "segments" above), in the sequential kernels' layout and config.
// Launch: gridDim = (ceil(dim / kChannels), batch, nsegs - 1), blockDim = kThreads, dynamic shared
// memory seq_seg_smem_floats() floats; seg_len and nsegs as given to the main kernels.
// ---------------------------------------------------------------------------------------------
template <typename Tr>
constexpr int seq_seg_smem_floats() {
  return 2 * Tr::kChunk * Tr::kCs + (Tr::kVarB || Tr::kVarC ? Tr::kChunk * Tr::kNp : 0);
}

// Segment z = blockIdx.z (every one but the last) from a zero state: seg_h = its end state, seg_dt =
// its sum of dt. Up to 4 states per thread, registers are capped at 128 (4 blocks of 4 warps per SM):
// uncapped, ptxas took 163-188 for (4 warps, 4 lanes, chunk 32) once delta_bias was held in registers,
// against 105 before, and H100 1x2048x65536 bf16 went from 2.47 to 3.50 ms. At 8 the cap spilled;
// uncapped, the vector walk (kEven: the forward's heuristic with segments) takes 139, the scalar one 246.
// Since fma_exp2 the vector walk at 8 states takes 112 (4 blocks of 4 warps); capped at 5 blocks it fits
// 96 without spilling, and H100 1x2048x65536 bf16 (32 segments) ran this pass in 0.649 ms against 0.664.
template <typename Tr>
constexpr int seq_seg_min_blocks() {
  if (Tr::kSpt <= 4 && Tr::kThreads <= 512) return 512 / Tr::kThreads;
  return Tr::kSpt == 8 && Tr::kEven && Tr::kThreads == 128 ? 5 : 1;
}
template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, seq_seg_min_blocks<Tr>())
    selective_scan_seg_fwd_kernel(const typename Tr::T* __restrict__ u, const typename Tr::T* __restrict__ delta,
                                  const float* __restrict__ A, const typename Tr::TB* __restrict__ B,
                                  const float* __restrict__ delta_bias, float* __restrict__ seg_h,
                                  float* __restrict__ seg_dt, int dim, int seqlen, int channels_per_group, int groups,
                                  int seg_len, int nsegs, unsigned* __restrict__ seg_ready) {
  using namespace scan_detail;
  constexpr int N = Tr::kDstate, S = Tr::kSpt, kC = Tr::kChunk;
  if (seg_ready) seq_allow_next_kernel();
  extern __shared__ float smem[];
  float2* s_dtu = reinterpret_cast<float2*>(smem);
  float* s_B = smem + 2 * kC * Tr::kCs;
  const SeqPlace<Tr> at(dim, seqlen, channels_per_group, groups);
  float A2[S], Bf[S], x[S];
  at.template row<true>(A, kLog2e, A2);
  at.template row<!Tr::kVarB>(B, 1.0f, Bf);
  at.state(nullptr, x);
  const SeqSegment seg(static_cast<int>(blockIdx.z), kC, seqlen, seg_len);
  float sdt = 0.0f;
  if constexpr (Tr::kEven) {
    // The main kernel's vector loads, issued a chunk ahead (SeqPrefetch without z, C and outputs): the
    // scalar loads and per-element staging of seq_forward_walk were 452 of this kernel's 1144 instructions
    // per thread and chunk (1x2048x65536 bf16, 4 warps, 4 lanes, chunk 32); with it, 901, and the forward
    // took 1.839 ms on the H100 where it took 2.055 (16 segments; chunk 64: 3.020 -> 2.046). (The adjoint's
    // local pass, at chunk 16 and 4 warps, has half a vector per thread: the same tried there saved
    // nothing, 767 -> 774, half the threads staging twice the elements.)
    using Pf = SeqPrefetch<Tr, false>;
    Pf::walk(u, delta, nullptr, B, nullptr, nullptr, typename Pf::Rows(delta_bias, nullptr, at.d0, dim), at.b, at.d0,
             dim, seqlen, at.bc_base, seg.cb * kC, min(seg.ce * kC, seqlen), s_dtu, nullptr, s_B, nullptr, nullptr,
             [&](int) {
               seq_scan_chunk<Tr, false, true>(x, A2, Bf, Bf, s_dtu, s_B, nullptr, nullptr, at.cl, at.sl, sdt);
             });
  } else {
    seq_forward_walk<Tr, false>(x, A2, Bf, u, delta, B, delta_bias, nullptr, sdt, s_dtu, s_B, at.b, at.d0, dim,
                                seqlen, at.bc_base, seg.cb, seg.ce, at.cl, at.sl, at.live);
  }
  if (at.live) {
    const long long sg = at.chan * nsegs + seg.z;
    seq_put_state<Tr>(seg_h + sg * N, x, at.sl);
    if (at.sl == 0) seg_dt[sg] = sdt;
  }
  if (seg_ready) seq_publish_segment(seg_ready, nsegs, seg.z);
}

// Segment z = blockIdx.z + 1 (every one but the first), the adjoint H_{t-1} = a_t (H_t + gy_t C_t) from a
// zero end: seg_g = H at its first step, and its sum of dt to seg_dt (which the adjoint's fold needs:
// with the forward's states the forward local pass, which also writes it, does not run).
template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    selective_scan_seg_bwd_kernel(const typename Tr::T* __restrict__ delta, const float* __restrict__ A,
                                  const typename Tr::TC* __restrict__ C, const typename Tr::T* __restrict__ z,
                                  const float* __restrict__ delta_bias, const typename Tr::T* __restrict__ dout,
                                  float* __restrict__ seg_g, float* __restrict__ seg_dt, int dim, int seqlen,
                                  int channels_per_group, int groups, int seg_len, int nsegs) {
  using namespace scan_detail;
  constexpr int N = Tr::kDstate, S = Tr::kSpt, kC = Tr::kChunk;
  constexpr int CS = Tr::kCs, NP = Tr::kNp;
  extern __shared__ float smem[];
  float* s_gy = smem;
  float* s_dt = s_gy + kC * CS;
  float* s_C = s_dt + kC * CS;
  const SeqPlace<Tr> at(dim, seqlen, channels_per_group, groups);
  float A2[S], Cf[S], H[S];
  at.template row<true>(A, kLog2e, A2);
  at.template row<!Tr::kVarC>(C, 1.0f, Cf);
  at.state(nullptr, H);
  const SeqSegment seg(static_cast<int>(blockIdx.z) + 1, kC, seqlen, seg_len);
  SeqBwdChunk<Tr, kStageAdjoint> cur(delta_bias, at.d0, dim);  // reloaded once staged
  cur.load(nullptr, delta, dout, z, nullptr, C, at.b, at.d0, dim, seqlen, at.bc_base, (seg.ce - 1) * kC);
  float sdt = 0.0f;
  for (int c = seg.ce - 1; c >= seg.cb; --c) {
    cur.stage(nullptr, s_dt, s_gy, nullptr, s_C, at.d0, dim, seqlen, c * kC);
    __syncthreads();
    if (c > seg.cb) cur.load(nullptr, delta, dout, z, nullptr, C, at.b, at.d0, dim, seqlen, at.bc_base, (c - 1) * kC);
#pragma unroll 2
    for (int t = kC - 4; t >= 0; t -= 4) {
      float dt[4], gy[4], Cv[4][S];
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        dt[g] = s_dt[(t + g) * CS + at.cl];
        gy[g] = s_gy[(t + g) * CS + at.cl];
#pragma unroll
        for (int i = 0; i < S; ++i) Cv[g][i] = Tr::kVarC ? s_C[(t + g) * NP + at.sl * S + i] : Cf[i];
      }
#pragma unroll
      for (int g = 3; g >= 0; --g) {
        sdt += dt[g];
#pragma unroll
        for (int i = 0; i < S; ++i) H[i] = fast_exp2(dt[g] * A2[i]) * fmaf(gy[g], Cv[g][i], H[i]);
      }
    }
    __syncthreads();  // restaged next
  }
  if (!at.live) return;
  const long long sg = at.chan * nsegs + seg.z;
  seq_put_state<Tr>(seg_g + sg * N, H, at.sl);
  if (at.sl == 0) seg_dt[sg] = sdt;
}

}  // namespace kspec
