// What the selective scan's algorithms share (warp_scan.cuh, sequential.cuh, tile.cuh): the full
// warp mask and the stride of the forward's saved states for the backward.
#pragma once

#include "common/dtype.cuh"
#include "common/math.cuh"
#include "common/reduce.cuh"

namespace kspec {

// The compile-time facts of a problem that every scan kernel specializes on, one type for all of them
// (api/ops/selective_scan/schema.cpp: flags_type):
//   T: u, delta, z, out (and du, ddelta, dz); TB, TC: B and C (the input dtype or float).
//   kVarB/kVarC: B/C is input-dependent [batch, groups, dstate, seqlen] (else fixed [dim, dstate]).
//   kVectors: whole aligned 16-byte vectors along time; what "whole" means is the algorithm's (the warp
//   and sequential kernels' kEven: seqlen a multiple of 512; the tile kernel's kVec: of 8), and every
//   pointer 16-byte aligned.
//   kTimeMajor: u, delta, z, out (du, ddelta, dz, dout) lie as [batch, seqlen, dim] and a variable B/C
//   (dB/dC) as [batch, seqlen, groups, dstate] (layout "bld": seqlen stride dim, channel stride 1); the
//   sequential kernels' element-wise staging only (api/ops/selective_scan: the plan picks them for it).
template <typename T_, typename TB_, typename TC_, int kDstate_, bool kVarB_, bool kVarC_, bool kHasD_,
          bool kHasZ_, bool kHasDeltaBias_, bool kSoftplus_, bool kHasH0_, bool kVectors_, bool kTimeMajor_ = false>
struct ScanFlags {
  using T = T_;
  using TB = TB_;
  using TC = TC_;
  static constexpr int kDstate = kDstate_;
  static constexpr bool kVarB = kVarB_, kVarC = kVarC_, kHasD = kHasD_, kHasZ = kHasZ_;
  static constexpr bool kHasDeltaBias = kHasDeltaBias_, kSoftplus = kSoftplus_, kHasH0 = kHasH0_;
  static constexpr bool kVectors = kVectors_;
  static constexpr bool kTimeMajor = kTimeMajor_;
};

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
