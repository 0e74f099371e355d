// The device table's row types and the per-step scalars of the AdamW kernels (adamw.cuh), which the host
// (api/ops/adamw/op.cpp) writes byte for byte. Compiled by the host compiler and by NVRTC, so: no CUDA
// types, no standard headers; the layout assertions hold in both (each compiles this header), so a host
// table the kernels would misread does not build. The kernels keep their argument lists: taking one
// parameter struct (in any field order), adamw_update_kernel<float, float, false, false, false, 256, 4, *>
// spilled 24 B on sm_90a (NVRTC 13.0; 52 registers and no spill with the arguments).
#pragma once

#include "common/layout.h"

namespace kspec {

// One parameter tensor of the device table (pointers may be null where the list is absent).
struct AdamwTensor {
  void* param;             // TP
  const void* grad;        // TG
  float* exp_avg;
  float* exp_avg_sq;
  float* master;           // fp32 copy of a bf16/fp16 param (kMaster)
  float* max_exp_avg_sq;   // amsgrad
  long long numel;
};

// Chunk c covers elements [start, min(start + chunk size, numel)) of tensor `tensor`.
struct AdamwChunk {
  int tensor;
  int pad;
  long long start;
};

// Per-step scalars, computed by the host in double and rounded once.
struct AdamwScalars {
  float lr, beta1, beta2, eps, weight_decay;
  float step_size;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float max_norm;               // <= 0: no clipping
};

static_assert(sizeof(AdamwTensor) == 56 && KSPEC_OFFSETOF(AdamwTensor, numel) == 48 &&
                  sizeof(AdamwChunk) == 16 && KSPEC_OFFSETOF(AdamwChunk, start) == 8 &&
                  sizeof(AdamwScalars) == 32 && KSPEC_OFFSETOF(AdamwScalars, max_norm) == 28,
              "the device table's layout: the host writes it byte for byte");

}  // namespace kspec
