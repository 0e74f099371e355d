// y [n_in, batch] = x [batch, n_in] transposed, both contiguous (difflogic.transpose): how a row-major
// activation (what a plain model hands a LogicLayer) becomes the feature-major layout the layer's batch-tiled
// kernels read, and how dx goes back. A row-major layer gathers x[s, a_g] at random within a row (a 32-byte
// sector per 4-byte element through L2); one transpose moves x twice at streaming speed instead.
// One kTile x kTile tile per block and step, through shared memory: the block reads kTile rows of x along
// the row and writes kTile rows of y along the row, so a warp moves 32 consecutive elements per access both
// ways (128 bytes in fp32). Each thread issues its kTile * kTile / kThreads loads before it stores any to
// shared memory (16 at 64 x 64 and 256 threads: the bytes in flight an H100's DRAM needs). The tile is kept
// as floats (exact for every activation dtype) with one padding column, so the transposed reads of a warp
// fall in 32 different banks. Tiles run in row-major order of x's tile grid: consecutive blocks read
// neighbouring tiles of the same rows.
#pragma once

#include "common/dtype.cuh"
#include "difflogic/params.h"

namespace kspec {

template <typename T, int kThreads, int kTile>
__global__ void __launch_bounds__(kThreads) difflogic_transpose_kernel(const DiffLogicParams p) {
  static_assert(kTile % 32 == 0 && kThreads % 32 == 0 && kTile % (kThreads / 32) == 0, "whole warps per tile row");
  constexpr int kWarps = kThreads / 32, kCols = kTile / 32, kRows = kTile / kWarps;
  __shared__ float tile[kTile][kTile + 1];
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const long long rows = p.batch, cols = p.n_in;
  const long long tiles_c = (cols + kTile - 1) / kTile, tiles = (rows + kTile - 1) / kTile * tiles_c;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const long long r0 = t / tiles_c * kTile, c0 = t % tiles_c * kTile;
    float v[kRows][kCols];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int h = 0; h < kCols; ++h) {
        const long long r = r0 + warp + i * kWarps, c = c0 + lane + h * 32;
        v[i][h] = r < rows && c < cols ? to_float(x[r * cols + c]) : 0.0f;
      }
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int h = 0; h < kCols; ++h) tile[warp + i * kWarps][lane + h * 32] = v[i][h];
    __syncthreads();
    // y's row c0 + warp + i kWarps, columns r0 + lane + h 32: x's column read down the tile.
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int h = 0; h < kCols; ++h) {
        const long long c = c0 + warp + i * kWarps, r = r0 + lane + h * 32;
        if (c < cols && r < rows) y[c * rows + r] = from_float<T>(tile[lane + h * 32][warp + i * kWarps]);
      }
    __syncthreads();  // the tile is refilled by the next step
  }
}

}  // namespace kspec
