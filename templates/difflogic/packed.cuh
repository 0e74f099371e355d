// difflogic.packed.fwd: one hard layer on bit-packed samples (api/ops/difflogic/reference.h:
// difflogic_packed_fwd_ref is the spec). Sample s is bit s mod kWidth of word s / kWidth; a gate running
// op i is (f00 & ~A & ~B) | (f01 & ~A & B) | (f10 & A & ~B) | (f11 & A & B), f_uv all ones where truth
// table i is 1, with i the argmax of the gate's logits (ties to the lower index). Padding bits (samples
// >= batch) are cleared, so every output is again a canonical packing. First version: one thread per
// (gate, word), words fastest (coalesced rows of A, B and the output). A wire outside [0, n_in) is never
// followed: the gate's words stay zero.
//   difflogic_packed_fwd_rows_kernel (tuning axis vec = 1): a thread per gate and 128 bits of its row (4
// words at w = 32, 2 at w = 64, kThreads words apart: every load coalesced), gates along grid y. The flat
// kernel's per-word cost (a 64-bit division, the argmax of 16 logits) is paid per 32 samples at w = 32 but
// per 64 at w = 64, which made w = 32 slower per sample (H100, run 18: 2^18 samples, 6 x 64k layers: 42.9 ms
// against 32.7); here both pay it once per 128 samples.
#pragma once

#include "difflogic/params.h"
#include "difflogic/word.cuh"

namespace kspec {

template <int kWidth, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_packed_fwd_kernel(const DiffLogicParams p) {
  using W = typename DiffLogicWord<kWidth>::type;
  const W* in = static_cast<const W*>(p.x);
  W* out = static_cast<W*>(p.y);
  const long long total = p.n_out * p.words;
  for (long long e = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    const long long g = e / p.words, q = e - g * p.words;
    const int wa = p.a[g], wb = p.b[g];
    W r = 0;
    if (static_cast<unsigned long long>(static_cast<long long>(wa)) < static_cast<unsigned long long>(p.n_in) &&
        static_cast<unsigned long long>(static_cast<long long>(wb)) < static_cast<unsigned long long>(p.n_in)) {
      const float* l = p.logits + g * 16;
      int op = 0;
#pragma unroll
      for (int i = 1; i < 16; ++i)
        if (l[i] > l[op]) op = i;  // strict: ties stay with the lower index
      const W A = in[wa * p.words + q], B = in[wb * p.words + q];
      const W f00 = (op >> 3) & 1 ? ~W(0) : W(0), f01 = (op >> 2) & 1 ? ~W(0) : W(0),
              f10 = (op >> 1) & 1 ? ~W(0) : W(0), f11 = op & 1 ? ~W(0) : W(0);
      r = (f00 & ~A & ~B) | (f01 & ~A & B) | (f10 & A & ~B) | (f11 & A & B);
      const long long valid = p.batch - q * kWidth;  // samples in this word
      if (valid < kWidth) r &= valid > 0 ? (W(1) << valid) - W(1) : W(0);
    }
    out[e] = r;
  }
}

template <int kWidth, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_packed_fwd_rows_kernel(const DiffLogicParams p) {
  using W = typename DiffLogicWord<kWidth>::type;
  constexpr int kVec = 128 / kWidth;
  const W* in = static_cast<const W*>(p.x);
  W* out = static_cast<W*>(p.y);
  const long long q0 = blockIdx.x * static_cast<long long>(kThreads) * kVec + threadIdx.x;
  for (long long g = blockIdx.y; g < p.n_out; g += gridDim.y) {
    const int wa = p.a[g], wb = p.b[g];
    const bool ok = static_cast<unsigned long long>(static_cast<long long>(wa)) < static_cast<unsigned long long>(p.n_in) &&
                    static_cast<unsigned long long>(static_cast<long long>(wb)) < static_cast<unsigned long long>(p.n_in);
    const float* l = p.logits + g * 16;
    int op = 0;
#pragma unroll
    for (int i = 1; i < 16; ++i)
      if (l[i] > l[op]) op = i;  // strict: ties stay with the lower index
    const W f00 = (op >> 3) & 1 ? ~W(0) : W(0), f01 = (op >> 2) & 1 ? ~W(0) : W(0),
            f10 = (op >> 1) & 1 ? ~W(0) : W(0), f11 = op & 1 ? ~W(0) : W(0);
    const W* ra = in + (ok ? wa : 0) * p.words;
    const W* rb = in + (ok ? wb : 0) * p.words;
    W A[kVec], B[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const long long q = q0 + v * kThreads;
      A[v] = q < p.words && ok ? ra[q] : W(0);
      B[v] = q < p.words && ok ? rb[q] : W(0);
    }
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const long long q = q0 + v * kThreads;
      if (q >= p.words) break;
      W r = ok ? (f00 & ~A[v] & ~B[v]) | (f01 & ~A[v] & B[v]) | (f10 & A[v] & ~B[v]) | (f11 & A[v] & B[v]) : W(0);
      const long long valid = p.batch - q * kWidth;  // samples in this word
      if (valid < kWidth) r &= valid > 0 ? (W(1) << valid) - W(1) : W(0);
      out[g * p.words + q] = r;
    }
  }
}

}  // namespace kspec
