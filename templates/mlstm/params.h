// The argument of every mLSTM kernel (mlstm.cuh), one plain struct compiled by both the host compiler
// (api/ops/mlstm/op.cpp fills it) and NVRTC, so the two sides cannot disagree on its layout. Passed by
// value. Tensors are contiguous, [B, NH, ...] flattened to sequences seq = b * NH + h.
#pragma once

namespace kspec {

struct MlstmParams {
  const void *q, *k, *v;  // [seqs, S, DHQK], [seqs, S, DHQK], [seqs, S, DHHV]: the input dtype
  const void *i, *f;      // [seqs, S] gate pre-activations: the input dtype or float
  const float *C0, *n0, *m0;  // the states entering: [seqs, DHQK, DHHV], [seqs, DHQK], [seqs] (null: zeros)
  void* h;                    // [seqs, S, DHHV], the input dtype
  float *nrm, *m_rows;        // [seqs, S]: max(|s q.n|, e^-m) and m per step, for the backward (null: not kept)
  float *C, *n, *m;           // the states after the last step (for the chunkwise kernel its running state)
  long long seqlen;           // S (1 for the step)
  float eps;
};

// Dynamic shared memory of mlstm_chunkwise_fwd_kernel in floats: S (chunk x chunk), six vectors of
// chunk floats and two scalars.
constexpr int mlstm_chunkwise_fwd_smem_floats(int chunk) { return chunk * chunk + 6 * chunk + 2; }

}  // namespace kspec
