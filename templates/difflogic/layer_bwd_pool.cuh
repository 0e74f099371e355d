// difflogic layer backward, feature-major x and dout, batch-tiled, with a block's inputs handed out on demand
// (difflogic.layer.bwd, config pool > 0). The tiled backward (layer.cuh) gives each lane group one input of
// the block, so a block lasts as long as its input with the most readers: with random wiring an input has
// Poisson(2) readers, and the slowest of a block's 8 inputs (lanes 32, 256 threads) has ~4-5 where the mean
// is 2: ~half of the block's warp-time idles, which is how the H100 ran it (run 28, ncu, 16384 x 16000 ->
// 16000 fp32: 1.97 ms, 49% of DRAM peak, 48% occupancy, every warp slot held). Here a block owns kPool
// consecutive inputs and each lane group takes the next one from a shared counter when it is done, so the
// groups finish within one input of each other. Which group computes an input changes nothing it sums (dx in
// the CSR's order within the lanes, each gate's S_uv by the same shuffle tree as the tiled kernel), so the
// bits are the tiled kernel's (asserted by the tests). kDxRowMajor: the kPool inputs x the tile's samples of
// dx go through shared memory and out along dx's rows (128 bytes of fp32 a row at kPool 32), as the tiled
// kernel does for its inputs.
#pragma once

#include "difflogic/layer.cuh"

namespace kspec {

// Grid (ceil(n_in / kPool), tiles). Registers (sm_90, lanes 32, row-major dx): fp32 61 at ahead 0 (4 blocks of
// 256 threads an SM, as the tiled kernel's), 72 at ahead 1 (3); halves 85-96. Launch bounds of one block an SM:
// without them ptxas held the halves' variants to 80 registers and spilled 2-10 bytes.
template <typename T, int kThreads, int kLanes, int kPool, bool kDxRowMajor, bool kAhead>
__global__ void __launch_bounds__(kThreads, 1) difflogic_bwd_pool_kernel(const DiffLogicParams p) {
  static_assert(kLanes >= 1 && kLanes <= kWarpSize && (kLanes & (kLanes - 1)) == 0, "lanes: a power of two <= 32");
  static_assert(kThreads % kWarpSize == 0, "whole warps");
  static_assert(kPool >= kThreads / kLanes, "at least one input a lane group");
  using Tile = DiffLogicTile<T, kLanes>;
  constexpr int kV = Tile::kVec;
  // kDxRowMajor's staging: [input of the pool][sample of the tile], one padding column (conflict-free reads
  // down a column); a one-float dummy otherwise.
  __shared__ float staged[kDxRowMajor ? kPool : 1][kDxRowMajor ? Tile::kSamples + 1 : 1];
  __shared__ int next_input;  // the pool's next input not yet taken
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  T* dx = static_cast<T*>(p.dx);
  const long long j0 = blockIdx.x * static_cast<long long>(kPool);
  const int lane = threadIdx.x % kLanes;
  const unsigned group = difflogic_group_mask<kLanes>();
  // Feature-major dx shares x's alignment rule; row-major dx is written element by element.
  const bool vec = difflogic_rows_aligned<T>(p.batch, x, dout, kDxRowMajor ? nullptr : dx);
  for (long long tile = blockIdx.y; tile * Tile::kSamples < p.batch; tile += gridDim.y) {
    const long long s0 = tile * Tile::kSamples;
    if (threadIdx.x == 0) next_input = 0;
    __syncthreads();
    for (;;) {
      int jj = 0;
      if (lane == 0) jj = atomicAdd(&next_input, 1);
      jj = __shfl_sync(group, jj, 0, kLanes);  // the group's lane 0 took it for the group
      if (jj >= kPool) break;
      const long long j = j0 + jj;
      if (j < p.n_in) {  // the last pool's inputs past n_in: taken, nothing to do
        float sum[kV];
        difflogic_bwd_input_tile<T, kLanes, kAhead>(p, true, j, p.offsets[j], p.offsets[j + 1], s0, tile, lane,
                                                    group, vec, sum);
        if (kDxRowMajor) {
#pragma unroll
          for (int k = 0; k < kV; ++k) staged[jj][Tile::sample(vec, 0, lane, k)] = sum[k];
        } else {
          Tile::store(dx + j * p.batch, vec, s0, lane, p.batch, sum);
        }
      }
    }
    __syncthreads();  // every input of the pool done (and every group past the counter before it is reset)
    if (kDxRowMajor) {
      // Element e of the pool's tile: sample e / kPool, input e % kPool (consecutive threads, consecutive
      // inputs of one dx row). Not unrolled: the 16 to 32 stores' addresses, computed ahead, took 15-25 registers.
#pragma unroll 1
      for (int e = threadIdx.x; e < kPool * Tile::kSamples; e += kThreads) {
        const long long s = s0 + e / kPool, j = j0 + e % kPool;
        if (s < p.batch && j < p.n_in) dx[s * p.n_in + j] = from_float<T>(staged[e % kPool][e / kPool]);
      }
      __syncthreads();  // staged is refilled by the next tile
    }
  }
}

}  // namespace kspec
