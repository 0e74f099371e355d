// Sum reductions for NVRTC kernels: across a warp, and across a "row group" of kThreadsPerRow
// consecutive threads of a 1-D block (several row groups share a block in the row-wise kernels).
// Every reduction here is a xor butterfly, so all threads of a group end with bit-identical totals.
#pragma once

namespace kspec {

constexpr int kWarpSize = 32;

// Shuffle mask for a block of kThreads threads: a block smaller than a warp has only its first
// kThreads lanes, and naming absent lanes in the mask is undefined behaviour.
template <int kThreads>
struct WarpMask {
  static constexpr unsigned value = kThreads >= kWarpSize ? 0xffffffffu : ((1u << kThreads) - 1u);
};

// Sums each of the kN values over aligned segments of kWidth lanes (kWidth a power of two <= 32).
// Every lane named in kMask must call this.
template <int kWidth, int kN, unsigned kMask = 0xffffffffu>
__device__ __forceinline__ void warp_reduce_sum(float (&vals)[kN]) {
  static_assert(kWidth >= 1 && kWidth <= kWarpSize && (kWidth & (kWidth - 1)) == 0,
                "warp reduce width must be a power of two <= 32");
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int n = 0; n < kN; ++n) vals[n] += __shfl_xor_sync(kMask, vals[n], offset, kWidth);
  }
}

template <int kWidth = kWarpSize>
__device__ __forceinline__ float warp_reduce_sum(float v) {
  float vals[1] = {v};
  warp_reduce_sum<kWidth, 1>(vals);
  return vals[0];
}

// A transposing reduction: sums each of V values over the P lanes {lane ^ (kStride * j), j < P} (P and
// kStride powers of two, P * kStride <= 32), halving the values a lane holds at each level: a lane keeps
// one half, sends the other to its partner and adds what comes back. V values cost V/2 + V/4 + ...
// shuffles instead of V * log2(P). Afterwards, with p = (lane / kStride) % P the lane's position and
// kOut = max(V / P, 1):
//   P <= V: v[0 .. kOut) hold the sums of the original v[p * kOut + j];
//   P > V:  v[0] holds the sum of the original v[p / (P / V)], alike in the P / V lanes that share it.
// Returns the original index of v[0] and sets *writer for one lane per distinct sum (all when P <= V).
// Every lane of the warp must call it (full shuffle mask).
template <int V, int P, int kStride>
struct TransposeReduce {
  static_assert(V >= 1 && (V & (V - 1)) == 0, "V: a power of two");
  static_assert(P >= 1 && (P & (P - 1)) == 0 && kStride >= 1 && P * kStride <= kWarpSize, "P lanes of stride kStride");
  static constexpr int kOut = V >= P ? V / P : 1;

  template <int W, int O>
  static __device__ __forceinline__ void level(float (&v)[V], int lane, int& blk) {
    if constexpr (O >= 1) {
      const int off = O * kStride;
      const bool bit = (lane & off) != 0;
      if constexpr (W > 1) {
        constexpr int H = W / 2;
#pragma unroll
        for (int j = 0; j < H; ++j) {
          const float send = bit ? v[j] : v[j + H];
          const float keep = bit ? v[j + H] : v[j];
          v[j] = keep + __shfl_xor_sync(0xffffffffu, send, off);
        }
        blk = 2 * blk + (bit ? 1 : 0);
        level<H, O / 2>(v, lane, blk);
      } else {
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], off);
        level<1, O / 2>(v, lane, blk);
      }
    }
  }

  static __device__ __forceinline__ int run(float (&v)[V], int lane, bool* writer) {
    int blk = 0;
    level<V, P / 2>(v, lane, blk);
    const int p = (lane / kStride) % P;
    *writer = V >= P || p % (P / (V >= P ? P : V)) == 0;
    return blk * kOut;
  }
};

// Shared-memory floats row_group_reduce_sum needs for kN values (0: shuffles alone suffice).
template <int kThreads, int kThreadsPerRow, int kN>
struct RowReduceScratch {
  static constexpr int value = kThreadsPerRow > kWarpSize ? (kThreads / kWarpSize) * kN : 0;
};

// Sums each of the kN values over the row group of the calling thread; afterwards every thread of
// the group holds the group's totals. The block must be 1-D with blockDim.x == kThreads, and every
// thread of the block must call this (it may contain __syncthreads()), valid row or not.
// scratch: RowReduceScratch<...>::value floats of shared memory (unused, may be null, when
// kThreadsPerRow <= 32). The function ends with a barrier, so scratch may be reused right away.
template <int kThreads, int kThreadsPerRow, int kN>
__device__ __forceinline__ void row_group_reduce_sum(float (&vals)[kN], float* scratch) {
  static_assert(kThreadsPerRow >= 1 && kThreadsPerRow <= 1024 &&
                    (kThreadsPerRow & (kThreadsPerRow - 1)) == 0,
                "kThreadsPerRow must be a power of two in 1..1024");
  static_assert(kThreads % kThreadsPerRow == 0 && kThreads <= 1024,
                "the block must hold whole row groups");
  if constexpr (kThreadsPerRow <= kWarpSize) {
    warp_reduce_sum<kThreadsPerRow, kN, WarpMask<kThreads>::value>(vals);
  } else {
    // A group spans kWarpsPerRow whole warps: reduce inside each warp, publish one partial per warp,
    // then every warp re-reduces its group's partials. Lane l reads partial (l % kWarpsPerRow), so each
    // kWarpsPerRow-lane segment holds the full set and the butterfly leaves the total in every lane.
    constexpr int kWarpsPerRow = kThreadsPerRow / kWarpSize;
    const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
    const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
    warp_reduce_sum<kWarpSize, kN>(vals);
    if (lane == 0) {
#pragma unroll
      for (int n = 0; n < kN; ++n) scratch[warp * kN + n] = vals[n];
    }
    __syncthreads();
    const int src = (warp / kWarpsPerRow) * kWarpsPerRow + lane % kWarpsPerRow;
#pragma unroll
    for (int n = 0; n < kN; ++n) vals[n] = scratch[src * kN + n];
    warp_reduce_sum<kWarpsPerRow, kN>(vals);
    __syncthreads();
  }
}

}  // namespace kspec
