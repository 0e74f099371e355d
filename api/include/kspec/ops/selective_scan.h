// Typed C++ entry points for the selective_scan family (they call the registry like everything else).
#pragma once

#include "kspec/registry.h"

namespace kspec::ops {

// The scan's inputs. u, delta, z: [batch, dim, seqlen]; A: [dim, dstate] fp32; B, C: variable
// [batch, groups, dstate, seqlen] or fixed [dim, dstate] (the dtype of u or fp32); D, delta_bias: [dim]
// fp32; h0: [batch, dim, dstate] fp32. Optional ones may be TensorView(). All contiguous.
struct ScanInputs {
  TensorView u, delta, A, B, C, D, z, delta_bias, h0;
  bool delta_softplus = false;
};

// out: [batch, dim, seqlen] like u; last_state: [batch, dim, dstate] fp32.
inline void selective_scan_fwd(const ScanInputs& in, const TensorView& out, const TensorView& last_state,
                               Stream stream = nullptr) {
  call("selective_scan.fwd", {in.u, in.delta, in.A, in.B, in.C, in.D, in.z, in.delta_bias, in.h0},
       {out, last_state}, {{"delta_softplus", in.delta_softplus}}, stream);
}

// Gradients, each shaped like its input (dB, dC like B, C); dD, dz, ddelta_bias, dh0 given iff their
// input is. dlast_state may be TensorView() (no gradient flows into last_state).
struct ScanGrads {
  TensorView du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dh0;
};

inline void selective_scan_bwd(const TensorView& dout, const ScanInputs& in, const TensorView& dlast_state,
                               const ScanGrads& g, Stream stream = nullptr) {
  call("selective_scan.bwd",
       {dout, in.u, in.delta, in.A, in.B, in.C, in.D, in.z, in.delta_bias, in.h0, dlast_state},
       {g.du, g.ddelta, g.dA, g.dB, g.dC, g.dD, g.dz, g.ddelta_bias, g.dh0}, {{"delta_softplus", in.delta_softplus}},
       stream);
}

// One decode step: state [batch, dim, dstate] fp32 is updated in place (new_state = state is allowed);
// u, delta, z, out: [batch, dim]; B, C: [batch, groups, dstate] or fixed [dim, dstate].
inline void selective_scan_step(const TensorView& state, const ScanInputs& in, const TensorView& out,
                                Stream stream = nullptr) {
  call("selective_scan.step", {state, in.u, in.delta, in.A, in.B, in.C, in.D, in.z, in.delta_bias},
       {out, state}, {{"delta_softplus", in.delta_softplus}}, stream);
}

}  // namespace kspec::ops
