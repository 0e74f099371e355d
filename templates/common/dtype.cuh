// dtype traits for NVRTC-compiled kernels: fp32 <-> storage-type conversion and aligned vector access.
// Kernels keep all arithmetic in fp32 and convert only at load and store; this header must stay free
// of standard-library includes because NVRTC sees only the CUDA include directory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kspec {

// Own minimal traits instead of <type_traits>, which NVRTC cannot see.
template <typename A, typename B>
struct IsSame {
  static constexpr bool value = false;
};
template <typename A>
struct IsSame<A, A> {
  static constexpr bool value = true;
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// One element as its raw bits in a 32-bit word (16-bit types zero-extended), for a value that waits in a
// register between its load and its use: converted at the load, the compiler waited for the load there.
// raw_to_float gives the value; raw 0 is 0.0f for every type.
__device__ __forceinline__ unsigned load_raw(const float* p) { return __float_as_uint(*p); }
__device__ __forceinline__ unsigned load_raw(const __half* p) { return *reinterpret_cast<const unsigned short*>(p); }
__device__ __forceinline__ unsigned load_raw(const __nv_bfloat16* p) {
  return *reinterpret_cast<const unsigned short*>(p);
}
template <typename T>
__device__ __forceinline__ float raw_to_float(unsigned r);
template <>
__device__ __forceinline__ float raw_to_float<float>(unsigned r) {
  return __uint_as_float(r);
}
template <>
__device__ __forceinline__ float raw_to_float<__half>(unsigned r) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(r)));
}
template <>
__device__ __forceinline__ float raw_to_float<__nv_bfloat16>(unsigned r) {
  return __uint_as_float(r << 16);
}

// Any-to-any conversion through fp32 (exact for every pair we support, apart from the final rounding).
template <typename To, typename From>
__device__ __forceinline__ To load_as(From v) {
  return from_float<To>(to_float(v));
}
template <typename To>
__device__ __forceinline__ To store_as(float v) {
  return from_float<To>(v);
}

// N elements moved by one aligned wide access: the alignment lets the compiler emit a single
// LDG/STG.64/.128 instead of N narrow ones, which is what keeps memory-bound kernels at bandwidth.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  static_assert(N >= 1 && (N & (N - 1)) == 0, "Vec width must be a power of two");
  static_assert(sizeof(T) * N <= 16, "one access moves at most 16 bytes");
  T v[N];
};

// p must be aligned to N*sizeof(T) bytes.
template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}
template <int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& val) {
  *reinterpret_cast<Vec<T, N>*>(p) = val;
}

// 16 bytes held as four raw 32-bit words, e.g. a prefetch waiting in registers. Held as Vec<bf16, 8>, the
// compiler split the 16-bit elements into registers right at the load (PRMT), which waited for the load
// there; as words they are split where used (as_vec). p must be 16-byte aligned.
template <typename T>
__device__ __forceinline__ uint4 load_raw16(const T* p) {
  return *reinterpret_cast<const uint4*>(p);
}
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> as_vec(const uint4& raw) {
  static_assert(sizeof(Vec<T, N>) == sizeof(uint4), "16 bytes");
  Vec<T, N> v;
  memcpy(&v, &raw, sizeof(v));
  return v;
}

// Widest legal access for T: 16 bytes, or N elements if that is less.
template <typename T, int N>
struct WidestVec {
  static constexpr int kMax = 16 / static_cast<int>(sizeof(T));
  static constexpr int value = N < kMax ? N : kMax;
};

// Loads N elements into fp32 registers using accesses of up to 16 bytes each, so a wider element type
// (fp32 weights beside bf16 activations) can share the activations' column chunking.
// p must be aligned to min(N*sizeof(T), 16) bytes.
template <int N, typename T>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[N]) {
  constexpr int kW = WidestVec<T, N>::value;
#pragma unroll
  for (int i = 0; i < N; i += kW) {
    const Vec<T, kW> chunk = load_vec<kW>(p + i);
#pragma unroll
    for (int j = 0; j < kW; ++j) out[i + j] = to_float(chunk.v[j]);
  }
}

// Rounds N fp32 values to T and stores them with accesses of up to 16 bytes each (alignment as above).
template <int N, typename T>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[N]) {
  constexpr int kW = WidestVec<T, N>::value;
#pragma unroll
  for (int i = 0; i < N; i += kW) {
    Vec<T, kW> chunk;
#pragma unroll
    for (int j = 0; j < kW; ++j) chunk.v[j] = from_float<T>(in[i + j]);
    store_vec<kW>(p + i, chunk);
  }
}

}  // namespace kspec
