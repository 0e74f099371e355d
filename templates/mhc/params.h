// The arguments of the mHC kernels (mhc_pre.cuh, mhc_post.cuh, sinkhorn.cuh), plain structs compiled by
// both the host compiler (api/ops/mhc/op.cpp fills them) and NVRTC, passed by value, so the two sides
// cannot disagree on their layout. Strided token tensors: element (t, i, d) of x at
// x[(t * n + i) * x_row + d] (the leading dims [B, S] or [T] collapse into t with one row stride).
// The kernels read the const pointers through __ldg: members of a by-value struct cannot carry
// __restrict__, so the read-only load path is asked for explicitly.
#pragma once

namespace kspec {

struct MhcPreParams {
  const void* x;        // [T, n, D], the op's dtype
  const float* phi;     // [M, nD]
  const float* alpha;   // [3] ([1] pre_only)
  const float* bias;    // [M]
  const float* gamma;   // [nD] or null
  void* y;              // [T, D]
  float* h_pre;         // [T, n]
  float* h_post;        // [T, n] (null pre_only)
  float* r;             // [T, n, n] (null pre_only)
  float* inv;           // [T]
  float* h;             // [T, M]
  long long T, x_row, y_row;
  float eps_rms, eps_pre, eps_sk;
};

// mhc.pre.fwd's split plan for few tokens (mhc_pre_mma.cuh): the forward's arguments and the workspace of
// partial totals, [ceil(T / 16), splits, 16, M + 1]. Its own struct: a field more in MhcPreParams moved
// ptxas' choices in the SIMT kernels (pre_only n 8 at 256 threads spilled 8 bytes on sm_90).
struct MhcPreSplitParams {
  MhcPreParams pre;
  float* ws;
};

// mhc.pre.bwd. Per token (mhc_pre_bwd_token_kernel): dx, and g = dL/dh, dm = inv alpha_s g and the
// token's three inv * sum_s g m into the workspace; over tokens (mhc_pre_bwd_columns_kernel, then
// mhc_pre_bwd_reduce_kernel): dphi, dgamma, dbias, dalpha summed part by part in a fixed order.
struct MhcPreBwdParams {
  const void* dy;       // [T, D]
  const void* x;        // [T, n, D]
  const float* phi, *alpha, *bias, *gamma;
  const float* inv;     // [T], saved by the forward
  const float* h;       // [T, M], saved by the forward
  const float* dh_pre;  // [T, n] or null
  const float* dh_post; // [T, n] or null
  const float* dr;      // [T, n, n] or null
  const void* dx_post;  // [T, n, D] or null: added into dx
  void* dx;             // [T, n, D]
  float* dphi;          // [M, nD]
  float* dalpha;        // [3] / [1]
  float* dbias;         // [M]
  float* dgamma;        // [nD] or null
  float* ws_g;          // [T, M]   g
  float* ws_dm;         // [T, M]   inv alpha_s g
  float* ws_ga;         // [T, 3]   inv sum_{rows of alpha_s} g m
  float* ws_part;       // [parts, M + 1, nD] then [parts, M + 3]: the parts' column sums
  float* ws_cv;         // [T]      dinv inv^3 / nD (algo=mma: the token kernel leaves dx to the dx kernel)
  float* ws_hpre;       // [T, n]   H_pre (algo=mma, likewise)
  long long T, x_row, dy_row, dx_row, dx_post_row;
  int parts, tokens_per_part;
  float eps_pre, eps_sk;
};

struct MhcPostParams {
  const void* x;        // [T, n, D]
  const void* f;        // [T, D]
  const float* h_post;  // [T, n]
  const float* r;       // [T, n, n]
  void* out;            // [T, n, D]
  long long T, x_row, f_row, out_row;
};

// mhc.post_pre.fwd: post(l) then pre(l + 1) per token, x_next written once and fed to the projection
// from registers. pre.x is x_next (the y pass reads it back); the post side's x, f, h_post, r below.
struct MhcPostPreParams {
  MhcPreParams pre;
  void* x_next;         // [T, n, D] (= pre.x)
  const void* x;        // [T, n, D]
  const void* f;        // [T, D]
  const float* h_post;  // [T, n], layer l's
  const float* r;       // [T, n, n], layer l's
  long long x_row, f_row;
};

struct MhcPostBwdParams {
  const void* dout;     // [T, n, D]
  const void* x;        // [T, n, D]
  const void* f;        // [T, D]
  const float* h_post;  // [T, n]
  const float* r;       // [T, n, n]
  void* dx;             // [T, n, D]
  void* df;             // [T, D]
  float* dh_post;       // [T, n]
  float* dr;            // [T, n, n]
  long long T, dout_row, x_row, f_row, dx_row, df_row;
};

struct MhcSinkhornParams {
  const float* logits;  // [T, n, n]
  const float* dr;      // [T, n, n] (backward)
  float* out;           // r (forward) or dlogits (backward)
  long long T;
  float eps;
};

}  // namespace kspec
