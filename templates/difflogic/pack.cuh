// difflogic.pack / difflogic.unpack (api/ops/difflogic/reference.h: difflogic_binarize, difflogic_pack_ref,
// difflogic_unpack_ref are the spec): activations [batch, n_in] <-> words [n_in, words], kWidth = 32 or 64
// samples a word, sample s in bit s mod kWidth of word s / kWidth. Packing sets a bit where the activation
// is > 0.5 (exact for {0, 1}; NaN gives 0); padding bits (samples >= batch) are zero.
//   difflogic_pack_kernel    one thread per word, columns fastest: for each of its kWidth samples the
//                            warp reads 32 consecutive activations of one row (coalesced).
//   difflogic_unpack_kernel  one thread per (sample, column), columns fastest (coalesced writes).
#pragma once

#include "common/dtype.cuh"
#include "difflogic/params.h"
#include "difflogic/word.cuh"

namespace kspec {

template <typename T, int kWidth, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_pack_kernel(const DiffLogicParams p) {
  using W = typename DiffLogicWord<kWidth>::type;
  const T* x = static_cast<const T*>(p.x);
  W* words = static_cast<W*>(p.y);
  const long long total = p.words * p.n_in;
  for (long long e = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    const long long q = e / p.n_in, j = e - q * p.n_in, first = q * kWidth;
    const int valid = p.batch - first < kWidth ? static_cast<int>(p.batch - first) : kWidth;
    W r = 0;
    for (int t = 0; t < valid; ++t)
      if (to_float(x[(first + t) * p.n_in + j]) > 0.5f) r |= W(1) << t;
    words[j * p.words + q] = r;
  }
}

template <typename T, int kWidth, int kThreads>
__global__ void __launch_bounds__(kThreads) difflogic_unpack_kernel(const DiffLogicParams p) {
  using W = typename DiffLogicWord<kWidth>::type;
  const W* words = static_cast<const W*>(p.x);
  T* x = static_cast<T*>(p.y);
  const long long total = p.batch * p.n_in;
  for (long long e = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    const long long s = e / p.n_in, j = e - s * p.n_in, q = s / kWidth;
    const W w = words[j * p.words + q];
    x[e] = from_float<T>(static_cast<float>((w >> (s - q * kWidth)) & W(1)));
  }
}

}  // namespace kspec
