// The selective scan's kernel arguments in one typed struct: every pointer and runtime size of a call,
// filled once by the launch (scan_params_of and the algorithm's own: workspace, segments), and each
// kernel's parameter list read from it in its order (the *_args functions), written once per kernel
// signature instead of a hand-ordered void* array per launch.
//
// The kernels themselves keep loose __restrict__ pointer parameters: NVVM takes the read-only load path
// (LDG.CONSTANT) only for a kernel's own pointer parameters. Passed this struct by value (tried, with the
// pointers as __restrict__ locals and __builtin_assume(__isGlobal)), the sequential backward
// (bf16, dstate 16, 4 warps, 4 lanes, chunk 16, sm_90, the heuristic's config at 8x2048x2048) lost it on
// all of its 84 input loads and spilled 8 bytes at its 168-register cap, and the warp forward (fp16, 2
// warps, 4 items, sm_80) went from 72 to 76 registers.
#pragma once

#include <array>

namespace kspec::scan {

struct ScanParams {
  // Inputs: u, delta, z and dout are the traits' T; B is TB, C is TC; the rest fp32.
  const void* u = nullptr;
  const void* delta = nullptr;
  const float* A = nullptr;
  const void* B = nullptr;
  const void* C = nullptr;
  const float* D = nullptr;
  const void* z = nullptr;
  const float* delta_bias = nullptr;
  const float* h0 = nullptr;
  // Forward outputs (out is T); `states`: the forward's saved states, written by the forward and, given
  // to the backward as `given`, read in place of its own forward pass (else the backward's workspace).
  void* out = nullptr;
  float* last_state = nullptr;
  float* states = nullptr;
  // Backward: dout and du, ddelta, dz are T.
  const void* dout = nullptr;
  const float* dlast_state = nullptr;
  void* du = nullptr;
  void* ddelta = nullptr;
  void* dz = nullptr;
  float* dh0 = nullptr;
  float* dB_acc = nullptr;
  float* dC_acc = nullptr;
  float* partials = nullptr;
  const float* given = nullptr;
  // Segments along time (sequential.cuh): local end states, adjoints, sums of dt and ready flags.
  float* seg_h = nullptr;
  float* seg_g = nullptr;
  float* seg_dt = nullptr;
  unsigned* seg_ready = nullptr;
  int dim = 0, seqlen = 0, channels_per_group = 0, groups = 0;
  int seg_len = 0, nsegs = 1;
};

// Each kernel's parameters in its order (templates/selective_scan/*.cuh), as Launcher::launch takes them.
// selective_scan_fwd_kernel and selective_scan_fwd_tile_kernel:
inline std::array<void*, 16> fwd_args(ScanParams& s) {
  return {&s.u, &s.delta, &s.A, &s.B, &s.C, &s.D, &s.z, &s.delta_bias, &s.h0, &s.out, &s.last_state,
          &s.dim, &s.seqlen, &s.channels_per_group, &s.groups, &s.states};
}
inline std::array<void*, 21> fwd_seq_args(ScanParams& s) {
  return {&s.u,   &s.delta, &s.A,      &s.B,                  &s.C,      &s.D,     &s.z,
          &s.delta_bias, &s.h0, &s.out, &s.last_state, &s.dim, &s.seqlen, &s.channels_per_group,
          &s.groups, &s.seg_h, &s.seg_dt, &s.seg_len, &s.nsegs, &s.states, &s.seg_ready};
}
inline std::array<void*, 24> bwd_args(ScanParams& s) {
  return {&s.u,      &s.delta,  &s.A,        &s.B,  &s.C,      &s.D,    &s.z,  &s.delta_bias,
          &s.h0,     &s.dout,   &s.dlast_state, &s.du, &s.ddelta, &s.dz,  &s.dh0, &s.dB_acc,
          &s.dC_acc, &s.states, &s.partials, &s.dim, &s.seqlen, &s.channels_per_group, &s.groups, &s.given};
}
inline std::array<void*, 29> bwd_seq_args(ScanParams& s) {
  return {&s.u,      &s.delta,  &s.A,        &s.B,   &s.C,      &s.D,   &s.z,   &s.delta_bias,
          &s.h0,     &s.dout,   &s.dlast_state, &s.du, &s.ddelta, &s.dz, &s.dh0, &s.dB_acc,
          &s.dC_acc, &s.states, &s.partials, &s.dim, &s.seqlen, &s.channels_per_group, &s.groups, &s.seg_h,
          &s.seg_g,  &s.seg_dt, &s.seg_len,  &s.nsegs, &s.given};
}
inline std::array<void*, 14> seg_fwd_args(ScanParams& s) {
  return {&s.u,   &s.delta,  &s.A,     &s.B,                  &s.delta_bias, &s.seg_h,   &s.seg_dt,
          &s.dim, &s.seqlen, &s.channels_per_group, &s.groups, &s.seg_len, &s.nsegs, &s.seg_ready};
}
inline std::array<void*, 14> seg_bwd_args(ScanParams& s) {
  return {&s.delta, &s.A,      &s.C,     &s.z,                  &s.delta_bias, &s.dout,  &s.seg_g,
          &s.seg_dt, &s.dim, &s.seqlen, &s.channels_per_group, &s.groups,     &s.seg_len, &s.nsegs};
}

}  // namespace kspec::scan
