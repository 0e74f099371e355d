// mlstm.chunkwise.fwd: the mLSTM over a sequence, chunk by chunk (api/ops/mlstm/reference.h is the
// spec). Inside a chunk of L steps from the states (C, n, m), with b the in-chunk cumsum of
// a = logsigmoid(f) and s = DHQK^-1/2:
//   m_t = max(b_t + m, max_s<=t (b_t - b_s + i_s)) = b_t + max(m, max_s<=t (i_s - b_s))
//   S_ts = e^(b_t - b_s + i_s - m_t) (s q_t . k_s)   (s <= t)        g_t = e^(b_t + m - m_t)
//   nrm_t = max(|g_t (s q_t . n) + sum_s S_ts|, e^(-m_t))
//   h_t = (g_t (s q_t)^T C + sum_s S_ts v_s) / (nrm_t + eps)
//   C <- e^(b_L + m - m_L) C + sum_s e^(b_L - b_s + i_s - m_L) k_s v_s^T   (n alike), m <- m_L
// Numerics (issue 29): every exponent is <= 0 up to rounding, as m_t is the row's final max (never a
// partial one, never clamped); the unnormalized sums are divided once; the cumulative gates are formed
// once per chunk; fp32 throughout.
//
// First version, correct before fast: one CTA per sequence, chunks in order, the running state C, n in
// global memory (the C_last output or a workspace, L2-resident), S (L x L) and the per-step gate
// vectors in shared memory; q, k, v read from global memory in each pass. Barriers separate the
// passes: gates (one thread) | S | normalizers | outputs | state update.
// mlstm.parallel.fwd is this kernel from the states (0, 0, -inf) (MlstmParams::m_init): the recurrence
// from m = -inf gives m_t = max_s<=t (F_t - F_s + i_s), the parallel form's, and the same h and nrm.
#pragma once

#include "mlstm/common.cuh"
#include "mlstm/params.h"

namespace kspec {

template <typename T, typename TG, int kDk, int kDv, int kChunk, int kThreads>
__global__ void __launch_bounds__(kThreads) mlstm_chunkwise_fwd_kernel(const MlstmParams p) {
  constexpr int L = kChunk;
  extern __shared__ float smem[];  // mlstm_chunkwise_fwd_smem_floats(L) floats (params.h)
  float* Sm = smem;        // [L][L]
  float* b = Sm + L * L;   // in-chunk cumsum of a
  float* mr = b + L;       // m_t
  float* g = mr + L;       // e^(b_t + m - m_t)
  float* w = g + L;        // e^(b_L - b_s + i_s - m_L)
  float* ig = w + L;       // i_s
  float* den = ig + L;     // nrm_t + eps
  float* state = den + L;  // [0]: m, [1]: e^(b_L + m - m_L)
  mlstm_poison_smem<kThreads>(smem, mlstm_chunkwise_fwd_smem_floats(L));
  const long long seq = blockIdx.x, S = p.seqlen;
  const int tid = threadIdx.x;
  const T* q = static_cast<const T*>(p.q) + seq * S * kDk;
  const T* k = static_cast<const T*>(p.k) + seq * S * kDk;
  const T* v = static_cast<const T*>(p.v) + seq * S * kDv;
  const TG* ip = static_cast<const TG*>(p.i) + seq * S;
  const TG* fp = static_cast<const TG*>(p.f) + seq * S;
  float* C = p.C + seq * kDk * kDv;
  float* n = p.n + seq * kDk;
  const float scale = rsqrtf(static_cast<float>(kDk));
  for (int j = tid; j < kDk * kDv; j += kThreads) C[j] = p.C0 ? p.C0[seq * kDk * kDv + j] : 0.0f;
  for (int d = tid; d < kDk; d += kThreads) n[d] = p.n0 ? p.n0[seq * kDk + d] : 0.0f;
  if (tid == 0) state[0] = p.m0 ? p.m0[seq] : p.m_init;
  __syncthreads();

  for (long long t0 = 0; t0 < S; t0 += L) {
    const int len = static_cast<int>(S - t0 < L ? S - t0 : L);
    if (tid == 0) {
      const float m = state[0];
      float run = 0.0f, pmax = 0.0f;  // pmax: max_s<=t (i_s - b_s)
      for (int t = 0; t < len; ++t) {
        run += mlstm_log_sigmoid(to_float(fp[t0 + t]));
        const float it = to_float(ip[t0 + t]);
        b[t] = run;
        ig[t] = it;
        pmax = t == 0 ? it - run : fmaxf(pmax, it - run);
        mr[t] = run + fmaxf(m, pmax);
        g[t] = expf(run + m - mr[t]);
      }
      const float m_end = mr[len - 1];
      for (int s = 0; s < len; ++s) w[s] = expf(b[len - 1] - b[s] + ig[s] - m_end);
      state[1] = expf(b[len - 1] + m - m_end);
    }
    __syncthreads();
    for (int j = tid; j < L * L; j += kThreads) {
      const int t = j / L, s = j % L;
      float val = 0.0f;
      if (s <= t && t < len) {
        const T* qt = q + (t0 + t) * kDk;
        const T* kt = k + (t0 + s) * kDk;
        for (int d = 0; d < kDk; ++d) val = fmaf(to_float(qt[d]), to_float(kt[d]), val);
        val *= scale * expf(b[t] - b[s] + ig[s] - mr[t]);
      }
      Sm[j] = val;
    }
    __syncthreads();
    for (int t = tid; t < len; t += kThreads) {
      const T* qt = q + (t0 + t) * kDk;
      float z = 0.0f;
      for (int d = 0; d < kDk; ++d) z = fmaf(to_float(qt[d]), n[d], z);
      z *= g[t] * scale;
      for (int s = 0; s <= t; ++s) z += Sm[t * L + s];
      const float nrm = fmaxf(fabsf(z), expf(-mr[t]));
      den[t] = nrm + p.eps;
      if (p.nrm) p.nrm[seq * S + t0 + t] = nrm;
      if (p.m_rows) p.m_rows[seq * S + t0 + t] = mr[t];
    }
    __syncthreads();
    for (int j = tid; j < len * kDv; j += kThreads) {
      const int t = j / kDv, e = j % kDv;
      const T* qt = q + (t0 + t) * kDk;
      float acc = 0.0f;
      for (int d = 0; d < kDk; ++d) acc = fmaf(to_float(qt[d]), C[d * kDv + e], acc);
      acc *= g[t] * scale;
      for (int s = 0; s <= t; ++s) acc = fmaf(Sm[t * L + s], to_float(v[(t0 + s) * kDv + e]), acc);
      static_cast<T*>(p.h)[(seq * S + t0 + t) * kDv + e] = from_float<T>(acc / den[t]);
    }
    __syncthreads();
    const float g_end = state[1];
    for (int j = tid; j < kDk * kDv; j += kThreads) {
      const int d = j / kDv, e = j % kDv;
      float c = g_end * C[j];
      for (int s = 0; s < len; ++s) c = fmaf(w[s] * to_float(k[(t0 + s) * kDk + d]), to_float(v[(t0 + s) * kDv + e]), c);
      C[j] = c;
    }
    for (int d = tid; d < kDk; d += kThreads) {
      float nn = g_end * n[d];
      for (int s = 0; s < len; ++s) nn = fmaf(w[s], to_float(k[(t0 + s) * kDk + d]), nn);
      n[d] = nn;
    }
    if (tid == 0) state[0] = mr[len - 1];
    __syncthreads();
  }
  if (tid == 0 && p.m) p.m[seq] = state[0];
}

}  // namespace kspec
