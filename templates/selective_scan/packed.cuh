// 16-bit elements held as raw 32-bit words, split and packed by the kernels that prefetch them as words
// (the tile kernel, tile.cuh; the wide kernel, wide.cuh): a shift or a mask per element where a Vec<T, N>
// unpacked with PRMTs.
#pragma once

#include "selective_scan/common.cuh"

namespace kspec {
namespace scan_detail {

// The low (hi = 0) or high 16-bit element of a word as a float.
template <typename T>
__device__ __forceinline__ float half_word_to_float(unsigned x, int hi);
template <>
__device__ __forceinline__ float half_word_to_float<__nv_bfloat16>(unsigned x, int hi) {
  return __uint_as_float(hi ? x & 0xffff0000u : x << 16);
}
template <>
__device__ __forceinline__ float half_word_to_float<__half>(unsigned x, int hi) {
  return raw_to_float<__half>(hi ? x >> 16 : x & 0xffffu);
}
// Two floats rounded to T and packed in a word (one conversion instruction for both).
template <typename T>
__device__ __forceinline__ unsigned pack2(float a, float b);
template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&v);
}
template <>
__device__ __forceinline__ unsigned pack2<__half>(float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&v);
}

}  // namespace scan_detail
}  // namespace kspec
