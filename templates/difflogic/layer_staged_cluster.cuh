// difflogic layer forward on a row-major x whose row does not fit one block's shared memory (difflogic.layer.fwd,
// layout row_major, config stage 2 or 4: sm_90 and newer). As layer_staged.cuh, but a row is staged across a
// thread-block cluster of kCluster CTAs: CTA `rank` copies the columns [rank slice, (rank + 1) slice) of the
// pass's rows into its shared memory (16-byte coalesced loads where the rows allow), and computes the gates
// [rank share, (rank + 1) share) of those rows, reading x[s, a_g] and x[s, b_g] from the shared memory of the
// CTA that holds the column (distributed shared memory: mapa + ld.shared::cluster; its own through the same
// window). At 64000 fp32 (256 KB a row, no row fits the H100's 227 KB) a cluster of 4 holds 3 rows a pass in
// 64 KB slices and reads x once where the transpose path moved it three times. A cluster barrier after the
// copy makes every slice visible to the cluster; one after the gates keeps a slice until its readers are done.
// Every y element is difflogic_gate of its T and two inputs, as in the other forward kernels, nothing summed
// across threads: the grid cannot change a bit.
#pragma once

#include "common/cluster.cuh"
#include "difflogic/layer.cuh"

namespace kspec {

// Columns a CTA of the cluster holds: n_in / kCluster rounded up to 8 elements, so every slice of a 16-byte
// aligned row starts 16-byte aligned (the host sizes shared memory by the same rule).
template <int kCluster>
__device__ __forceinline__ long long difflogic_cluster_slice(long long n_in) {
  return ((n_in + kCluster - 1) / kCluster + 7) / 8 * 8;
}

// The element at a shared::cluster address as a float. volatile, and a memory clobber: the same addresses are
// read again after the next pass's barrier, and must be neither merged with this pass's reads nor moved across
// the barriers (cluster_sync).
template <typename T>
__device__ __forceinline__ float difflogic_cluster_load(unsigned addr);
template <>
__device__ __forceinline__ float difflogic_cluster_load<float>(unsigned addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
template <>
__device__ __forceinline__ float difflogic_cluster_load<__half>(unsigned addr) {
  unsigned short v;
  asm volatile("ld.shared::cluster.u16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return raw_to_float<__half>(v);
}
template <>
__device__ __forceinline__ float difflogic_cluster_load<__nv_bfloat16>(unsigned addr) {
  unsigned short v;
  asm volatile("ld.shared::cluster.u16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return raw_to_float<__nv_bfloat16>(v);
}

// Grid: clusters of kCluster CTAs along x, a pass of rows each (grid-stride where there are fewer clusters than
// passes). The host launches a cluster per pass rather than the clusters resident at once, as the one-block
// kernel does: how many clusters fit at once depends on the GPCs (4-CTA clusters on the H100: ~32, not 132 / 4),
// and a cluster that waited for a slot while the others each ran a share of the passes would double the time;
// one pass each, the hardware hands the passes to the slots as they free up.
template <typename T, int kThreads, int kCluster, int kGates = 2>
__global__ void __launch_bounds__(kThreads) difflogic_fwd_staged_cluster_kernel(const DiffLogicParams p) {
  static_assert(kCluster >= 2 && kCluster <= 8, "a portable cluster: 2 to 8 CTAs");
  extern __shared__ __align__(16) unsigned char difflogic_cluster_rows[];
  T* xs = reinterpret_cast<T*>(difflogic_cluster_rows);
  unsigned smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  const unsigned rank = cluster_ctarank();
  const long long width = p.n_in, slice = difflogic_cluster_slice<kCluster>(width);
  const long long lo = rank * slice, mine = lo < width ? (width - lo < slice ? width - lo : slice) : 0;
  const long long per_pass = smem_bytes / (slice * static_cast<long long>(sizeof(T)));  // >= 1 by the launch
  const long long share = (p.n_out + kCluster - 1) / kCluster, g_lo = rank * share,
                  g_hi = g_lo + share < p.n_out ? g_lo + share : p.n_out;
  const long long cluster = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const float4* tables = reinterpret_cast<const float4*>(p.tables);
  const unsigned row_stride = static_cast<unsigned>(slice * sizeof(T));  // bytes between staged rows
  // 16-byte copies where every row (hence every slice) starts 16-byte aligned.
  const bool vec = reinterpret_cast<unsigned long long>(x) % 16 == 0 && width * sizeof(T) % 16 == 0;
  for (long long r0 = cluster * per_pass; r0 < p.batch; r0 += clusters * per_pass) {
    const int rows = static_cast<int>(per_pass < p.batch - r0 ? per_pass : p.batch - r0);
    // Unit i of the copy: row i / per_row, unit i % per_row of this CTA's slice (32-bit: a pass's units fit
    // in shared memory).
    if (vec) {
      const unsigned per_row = static_cast<unsigned>(mine * sizeof(T) / 16), n = rows * per_row;
      const uint4* src = reinterpret_cast<const uint4*>(x + r0 * width + lo);
      const unsigned src_row = static_cast<unsigned>(width * sizeof(T) / 16), dst_row = row_stride / 16;
      uint4* dst = reinterpret_cast<uint4*>(xs);
      for (unsigned i = threadIdx.x; i < n; i += 4 * kThreads) {
        uint4 v[4];  // four loads issued before any store
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const unsigned u = i + k * kThreads, r = u / per_row;
          if (u < n) v[k] = src[static_cast<unsigned long long>(r) * src_row + (u - r * per_row)];
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const unsigned u = i + k * kThreads, r = u / per_row;
          if (u < n) dst[r * dst_row + (u - r * per_row)] = v[k];
        }
      }
    } else {
      const unsigned per_row = static_cast<unsigned>(mine), n = rows * per_row;
      const T* src = x + r0 * width + lo;
      for (unsigned i = threadIdx.x; i < n; i += 4 * kThreads) {
        T v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const unsigned u = i + k * kThreads, r = u / per_row;
          if (u < n) v[k] = src[static_cast<long long>(r) * width + (u - r * per_row)];
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const unsigned u = i + k * kThreads, r = u / per_row;
          if (u < n) xs[r * static_cast<unsigned>(slice) + (u - r * per_row)] = v[k];
        }
      }
    }
    cluster_sync();  // every slice of the pass's rows staged
    for (long long g0 = g_lo + threadIdx.x; g0 < g_hi; g0 += static_cast<long long>(kGates) * kThreads) {
      int wa[kGates], wb[kGates];
      float4 t[kGates];
#pragma unroll
      for (int k = 0; k < kGates; ++k) {
        const long long g = g0 + k * kThreads;
        if (g < g_hi) {
          wa[k] = p.a[g];
          wb[k] = p.b[g];
          t[k] = tables[g];
        }
      }
#pragma unroll
      for (int k = 0; k < kGates; ++k) {
        const long long g = g0 + k * kThreads;
        if (g >= g_hi) break;
        const bool ok = difflogic_wire_ok(wa[k], p.n_in) && difflogic_wire_ok(wb[k], p.n_in);
        const float tk[4] = {t[k].x, t[k].y, t[k].z, t[k].w};
        // Row 0's element of each wire in the shared window of the CTA holding its column; row r is r
        // row_stride bytes on.
        unsigned at_a = 0, at_b = 0;
        if (ok) {
          const unsigned s = static_cast<unsigned>(slice), ra = static_cast<unsigned>(wa[k]) / s,
                         rb = static_cast<unsigned>(wb[k]) / s;
          at_a = cluster_map(xs + (static_cast<unsigned>(wa[k]) - ra * s), ra);
          at_b = cluster_map(xs + (static_cast<unsigned>(wb[k]) - rb * s), rb);
        }
        T* out = y + r0 * p.n_out + g;
        for (int r = 0; r < rows; ++r) {
          float v = __int_as_float(0x7fc00000);  // NaN for a wire out of range
          if (ok)
            v = difflogic_gate(tk, difflogic_cluster_load<T>(at_a + r * row_stride),
                               difflogic_cluster_load<T>(at_b + r * row_stride));
          out[r * p.n_out] = from_float<T>(v);
        }
      }
    }
    cluster_sync();  // every CTA done reading the slices before any is refilled (or its CTA exits)
  }
}

}  // namespace kspec
