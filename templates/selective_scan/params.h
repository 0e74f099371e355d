// The selective scan kernels' one argument: every pointer and runtime size, passed by value (the
// launch in api/ops/selective_scan fills one of these). Plain C++ read by both the host compiler and
// NVRTC, so no CUDA types: element pointers are void and each kernel casts them to its traits' types.
#pragma once

#ifndef __CUDACC_RTC__
#include <cstddef>
#endif

namespace kspec {

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

// The layout both compilers must agree on (a launch copies the host's bytes as the kernel's parameter):
// 26 pointers, then 6 ints, no padding. Both compilers check the size (a member retyped, or a type of
// another width in one of them, fails to build the kernel or the library); the host also checks each
// block's offsets (NVRTC has no offsetof).
static_assert(sizeof(void*) == 8 && sizeof(int) == 4, "kspec kernels are 64-bit");
static_assert(sizeof(ScanParams) == 26 * 8 + 6 * 4, "ScanParams: 26 pointers and 6 ints, no padding");
#ifndef __CUDACC_RTC__
static_assert(offsetof(ScanParams, seg_ready) == 25 * 8 && offsetof(ScanParams, dim) == 26 * 8 &&
                  offsetof(ScanParams, nsegs) == 26 * 8 + 5 * 4,
              "ScanParams: the pointers, then the ints");
#endif

}  // namespace kspec
