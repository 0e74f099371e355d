// The segments' local passes of the sequential kernels (algo 1; see "segments" in sequential.cuh):
// the forward's (before the main forward or backward) and the backward's adjoint.
#pragma once

#include "selective_scan/sequential_chunks.cuh"

namespace kspec {

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
                                seqlen, at.bc_base, seg.cb, seg.ce, at.cl, at.sl, at.live, groups);
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
  cur.load(nullptr, delta, dout, z, nullptr, C, at.b, at.d0, dim, seqlen, at.bc_base, (seg.ce - 1) * kC, groups);
  float sdt = 0.0f;
  for (int c = seg.ce - 1; c >= seg.cb; --c) {
    cur.stage(nullptr, s_dt, s_gy, nullptr, s_C, at.d0, dim, seqlen, c * kC);
    __syncthreads();
    if (c > seg.cb)
      cur.load(nullptr, delta, dout, z, nullptr, C, at.b, at.d0, dim, seqlen, at.bc_base, (c - 1) * kC, groups);
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
