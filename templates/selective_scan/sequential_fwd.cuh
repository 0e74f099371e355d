// The sequential-state forward (algo 1; design and launch contract in sequential.cuh).
#pragma once

#include "selective_scan/sequential.cuh"

namespace kspec {

// Shared memory of the sequential forward, in floats: s_dtu (float2 {dt, dt u}), s_u, s_y, then s_B and s_C
// when variable.
template <typename Tr>
constexpr int seq_fwd_smem_floats() {
  return 4 * Tr::kChunk * Tr::kCs + ((Tr::kVarB ? 1 : 0) + (Tr::kVarC ? 1 : 0)) * Tr::kChunk * Tr::kNp;
}


namespace scan_detail {

// The chunks [tb, te) of time-major tensors (layout "bld": u, delta, z, out as [batch, seqlen, dim], a
// variable B/C as [batch, seqlen, groups, dstate]), element by element: a warp's threads take neighbouring
// channels (or states) of one step, unit stride in memory, so every load and store stays coalesced; the
// shared-memory arrays and the scan are the bdl path's. Its own loop, not the bdl loop with the index
// maps as functions: written that way the bdl kernel itself compiled differently (121 -> 117 registers,
// bf16, dstate 16, 4 warps, 4 lanes, chunk 32, sm_90a), and the bdl kernels must stay as they were.
template <typename Tr>
__device__ __forceinline__ void seq_fwd_time_major(
    const typename Tr::T* __restrict__ u, const typename Tr::T* __restrict__ delta,
    const typename Tr::TB* __restrict__ B, const typename Tr::TC* __restrict__ C, const float* __restrict__ D,
    const typename Tr::T* __restrict__ z, const float* __restrict__ delta_bias, typename Tr::T* __restrict__ out,
    float (&x)[Tr::kSpt], const float (&A2)[Tr::kSpt], const float (&Bf)[Tr::kSpt], const float (&Cf)[Tr::kSpt],
    float2* s_dtu, float* s_u, float* s_y, float* s_B, float* s_C, const SeqPlace<Tr>& at, int dim, int seqlen,
    int groups, int tb, int te, float* ck) {
  using T = typename Tr::T;
  constexpr int N = Tr::kDstate, NC = Tr::kChannels, CS = Tr::kCs, kC = Tr::kChunk, NP = Tr::kNp;
  const int tid = at.tid, d0 = at.d0, b = at.b;
  float unused = 0.0f;
  for (int t0 = tb; t0 < te; t0 += kC) {
    for (int e = tid; e < NC * kC; e += Tr::kThreads) {
      const int r = Tr::row_of(e), t = Tr::step_of(e);
      const bool ok = d0 + r < dim && t0 + t < seqlen;
      const long long off = Tr::seq_off(b, dim, d0, r, seqlen, t0, t);
      float w = ok ? to_float(delta[off]) + (Tr::kHasDeltaBias ? delta_bias[d0 + r] : 0.0f) : 0.0f;
      if constexpr (Tr::kSoftplus) w = softplus_sfu(w);
      const float uu = ok ? to_float(u[off]) : 0.0f;
      w = ok ? w : 0.0f;
      s_u[t * CS + r] = uu;
      s_dtu[t * CS + r] = make_float2(w, w * uu);
    }
    for (int e = tid; e < NP * kC; e += Tr::kThreads) {
      const int n = Tr::template bc_row_of<NP>(e), t = Tr::template bc_step_of<NP>(e);
      const bool ok = n < N && t0 + t < seqlen;
      const long long off = Tr::bc_off(at.bc_base, n, seqlen, groups, t0, t);
      if constexpr (Tr::kVarB) s_B[t * NP + n] = ok ? to_float(B[off]) : 0.0f;
      if constexpr (Tr::kVarC) s_C[t * NP + n] = ok ? to_float(C[off]) : 0.0f;
    }
    __syncthreads();
    seq_scan_chunk<Tr>(x, A2, Bf, Cf, s_dtu, s_B, s_C, s_y, at.cl, at.sl, unused, ck, t0, seqlen);
    __syncthreads();
    for (int e = tid; e < NC * kC; e += Tr::kThreads) {
      const int r = Tr::row_of(e), t = Tr::step_of(e);
      if (d0 + r >= dim || t0 + t >= seqlen) continue;
      const long long off = Tr::seq_off(b, dim, d0, r, seqlen, t0, t);
      float o = fmaf(Tr::kHasD ? D[d0 + r] : 0.0f, s_u[t * CS + r], s_y[t * CS + r]);
      if constexpr (Tr::kHasZ) o *= silu_sfu(to_float(z[off]));
      out[off] = from_float<T>(o);
    }
    __syncthreads();  // s_u, s_y are restaged next
  }
}

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
  } else if constexpr (Tr::kTimeMajor) {
    seq_fwd_time_major<Tr>(u, delta, B, C, D, z, delta_bias, out, x, A2, Bf, Cf, s_dtu, s_u, s_y, s_B, s_C, at, dim,
                           seqlen, groups, tb, te, ck);
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

}  // namespace kspec
