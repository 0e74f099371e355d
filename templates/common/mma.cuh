// Tensor-core building blocks for NVRTC kernels (sm_80+): mma.sync m16n8k16 with fp16/bf16 inputs and
// fp32 accumulators, ldmatrix fragment loads from shared memory, cp.async global-to-shared copies.
// Fragment layouts (PTX ISA, "mma.m16n8k16"), g = lane / 4, c = lane % 4:
//   A 16x16: a0 (row g, cols 2c, 2c+1), a1 (row g+8, same cols), a2 (row g, cols 2c+8, 2c+9), a3 (row g+8, ..)
//   B 16x8:  b0 (k 2c, 2c+1; n g), b1 (k 2c+8, 2c+9; n g)
//   C 16x8:  d0, d1 (row g, cols 2c, 2c+1), d2, d3 (row g+8, cols 2c, 2c+1)
#pragma once

#include "common/dtype.cuh"
#include "common/pack.cuh"

namespace kspec {

// One register of two T scaled by (lo, hi) in fp32 and rounded back to T; the fp32 products are also
// added to `sum` (a row sum of the scaled operand before its rounding).
template <typename T>
__device__ __forceinline__ unsigned scale2(unsigned r, float lo, float hi, float& sum) {
  const T* v = reinterpret_cast<const T*>(&r);
  const float x = to_float(v[0]) * lo, y = to_float(v[1]) * hi;
  sum += x + y;
  return pack2<T>(x, y);
}

// The dot product of a register of two T with (x, y), in fp32.
template <typename T>
__device__ __forceinline__ float dot2(unsigned r, float x, float y) {
  const T* v = reinterpret_cast<const T*>(&r);
  return fmaf(to_float(v[0]), x, to_float(v[1]) * y);
}

// D += A * B, A 16x16 row-major, B 16x8 column-major, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8x8 matrices of 16-bit elements; lanes 8j..8j+7 give the row addresses of matrix j, and r[j] is
// its fragment (lane holds row lane/4, cols 2(lane%4), +1; with .trans, of the transposed matrix).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}

// Lane row addresses for ldmatrix_x4 of a 16x16 A fragment at (m0, k0): frag_a from a row-major [m][k]
// tile (plain load), frag_a_t from a [k][m] tile (transposed load). Strides in elements.
template <typename T>
__device__ __forceinline__ const T* frag_a(const T* base, int stride, int m0, int k0, int lane) {
  return base + (m0 + lane % 8 + 8 * ((lane / 8) % 2)) * stride + k0 + 8 * (lane / 16);
}
template <typename T>
__device__ __forceinline__ const T* frag_a_t(const T* base, int stride, int m0, int k0, int lane) {
  return base + (k0 + lane % 8 + 8 * (lane / 16)) * stride + m0 + 8 * ((lane / 8) % 2);
}

// acc[nt] (16 x 8 each, kNt of them) += A (16x16, registers) * B (16 x 8 kNt) read from shared memory at
// row k0 of B: stored as [n][k] (kTrans false: plain loads) or [k][n] (kTrans true: transposed loads).
template <typename T, int kNt, bool kTrans>
__device__ __forceinline__ void mma_row(float (&acc)[kNt][4], const unsigned (&a)[4], const T* b, int stride, int k0,
                                        int lane) {
  static_assert(kNt % 2 == 0, "pairs of n-tiles");
#pragma unroll
  for (int np = 0; np < kNt / 2; ++np) {
    unsigned r[4];
    if (kTrans)
      ldmatrix_x4_trans(r, b + (k0 + lane % 8 + 8 * ((lane / 8) % 2)) * stride + np * 16 + 8 * (lane / 16));
    else
      ldmatrix_x4(r, b + (np * 16 + lane % 8 + 8 * (lane / 16)) * stride + k0 + 8 * ((lane / 8) % 2));
    mma_16816<T>(acc[2 * np], a, r[0], r[1]);
    mma_16816<T>(acc[2 * np + 1], a, r[2], r[3]);
  }
}

// kNt 16 x 8 accumulator tiles set to zero, and their rows scaled: row g (d0, d1) by `lo`, row g + 8
// (d2, d3) by `hi` (a per-row factor of a 16-row tile).
template <int kNt>
__device__ __forceinline__ void mma_zero(float (&acc)[kNt][4]) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
}
template <int kNt>
__device__ __forceinline__ void mma_scale_rows(float (&acc)[kNt][4], float lo, float hi) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) acc[nt][0] *= lo, acc[nt][1] *= lo, acc[nt][2] *= hi, acc[nt][3] *= hi;
}

// The A fragments of a 16 x 16 step taken from score accumulators (FA2's register reuse): columns
// 16 kk .. 16 kk + 15 of a 16-row C-layout tile, rounded to T.
template <typename T, int kNt>
__device__ __forceinline__ void scores_as_a(unsigned (&a)[4], const float (&sc)[kNt][4], int kk) {
  a[0] = pack2<T>(sc[2 * kk][0], sc[2 * kk][1]);
  a[1] = pack2<T>(sc[2 * kk][2], sc[2 * kk][3]);
  a[2] = pack2<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
  a[3] = pack2<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
}

// 16 bytes from global to shared memory without a register round trip; `valid` false writes zeros
// (the source is not read: src-size 0), which is how tiles past the sequence's end are masked.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace kspec
