// difflogic.ca.step.fwd: one step of a DiffLogic cellular automaton (api/ops/difflogic/reference.h:
// difflogic_ca_step_ref is the spec), the architecture kDiffLogicCaArchs[kArch] compiled in, wiring and
// the gate tables T (difflogic_tables_kernel, once per call) read as data. First version: one block per
// cell (grid: width, height, batch), the cell's whole network in shared memory, layer after layer with a
// barrier between them:
//   the C 3x3 patches (zero-padded or periodic), then the perception, all C K (channel, kernel) instances
//   of a layer at once (instance c K + k reads channel c's patch, kernel k's tables), its last layer placed
//   at C + c P K + bit K + k of the update network's input after the state's C values, then the update
//   layers, whose C outputs replace the state where fire is 1 (no fire: everywhere).
// Sums: none across threads (every gate is one thread's 4 products), so a rerun gives the same bits.
#pragma once

#include "common/dtype.cuh"
#include "difflogic/params.h"

namespace kspec {

// Largest width of a list (the buffers' sizes), and the sum (gate counts).
constexpr int difflogic_max_width(const int* w, int n) {
  int m = 0;
  for (int i = 0; i < n; ++i) m = w[i] > m ? w[i] : m;
  return m;
}
constexpr int difflogic_sum_width(const int* w, int n) {
  int s = 0;
  for (int i = 0; i < n; ++i) s += w[i];
  return s;
}

__device__ __forceinline__ bool difflogic_ca_wire_ok(int w, int n_in) {
  return static_cast<unsigned>(w) < static_cast<unsigned>(n_in);
}

__device__ __forceinline__ float difflogic_ca_gate(const float* t, float xa, float xb) {
  return t[0] * (1.0f - xa) * (1.0f - xb) + t[1] * (1.0f - xa) * xb + t[2] * xa * (1.0f - xb) + t[3] * xa * xb;
}

template <typename T, int kArch, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_ca_step_fwd_kernel(const DiffLogicParams p) {
  constexpr DiffLogicCaArch A = kDiffLogicCaArchs[kArch];
  constexpr int C = A.C, K = A.K, P = A.perception[A.n_perception - 1], kInputs = C + C * P * K;
  constexpr int kPercMax = difflogic_max_width(A.perception, A.n_perception);
  constexpr int kUpdMax = difflogic_max_width(A.update, A.n_update);
  constexpr int kBuf = kInputs > kUpdMax ? kInputs : kUpdMax;
  constexpr int kPercGates = difflogic_sum_width(A.perception, A.n_perception);
  __shared__ float patch[C * 9];
  __shared__ float perc[2][C * K * kPercMax];
  __shared__ float buf[2][kBuf];
  const T* state = static_cast<const T*>(p.x);
  const T* fire = static_cast<const T*>(p.fire);
  T* next = static_cast<T*>(p.y);
  const int* wa = p.b;              // row a of the wires [2, wired]
  const int* wb = p.b + p.wired;    // row b
  const float* tables_update = p.tables + 4LL * K * kPercGates;
  // One block per cell, the grid (width, height, batch): no integer division (64-bit ones are calls
  // that took a stack frame).
  const int x0 = blockIdx.x, y0 = blockIdx.y, H = static_cast<int>(p.height), W = static_cast<int>(p.width);
  const long long cell = (static_cast<long long>(blockIdx.z) * H + y0) * W + x0;
  for (int t = threadIdx.x; t < C * 9; t += kThreads) {
    const int c = t / 9, q = t % 9;
    int y = y0 + q / 3 - 1, x = x0 + q % 3 - 1;
    if (p.periodic) {
      y = y < 0 ? y + H : y >= H ? y - H : y;
      x = x < 0 ? x + W : x >= W ? x - W : x;
    }
    float v = 0.0f;
    if (y >= 0 && y < H && x >= 0 && x < W)
      v = to_float(state[((static_cast<long long>(blockIdx.z) * H + y) * W + x) * C + c]);
    patch[t] = v;
  }
  __syncthreads();
  // The perception: layer l of every (channel, kernel) instance.
  // Layers unrolled: their widths and offsets are constants. A wire outside the layer's inputs (a
  // wiring that skipped the host check) gives NaN, not a fault.
  int gate0 = 0, wire0 = 0;  // layer l's first gate among the perception's, first column of the wires
#pragma unroll
  for (int l = 0; l < A.n_perception; ++l) {
    const int width = A.perception[l], n_in = l == 0 ? 9 : A.perception[l - 1];
    float* out = perc[l % 2];
    const float* in = perc[(l + 1) % 2];
    for (int e = threadIdx.x; e < C * K * width; e += kThreads) {
      const int inst = e / width, g = e - inst * width, c = inst / K, k = inst - c * K;
      const float* t = p.tables + 4LL * (k * kPercGates + gate0 + g);
      const int ia = l == 0 ? p.a[g] : wa[wire0 + g], ib = l == 0 ? 4 : wb[wire0 + g];
      const float* src = l == 0 ? patch + c * 9 : in + inst * n_in;
      out[inst * width + g] = difflogic_ca_wire_ok(ia, n_in) && difflogic_ca_wire_ok(ib, n_in)
                                  ? difflogic_ca_gate(t, src[ia], src[ib])
                                  : __int_as_float(0x7fc00000);
    }
    gate0 += width;
    if (l > 0) wire0 += width;
    __syncthreads();
  }
  // The update network's input: the state, then the perception at C + c P K + bit K + k.
  const float* last = perc[(A.n_perception - 1) % 2];
  for (int e = threadIdx.x; e < kInputs; e += kThreads) {
    if (e < C) {
      buf[0][e] = patch[e * 9 + 4];
    } else {
      const int j = e - C, c = j / (P * K), bit = (j / K) % P, k = j % K;
      buf[0][e] = last[(c * K + k) * P + bit];
    }
  }
  __syncthreads();
  int ugate0 = 0;
#pragma unroll
  for (int l = 0; l < A.n_update; ++l) {
    const int width = A.update[l], n_in = l == 0 ? kInputs : A.update[l - 1];
    const float* in = buf[l % 2];
    float* out = buf[(l + 1) % 2];
    for (int g = threadIdx.x; g < width; g += kThreads) {
      const int w = wire0 + ugate0 + g;
      const int ia = wa[w], ib = wb[w];
      out[g] = difflogic_ca_wire_ok(ia, n_in) && difflogic_ca_wire_ok(ib, n_in)
                   ? difflogic_ca_gate(tables_update + 4LL * (ugate0 + g), in[ia], in[ib])
                   : __int_as_float(0x7fc00000);
    }
    ugate0 += width;
    __syncthreads();
  }
  const float* result = buf[A.n_update % 2];
  for (int c = threadIdx.x; c < C; c += kThreads) {
    const bool keep = fire != nullptr && to_float(fire[cell]) == 0.0f;
    next[cell * C + c] = keep ? state[cell * C + c] : from_float<T>(result[c]);
  }
}

}  // namespace kspec
