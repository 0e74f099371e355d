// Two fp32 values rounded to a 16-bit type and packed in one 32-bit word: the one conversion instruction
// for both that the tensor-core fragments (common/mma.cuh) and the scan's packed stores
// (selective_scan/packed.cuh) use.
#pragma once

#include "common/dtype.cuh"

namespace kspec {

// Two fp32 values as one register of two 16-bit T (lo in the low half).
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);
template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}
template <>
__device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

}  // namespace kspec
