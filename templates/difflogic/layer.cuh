// difflogic layer kernels (api/ops/difflogic/reference.h is the spec). First versions, correct before
// fast; every sum in a fixed order, no atomics, so a rerun gives the same bits:
//   difflogic_tables_kernel   one thread per gate: p = softmax(logits) or one-hot argmax (ties to the
//                             lower index), T = p . truth table, 4 floats per gate, once per call.
//                             With p.gumbel the logits are logits + G, G the gate's Gumbel noise of
//                             p.seed (philox.cuh), here and in difflogic_dlogits_kernel alike: the
//                             straight-through estimator's hard forward and soft backward see one G.
//   difflogic_fwd_kernel      one thread per (sample, gate), gates fastest (coalesced y):
//                             y = T00 (1-a)(1-b) + T01 (1-a) b + T10 a (1-b) + T11 a b.
//   difflogic_dx_kernel       one thread per (sample, input): dx = grad_factor * the sum of da or db over
//                             the input's readers in the consumers CSR's order (recomputed from x, dout, T:
//                             no [batch, n_out, 2] buffer); a self-paired gate gives da + db.
//   difflogic_dlogits_kernel  one block per gate: S_uv = sum_s dout P(a = u) P(b = v) in a fixed block
//                             tree, then dlogits_i = p_i (sum_uv f_i(u, v) S_uv - sum_uv T_uv S_uv), which is
//                             sum_s dout p_i (op_i - y) with 4 sums instead of 16.
// A wire outside [0, n_in) is never followed: its outputs become NaN (the wiring is validated on the host
// when it is built; this keeps a bad one from reading out of bounds).
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "difflogic/params.h"
#include "difflogic/philox.cuh"

namespace kspec {

// f_i(u, v) of op i, uv = 2u + v: bit 3 - uv of i.
__device__ __forceinline__ float difflogic_truth(int i, int uv) { return static_cast<float>((i >> (3 - uv)) & 1); }

__device__ __forceinline__ bool difflogic_wire_ok(int w, long long n_in) {
  return static_cast<unsigned long long>(static_cast<long long>(w)) < static_cast<unsigned long long>(n_in);
}

// softmax of gate g's logits into p[16] (max subtracted; fp32).
__device__ __forceinline__ void difflogic_softmax(const float* l, float* p) {
  float mx = l[0];
#pragma unroll
  for (int i = 1; i < 16; ++i) mx = fmaxf(mx, l[i]);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) sum += p[i] = expf(l[i] - mx);
  const float inv = 1.0f / sum;
#pragma unroll
  for (int i = 0; i < 16; ++i) p[i] *= inv;
}

// Gate g's 16 logits, plus its Gumbel noise when p.gumbel.
__device__ __forceinline__ void difflogic_load_logits(const DiffLogicParams& p, long long g, float* l) {
#pragma unroll
  for (int i = 0; i < 16; ++i) l[i] = p.logits[g * 16 + i];
  if (p.gumbel) difflogic_add_gumbel(l, p.seed, g);
}

template <bool kHard, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_tables_kernel(const DiffLogicParams p) {
  for (long long g = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; g < p.n_out;
       g += static_cast<long long>(gridDim.x) * kThreads) {
    float l[16];
    difflogic_load_logits(p, g, l);
    float w[16];
    if (kHard) {
      int best = 0;
#pragma unroll
      for (int i = 1; i < 16; ++i)
        if (l[i] > l[best]) best = i;  // strict: ties stay with the lower index
#pragma unroll
      for (int i = 0; i < 16; ++i) w[i] = i == best ? 1.0f : 0.0f;
    } else {
      difflogic_softmax(l, w);
    }
#pragma unroll
    for (int uv = 0; uv < 4; ++uv) {
      float t = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) t += w[i] * difflogic_truth(i, uv);
      p.tables[g * 4 + uv] = t;
    }
  }
}

__device__ __forceinline__ float difflogic_gate(const float* t, float xa, float xb) {
  return t[0] * (1.0f - xa) * (1.0f - xb) + t[1] * (1.0f - xa) * xb + t[2] * xa * (1.0f - xb) + t[3] * xa * xb;
}

template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_fwd_kernel(const DiffLogicParams p) {
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const long long total = p.batch * p.n_out;
  for (long long e = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    const long long s = e / p.n_out, g = e - s * p.n_out;
    const int wa = p.a[g], wb = p.b[g];
    float out = __int_as_float(0x7fc00000);  // NaN for a wire out of range
    if (difflogic_wire_ok(wa, p.n_in) && difflogic_wire_ok(wb, p.n_in)) {
      const float t[4] = {p.tables[g * 4], p.tables[g * 4 + 1], p.tables[g * 4 + 2], p.tables[g * 4 + 3]};
      out = difflogic_gate(t, to_float(x[s * p.n_in + wa]), to_float(x[s * p.n_in + wb]));
    }
    y[e] = from_float<T>(out);
  }
}

template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_dx_kernel(const DiffLogicParams p) {
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  T* dx = static_cast<T*>(p.dx);
  const long long total = p.batch * p.n_in;
  for (long long e = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    const long long s = e / p.n_in, j = e - s * p.n_in;
    const T* xs = x + s * p.n_in;
    float sum = 0.0f;
    for (int k = p.offsets[j]; k < p.offsets[j + 1]; ++k) {
      const int entry = p.entries[k], g = entry >> 1, wa = p.a[g], wb = p.b[g];
      if (!difflogic_wire_ok(wa, p.n_in) || !difflogic_wire_ok(wb, p.n_in)) {
        sum = __int_as_float(0x7fc00000);
        break;
      }
      const float* t = p.tables + 4 * g;
      const float xa = to_float(xs[wa]), xb = to_float(xs[wb]), d = to_float(dout[s * p.n_out + g]);
      sum += (entry & 1) ? d * ((t[1] - t[0]) * (1.0f - xa) + (t[3] - t[2]) * xa)
                         : d * ((t[2] - t[0]) * (1.0f - xb) + (t[3] - t[1]) * xb);
    }
    dx[e] = from_float<T>(p.grad_factor * sum);
  }
}

template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_dlogits_kernel(const DiffLogicParams p) {
  static_assert(kThreads % kWarpSize == 0, "whole warps");
  __shared__ float partial[4][kThreads / kWarpSize];
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  for (long long g = blockIdx.x; g < p.n_out; g += gridDim.x) {
    const int wa = p.a[g], wb = p.b[g];
    const bool ok = difflogic_wire_ok(wa, p.n_in) && difflogic_wire_ok(wb, p.n_in);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (ok)
      for (long long s = threadIdx.x; s < p.batch; s += kThreads) {
        const float xa = to_float(x[s * p.n_in + wa]), xb = to_float(x[s * p.n_in + wb]);
        const float d = to_float(dout[s * p.n_out + g]);
        acc[0] += d * (1.0f - xa) * (1.0f - xb);
        acc[1] += d * (1.0f - xa) * xb;
        acc[2] += d * xa * (1.0f - xb);
        acc[3] += d * xa * xb;
      }
    // The block tree: shuffles within each warp, then warp 0 sums the warps' partials in order.
    warp_reduce_sum<kWarpSize, 4>(acc);
    if (threadIdx.x % kWarpSize == 0)
#pragma unroll
      for (int uv = 0; uv < 4; ++uv) partial[uv][threadIdx.x / kWarpSize] = acc[uv];
    __syncthreads();
    if (threadIdx.x < 16) {
      float S[4];
#pragma unroll
      for (int uv = 0; uv < 4; ++uv) {
        S[uv] = 0.0f;
        for (int w = 0; w < kThreads / kWarpSize; ++w) S[uv] += partial[uv][w];
      }
      float l[16], pr[16];
      difflogic_load_logits(p, g, l);
      difflogic_softmax(l, pr);
      const int i = threadIdx.x;
      const float* t = p.tables + 4 * g;
      float own = 0.0f, mix = 0.0f;
#pragma unroll
      for (int uv = 0; uv < 4; ++uv) {
        own += difflogic_truth(i, uv) * S[uv];
        mix += t[uv] * S[uv];
      }
      p.dlogits[g * 16 + i] = ok ? pr[i] * (own - mix) : __int_as_float(0x7fc00000);
    }
    __syncthreads();  // partial is reused by the next gate
  }
}

}  // namespace kspec
