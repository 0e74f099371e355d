// mlstm.step: one decoding step of the mLSTM, states updated in place (api/ops/mlstm/reference.h is
// the spec):
//   m' = max(a + m, i)   C' = e^(a+m-m') C + e^(i-m') k v^T   n' = e^(a+m-m') n + e^(i-m') k
//   h = (s q)^T C' / (max(|s q . n'|, e^(-m')) + eps),   a = logsigmoid(f), s = DHQK^-1/2.
// Three algorithms (mlstm.step's `algo` axis). algo=block, mlstm_step_kernel: one CTA per sequence,
// the first version. algo=split (tools/bench/NOTES.md, "mlstm.step as a bandwidth op"): the step is a
// read and a write of C (64 KB a head at 128 x 128 in fp32), so C is cut into column slabs, one CTA
// each, read once in float4s; every slab needs the same three scalars (decay, gain and the normalizer,
// which needs all of n), so a one-warp kernel per sequence computes them first with n' and m'
// (mlstm_step_gates_kernel), and the slab kernel (mlstm_step_cols_kernel) starts early by programmatic
// dependent launch, loading its slab before it waits for them. algo=head (mlstm_step_head_kernel): one
// CTA per sequence again, but moving all of C in float4s, every load in flight at once, and the scalars
// formed in the CTA itself: one launch, nothing waited for from another grid.
//
// algo=block, correct before fast: q and k in shared memory; thread j owns columns e = j, j +
// kThreads, ... of C (coalesced rows) and elements d = j, ... of n. The state is memory-bound traffic
// (DHQK x DHHV fp32 read and written once); C' and n' are written where C and n were read, by the same
// thread, so the update may be in place. m is written after the block sum, by when every thread has
// read it.
#pragma once

#include "mlstm/common.cuh"
#include "mlstm/params.h"

namespace kspec {

template <typename T, typename TG, int kDk, int kDv, int kThreads>
__global__ void __launch_bounds__(kThreads) mlstm_step_kernel(const MlstmParams p) {
  __shared__ float qs[kDk], ks[kDk], scratch[kThreads / kWarpSize];
  const long long seq = blockIdx.x;
  const int tid = threadIdx.x;
  const T* q = static_cast<const T*>(p.q) + seq * kDk;
  const T* k = static_cast<const T*>(p.k) + seq * kDk;
  const T* v = static_cast<const T*>(p.v) + seq * kDv;
  const float m_old = p.m0[seq];
  const float a = mlstm_log_sigmoid(to_float(static_cast<const TG*>(p.f)[seq]));
  const float ig = to_float(static_cast<const TG*>(p.i)[seq]);
  const float m_new = fmaxf(a + m_old, ig);
  const float decay = expf(a + m_old - m_new), gain = expf(ig - m_new);
  const float scale = rsqrtf(static_cast<float>(kDk));
  for (int d = tid; d < kDk; d += kThreads) {
    qs[d] = to_float(q[d]) * scale;
    ks[d] = to_float(k[d]);
  }
  float z = 0.0f;  // s q . n', this thread's part
  for (int d = tid; d < kDk; d += kThreads) {
    const float nn = fmaf(decay, p.n0[seq * kDk + d], gain * ks[d]);
    p.n[seq * kDk + d] = nn;
    z = fmaf(qs[d], nn, z);
  }
  z = mlstm_block_sum<kThreads>(z, scratch);  // also the barrier before qs, ks are read by all threads
  const float den = fmaxf(fabsf(z), expf(-m_new)) + p.eps;
  const float* C0 = p.C0 + seq * kDk * kDv;
  float* C = p.C + seq * kDk * kDv;
  for (int e = tid; e < kDv; e += kThreads) {
    const float ve = to_float(v[e]) * gain;
    float num = 0.0f;
    for (int d = 0; d < kDk; ++d) {
      const float c = fmaf(decay, C0[d * kDv + e], ks[d] * ve);
      C[d * kDv + e] = c;
      num = fmaf(qs[d], c, num);
    }
    static_cast<T*>(p.h)[seq * kDv + e] = from_float<T>(num / den);
  }
  if (tid == 0) p.m[seq] = m_new;
}

// ---- algo=split ----

// sm_90's programmatic dependent launch (Launcher::launch_dependent; before sm_90 a plain launch, and
// these are no-ops). The gates kernel lets the slab kernel start at once; the slab kernel waits for
// the gates kernel to have finished, its writes visible, before reading the scalars.
__device__ __forceinline__ void mlstm_step_allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void mlstm_step_wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// One warp's part of algo=split's gates (and algo=cluster's, step_cluster.cuh): lane j loads n's elements j,
// j + 32, ... with q's and k's, and forms their n' (`nn`), the decay, gain, m' and the normalizer (every lane
// the same scalars). Every load is issued before anything is stored (the callers store n' after): n' may be
// n, and the compiler cannot move a load of n0, q or k above a store of n that may alias it, so a loop
// storing as it goes waited one DRAM round trip per 32 elements (4 at DHQK 128); all lanes read m, f, i (one
// broadcast each) instead of lane 0 reading and shuffling them.
struct MlstmStepScalars {
  float decay, gain, den, m_new;
};
template <typename T, typename TG, int kDk>
__device__ __forceinline__ MlstmStepScalars mlstm_step_gates_warp(const MlstmParams& p, long long seq, int lane,
                                                                  float (&nn)[(kDk + kWarpSize - 1) / kWarpSize]) {
  constexpr int kPer = (kDk + kWarpSize - 1) / kWarpSize;
  const T* q = static_cast<const T*>(p.q) + seq * kDk;
  const T* k = static_cast<const T*>(p.k) + seq * kDk;
  const float* n0 = p.n0 + seq * kDk;
  const float m_old = p.m0[seq];
  const float fg = to_float(static_cast<const TG*>(p.f)[seq]), ig = to_float(static_cast<const TG*>(p.i)[seq]);
  float nv[kPer], kv[kPer], qv[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int d = lane + j * kWarpSize;
    const bool in = kDk % kWarpSize == 0 || d < kDk;
    nv[j] = in ? n0[d] : 0.0f;
    kv[j] = in ? to_float(k[d]) : 0.0f;
    qv[j] = in ? to_float(q[d]) : 0.0f;
  }
  const float a = mlstm_log_sigmoid(fg);
  const float m_new = fmaxf(a + m_old, ig);
  const float decay = expf(a + m_old - m_new), gain = expf(ig - m_new);
  const float scale = rsqrtf(static_cast<float>(kDk));
  float z = 0.0f;  // s q . n', this lane's part
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    nn[j] = fmaf(decay, nv[j], gain * kv[j]);
    z = fmaf(qv[j] * scale, nn[j], z);
  }
  z = warp_reduce_sum(z);
  return {decay, gain, fmaxf(fabsf(z), expf(-m_new)) + p.eps, m_new};
}

// n' (from mlstm_step_gates_warp's `nn`, lane j's elements j, j + 32, ...) and m' (lane 0) of sequence seq.
template <int kDk>
__device__ __forceinline__ void mlstm_step_store_nm(const MlstmParams& p, long long seq, int lane,
                                                    const float (&nn)[(kDk + kWarpSize - 1) / kWarpSize], float m_new) {
#pragma unroll
  for (int j = 0; j < (kDk + kWarpSize - 1) / kWarpSize; ++j) {
    const int d = lane + j * kWarpSize;
    if (kDk % kWarpSize == 0 || d < kDk) p.n[seq * kDk + d] = nn[j];
  }
  if (lane == 0) p.m[seq] = m_new;
}

// One warp per sequence: m', n' (in place: lane j reads and writes n's elements j, j + 32, ...; m is
// written by lane 0 alone) and the slab kernel's three scalars to p.gate_rows[seq] (decay, gain, den).
// The slab kernel never touches n or m, and this kernel never touches C or h.
template <typename T, typename TG, int kDk>
__global__ void __launch_bounds__(kWarpSize) mlstm_step_gates_kernel(const MlstmParams p) {
  mlstm_step_allow_dependents();
  const long long seq = blockIdx.x;
  const int lane = threadIdx.x;
  float nn[(kDk + kWarpSize - 1) / kWarpSize];
  const MlstmStepScalars sc = mlstm_step_gates_warp<T, TG, kDk>(p, seq, lane, nn);
  mlstm_step_store_nm<kDk>(p, seq, lane, nn, sc.m_new);
  if (lane == 0) {
    float* s = p.gate_rows + seq * kMlstmStepScalars;
    s[0] = sc.decay;
    s[1] = sc.gain;
    s[2] = sc.den;
  }
}

// A thread's rows of C updated in place, C' = decay C + k (gain v)^T, on its kPasses float4s (rows r0 +
// j * kRowStep, the 4 columns at `base` + row * kDv, loaded by the caller into c), and their part of h's
// numerator: the sum over those rows of (s q)_d C'_d (qs holds s q, ks k). algo=split's and algo=cluster's
// slabs and algo=head's CTAs: the same fmas in the same order, so C' is bitwise equal between them.
template <int kDv, int kRowStep, int kPasses>
__device__ __forceinline__ float4 mlstm_step_update_rows(const MlstmParams& p, const float4 (&c)[kPasses],
                                                         long long base, int r0, const float* qs, const float* ks,
                                                         float decay, float gain, float v0, float v1, float v2,
                                                         float v3) {
  const float g0 = v0 * gain, g1 = v1 * gain, g2 = v2 * gain, g3 = v3 * gain;
  float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int j = 0; j < kPasses; ++j) {
    const int d = r0 + j * kRowStep;
    const float kd = ks[d], qd = qs[d];
    float4 cn;
    cn.x = fmaf(decay, c[j].x, kd * g0);
    cn.y = fmaf(decay, c[j].y, kd * g1);
    cn.z = fmaf(decay, c[j].z, kd * g2);
    cn.w = fmaf(decay, c[j].w, kd * g3);
    *reinterpret_cast<float4*>(p.C + base + static_cast<long long>(d) * kDv) = cn;
    num.x = fmaf(qd, cn.x, num.x);
    num.y = fmaf(qd, cn.y, num.y);
    num.z = fmaf(qd, cn.z, num.z);
    num.w = fmaf(qd, cn.w, num.w);
  }
  return num;
}

// The slab of kCols columns of C (blockIdx.y) of one sequence (blockIdx.x), kThreads threads: a row's
// kCols / 4 float4s go to kCols / 4 consecutive threads, so a warp reads 32 / (kCols / 4) whole row
// pieces of 64-256 bytes; the CTA covers kThreads / (kCols / 4) rows a pass, kPasses passes, every
// float4 of the slab loaded (all in flight at once) before the scalars are asked for (`scalars()`: they
// may wait on another grid, or be formed by the CTA itself). Each element of C is read and written by the
// same thread (in place). h's columns: the thread's 4 partial sums over its rows, summed across the warp's
// row groups by shuffles and across warps in shared memory, in a fixed order (bitwise repeatable).
template <typename T, int kDk, int kDv, int kCols, int kThreads, typename Scalars>
__device__ __forceinline__ void mlstm_step_slab(const MlstmParams& p, Scalars scalars) {
  constexpr int kGroups = kCols / 4;              // threads a row
  constexpr int kRowStep = kThreads / kGroups;    // rows a pass
  constexpr int kPasses = kDk / kRowStep;
  constexpr int kWarps = kThreads / kWarpSize;
  static_assert(kCols % 4 == 0 && kDv % kCols == 0 && kWarpSize % kGroups == 0, "column slab");
  static_assert(kThreads % kWarpSize == 0 && kPasses >= 1 && kDk % kRowStep == 0, "rows");
  __shared__ float qs[kDk], ks[kDk], part[kWarps][kCols];
  const long long seq = blockIdx.x;
  const int tid = threadIdx.x, g = tid % kGroups, r0 = tid / kGroups;
  const int col = blockIdx.y * kCols + 4 * g;
  const long long base = seq * kDk * kDv + col;
  float4 c[kPasses];
#pragma unroll
  for (int j = 0; j < kPasses; ++j)
    c[j] = *reinterpret_cast<const float4*>(p.C0 + base + static_cast<long long>(r0 + j * kRowStep) * kDv);
  const T* q = static_cast<const T*>(p.q) + seq * kDk;
  const T* k = static_cast<const T*>(p.k) + seq * kDk;
  const T* v = static_cast<const T*>(p.v) + seq * kDv + col;
  const float scale = rsqrtf(static_cast<float>(kDk));
  for (int d = tid; d < kDk; d += kThreads) {
    qs[d] = to_float(q[d]) * scale;
    ks[d] = to_float(k[d]);
  }
  const float v0 = to_float(v[0]), v1 = to_float(v[1]), v2 = to_float(v[2]), v3 = to_float(v[3]);
  const MlstmStepScalars sc = scalars();  // ends with a barrier: qs, ks
  float4 num = mlstm_step_update_rows<kDv, kRowStep>(p, c, base, r0, qs, ks, sc.decay, sc.gain, v0, v1, v2, v3);
  // Lanes l and l ^ off (off a multiple of kGroups) hold the same columns.
#pragma unroll
  for (int off = kGroups; off < kWarpSize; off *= 2) {
    num.x += __shfl_xor_sync(0xffffffffu, num.x, off);
    num.y += __shfl_xor_sync(0xffffffffu, num.y, off);
    num.z += __shfl_xor_sync(0xffffffffu, num.z, off);
    num.w += __shfl_xor_sync(0xffffffffu, num.w, off);
  }
  const int lane = tid % kWarpSize, warp = tid / kWarpSize;
  if (lane < kGroups) {
    part[warp][4 * lane] = num.x;
    part[warp][4 * lane + 1] = num.y;
    part[warp][4 * lane + 2] = num.z;
    part[warp][4 * lane + 3] = num.w;
  }
  __syncthreads();
  if (tid < kCols) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += part[w][tid];
    static_cast<T*>(p.h)[seq * kDv + blockIdx.y * kCols + tid] = from_float<T>(total / sc.den);
  }
}

// algo=split's slabs: the scalars from the gates kernel, waited for after the slab's loads are issued.
template <typename T, int kDk, int kDv, int kCols, int kThreads>
__global__ void __launch_bounds__(kThreads) mlstm_step_cols_kernel(const MlstmParams p) {
  mlstm_step_slab<T, kDk, kDv, kCols, kThreads>(p, [&]() {
    mlstm_step_wait_prior_grid();
    const float* s = p.gate_rows + static_cast<long long>(blockIdx.x) * kMlstmStepScalars;
    const MlstmStepScalars sc{s[0], s[1], s[2], 0.0f};
    __syncthreads();  // qs, ks
    return sc;
  });
}

// ---- algo=head ----

// One CTA of kThreads per sequence, C in float4s: a row's kDv / 4 float4s on consecutive threads, kRowStep
// rows a pass, kPasses passes, every float4 of C loaded (all in flight) before anything else. Thread d <
// kDk forms n'_d (read and written by it alone: in place) and its share of s q . n'; the block sum gives
// the normalizer to all, and m' is written after it (every thread has read m by then). C', n', m' are the
// same fmas as algo=split's (bitwise equal); h's columns sum the threads' row partials in shared memory in
// row order. Against algo=split at B = 64, NH = 8, DH = 128 (512 CTAs here, 2048 slab CTAs and a gates
// kernel there): no wait for the gates grid before the first wave's updates (tools/bench/NOTES.md).
template <typename T, typename TG, int kDk, int kDv, int kThreads>
__global__ void __launch_bounds__(kThreads) mlstm_step_head_kernel(const MlstmParams p) {
  constexpr int kGroups = kDv / 4;            // threads a row
  constexpr int kRowStep = kThreads / kGroups;  // rows a pass
  constexpr int kPasses = kDk / kRowStep;
  static_assert(kDv % 4 == 0 && kThreads % kGroups == 0 && kRowStep >= 1 && kDk % kRowStep == 0, "rows");
  static_assert(kThreads >= kDk && kThreads % kWarpSize == 0, "a thread for each element of n");
  __shared__ float qs[kDk], ks[kDk], scratch[kThreads / kWarpSize];
  __shared__ __align__(16) float part[kRowStep][kDv];  // each row group's partial h
  const long long seq = blockIdx.x;
  const int tid = threadIdx.x, g = tid % kGroups, r0 = tid / kGroups;
  const long long base = seq * kDk * kDv + 4 * g;
  float4 c[kPasses];
#pragma unroll
  for (int j = 0; j < kPasses; ++j)
    c[j] = *reinterpret_cast<const float4*>(p.C0 + base + static_cast<long long>(r0 + j * kRowStep) * kDv);
  // Every other load before the first store (n' may be n, and may alias anything else the compiler sees).
  const T* v = static_cast<const T*>(p.v) + seq * kDv + 4 * g;
  const float v0 = to_float(v[0]), v1 = to_float(v[1]), v2 = to_float(v[2]), v3 = to_float(v[3]);
  const bool owns_n = tid < kDk;
  const float qd = owns_n ? to_float(static_cast<const T*>(p.q)[seq * kDk + tid]) : 0.0f;
  const float kd = owns_n ? to_float(static_cast<const T*>(p.k)[seq * kDk + tid]) : 0.0f;
  const float n_old = owns_n ? p.n0[seq * kDk + tid] : 0.0f;
  const float m_old = p.m0[seq];
  const float fg = to_float(static_cast<const TG*>(p.f)[seq]), ig = to_float(static_cast<const TG*>(p.i)[seq]);
  const float a = mlstm_log_sigmoid(fg);
  const float m_new = fmaxf(a + m_old, ig);
  const float decay = expf(a + m_old - m_new), gain = expf(ig - m_new);
  const float scale = rsqrtf(static_cast<float>(kDk));
  float z = 0.0f;  // s q . n', this thread's element
  if (owns_n) {
    qs[tid] = qd * scale;
    ks[tid] = kd;
    const float nn = fmaf(decay, n_old, gain * kd);
    p.n[seq * kDk + tid] = nn;
    z = qd * scale * nn;
  }
  z = mlstm_block_sum<kThreads>(z, scratch);  // also the barrier before qs, ks are read by all threads
  if (tid == 0) p.m[seq] = m_new;
  const float den = fmaxf(fabsf(z), expf(-m_new)) + p.eps;
  const float4 num = mlstm_step_update_rows<kDv, kRowStep>(p, c, base, r0, qs, ks, decay, gain, v0, v1, v2, v3);
  *reinterpret_cast<float4*>(&part[r0][4 * g]) = num;
  __syncthreads();
  for (int e = tid; e < kDv; e += kThreads) {
    float total = 0.0f;
#pragma unroll
    for (int r = 0; r < kRowStep; ++r) total += part[r][e];
    static_cast<T*>(p.h)[seq * kDv + e] = from_float<T>(total / den);
  }
}

}  // namespace kspec
