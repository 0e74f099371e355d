// The selective scan's single decode step.
#pragma once

#include "common/dtype.cuh"
#include "common/math.cuh"
#include "common/reduce.cuh"

namespace kspec {

// ---------------------------------------------------------------------------------------------
// One decode step (new_state may alias state: an update in place): for each (b, d, n)
//   state = exp(dt A) state + dt B u;  out = (C . state + D u) * silu(z).
// Launch: blockDim = (kThreads, 1, 1) with kThreads a multiple of kSplit; gridDim.x =
// ceil(batch * dim * kSplit / kThreads). kSplit lanes (a power of two <= 32) share one channel, each
// taking states n = lane, lane + kSplit, ...; their partial C . state is summed by shuffles.
// u, delta, z, out: [batch, dim]; B, C: [batch, groups, dstate] (kVarB/kVarC) or [dim, dstate].
// ---------------------------------------------------------------------------------------------
template <typename T, typename TB, typename TC, int kDstate, bool kVarB, bool kVarC, bool kHasD, bool kHasZ,
          bool kHasDeltaBias, bool kSoftplus, int kSplit, int kThreads>
__global__ void __launch_bounds__(kThreads)
    selective_scan_step_kernel(const float* state, float* new_state, const T* __restrict__ u, const T* __restrict__ delta,
                               const float* __restrict__ A, const TB* __restrict__ B, const TC* __restrict__ C,
                               const float* __restrict__ D, const T* __restrict__ z,
                               const float* __restrict__ delta_bias, T* __restrict__ out, int batch, int dim,
                               int channels_per_group, int groups) {
  static_assert(kSplit >= 1 && kSplit <= kWarpSize && (kSplit & (kSplit - 1)) == 0, "kSplit: power of two <= 32");
  static_assert(kThreads % kSplit == 0 && kThreads % kWarpSize == 0, "whole channels and warps per block");
  constexpr int N = kDstate;
  const long long gid = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  const long long chan = gid / kSplit;
  const int part = static_cast<int>(gid % kSplit);
  const bool ok = chan < static_cast<long long>(batch) * dim;  // no early return: the shuffles need the lanes
  const long long c = ok ? chan : 0;
  const int b = static_cast<int>(c / dim), d = static_cast<int>(c % dim);
  const int g = d / channels_per_group;
  float dt = to_float(delta[c]) + (kHasDeltaBias ? delta_bias[d] : 0.0f);
  if constexpr (kSoftplus) dt = softplus(dt);
  const float uv = to_float(u[c]);
  float y = 0.0f;
  for (int n = part; n < N; n += kSplit) {
    const long long bc = (static_cast<long long>(b) * groups + g) * N + n;
    const float Bn = kVarB ? to_float(B[bc]) : to_float(B[d * N + n]);
    const float Cn = kVarC ? to_float(C[bc]) : to_float(C[d * N + n]);
    const float a = fast_exp2(dt * A[d * N + n] * kLog2e);
    const float x = fmaf(a, state[c * N + n], dt * Bn * uv);
    if (ok) new_state[c * N + n] = x;  // may be `state` itself: each element is read, then written, once
    y = fmaf(Cn, x, y);
  }
  y = warp_reduce_sum<kSplit>(y);
  if (ok && part == 0) {
    float o = y + (kHasD ? D[d] * uv : 0.0f);
    if constexpr (kHasZ) o *= silu(to_float(z[c]));
    out[c] = from_float<T>(o);
  }
}

}  // namespace kspec
