// Float64 CPU reference for the E79 coupled memory-modulation matrix RNN cell, forward and exact
// reverse-mode backward: the spec the GPU kernels and the Python twin (python/kspec/reference/e79.py)
// are tested against. The projections are already applied: the cell takes k, v, q, m per time step.
#pragma once

#include <cstdint>
#include <vector>

namespace kspec::ref {

// How the gate biases b_s and b_m are given.
constexpr int kE79BiasNone = 0;   // b_s = b_m = 0; both vectors empty
constexpr int kE79BiasFixed = 1;  // b_s, b_m: [n], broadcast over time and batch
constexpr int kE79BiasInput = 2;  // b_s, b_m: [T, B, n], one per time step

struct E79Shape {
  int64_t T = 1, B = 1, n = 1;
  int bias_mode = kE79BiasNone;
};

// All tensors row-major float64; an optional input is absent when its vector is empty.
//   k, v, q, m: [T, B, n]   b_s, b_m: see E79Shape   S0, M0: [B, n, n] (zeros when absent)
// Per batch element, for t = 0..T-1 (|x| the Euclidean norm over n, sigma the logistic sigmoid):
//   kh = k / (|k| + 1e-6)               mh = m / (|m| + 1e-6)
//   s_row = sigma(M kh + b_s)           s_col = sigma(M^T kh + b_s)
//   s_delta = v - S kh
//   S <- s_row[:,None] * S * s_col[None,:] + s_delta kh^T
//   m_row = sigma(S mh + b_m)           m_col = sigma(S^T mh + b_m)      (with the updated S)
//   m_delta = s_delta - M mh
//   M <- m_row[:,None] * M * m_col[None,:] + m_delta mh^T
//   Sq = S q;   out_t = Sq * silu(Sq)                                   (elementwise)
struct E79Inputs {
  std::vector<double> k, v, q, m;
  std::vector<double> b_s, b_m, S0, M0;
};

// out: [T, B, n]; S, M: [B, n, n], the states after the last step.
struct E79Outputs {
  std::vector<double> out, S, M;
};

// Gradients of sum(dout * out) + sum(dS_final * S) + sum(dM_final * M), each in its input's layout:
// db_s, db_m are [n] (summed over T and B) for fixed biases, [T, B, n] for input biases, and empty
// without biases; dS0, dM0 are empty when S0, M0 are absent (as for every absent optional input).
struct E79Grads {
  std::vector<double> dk, dv, dq, dm, db_s, db_m, dS0, dM0;
};

// Both throw std::invalid_argument when a size disagrees with the shape or the bias mode is unknown.
// The forward keeps only the current states: 2 * n^2 doubles of scratch for any T.
E79Outputs e79_fwd_ref(const E79Shape& shape, const E79Inputs& in);

// dout: [T, B, n]; dS_final, dM_final: [B, n, n] or null (no gradient flows into the final states).
// Recomputes the forward one batch element at a time and stores its states S_t, M_t for t = -1..T-1:
// 2 * (T + 1) * n^2 doubles, reused across batch elements (T = 4096, n = 64: 268 MB). The recurrence
// is run backwards in a loop, never recursively.
E79Grads e79_bwd_ref(const E79Shape& shape, const E79Inputs& in, const std::vector<double>& dout,
                     const std::vector<double>* dS_final, const std::vector<double>* dM_final);

}  // namespace kspec::ref
