// The argument of every mLSTM kernel (templates/mlstm/*.cuh), one plain struct compiled by both the host
// compiler (api/ops/mlstm/op.cpp fills it) and NVRTC, so the two sides cannot disagree on its layout.
// Passed by value. Tensors are contiguous, [B, NH, ...] flattened to sequences seq = b * NH + h.
#pragma once

namespace kspec {

struct MlstmParams {
  const void *q, *k, *v;  // [seqs, S, DHQK], [seqs, S, DHQK], [seqs, S, DHHV]: the input dtype
  const void *i, *f;      // [seqs, S] gate pre-activations: the input dtype or float
  const float *C0, *n0, *m0;  // the states entering: [seqs, DHQK, DHHV], [seqs, DHQK], [seqs] (null: zeros)
  void* h;                    // [seqs, S, DHHV], the input dtype
  float *nrm, *m_rows;        // [seqs, S]: max(|s q.n|, e^-m) and m per step, for the backward (null: not kept)
  float *C, *n, *m;           // the states after the last step (for the chunkwise kernels their running state)
  long long seqlen;           // S (1 for the step)
  float eps;
  // m entering the first step when m0 is null: 0 for the recurrence (chunkwise, step), -inf for the
  // parallel form (no state: the first step's max is i_0 alone), which is otherwise the same function.
  float m_init;
  // Backward (mlstm_chunkwise_bwd_kernel): nrm, m_rows above are its inputs (the forward's constants).
  const void* dh;          // [seqs, S, DHHV], the input dtype
  const float* dC_last;    // [seqs, DHQK, DHHV] (null: zero)
  void *dq, *dk, *dv;      // like q, k, v
  void *di, *df;           // like i
  float* qdq;              // [seqs, S] workspace: q_t . dq_t in fp32, from the forward pass to df's
};

// Dynamic shared memory of mlstm_chunkwise_fwd_kernel in floats: S (chunk x chunk), six vectors of
// chunk floats and two scalars.
constexpr int mlstm_chunkwise_fwd_smem_floats(int chunk) { return chunk * chunk + 6 * chunk + 2; }

// Dynamic shared memory of mlstm_chunkwise_bwd_kernel in floats: two chunk x chunk matrices, seven
// vectors of chunk floats, two scalars and a block sum's scratch (up to 32 warps).
constexpr int mlstm_chunkwise_bwd_smem_floats(int chunk) { return 2 * chunk * chunk + 7 * chunk + 2 + 32; }

}  // namespace kspec
