// Float64 CPU reference for the Mamba selective scan (mamba_ssm's selective_scan_fn plus an initial
// state h0), forward and exact reverse-mode backward: the spec the GPU kernels and the Python twin
// (python/kspec/reference/selective_scan.py) are tested against.
#pragma once

#include <cstdint>
#include <vector>

namespace kspec::ref {

// Sizes of one scan. B and C are each either fixed, [dim, dstate], or input-dependent ("variable"),
// [batch, groups, dstate, seqlen]; groups divides dim, and channel d reads group d / (dim / groups).
// groups only matters for a variable B or C (one count for both, as in Mamba).
struct ScanShape {
  int64_t batch = 1, dim = 1, seqlen = 1, dstate = 1, groups = 1;
  bool variable_b = false, variable_c = false;
};

// All tensors row-major float64. An optional input is absent when its vector is empty.
//   u, delta, z: [batch, dim, seqlen]   A: [dim, dstate]   B, C: see ScanShape
//   D, delta_bias: [dim]                h0: [batch, dim, dstate]
// For channel d, time t and state n (dt = delta + delta_bias, then softplus if delta_softplus):
//   x_t[n] = exp(dt_t * A[d,n]) * x_{t-1}[n] + dt_t * B_t[n] * u_t,   x_{-1} = h0 (or 0)
//   out_t  = (sum_n C_t[n] * x_t[n] + D * u_t) * silu(z_t)            (each factor only if given)
struct ScanInputs {
  std::vector<double> u, delta, A, B, C;
  std::vector<double> D, z, delta_bias, h0;
  bool delta_softplus = false;
};

// out: [batch, dim, seqlen]; last_state: [batch, dim, dstate] = x_{seqlen-1}; states (when asked for
// with a stride k > 0): [batch, dim, ceil(seqlen / k), dstate], the state entering steps 0, k, 2k, ...
// (x_{-1} = h0 or 0 first).
struct ScanOutputs {
  std::vector<double> out, last_state, states;
};

// Gradients of sum(dout * out) + sum(dlast_state * last_state), each in its input's layout (dB and dC
// fixed or variable like B and C); the gradient of an absent optional input is empty.
struct ScanGrads {
  std::vector<double> du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dh0;
};

// Both throw std::invalid_argument when a size disagrees with the shape. The forward keeps only the
// current state: O(dstate) scratch for any seqlen.
ScanOutputs selective_scan_fwd_ref(const ScanShape& shape, const ScanInputs& in, int64_t state_stride = 0);

// dout: [batch, dim, seqlen]; dlast_state: [batch, dim, dstate] or null (no gradient flows into
// last_state). Recomputes the forward one channel at a time and stores that channel's states
// x_{-1..seqlen-1}: (seqlen + 1) * dstate doubles of scratch, reused across channels (8.4 MB for
// seqlen 65536, dstate 16). The recurrence is run backwards in a loop, never recursively.
ScanGrads selective_scan_bwd_ref(const ScanShape& shape, const ScanInputs& in,
                                 const std::vector<double>& dout,
                                 const std::vector<double>* dlast_state);

}  // namespace kspec::ref
