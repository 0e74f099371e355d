// The sequential-state backward (algo 1).
#pragma once

#include "selective_scan/sequential_chunks.cuh"

namespace kspec {

// =============================================================================================
// The sequential-state backward ("algo 1"): the forward's thread layout (kSpt states of one channel
// per thread, kLanes threads per channel, kChannels channels of one batch and group per block), time
// walked in order forward and then in reverse.
//
// 1. Checkpoints: a forward walk over every chunk but the last writes the state entering each chunk
//    of kChunk steps to `states` ([batch * dim, nchunks, dstate] fp32; one ex2 per step and state).
//    Skipped when the forward's states are `given` (training): chunk c starts from given[c * kChunk /
//    16] (H100, 8x2048x2048 bf16: 1.77 ms with this pass, 1.44 without).
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
//       a_t again by ex2, for a group of 4 steps before its chain (not read from shared memory: that
//       traffic was a third of the backward's wavefronts). q from x_{t-1}, not (x_t - dt_t B_t u_t) hx
//       (a cancellation): the adjoint is 7 FMA/FMUL per state.
//    Sums over a channel's kLanes threads (ddt, du, y) and over the channels of a warp (a variable
//    dB_t, dC_t) are transposing shuffle reductions over groups of 4 steps (TransposeReduce); the
//    warps' dB/dC then go through shared memory and one fp32 atomicAdd per element, chunk and block
//    to dB_acc/dC_acc (run-order dependent, as in algo 0). Staging also keeps softplus'(pre) and
//    dout silu'(z) in shared memory, so the outputs du, ddelta, dz are written from there.
// 3. dA, a fixed dB/dC, dD and ddelta_bias go to `partials` per channel as in algo 0 (the same
//    reduce kernel sums them over the batch, deterministically), dh0 = the adjoint left at t = -1.
// Two ex2 per step and state in all, one with the forward's states (mamba_ssm's backward: one; its
// forward saves the checkpoints), no per-state scans. The next chunk's global loads are issued before
// this chunk's work. The staging is packed (one 16-byte load of {dt, dt u, gy, u}; B and C of a
// thread's states side by side) because the kernel is bound by the L1's shared-memory wavefronts:
// H100, 8x2048x2048 bf16, 2.00 ms unpacked, 1.77 packed (the heuristic's config, 4 lanes, now takes
// 1.2 ms: seq_bwd_min_blocks). The steps from 2.35 ms to there: tools/bench/NOTES.md, "The
// sequential backward's steps".
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

namespace scan_detail {

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
    const int r = Tr::row_of(e), t = Tr::step_of(e);
    if (e >= NC * kC || d0 + r >= dim || t0 + t >= seqlen) continue;
    const long long off = Tr::seq_off(b, dim, d0, r, seqlen, t0, t);
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
                               s_dtu, s_B, b, d0, dim, seqlen, bc_base, seg.cb, seg.ce, cl, sl, live, groups);
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
    const int r = Tr::row_of(tid + k * Tr::kThreads);
    dDk[k] = dbk[k] = 0.0f;
    Dk[k] = Tr::kHasD && r < NC && d0 + r < dim ? D[d0 + r] : 0.0f;
  }
  Ck cur(delta_bias, d0, dim);  // reloaded once staged: its registers are free during the chunk's work
  float xn[S];  // the next chunk's checkpoint, loaded a chunk ahead like its inputs
  cur.load(u, delta, dout, z, B, C, b, d0, dim, seqlen, bc_base, (seg.ce - 1) * kC, groups);
  seq_get_state<Tr>(xn, ckpt + (seg.ce - 1) * ck_step * N, sl, live);
  for (int c = seg.ce - 1; c >= seg.cb; --c) {
    const int t0 = c * kC;
#pragma unroll
    for (int i = 0; i < S; ++i) x[i] = xn[i];
    cur.stage_packed(s_st, s_sig, s_dzf, s_bc, d0, dim, seqlen, t0);
    __syncthreads();
    if (c > seg.cb) {
      cur.load(u, delta, dout, z, B, C, b, d0, dim, seqlen, bc_base, t0 - kC, groups);
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
        const int n = Tr::template bc_row_of<N>(e), t = Tr::template bc_step_of<N>(e);
        if (t0 + t >= seqlen) continue;
        const long long idx = Tr::bc_off(bc_base, n, seqlen, groups, t0, t);
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
      // [channel][step], whichever order the elements were taken in
      const int j = Tr::kTimeMajor ? Tr::row_of(e) * kC + Tr::step_of(e) : e;
      s_sD[j] = dDk[k];
      s_sb[j] = dbk[k];
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

}  // namespace kspec
