// The AdamW kernels' parameters: one plain struct, filled by the host (api/ops/adamw/op.cpp) and passed
// by value to the three kernels (adamw.cuh), and the device table's row types the host builds. Compiled
// by the host compiler and by NVRTC, so: no CUDA types, no standard headers. The layout assertions hold
// in both compilers (each compiles this header), so a host table the kernels misread does not build.
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

// Pass 1 (grad norm) reads tensors, chunks and writes partial; pass 2 (finalize) reduces partial into
// result and the optional found_inf / grad_norm; pass 3 (update) reads tensors, chunks, s, result.
struct AdamwParams {
  const AdamwTensor* tensors;
  const AdamwChunk* chunks;
  double* partial;           // one per chunk
  int n_chunks;
  const float* grad_scale;   // null: 1
  float* result;             // [2]: gradient multiplier, skip flag (from pass 2); null when only pass 3 runs
  float* found_inf;          // optional
  float* grad_norm;          // optional
  AdamwScalars s;
};

static_assert(sizeof(AdamwTensor) == 56 && KSPEC_OFFSETOF(AdamwTensor, numel) == 48 &&
                  sizeof(AdamwChunk) == 16 && KSPEC_OFFSETOF(AdamwChunk, start) == 8 &&
                  sizeof(AdamwScalars) == 32 && KSPEC_OFFSETOF(AdamwScalars, max_norm) == 28,
              "the device table's layout: the host writes it byte for byte");
static_assert(sizeof(AdamwParams) == 96 && KSPEC_OFFSETOF(AdamwParams, n_chunks) == 24 &&
                  KSPEC_OFFSETOF(AdamwParams, grad_scale) == 32 && KSPEC_OFFSETOF(AdamwParams, s) == 64,
              "AdamwParams: the same layout for the host and NVRTC");

}  // namespace kspec
