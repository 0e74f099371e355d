// gemm's unfused epilogue, a tuning candidate: cuBLASLt runs the plain GEMM (or its cheap BIAS epilogue)
// into y, then this kernel adds the bias (when cuBLASLt did not), saves the pre-activation to aux (when
// asked) and applies the activation in place. Where cuBLASLt's fused GELU epilogue is slow (K = 33: its
// heuristic choice ran at 6 TFLOP/s for 4097x4095, about 180 µs, when reading and writing y costs about
// 25 µs), two passes over y can win; the tuner times both and keeps the faster.
#pragma once

#include "common/dtype.cuh"
#include "common/math.cuh"

namespace kspec {

// kAct: 1 = ReLU, 2 = GELU (tanh approximation, as cuBLASLt's epilogue). kBias: add bias[col] first.
// kAux: write the pre-activation to aux (contiguous rows x cols). y: rows x cols, unit column stride,
// row stride y_row_stride. Launch: blockDim = (kThreads); any grid (grid-stride loop).
template <typename T, int kAct, bool kBias, bool kAux, int kThreads>
__global__ void __launch_bounds__(kThreads)
    gemm_bias_act_kernel(T* __restrict__ y, const T* __restrict__ bias, T* __restrict__ aux, long long rows,
                         long long cols, long long y_row_stride) {
  static_assert(kAct == 1 || kAct == 2, "act must be relu (1) or gelu (2)");
  const long long total = rows * cols;
  for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    const long long r = i / cols, c = i - r * cols;
    T* at = y + r * y_row_stride + c;
    float h = to_float(*at);
    if constexpr (kBias) h = to_float(store_as<T>(h + to_float(bias[c])));  // rounded, as a GEMM output is
    if constexpr (kAux) aux[i] = store_as<T>(h);
    float out;
    if constexpr (kAct == 1) {
      out = h > 0.f ? h : 0.f;
    } else {
      out = gelu_tanh(h);
    }
    *at = store_as<T>(out);
  }
}

}  // namespace kspec
