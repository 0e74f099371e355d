// The parameters of the GEMM's own kernels around cuBLASLt, filled by the host (api/ops/gemm/op.cpp) and
// passed by value: GemmEpilogueParams for the elementwise ones (gemm_bias_act.cuh, gemm_fill_bias.cuh,
// gemm_act_grad.cuh; each reads its own fields), AugmentParams for gemm_augment.cuh. Compiled by the
// host compiler and by NVRTC, so: no CUDA types (element pointers are void*, typed by the kernel's
// template argument), no standard headers.
#pragma once

#include "common/layout.h"

namespace kspec {

struct GemmEpilogueParams {
  void* y;                  // forward: [rows, cols] T, rows y_row_stride apart
  const void* bias;         // [cols] T or null
  void* aux;                // the pre-activation kept for the backward, or null
  const void* dy;           // backward: [rows, cols] T, rows dy_row_stride apart
  const void* saved;        // the forward's output (relu) or pre-activation (gelu)
  void* dpre;               // [rows, cols] T, contiguous
  long long rows, cols, y_row_stride, dy_row_stride;
};

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

static_assert(KSPEC_OFFSETOF(GemmEpilogueParams, rows) == 48 && sizeof(GemmEpilogueParams) == 80,
              "GemmEpilogueParams: the same layout for the host and NVRTC");
static_assert(sizeof(AugmentOperand) == 64 && KSPEC_OFFSETOF(AugmentParams, w) == 64 &&
                  sizeof(AugmentParams) == 144,
              "AugmentParams: the same layout for the host and NVRTC");

}  // namespace kspec
