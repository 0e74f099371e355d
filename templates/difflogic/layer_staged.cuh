// difflogic layer forward on a row-major x that reads x once (difflogic.layer.fwd, layout row_major, config
// stage 1; api/ops/difflogic/op.cpp picks the rows a pass and falls back to the flat gather kernel where
// one row does not fit in shared memory).
// The flat row-major kernel gathers x[s, a_g] at random within a row: a 32-byte sector through L2 for each
// 4-byte element, twice an output (3.81 ms at 16384 x 16000 -> 16000 fp32 on the H100, 8x the bytes it
// uses). Here a block copies whole rows of x (consecutive rows of a row-major x are one contiguous run:
// 16-byte loads, coalesced) into shared memory, then every gate of those rows reads its two inputs there
// (random shared reads: a few-way bank conflicts, cheap next to DRAM) and writes y along its rows
// (consecutive threads, consecutive gates). DRAM sees x once and y once. A gate's wires and T (24 bytes,
// from L2) are loaded once a pass and used for every row of it, so a pass stages as many rows as the launch
// gave shared memory for (read from %dynamic_smem_size: 3 rows at 16k fp32 in the H100's 227 KB, 7 in bf16);
// while a pass computes, its block asks L2 for the next pass's rows (prefetch.global.L2), so the copy at the
// top of the next pass waits on L2 rather than DRAM. Every y element is difflogic_gate of its T and two
// inputs, as in the other forward kernels (equal to theirs up to the compiler's FMA contractions), and
// nothing is summed across threads: the grid (the device's multiprocessors) cannot change a bit.
// kXT (layer.fwd's save_xt): the block also writes its staged rows transposed, p.dx = x^T [n_in, batch]
// (the feature-major x the tiled backward reads), from shared memory: one more X of stores beside x and y
// once, where the training path otherwise transposed x in a kernel of its own (2X) before the feature-major
// forward (2X). Each pass writes `rows` consecutive samples of every column (12 bytes at 16k fp32: a third
// of a sector); the blocks resident at once stage neighbouring rows, so L2 completes the sectors before it
// writes them back.
#pragma once

#include "difflogic/layer.cuh"

namespace kspec {

// Gates a thread has in flight at once: their wires and tables are loaded together, one L2 round trip for
// kGates gates instead of one each.
template <typename T, int kThreads, int kGates = 4, bool kXT = false>
__global__ void __launch_bounds__(kThreads) difflogic_fwd_staged_kernel(const DiffLogicParams p) {
  extern __shared__ __align__(16) unsigned char difflogic_staged_rows[];
  T* xs = reinterpret_cast<T*>(difflogic_staged_rows);
  unsigned smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  const long long width = p.n_in, row_bytes = width * static_cast<long long>(sizeof(T));
  const long long per_pass = smem_bytes / row_bytes;  // >= 1: the launch gives at least one row
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const float4* tables = reinterpret_cast<const float4*>(p.tables);
  // 16-byte copies where every row starts 16-byte aligned, else element by element (still coalesced).
  const bool vec = reinterpret_cast<unsigned long long>(x) % 16 == 0 && row_bytes % 16 == 0;
  for (long long r0 = blockIdx.x * per_pass; r0 < p.batch; r0 += gridDim.x * per_pass) {
    const int rows = static_cast<int>(per_pass < p.batch - r0 ? per_pass : p.batch - r0);
    const T* from = x + r0 * width;
    if (vec) {
      const uint4* src = reinterpret_cast<const uint4*>(from);
      uint4* dst = reinterpret_cast<uint4*>(xs);
      const long long n = rows * row_bytes / 16;
      for (long long i = threadIdx.x; i < n; i += 4LL * kThreads) {
        uint4 v[4];  // four loads issued before any store
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (i + k * kThreads < n) v[k] = src[i + k * kThreads];
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (i + k * kThreads < n) dst[i + k * kThreads] = v[k];
      }
    } else {
      const long long n = rows * width;
      for (long long i = threadIdx.x; i < n; i += 4LL * kThreads) {
        T v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (i + k * kThreads < n) v[k] = from[i + k * kThreads];
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (i + k * kThreads < n) xs[i + k * kThreads] = v[k];
      }
    }
    const long long next = r0 + gridDim.x * per_pass;
    if (next < p.batch) {  // this block's next rows into L2 (a hint: nothing waits on it)
      const char* ahead = reinterpret_cast<const char*>(x + next * width);
      const long long bytes = (per_pass < p.batch - next ? per_pass : p.batch - next) * row_bytes;
      for (long long o = threadIdx.x * 128LL; o < bytes; o += 128LL * kThreads)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(ahead + o));
    }
    __syncthreads();
    if (kXT) {  // element e: column e / rows, sample r0 + e % rows (a thread's neighbours: the next samples)
      T* xt = static_cast<T*>(p.dx) + r0;
      // 32-bit: a pass's elements fit in shared memory (under 2^17), and the division is per element.
      const unsigned n = static_cast<unsigned>(rows * width), w = static_cast<unsigned>(width);
      for (unsigned e = threadIdx.x; e < n; e += kThreads) {
        const unsigned j = e / static_cast<unsigned>(rows), r = e - j * static_cast<unsigned>(rows);
        xt[j * p.batch + r] = xs[r * w + j];
      }
    }
    for (long long g0 = threadIdx.x; g0 < p.n_out; g0 += static_cast<long long>(kGates) * kThreads) {
      int wa[kGates], wb[kGates];
      float4 t[kGates];
#pragma unroll
      for (int k = 0; k < kGates; ++k) {
        const long long g = g0 + k * kThreads;
        if (g < p.n_out) {
          wa[k] = p.a[g];
          wb[k] = p.b[g];
          t[k] = tables[g];
        }
      }
#pragma unroll
      for (int k = 0; k < kGates; ++k) {
        const long long g = g0 + k * kThreads;
        if (g >= p.n_out) break;
        const bool ok = difflogic_wire_ok(wa[k], p.n_in) && difflogic_wire_ok(wb[k], p.n_in);
        const float tk[4] = {t[k].x, t[k].y, t[k].z, t[k].w};
        T* out = y + r0 * p.n_out + g;
        for (int r = 0; r < rows; ++r) {
          float v = __int_as_float(0x7fc00000);  // NaN for a wire out of range
          if (ok) {
            const T* row = xs + r * width;
            v = difflogic_gate(tk, to_float(row[wa[k]]), to_float(row[wb[k]]));
          }
          out[r * p.n_out] = from_float<T>(v);
        }
      }
    }
    __syncthreads();  // the rows are refilled by the next pass
  }
}

}  // namespace kspec
