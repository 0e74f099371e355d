// difflogic layer forward on a row-major x whose row may not fit one block's shared memory (difflogic.layer.fwd,
// layout row_major, config stage 8, "hybrid"; sm_80 and newer). One block an SM takes one row a pass: it copies
// the row's first `prefix` columns into shared memory (as many as the launch gave it: 58112 fp32 in the H100's
// 227 KB, so 64000 fp32 leaves a tail of 5888 columns, 9%), asks L2 for its next row, then every gate reads an
// input below the prefix from shared memory and one past it straight from global memory: the row was just
// streamed through L2, and the tail (23.5 KB at 64000 fp32) mostly stays in the SM's L1 (the 28 KB the shared
// memory leaves it), because nothing else of the pass allocates there: the gates' records are read with
// L1::no_allocate. The flat kernel instead gathers every input from global memory (a 32-byte sector a 4-byte
// element), the one-block staged kernel needs the whole row in shared memory, and the cluster kernels read 3/4
// of their inputs through distributed shared memory, which ran at ~20% of the staged kernel's rate.
// What bounds it: at one row a pass every gate's record comes from L2 once an output. difflogic_tables_wires
// _kernel makes the records 20 bytes (T as a float4, both wires as uint16 in one word, where n_in <= 65536)
// against the staged kernel's 24; beside x's 4 bytes an output in and y's 4 out that is ~28 bytes of L2 traffic
// an output (tools/bench/NOTES.md, h-dl11, has the model). Wider rows read the int32 wires (24 bytes).
// Every y element is difflogic_gate of its T and two inputs, as in the other forward kernels (equal to theirs up
// to the compiler's FMA contractions), nothing summed across threads: the grid cannot change a bit.
#pragma once

#include "common/mma.cuh"
#include "difflogic/layer.cuh"

namespace kspec {

// The packed wires follow the n_out x 4 tables in the forward's workspace (op.cpp sizes it 5 floats a gate).
__device__ __forceinline__ unsigned* difflogic_packed_wires(const DiffLogicParams& p) {
  return reinterpret_cast<unsigned*>(p.tables + 4 * p.n_out);
}

// Widths whose wires fit 16 bits each.
__device__ __forceinline__ bool difflogic_wires_pack(long long n_in) { return n_in <= 65536; }

// The tables kernel's T, and where the wires pack, a | b << 16 per gate. A gate with a wire outside [0, n_in)
// gets wires 0 (a column every row has) and a NaN table, so its outputs are NaN as in the other kernels.
template <bool kHard, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_tables_wires_kernel(const DiffLogicParams p) {
  unsigned* wires = difflogic_packed_wires(p);
  const bool pack = difflogic_wires_pack(p.n_in);
  for (long long g = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; g < p.n_out;
       g += static_cast<long long>(gridDim.x) * kThreads) {
    float t[4];
    difflogic_table<kHard>(p, g, t);
    const int a = p.a[g], b = p.b[g];
    const bool ok = difflogic_wire_ok(a, p.n_in) && difflogic_wire_ok(b, p.n_in);
#pragma unroll
    for (int uv = 0; uv < 4; ++uv) p.tables[g * 4 + uv] = ok ? t[uv] : __int_as_float(0x7fc00000);
    if (pack) wires[g] = ok ? static_cast<unsigned>(a) | static_cast<unsigned>(b) << 16 : 0u;
  }
}

// Loads that stream past L1 (read once a pass; allocating them would evict the row's tail).
__device__ __forceinline__ unsigned difflogic_ld_stream(const unsigned* p) {
  unsigned v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float4 difflogic_ld_stream(const float4* p) {
  float4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p));
  return v;
}

// The row's first `prefix` columns into shared memory: 16-byte cp.async copies (L2 to shared memory, past L1
// and the registers, all of them in flight at once) where `vec` (the row 16-byte aligned; the launch sizes the
// prefix a multiple of 16 bytes), else element by element. The caller syncs before reading xs.
template <typename T, int kThreads>
__device__ __forceinline__ void difflogic_hybrid_copy(T* xs, const T* row, unsigned prefix, bool vec) {
  if (vec) {
    const unsigned units = prefix * static_cast<unsigned>(sizeof(T)) / 16;
    for (unsigned u = threadIdx.x; u < units; u += kThreads)
      cp_async_16(reinterpret_cast<uint4*>(xs) + u, reinterpret_cast<const uint4*>(row) + u, true);
    cp_async_commit();
    cp_async_wait<0>();
  } else {
    for (unsigned i = threadIdx.x; i < prefix; i += kThreads) xs[i] = row[i];
  }
}

// Gate g's record: its wires (packed, or the int32 ones: a wire out of range becomes one past any column) and T.
__device__ __forceinline__ void difflogic_hybrid_record(const DiffLogicParams& p, long long g, bool pack,
                                                        unsigned& wa, unsigned& wb, float4& t) {
  if (pack) {
    const unsigned w = difflogic_ld_stream(difflogic_packed_wires(p) + g);
    wa = w & 0xffffu;
    wb = w >> 16;
  } else {
    wa = static_cast<unsigned>(p.a[g]);
    wb = static_cast<unsigned>(p.b[g]);
  }
  t = difflogic_ld_stream(reinterpret_cast<const float4*>(p.tables) + g);
}

// Input column w of the pass's row: from the staged prefix, else from global memory (L1, then L2).
template <typename T>
__device__ __forceinline__ float difflogic_hybrid_input(const T* xs, const T* row, unsigned w, unsigned prefix) {
  return to_float(w < prefix ? xs[w] : row[w]);
}

// Columns of a row staged: all, or as many as the launch's shared memory holds (op.cpp sizes it a multiple of
// 16 bytes).
template <typename T>
__device__ __forceinline__ unsigned difflogic_hybrid_prefix_of(long long width) {
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  const long long fit = bytes / sizeof(T);
  return static_cast<unsigned>(width < fit ? width : fit);
}

// Grid: the blocks resident at once (one an SM where the prefix fills shared memory); block b runs rows b,
// b + gridDim.x, ... Gates a thread has in flight at once: kGates, their records loaded together.
template <typename T, int kThreads, int kGates = 4>
__global__ void __launch_bounds__(kThreads) difflogic_fwd_hybrid_kernel(const DiffLogicParams p) {
  extern __shared__ __align__(16) unsigned char difflogic_hybrid_prefix[];
  T* xs = reinterpret_cast<T*>(difflogic_hybrid_prefix);
  const long long width = p.n_in, row_bytes = width * static_cast<long long>(sizeof(T));
  const unsigned prefix = difflogic_hybrid_prefix_of<T>(width);
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const bool pack = difflogic_wires_pack(width);
  const bool vec = reinterpret_cast<unsigned long long>(x) % 16 == 0 && row_bytes % 16 == 0;
  for (long long r = blockIdx.x; r < p.batch; r += gridDim.x) {
    const T* row = x + r * width;
    difflogic_hybrid_copy<T, kThreads>(xs, row, prefix, vec);
    if (r + gridDim.x < p.batch) {  // this block's next row into L2, a 128-byte line a thread (nothing waits on it)
      const char* next = reinterpret_cast<const char*>(row + gridDim.x * width);
      for (long long line = threadIdx.x; line * 128 < row_bytes; line += kThreads)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(next + line * 128));
    }
    __syncthreads();
    T* out = y + r * p.n_out;
    for (long long g0 = threadIdx.x; g0 < p.n_out; g0 += static_cast<long long>(kGates) * kThreads) {
      unsigned wa[kGates], wb[kGates];
      float4 t[kGates];
#pragma unroll
      for (int k = 0; k < kGates; ++k)
        if (g0 + k * kThreads < p.n_out) difflogic_hybrid_record(p, g0 + k * kThreads, pack, wa[k], wb[k], t[k]);
#pragma unroll
      for (int k = 0; k < kGates; ++k) {
        const long long g = g0 + k * kThreads;
        if (g >= p.n_out) break;
        float v = __int_as_float(0x7fc00000);  // NaN for a wire out of range (packed: a NaN table, wires 0)
        if (wa[k] < width && wb[k] < width) {
          const float tk[4] = {t[k].x, t[k].y, t[k].z, t[k].w};
          v = difflogic_gate(tk, difflogic_hybrid_input(xs, row, wa[k], prefix),
                             difflogic_hybrid_input(xs, row, wb[k], prefix));
        }
        out[g] = from_float<T>(v);
      }
    }
    __syncthreads();  // the prefix is refilled by the next pass
  }
}

}  // namespace kspec
