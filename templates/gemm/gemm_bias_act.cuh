// gemm's unfused epilogue, a tuning candidate: cuBLASLt runs the plain GEMM (or its cheap BIAS epilogue)
// into y, then this kernel adds the bias (when cuBLASLt did not), saves the pre-activation to aux (when
// asked) and applies the activation in place. Where cuBLASLt's fused GELU epilogue is slow (K = 33: its
// heuristic choice ran at 6 TFLOP/s for 4097x4095, about 180 µs, when reading and writing y costs about
// 25 µs), two passes over y can win; the tuner times both and keeps the faster.
#pragma once

#include "common/dtype.cuh"
#include "common/math.cuh"
#include "gemm/params.h"

namespace kspec {

template <int kAct>
__device__ __forceinline__ float gemm_act(float h) {
  static_assert(kAct == 1 || kAct == 2, "act must be relu (1) or gelu (2)");
  if constexpr (kAct == 1) return h > 0.f ? h : 0.f;
  else return gelu_tanh(h);
}

// kAct: 1 = ReLU, 2 = GELU (tanh approximation, as cuBLASLt's epilogue). kBias: add bias[col] first.
// kAux: write the pre-activation to aux (contiguous rows x cols). y: rows x cols, unit column stride,
// row stride y_row_stride. Launch: blockDim = (kThreads); any grid (grid-stride loop).
// A contiguous y with nothing but the activation to apply (unfused=1: cuBLASLt added the bias) is one
// flat array, walked in 16-byte vectors; otherwise each thread steps its (row, column) by the grid's
// stride without a division per element (a 64-bit division per element made this pass take 0.265 ms
// for 16384x4096 bf16 on the H100, against ~0.1 to read and write y).
template <typename T, int kAct, bool kBias, bool kAux, int kThreads>
__global__ void __launch_bounds__(kThreads)
    gemm_bias_act_kernel(const GemmEpilogueParams prm) {
  T* __restrict__ y = static_cast<T*>(prm.y);
  const T* __restrict__ bias = static_cast<const T*>(prm.bias);
  T* __restrict__ aux = static_cast<T*>(prm.aux);
  const long long rows = prm.rows;
  const long long cols = prm.cols;
  const long long y_row_stride = prm.y_row_stride;
  const long long total = rows * cols, step = static_cast<long long>(gridDim.x) * kThreads;
  const long long first = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  if (!kBias && !kAux && y_row_stride == cols && reinterpret_cast<unsigned long long>(y) % 16 == 0) {
    constexpr int V = 16 / static_cast<int>(sizeof(T));
    const long long nv = total / V;
    for (long long v = first; v < nv; v += step) {
      uint4 w = *reinterpret_cast<const uint4*>(y + v * V);
      T* e = reinterpret_cast<T*>(&w);
#pragma unroll
      for (int k = 0; k < V; ++k) e[k] = store_as<T>(gemm_act<kAct>(to_float(e[k])));
      *reinterpret_cast<uint4*>(y + v * V) = w;
    }
    for (long long i = nv * V + first; i < total; i += step) y[i] = store_as<T>(gemm_act<kAct>(to_float(y[i])));
    return;
  }
  const long long dr = step / cols, dc = step - dr * cols;
  long long r = first / cols, c = first - r * cols;
  for (long long i = first; i < total; i += step) {
    T* at = y + r * y_row_stride + c;
    float h = to_float(*at);
    if constexpr (kBias) h = to_float(store_as<T>(h + to_float(bias[c])));  // rounded, as a GEMM output is
    if constexpr (kAux) aux[i] = store_as<T>(h);
    *at = store_as<T>(gemm_act<kAct>(h));
    r += dr;
    c += dc;
    if (c >= cols) c -= cols, ++r;
  }
}

}  // namespace kspec
