// mlstm.step: one decoding step of the mLSTM, states updated in place (api/ops/mlstm/reference.h is
// the spec), one CTA per sequence:
//   m' = max(a + m, i)   C' = e^(a+m-m') C + e^(i-m') k v^T   n' = e^(a+m-m') n + e^(i-m') k
//   h = (s q)^T C' / (max(|s q . n'|, e^(-m')) + eps),   a = logsigmoid(f), s = DHQK^-1/2.
// First version, correct before fast: q and k in shared memory; thread j owns columns e = j, j +
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

}  // namespace kspec
