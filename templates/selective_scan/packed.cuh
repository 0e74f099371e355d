// What the forward's one-pass kernels share (the tile kernel, tile.cuh; the wide kernel, wide.cuh): their
// prefetch of 16-bit u, delta, z and variable B/C as raw 32-bit words, a tile or chunk ahead of use, split
// where used (a shift or a mask per element where a Vec<T, N> unpacked with PRMTs), and the packed stores.
#pragma once

#include "common/pack.cuh"
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

// Q consecutive 16-bit elements as Q / 2 raw words: one 4-, 8- or 16-byte vector.
template <typename T, int Q>
struct RawSteps {
  static_assert(sizeof(T) == 2 && (Q == 2 || Q == 4 || Q == 8), "2, 4 or 8 steps of a 16-bit type: one 4-, 8- or 16-byte vector");
  static constexpr int kWords = Q / 2;
  Vec<unsigned, kWords> w;
  // p: aligned to Q elements
  __device__ __forceinline__ void load(const T* p) { w = load_vec<kWords>(reinterpret_cast<const unsigned*>(p)); }
  __device__ __forceinline__ float at(int k) const { return half_word_to_float<T>(w.v[k / 2], k & 1); }
};

// A lane's Q steps of its channel's u, delta and z, loaded a tile or chunk ahead of their use. The loads
// never leave the tensors, so they need no predicate and no zeroing: the kernels give channels past dim
// the last channel's row and steps past seqlen the row's last Q (and dt = 0 to both).
template <typename Tr, int Q>
struct LaneSteps {
  using T = typename Tr::T;
  RawSteps<T, Q> u, delta, z;
  // The block's rows (u_blk, ...: one 64-bit base each), the lane's row offset and first step (32 bits).
  __device__ __forceinline__ void load(const T* u_blk, const T* delta_blk, const T* z_blk, int row, int t, int seqlen) {
    const int o = row + min(t, seqlen - Q);
    u.load(u_blk + o);
    delta.load(delta_blk + o);
    if constexpr (Tr::kHasZ) z.load(z_blk + o);
  }
};

// The block's variable B/C rows of kSteps steps: 16-byte vectors of 8 steps of one state, [state][step] in
// global memory, staged transposed to [step][state] floats ([variable B, C][step][state] in shared memory).
// The vectors of both tensors are spread over the block's threads, vector e of the first variable tensor
// then of the second (the tile kernel at 4 warps: thread t loads B's vector t and C's vector t; the wide
// kernel at 4 warps: B's vectors on threads 0-63, C's on 64-127).
template <typename Tr, int kSteps>
struct BcRows {
  using T = typename Tr::T;
  static_assert((!Tr::kVarB || IsSame<typename Tr::TB, T>::value) && (!Tr::kVarC || IsSame<typename Tr::TC, T>::value),
                "a variable B or C of u's 16-bit type");
  static constexpr int N = Tr::kDstate;
  static constexpr int kVecs = N * kSteps / 8;  // of one tensor
  static constexpr int kAll = Tr::kNvar * kVecs;
  static constexpr int kPer = (kAll + Tr::kThreads - 1) / Tr::kThreads;
  // Where a tensor's vectors fill whole rounds of the block's threads, a round's tensor is a constant.
  static constexpr bool kWhole = kVecs % Tr::kThreads == 0;
  uint4 v[kPer > 0 ? kPer : 1];
  // The vector of round k of this thread: its tensor (0: the first variable one) and index in it.
  static __device__ __forceinline__ int slot(int k, int e) { return kWhole ? k * Tr::kThreads / kVecs : e / kVecs; }
  static __device__ __forceinline__ int index(int k, int e) { return e - slot(k, e) * kVecs; }
  // B, C: the block's group's rows (dstate seqlen elements each: 32-bit offsets, see the ops' rules).
  // Vectors past seqlen read the row's last one instead: their steps have dt = 0.
  __device__ __forceinline__ void load(const T* __restrict__ B, const T* __restrict__ C, int seqlen, int t0) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int e = static_cast<int>(threadIdx.x) + k * Tr::kThreads;
      if (kAll % Tr::kThreads == 0 || e < kAll) {
        const int i = index(k, e);
        const T* g = Tr::kVarB && slot(k, e) == 0 ? B : C;
        v[k] = load_raw16(g + ((i % N) * seqlen + min(t0 + i / N * 8, seqlen - 8)));
      }
    }
  }
  __device__ __forceinline__ void stage(float* s) const {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int e = static_cast<int>(threadIdx.x) + k * Tr::kThreads;
      if (kAll % Tr::kThreads == 0 || e < kAll) {
        const int i = index(k, e);
        float* st = s + slot(k, e) * kSteps * N;
        const int n = i % N, tv = i / N * 8;
        const unsigned w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int j = 0; j < 8; ++j) st[(tv + j) * N + n] = half_word_to_float<T>(w[j / 2], j & 1);  // a shift or a mask
      }
    }
  }
};

}  // namespace scan_detail
}  // namespace kspec
