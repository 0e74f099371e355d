// The parameters of the GEMM's elementwise kernels around cuBLASLt (gemm_bias_act.cuh, gemm_fill_bias.cuh,
// gemm_act_grad.cuh): one plain struct, filled by the host (api/ops/gemm/op.cpp) and passed by value,
// each kernel reading its own fields. Compiled by the host compiler and by NVRTC, so: no CUDA types
// (element pointers are void*, typed by the kernel's template argument), no standard headers.
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

static_assert(KSPEC_OFFSETOF(GemmEpilogueParams, rows) == 48 && sizeof(GemmEpilogueParams) == 80,
              "GemmEpilogueParams: the same layout for the host and NVRTC");

}  // namespace kspec
