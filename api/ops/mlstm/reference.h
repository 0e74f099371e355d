// Float64 CPU reference for the mLSTM (xLSTM's matrix-memory cell): the recurrent step, the chunkwise
// and the parallel forms and their backward. The spec the GPU kernels and the Python twin
// (python/kspec/reference/mlstm.py) are tested against; semantics as mlstm_kernels 2.0.6 (issue 29).
#pragma once

#include <cstdint>
#include <vector>

namespace kspec::ref {

constexpr double kMlstmEps = 1e-6;

struct MlstmShape {
  int64_t B = 1, NH = 1, S = 1, DK = 1, DV = 1;  // DK = DHQK, DV = DHHV
};

// All tensors row-major float64:
//   q, k: [B, NH, S, DK]   v: [B, NH, S, DV]   i, f: [B, NH, S] (gate pre-activations)
//   C0: [B, NH, DK, DV]    n0: [B, NH, DK]     m0: [B, NH]   (all three or none: zeros)
// One step per sequence, s = DK^-1/2, a = logsigmoid(f):
//   m' = max(a + m, i)   C' = e^(a+m-m') C + e^(i-m') k v^T   n' = e^(a+m-m') n + e^(i-m') k
//   nrm = max(|s q . n'|, e^(-m'))   h = (s q)^T C' / (nrm + eps)
struct MlstmInputs {
  std::vector<double> q, k, v, i, f;
  std::vector<double> C0, n0, m0;
};

// h: [B, NH, S, DV]; nrm, m: [B, NH, S], per step (what the backward keeps); C, n, m_last: the states
// after the last step (empty for the parallel form, which has none).
struct MlstmOutputs {
  std::vector<double> h, nrm, m, C, n, m_last;
};

// Gradients in their inputs' layouts; dC0, dn0, dm0 empty without initial states.
struct MlstmGrads {
  std::vector<double> dq, dk, dv, di, df, dC0, dn0, dm0;
};

// Upstream gradients of the last states (null: none). dn, dm only in the exact backward.
struct MlstmUpstream {
  const std::vector<double>* dC = nullptr;
  const std::vector<double>* dn = nullptr;
  const std::vector<double>* dm = nullptr;
};

// log(sigmoid(x)) as min(x, 0) - log1p(e^-|x|): no overflow, full relative accuracy at both ends.
double log_sigmoid(double x);

// Every function throws std::invalid_argument when a size disagrees with the shape, only some of
// C0, n0, m0 are given, or chunk < 1.

// The recurrence, one step at a time (mlstm.step is S = 1: [B, NH, 1, DK] is [B, NH, DK]).
MlstmOutputs mlstm_recurrent_fwd_ref(const MlstmShape& s, const MlstmInputs& in, double eps = kMlstmEps);

// The same recurrence chunk by chunk (any chunk >= 1; the last chunk may be shorter): inside a chunk
// from states (C, n, m), b = in-chunk cumsum of a, m_t = max(b_t + m, max_s<=t (b_t - b_s + i_s)).
MlstmOutputs mlstm_chunkwise_fwd_ref(const MlstmShape& s, const MlstmInputs& in, int64_t chunk,
                                     double eps = kMlstmEps);

// The parallel form: no states (C0, n0, m0 must be empty; m0 = -inf), one chunk of length S. It
// differs from the recurrence (m0 = 0) only by eps e^m.
MlstmOutputs mlstm_parallel_fwd_ref(const MlstmShape& s, const MlstmInputs& in, double eps = kMlstmEps);

// Gradients of sum(dh * h) + sum(dC_last * C_last) with the forward's nrm and m constants (as
// mlstm_kernels; dn0 = dm0 = 0): h_t = (s q_t)^T Cbar_t e^(-m_t) / (nrm_t + eps), Cbar the
// unstabilized state, the same function in every form. Unlike mlstm_kernels, dC_last reaches df. The
// forward is recomputed chunk by chunk and the backward runs over the chunks in reverse.
MlstmGrads mlstm_chunkwise_bwd_ref(const MlstmShape& s, const MlstmInputs& in, const std::vector<double>& dh,
                                   const std::vector<double>* dC_last, int64_t chunk, double eps = kMlstmEps);

// The same for the parallel form (no states, no dC_last).
MlstmGrads mlstm_parallel_bwd_ref(const MlstmShape& s, const MlstmInputs& in, const std::vector<double>& dh,
                                  double eps = kMlstmEps);

// Reverse mode through the recurrence, one step at a time. exact = false: nrm and m constants (the
// chunkwise backward's gradient; up.dn, up.dm must be null). exact = true: the true gradient, through
// nrm and m' = max(a + m, i) (the subgradient of the branch taken), with dn0, dm0.
MlstmGrads mlstm_recurrent_bwd_ref(const MlstmShape& s, const MlstmInputs& in, const std::vector<double>& dh,
                                   const MlstmUpstream& up, bool exact, double eps = kMlstmEps);

}  // namespace kspec::ref
