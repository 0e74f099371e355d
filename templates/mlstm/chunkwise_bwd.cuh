// mlstm.chunkwise.bwd (and mlstm.parallel.bwd, from the states (0, -inf)): the gradients of
// sum(dh * h) + sum(dC_last * C_last) with the forward's nrm and m per step as constants (as
// mlstm_kernels; api/ops/mlstm/reference.h is the spec). With dhn_t = dh_t / (nrm_t + eps), the chunk's
// gates as in chunkwise_fwd.cuh (m_t read from m_rows) and D_ts = e^(b_t - b_s + i_s - m_t) (s <= t):
//   A_ts = D_ts (dhn_t . v_s)      B_ts = D_ts s (q_t . k_s)
//   dq_t = s (g_t C dhn_t + sum_s<=t A_ts k_s)                  C: the state entering the chunk
//   dk_s = s sum_t>=s A_ts q_t + w_s dC v_s                     dC: the gradient of the state after it
//   dv_s = sum_t>=s B_ts dhn_t + w_s dC^T k_s                   di_s = k_s . dk_s
//   dC <- g_end dC + s sum_t g_t q_t dhn_t^T                    (dC entering the first chunk: dC0)
//   df_t = sigmoid(-f_t) (<dC_last, C_last> + sum_r>=t (q_r . dq_r - k_r . dk_r))
// dq needs the state entering each chunk, dk and dv the gradient after it: one forward pass over the
// chunks rebuilds C and writes dq (and q . dq for df), then one reverse pass carries dC and writes dk,
// dv, di, df. Nothing is stored per chunk; the same buffer holds C, then dC. n is not needed (nrm is
// given). Deterministic: every sum is one thread's loop or one warp's / block's fixed-order reduction.
//
// First version, correct before fast: one CTA per sequence, as the forward; A and B in shared memory;
// one warp per row of dq, dk, dv (lanes along the head dim), so k . dk and q . dq are warp sums of the
// fp32 values, before they are rounded to the output dtype.
#pragma once

#include "mlstm/common.cuh"
#include "mlstm/params.h"

namespace kspec {

// The chunk's gates from its entering m and the forward's m_t: b (cumsum of a), i, m_t, g_t = e^(b_t
// + m - m_t), w_s = e^(b_L - b_s + i_s - m_L); returns g_end = e^(b_L + m - m_L). One thread.
template <typename TG>
__device__ __forceinline__ float mlstm_bwd_gates(const TG* ip, const TG* fp, const float* m_rows, int len, float m,
                                                 float* b, float* ig, float* mr, float* g, float* w) {
  float run = 0.0f;
  for (int t = 0; t < len; ++t) {
    run += mlstm_log_sigmoid(to_float(fp[t]));
    b[t] = run;
    ig[t] = to_float(ip[t]);
    mr[t] = m_rows[t];
    g[t] = expf(run + m - mr[t]);
  }
  const float m_end = mr[len - 1];
  for (int s = 0; s < len; ++s) w[s] = expf(b[len - 1] - b[s] + ig[s] - m_end);
  return expf(b[len - 1] + m - m_end);
}

template <typename T, typename TG, int kDk, int kDv, int kChunk, int kThreads>
__global__ void __launch_bounds__(kThreads) mlstm_chunkwise_bwd_kernel(const MlstmParams p) {
  constexpr int L = kChunk, kWarps = kThreads / kWarpSize;
  static_assert(kWarps <= 32, "the block sum's scratch holds 32 warps");
  extern __shared__ float smem[];  // mlstm_chunkwise_bwd_smem_floats(L) floats (params.h)
  float* A = smem;          // [L][L] D_ts (dhn_t . v_s)
  float* B = A + L * L;     // [L][L] D_ts s (q_t . k_s)
  float* b = B + L * L;     // in-chunk cumsum of a
  float* ig = b + L;        // i_s
  float* mr = ig + L;       // m_t
  float* g = mr + L;        // e^(b_t + m - m_t)
  float* w = g + L;         // e^(b_L - b_s + i_s - m_L)
  float* rden = w + L;      // 1 / (nrm_t + eps)
  float* di_c = rden + L;   // di_s of the chunk in fp32, for df
  float* misc = di_c + L;   // [0]: g_end, [1]: the running sum of df (thread 0)
  float* scratch = misc + 2;
  mlstm_poison_smem<kThreads>(smem, mlstm_chunkwise_bwd_smem_floats(L));
  const long long seq = blockIdx.x, S = p.seqlen;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const T* q = static_cast<const T*>(p.q) + seq * S * kDk;
  const T* k = static_cast<const T*>(p.k) + seq * S * kDk;
  const T* v = static_cast<const T*>(p.v) + seq * S * kDv;
  const T* dh = static_cast<const T*>(p.dh) + seq * S * kDv;
  const TG* ip = static_cast<const TG*>(p.i) + seq * S;
  const TG* fp = static_cast<const TG*>(p.f) + seq * S;
  const float* m_rows = p.m_rows + seq * S;
  const float* nrm = p.nrm + seq * S;
  float* qdq = p.qdq + seq * S;
  T* dq = static_cast<T*>(p.dq) + seq * S * kDk;
  T* dk = static_cast<T*>(p.dk) + seq * S * kDk;
  T* dv = static_cast<T*>(p.dv) + seq * S * kDv;
  TG* di = static_cast<TG*>(p.di) + seq * S;
  TG* df = static_cast<TG*>(p.df) + seq * S;
  float* C = p.C + seq * kDk * kDv;  // C in the forward pass, dC in the reverse one
  const float scale = rsqrtf(static_cast<float>(kDk));
  const float m_first = p.m0 ? p.m0[seq] : p.m_init;
  for (int j = tid; j < kDk * kDv; j += kThreads) C[j] = p.C0 ? p.C0[seq * kDk * kDv + j] : 0.0f;
  const long long nchunks = (S + L - 1) / L;

  // The chunk's gates and A (and B when `both`), after a barrier.
  auto prepare = [&](long long t0, int len, bool both) {
    if (tid == 0)
      misc[0] = mlstm_bwd_gates(ip + t0, fp + t0, m_rows + t0, len, t0 == 0 ? m_first : m_rows[t0 - 1], b, ig, mr,
                                g, w);
    for (int t = tid; t < len; t += kThreads) rden[t] = 1.0f / (nrm[t0 + t] + p.eps);
    __syncthreads();
    for (int j = tid; j < L * L; j += kThreads) {
      const int t = j / L, s = j % L;
      float a = 0.0f, bb = 0.0f;
      if (s <= t && t < len) {
        const float D = expf(b[t] - b[s] + ig[s] - mr[t]);
        const T* dht = dh + (t0 + t) * kDv;
        const T* vs = v + (t0 + s) * kDv;
        for (int e = 0; e < kDv; ++e) a = fmaf(to_float(dht[e]), to_float(vs[e]), a);
        a *= D * rden[t];
        if (both) {
          const T* qt = q + (t0 + t) * kDk;
          const T* ks = k + (t0 + s) * kDk;
          for (int d = 0; d < kDk; ++d) bb = fmaf(to_float(qt[d]), to_float(ks[d]), bb);
          bb *= D * scale;
        }
      }
      A[j] = a;
      if (both) B[j] = bb;
    }
    __syncthreads();
  };

  // Forward pass: dq from the state entering each chunk, then the state update (as the forward).
  for (long long c = 0; c < nchunks; ++c) {
    const long long t0 = c * L;
    const int len = static_cast<int>(S - t0 < L ? S - t0 : L);
    prepare(t0, len, false);
    for (int t = warp; t < len; t += kWarps) {
      const T* qt = q + (t0 + t) * kDk;
      const T* dht = dh + (t0 + t) * kDv;
      float part = 0.0f;
      for (int d = lane; d < kDk; d += kWarpSize) {
        float inter = 0.0f;
        for (int e = 0; e < kDv; ++e) inter = fmaf(C[d * kDv + e], to_float(dht[e]), inter);
        float acc = g[t] * rden[t] * inter;
        for (int s = 0; s <= t; ++s) acc = fmaf(A[t * L + s], to_float(k[(t0 + s) * kDk + d]), acc);
        acc *= scale;
        dq[(t0 + t) * kDk + d] = from_float<T>(acc);
        part = fmaf(to_float(qt[d]), acc, part);
      }
      part = warp_reduce_sum(part);
      if (lane == 0) qdq[t0 + t] = part;
    }
    __syncthreads();
    const float g_end = misc[0];
    for (int j = tid; j < kDk * kDv; j += kThreads) {
      const int d = j / kDv, e = j % kDv;
      float cj = g_end * C[j];
      for (int s = 0; s < len; ++s) cj = fmaf(w[s] * to_float(k[(t0 + s) * kDk + d]), to_float(v[(t0 + s) * kDv + e]), cj);
      C[j] = cj;
    }
    __syncthreads();
  }

  // C is C_last: <dC_last, C_last> starts df's sum, and dC_last (or zero) replaces it.
  float part = 0.0f;
  for (int j = tid; j < kDk * kDv; j += kThreads) {
    const float up = p.dC_last ? p.dC_last[seq * kDk * kDv + j] : 0.0f;
    part = fmaf(up, C[j], part);
    C[j] = up;
  }
  part = mlstm_block_sum<kThreads>(part, scratch);
  if (tid == 0) misc[1] = part;

  // Reverse pass: dk, dv, di from dC after each chunk; df; then dC before the chunk.
  for (long long c = nchunks - 1; c >= 0; --c) {
    const long long t0 = c * L;
    const int len = static_cast<int>(S - t0 < L ? S - t0 : L);
    prepare(t0, len, true);
    for (int s = warp; s < len; s += kWarps) {
      const T* ks = k + (t0 + s) * kDk;
      const T* vs = v + (t0 + s) * kDv;
      float kdk = 0.0f;
      for (int d = lane; d < kDk; d += kWarpSize) {
        float inter = 0.0f;
        for (int e = 0; e < kDv; ++e) inter = fmaf(C[d * kDv + e], to_float(vs[e]), inter);
        float intra = 0.0f;
        for (int t = s; t < len; ++t) intra = fmaf(A[t * L + s], to_float(q[(t0 + t) * kDk + d]), intra);
        const float acc = fmaf(scale, intra, w[s] * inter);
        dk[(t0 + s) * kDk + d] = from_float<T>(acc);
        kdk = fmaf(to_float(ks[d]), acc, kdk);
      }
      kdk = warp_reduce_sum(kdk);
      if (lane == 0) {
        di_c[s] = kdk;
        di[t0 + s] = from_float<TG>(kdk);
      }
      for (int e = lane; e < kDv; e += kWarpSize) {
        float inter = 0.0f;
        for (int d = 0; d < kDk; ++d) inter = fmaf(C[d * kDv + e], to_float(ks[d]), inter);
        float intra = 0.0f;
        for (int t = s; t < len; ++t) intra = fmaf(B[t * L + s] * rden[t], to_float(dh[(t0 + t) * kDv + e]), intra);
        dv[(t0 + s) * kDv + e] = from_float<T>(fmaf(w[s], inter, intra));
      }
    }
    __syncthreads();
    if (tid == 0) {  // the reverse cumsum of q . dq - k . dk over the chunk's rows
      float da = misc[1];
      for (int t = len - 1; t >= 0; --t) {
        da += qdq[t0 + t] - di_c[t];
        // The sum down to step 0 is <dC, C> before it: a_0 only scales the entering state. Without one
        // (zeros; the parallel form) that is exactly 0, where the sum leaves fp32 cancellation noise
        // (S = 1: ~1e-8 against a float64 0).
        const float da_t = (t0 + t == 0 && !p.C0) ? 0.0f : da;
        df[t0 + t] = from_float<TG>(da_t / (1.0f + expf(to_float(fp[t0 + t]))));  // da sigmoid(-f)
      }
      misc[1] = da;
    }
    const float g_end = misc[0];
    for (int j = tid; j < kDk * kDv; j += kThreads) {
      const int d = j / kDv, e = j % kDv;
      float r = 0.0f;
      for (int t = 0; t < len; ++t)
        r = fmaf(g[t] * rden[t] * to_float(q[(t0 + t) * kDk + d]), to_float(dh[(t0 + t) * kDv + e]), r);
      C[j] = fmaf(scale, r, g_end * C[j]);
    }
    __syncthreads();
  }
}

}  // namespace kspec
