// The argument of every difflogic kernel (layer.cuh), one plain struct compiled by both the host compiler
// (api/ops/difflogic/op.cpp fills it) and NVRTC, so the two sides cannot disagree on its layout. Passed by
// value. x, y, dout, dx: [batch, width] row-major in the activation dtype (packed.cuh: x, y are words
// [width, words], 32 or 64 samples a word; bits.cuh: the tensors its comments name); logits, dlogits:
// [n_out, 16] fp32; wires and the consumers CSR int32.
#pragma once

namespace kspec {

struct DiffLogicParams {
  const void* x;           // [batch, n_in]
  const float* logits;     // [n_out, 16]
  const int *a, *b;        // [n_out] wires in [0, n_in)
  const int* offsets;      // [n_in + 1]: input j's readers are entries[offsets[j] .. offsets[j + 1])
  const int* entries;      // [2 n_out]: 2 g + side, ascending per input
  const void* dout;        // [batch, n_out] (backward)
  float* tables;           // [n_out, 4] workspace: T00, T01, T10, T11 per gate, made once per call
  void* y;                 // [batch, n_out] (forward)
  void* dx;                // [batch, n_in] (backward)
  float* dlogits;          // [n_out, 16] (backward)
  long long batch, n_in, n_out;
  long long words;         // packed: ceil(batch / w) words per row
  long long groups;        // GroupSum: k groups of n_in / k consecutive columns (rows when packed)
  float grad_factor;
  float tau;               // GroupSum: sums / tau
  unsigned long long seed; // Gumbel noise: the Philox key (philox.cuh)
  int gumbel;              // layer: 1 adds Gumbel noise of `seed` to the logits (forward and backward)
};

}  // namespace kspec
