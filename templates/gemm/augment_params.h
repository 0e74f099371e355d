// The argument of gemm_augment_kernel (gemm_augment.cuh), one plain struct compiled by both the host
// compiler (api/ops/gemm/op.cpp fills it) and NVRTC, so the two sides cannot disagree on its layout.
#pragma once

namespace kspec {

// One operand's copy: dst is rows x kp, contiguous, of the GEMM's element type. Row r of src is batch
// r / rows_per_batch, row r % rows_per_batch, at batch_stride, row_stride and col_stride (elements).
// Column k of dst is last[r % rows_per_batch] (the bias, on the weight's side) or 1 (last == nullptr, on
// x's side); columns past k are 0.
struct AugmentOperand {
  void* dst;
  const void* src;
  const void* last;
  long long rows, rows_per_batch, batch_stride, row_stride, col_stride;
};

struct AugmentParams {
  AugmentOperand x, w;  // x' = [x, 1, 0…] then W' = [W, b, 0…]
  long long k, kp;      // K, and K' (K + 1 rounded up to 8)
};

}  // namespace kspec
