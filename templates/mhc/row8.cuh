// Rows of eight consecutive elements for the mhc kernels' 16-byte loads and stores (mhc_pre_mma.cuh,
// mhc_pre_bwd_*.cuh, mhc_post.cuh): a row as stored, loads with or without whole aligned 16-byte groups.
#pragma once

#include "common/dtype.cuh"

namespace kspec {

// Eight consecutive elements of a row, as stored.
template <typename T>
struct alignas(16) MhcRow8 {
  T v[8];
};

// Elements src[0 .. valid) (zeros past them). kVec: 16-byte loads, every 8-element group wholly inside
// or outside the row (D % 8 == 0) and 16-byte aligned. kReadOnly: through the read-only path (__ldg); false
// for data this kernel wrote.
template <typename T, bool kVec, bool kReadOnly = true>
__device__ __forceinline__ void mhc_load8(MhcRow8<T>& o, const T* src, int valid) {
  constexpr int kWords = sizeof(MhcRow8<T>) / 16;
  if (kVec) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      const uint4* q = reinterpret_cast<const uint4*>(src) + w;
      reinterpret_cast<uint4*>(o.v)[w] = valid > 0 ? (kReadOnly ? __ldg(q) : *q) : make_uint4(0, 0, 0, 0);
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) o.v[e] = e < valid ? src[e] : from_float<T>(0.f);
  }
}
template <bool kVec>
__device__ __forceinline__ void mhc_load8f(float (&o)[8], const float* src, int valid) {
  if (kVec) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const float4 q = valid > 0 ? __ldg(reinterpret_cast<const float4*>(src) + w) : make_float4(0.f, 0.f, 0.f, 0.f);
      o[4 * w] = q.x, o[4 * w + 1] = q.y, o[4 * w + 2] = q.z, o[4 * w + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = e < valid ? __ldg(src + e) : 0.f;
  }
}

// dst[0 .. 8) = o, as 16-byte stores (dst 16-byte aligned).
template <typename T>
__device__ __forceinline__ void mhc_store8(T* dst, const MhcRow8<T>& o) {
#pragma unroll
  for (int w = 0; w < static_cast<int>(sizeof(MhcRow8<T>) / 16); ++w)
    reinterpret_cast<uint4*>(dst)[w] = reinterpret_cast<const uint4*>(o.v)[w];
}

}  // namespace kspec
