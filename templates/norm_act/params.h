// The norm_act kernels' parameters: one plain struct, filled by the host (api/ops/norm_act/op.cpp) and
// passed by value to every kernel of norm_act.cuh, each reading its own fields. Compiled by the host
// compiler and by NVRTC, so: no CUDA types (element pointers are void*, typed by the kernel's template
// arguments), no standard headers.
#pragma once

#include "common/layout.h"

namespace kspec {

struct NormActParams {
  const void* x;              // [rows, hidden] T, rows x_row_stride apart
  const void* weight;         // [hidden] TW
  const void* bias;           // [hidden] TW or null
  void* y;                    // forward: [rows, hidden] T
  float* mean;                // [rows]: written by the forward (LayerNorm), read by the backward
  float* rstd;                // [rows]
  const void* dy;             // backward: [rows, hidden] T
  void* dx;                   // [rows, hidden] T
  float* dw_partial;          // [parts, hidden] partial sums of dweight (and dbias), reduced in order
  float* db_partial;
  void* dweight;              // [hidden] TW
  void* dbias;                // [hidden] TW or null
  long long x_row_stride, y_row_stride, dy_row_stride, dx_row_stride;
  int rows;
  int rows_per_part;          // streamed backward: rows per dweight/dbias partial
  int num_partials;           // partial rows the reduction adds
  float eps;
};

static_assert(KSPEC_OFFSETOF(NormActParams, dbias) == 88 && KSPEC_OFFSETOF(NormActParams, x_row_stride) == 96 &&
                  KSPEC_OFFSETOF(NormActParams, rows) == 128 && KSPEC_OFFSETOF(NormActParams, eps) == 140 &&
                  sizeof(NormActParams) == 144,
              "NormActParams: the same layout for the host and NVRTC");

}  // namespace kspec
