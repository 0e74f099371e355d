// difflogic.packed.fwd: one hard layer on bit-packed samples (api/ops/difflogic/reference.h:
// difflogic_packed_fwd_ref is the spec). Sample s is bit s mod kWidth of word s / kWidth; a gate running
// op i is (f00 & ~A & ~B) | (f01 & ~A & B) | (f10 & A & ~B) | (f11 & A & B), f_uv all ones where truth
// table i is 1, with i the argmax of the gate's logits (ties to the lower index). Padding bits (samples
// >= batch) are cleared, so every output is again a canonical packing. First version: one thread per
// (gate, word), words fastest (coalesced rows of A, B and the output). A wire outside [0, n_in) is never
// followed: the gate's words stay zero.
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

}  // namespace kspec
