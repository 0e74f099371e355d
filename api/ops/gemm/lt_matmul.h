// One cuBLASLt matmul on a stream: descriptors from an LtGemm (gemm/layout.h), the algorithm from
// cublasLtMatmulAlgoGetHeuristic cached per (sizes, layouts, dtypes, epilogue, pointer alignment,
// device), fp32 accumulation, and kspec's workspace.
#pragma once

#include <cublasLt.h>

#include <cstddef>

#include "gemm/layout.h"
#include "kspec/registry.h"

namespace kspec::gemm {

// cuBLASLt's workspace: 32 MiB is what cuBLAS itself reserves on Hopper; the heuristic is told the size.
constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

struct LtCall {
  LtGemm g;
  DType ab_dtype = DType::f32;  // A and B (and the bias)
  DType d_dtype = DType::f32;   // D (= C when beta != 0) and the GELU aux
  bool tf32 = false;            // fp32 inputs: allow TF32 tensor cores
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  float beta = 0.f;             // D = A·B + beta·D
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;   // bias (forward) or bias gradient (BGRAD epilogues)
  void* aux = nullptr;          // GELU pre-activation (GELU_AUX: written; DGELU: read)
  int64_t aux_ld = 0, aux_batch_stride = 0;
};

// Runs the matmul (nothing for an empty output). Throws Unsupported when cuBLASLt has no algorithm for
// the combination, CudaError when a call fails.
void lt_matmul(const LtCall& c, int device, Stream stream, void* workspace, size_t workspace_bytes);

}  // namespace kspec::gemm
