// The one elementwise step of the gemm backward that cuBLASLt cannot fuse here: dpre = dy * act'(pre).
// cuBLASLt's DRELU/DGELU epilogues apply the derivative to a GEMM's *result* (the next layer's dx
// GEMM); in y = act(x·Wᵀ + b) the derivative multiplies the incoming dy itself, before both GEMMs.
// dpre is then the A/B operand of the dx and dW GEMMs (and BGRADB sums it into dbias).
#pragma once

#include "common/dtype.cuh"
#include "common/math.cuh"
#include "gemm/params.h"

namespace kspec {

// kAct: 1 = ReLU (saved may be the pre-activation or the output: both are > 0 at the same places),
// 2 = GELU, tanh approximation (saved is the pre-activation).
// Launch: blockDim = (kThreads); any grid (grid-stride loop). dy: rows x cols with row stride
// dy_row_stride and unit column stride; saved and dpre contiguous rows x cols.
template <typename T, int kAct, int kThreads>
__global__ void __launch_bounds__(kThreads)
    gemm_act_grad_kernel(const GemmEpilogueParams prm) {
  const T* __restrict__ dy = static_cast<const T*>(prm.dy);
  const T* __restrict__ saved = static_cast<const T*>(prm.saved);
  T* __restrict__ dpre = static_cast<T*>(prm.dpre);
  const long long rows = prm.rows;
  const long long cols = prm.cols;
  const long long dy_row_stride = prm.dy_row_stride;
  static_assert(kAct == 1 || kAct == 2, "act must be relu (1) or gelu (2)");
  const long long total = rows * cols;
  for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    const long long r = i / cols, c = i - r * cols;
    const float g = to_float(dy[r * dy_row_stride + c]);
    const float h = to_float(saved[i]);
    float d;
    if constexpr (kAct == 1) {
      d = h > 0.f ? g : 0.f;
    } else {
      d = g * d_gelu_tanh(h);
    }
    dpre[i] = store_as<T>(d);
  }
}

}  // namespace kspec
