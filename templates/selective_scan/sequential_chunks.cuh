// The sequential backward's chunk staging and forward walk, shared by the backward and the segments'
// local passes (sequential_bwd.cuh, sequential_segments.cuh).
#pragma once

#include "selective_scan/sequential.cuh"

namespace kspec {

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
// staging. Element e = tid + k * kThreads of a [channel][step] tensor is (r, t) = (Tr::row_of(e),
// Tr::step_of(e)) (e / kChunk, e % kChunk unless time-major); of a B/C chunk, (n, t) likewise. Zeros past
// dim, seqlen and dstate.
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
      const int r = Tr::row_of(static_cast<int>(threadIdx.x) + k * Tr::kThreads);
      bias[k] = Tr::kHasDeltaBias && r < NC && d0 + r < dim ? delta_bias[d0 + r] : 0.0f;
    }
  }

  static __device__ __forceinline__ bool elem(int k, int d0, int dim, int seqlen, int t0, int* r, int* t) {
    const int e = static_cast<int>(threadIdx.x) + k * Tr::kThreads;
    *r = Tr::row_of(e);
    *t = Tr::step_of(e);
    return e < NC * kC && d0 + *r < dim && t0 + *t < seqlen;
  }

  __device__ __forceinline__ void load(const T* __restrict__ gu, const T* __restrict__ gd, const T* __restrict__ gout,
                                       const T* __restrict__ gz, const typename Tr::TB* __restrict__ gB,
                                       const typename Tr::TC* __restrict__ gC, int b, int d0, int dim, int seqlen,
                                       long long bc_base, int t0, int groups) {
#pragma unroll
    for (int k = 0; k < PE; ++k) {
      int r, t;
      const bool ok = elem(k, d0, dim, seqlen, t0, &r, &t);
      const long long off = Tr::seq_off(b, dim, d0, r, seqlen, t0, t);
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
      const int n = Tr::template bc_row_of<NP>(e), t = Tr::template bc_step_of<NP>(e);
      const bool ok = n < N && t0 + t < seqlen;
      const long long off = Tr::bc_off(bc_base, n, seqlen, groups, t0, t);
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
      const int n = Tr::template bc_row_of<NP>(e), t = Tr::template bc_step_of<NP>(e);
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
      const int n = Tr::template bc_row_of<NP>(e), t = Tr::template bc_step_of<NP>(e);
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
                                                 int sl, bool live, int groups) {
  constexpr int S = Tr::kSpt, N = Tr::kDstate, kC = Tr::kChunk;
  SeqBwdChunk<Tr, kStageWalk> cur(delta_bias, d0, dim);  // reloaded once staged: registers free during the scan
  const int last = kCkpt ? ce - 1 : ce;  // chunks [cb, last) are scanned
  if (cb < last) cur.load(u, delta, nullptr, nullptr, B, nullptr, b, d0, dim, seqlen, bc_base, cb * kC, groups);
  for (int c = cb; c < ce; ++c) {
    if constexpr (kCkpt) {
      if (live) seq_put_state<Tr>(ckpt + c * N, x, sl);
    }
    if (c == last) break;
    cur.stage(s_dtu, nullptr, nullptr, s_B, nullptr, d0, dim, seqlen, c * kC);
    __syncthreads();
    if (c + 1 < last)
      cur.load(u, delta, nullptr, nullptr, B, nullptr, b, d0, dim, seqlen, bc_base, (c + 1) * kC, groups);
    seq_scan_chunk<Tr, false, !kCkpt>(x, A2, Bf, Bf, s_dtu, s_B, nullptr, nullptr, cl, sl, sdt);
    __syncthreads();  // s_dtu, s_B are restaged next
  }
}

}  // namespace scan_detail

}  // namespace kspec
