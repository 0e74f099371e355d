// One cuBLASLt matmul on a stream: descriptors from an LtGemm (gemm/layout.h), the algorithm from
// cublasLtMatmulAlgoGetHeuristic (or a tuned one, checked with cublasLtMatmulAlgoCheck) cached per
// (sizes, layouts, dtypes, epilogue, pointer alignment, device, tuned config), fp32 accumulation, and
// kspec's workspace.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <string>
#include <vector>

#include "gemm/layout.h"
#include "kspec/registry.h"

namespace kspec::gemm {

// cuBLASLt's workspace: 32 MiB is what cuBLAS itself reserves on Hopper; the heuristic is told the size.
constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

// A cuBLASLt algorithm as its configuration attributes (what cublasLtMatmulAlgoInit and
// cublasLtMatmulAlgoConfigSetAttribute take), so that a tuned one reads in the tuning database as
// "algo=66,tile=20,stages=..." and is rebuilt for the call's descriptors, not restored as opaque bytes.
struct LtAlgoConfig {
  int64_t algo = -1;       // CUBLASLT_ALGO_CONFIG_ID
  int64_t tile = 0;        // cublasLtMatmulTile_t
  int64_t stages = 0;      // cublasLtMatmulStages_t
  int64_t splitk = 1;      // CUBLASLT_ALGO_CONFIG_SPLITK_NUM
  int64_t reduction = 0;   // cublasLtReductionScheme_t
  int64_t swizzle = 0;     // CTA swizzling, 0 or 1
  int64_t custom = 0;      // the algorithm's custom option
  int64_t inner = 0;       // cublasLtMatmulInnerShape_t
  int64_t cluster = 0;     // cublasLtClusterShape_t
};

// The config names, in order ("algo", "tile", ...), each behind `prefix` ("" or "dx.", "dw." for gemm.bwd).
const std::vector<std::string>& lt_algo_fields();
// Appends the algorithm's fields to a tuning config.
void add_to_config(const LtAlgoConfig& a, const std::string& prefix, Config& out);
// Reads the fields with `prefix` from a config. False (and `why`) when none or only some are there, or a
// value is out of its range; true with *found = false when the config has no field with this prefix
// (the heuristic's choice).
bool algo_from_config(const Config& c, const std::string& prefix, LtAlgoConfig* out, bool* found, std::string* why);

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
  const LtAlgoConfig* algo = nullptr;  // tuned: used when cublasLtMatmulAlgoCheck accepts it; else the heuristic's
};

// Runs the matmul (nothing for an empty output). Throws Unsupported when cuBLASLt has no algorithm for
// the combination, CudaError when a call fails.
void lt_matmul(const LtCall& c, int device, Stream stream, void* workspace, size_t workspace_bytes);

// The heuristic's first `max_count` algorithms for the call (its first is what lt_matmul uses without a
// tuned one), as configs, with the workspace each needs. Empty when cuBLASLt has none.
struct LtCandidate {
  LtAlgoConfig config;
  size_t workspace = 0;
  float waves = 0;
};
std::vector<LtCandidate> lt_candidates(const LtCall& c, int device, size_t workspace_bytes, int max_count);

// Whether a tuned algorithm applies to the call (cublasLtMatmulAlgoCheck on the call's descriptors, and its
// workspace within `workspace_bytes`); `why` says why not. Needs the GPU.
bool lt_algo_applies(const LtCall& c, const LtAlgoConfig& a, int device, size_t workspace_bytes, std::string* why);

}  // namespace kspec::gemm
