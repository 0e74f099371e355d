// The E79 kernels' parameters: one plain struct, filled by the host (api/ops/e79/op.cpp) and passed by
// value to the forward, backward and bias-reduce kernels, plain or clustered (e79.cuh, e79_cluster.cuh).
// Compiled by the host compiler and by NVRTC, so: no CUDA types (element pointers are void*, typed by
// the kernel's template arguments), no standard headers.
#pragma once

#include "common/layout.h"

namespace kspec {

// A [T, B, n] tensor with unit stride along n: element (t, b, i) at p[t * st + b * sb + i]. A fixed bias
// [n] is the same with st = sb = 0; an absent tensor has p = null.
struct E79SeqArg {
  void* p;
  long long st, sb;
};

struct E79Params {
  // inputs of both directions
  E79SeqArg k, v, q, m;
  E79SeqArg b_s, b_m;           // a fixed bias [n] or per-step [T, B, n]; p null without biases
  const float* S0;              // [B, n, n] or null (zero)
  const float* M0;
  // forward
  E79SeqArg out;
  float* S;                     // the final states [B, n, n]
  float* M;
  float* checkpoints;           // (S, M) every chunk steps; written by the forward (or null), read by the backward
  // backward
  E79SeqArg dout;
  E79SeqArg dk, dv, dq, dm;
  E79SeqArg db_s, db_m;         // per-step bias gradients (bias "input"); p null otherwise
  const float* dS;              // gradients of the final states, or null (zero)
  const float* dM;
  float* dS0;                   // gradients of S0, M0, or null
  float* dM0;
  float* bias_partial;          // fixed biases: [B, 2, n] per-sequence sums, reduced by e79_bias_reduce_kernel
  float* ws;                    // the backward's workspace
  void* db_s_sum;               // fixed biases: the reduced gradients [n] (TB)
  void* db_m_sum;
  int T, nchk, batch;
};

static_assert(sizeof(E79SeqArg) == 24 && KSPEC_OFFSETOF(E79SeqArg, sb) == 16, "E79SeqArg: host = NVRTC");
static_assert(KSPEC_OFFSETOF(E79Params, S0) == 144 && KSPEC_OFFSETOF(E79Params, out) == 160 &&
                  KSPEC_OFFSETOF(E79Params, dout) == 208 && KSPEC_OFFSETOF(E79Params, dS) == 376 &&
                  KSPEC_OFFSETOF(E79Params, T) == 440 && sizeof(E79Params) == 456,
              "E79Params: the same layout for the host and NVRTC");

}  // namespace kspec
