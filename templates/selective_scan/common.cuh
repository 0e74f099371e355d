// What the selective scan's algorithms share (warp_scan.cuh, sequential.cuh, tile.cuh): the full
// warp mask and the stride of the forward's saved states for the backward.
#pragma once

#include "common/dtype.cuh"
#include "common/math.cuh"
#include "common/reduce.cuh"

namespace kspec {

namespace scan_detail {

constexpr unsigned kFull = 0xffffffffu;

// The forward's states for the backward (training): `states` [batch, dim, ceil(seqlen / 16), dstate]
// fp32 holds the state entering steps 0, 16, 32, ... (h0 or zeros first). Every forward kernel writes
// it when given; every backward reads it when given, in place of its own forward pass (the chunks and
// tiles of the backward are whole multiples of 16 steps).
constexpr int kStateStride = 16;
__device__ __forceinline__ int nstates_of(int seqlen) { return (seqlen + kStateStride - 1) / kStateStride; }

}  // namespace scan_detail

}  // namespace kspec
