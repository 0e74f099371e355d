// cuBLASLt, loaded at run time with dlopen like the driver (jit/driver.h), so that `import kspec`, NVRTC
// compiles and every op that does not call cuBLASLt work on a machine without it. One handle per device.
// Error contract: cublaslt() throws Unsupported when libcublasLt.so.13 cannot be loaded or lacks a
// function; CUBLAS_CHECK throws CudaError naming the call, the status, its name and file:line.
#pragma once

#include <cublasLt.h>

#include <string>

#include "kspec/error.h"

namespace kspec::jit {

#define KSPEC_CUBLASLT_FUNCS(X)                                                                       \
  X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtGetStatusName) X(cublasLtGetStatusString)             \
  X(cublasLtGetVersion) X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy)                      \
  X(cublasLtMatmulDescSetAttribute) X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy)      \
  X(cublasLtMatrixLayoutSetAttribute) X(cublasLtMatmulPreferenceCreate)                               \
  X(cublasLtMatmulPreferenceDestroy) X(cublasLtMatmulPreferenceSetAttribute)                          \
  X(cublasLtMatmulAlgoGetHeuristic) X(cublasLtMatmul) X(cublasLtMatmulAlgoInit) X(cublasLtMatmulAlgoCheck)    \
  X(cublasLtMatmulAlgoConfigSetAttribute) X(cublasLtMatmulAlgoConfigGetAttribute)

struct CublasLt {
#define KSPEC_DECLARE_LT_PFN(name) decltype(&::name) name = nullptr;
  KSPEC_CUBLASLT_FUNCS(KSPEC_DECLARE_LT_PFN)
#undef KSPEC_DECLARE_LT_PFN
};

// Loads libcublasLt.so.13 once; throws Unsupported (with the dlopen error) if it is missing.
const CublasLt& cublaslt();
// True when the library loads. Never throws.
bool cublaslt_available();
// The handle of a device, created once in its primary context and kept for the process's lifetime.
cublasLtHandle_t cublaslt_handle(int device);

[[noreturn]] void throw_cublas_error(cublasStatus_t s, const char* call, const char* file, int line);

}  // namespace kspec::jit

#define CUBLAS_CHECK(call)                                                                \
  do {                                                                                    \
    cublasStatus_t kspec_cublas_status_ = ::kspec::jit::cublaslt().call;                  \
    if (kspec_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                    \
      ::kspec::jit::throw_cublas_error(kspec_cublas_status_, #call, __FILE__, __LINE__);  \
  } while (0)
