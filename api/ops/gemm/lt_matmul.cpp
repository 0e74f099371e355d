// cuBLASLt matmul: RAII descriptors per call (a few µs of host time), the heuristic's algorithm cached.
#include "gemm/lt_matmul.h"

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "jit/cublaslt.h"

namespace kspec::gemm {
namespace {

cudaDataType_t lt_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: throw Unsupported(detail::concat("gemm: dtype ", dtype_name(t), " is not supported"));
  }
}

struct Desc {
  cublasLtMatmulDesc_t h = nullptr;
  Desc(cublasComputeType_t compute) { CUBLAS_CHECK(cublasLtMatmulDescCreate(&h, compute, CUDA_R_32F)); }
  ~Desc() { jit::cublaslt().cublasLtMatmulDescDestroy(h); }
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t a, const T& v) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(h, a, &v, sizeof(v)));
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
};

struct Layout {
  cublasLtMatrixLayout_t h = nullptr;
  Layout(cudaDataType_t t, const LtOperand& o, int64_t batch) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&h, t, static_cast<uint64_t>(o.stored_rows),
                                            static_cast<uint64_t>(o.stored_cols), o.ld));
    if (batch > 1) {
      int32_t count = static_cast<int32_t>(batch);
      CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(h, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(h, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &o.batch_stride,
                                                    sizeof(o.batch_stride)));
    }
  }
  ~Layout() { jit::cublaslt().cublasLtMatrixLayoutDestroy(h); }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
};

struct Preference {
  cublasLtMatmulPreference_t h = nullptr;
  explicit Preference(size_t workspace) {
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&h));
    uint64_t ws = workspace;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(h, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  }
  ~Preference() { jit::cublaslt().cublasLtMatmulPreferenceDestroy(h); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
};

int align_of(const void* p) {
  auto a = reinterpret_cast<uintptr_t>(p);
  int al = 256;
  while (al > 1 && a % al) al /= 2;
  return p ? al : 0;
}

std::string algo_key(const LtCall& c, int device, size_t ws) {
  return detail::concat(describe(c.g), "|", dtype_short(c.ab_dtype), dtype_short(c.d_dtype), c.tf32 ? "t" : "",
                        "|e", static_cast<int>(c.epilogue), "|b", c.beta != 0.f, "|al", align_of(c.a), ",",
                        align_of(c.b), ",", align_of(c.d), ",", align_of(c.bias), ",", align_of(c.aux), "|ld",
                        c.aux_ld, ",", c.aux_batch_stride, "|d", device, "|w", ws);
}

}  // namespace

void lt_matmul(const LtCall& c, int device, Stream stream, void* workspace, size_t workspace_bytes) {
  const LtGemm& g = c.g;
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  KSPEC_CHECK_AS(g.k > 0, Unsupported, "gemm: the reduction dim k is 0");
  cublasComputeType_t compute =
      c.ab_dtype == DType::f32 && c.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  Desc desc(compute);
  cublasOperation_t ta = g.a.transpose ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.b.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, ta);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, tb);
  if (c.epilogue != CUBLASLT_EPILOGUE_DEFAULT) desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, c.epilogue);
  if (c.bias) desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, c.bias);
  if (c.aux) {
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, c.aux);
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, c.aux_ld);
    if (g.batch > 1) desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, c.aux_batch_stride);
  }
  cudaDataType_t tab = lt_type(c.ab_dtype), td = lt_type(c.d_dtype);
  Layout la(tab, g.a, g.batch), lb(tab, g.b, g.batch), ld(td, g.d, g.batch);

  static std::mutex mu;
  static std::map<std::string, cublasLtMatmulAlgo_t> algos;
  std::string key = algo_key(c, device, workspace_bytes);
  cublasLtMatmulAlgo_t algo;
  bool have = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = algos.find(key);
    if (it != algos.end()) {
      algo = it->second;
      have = true;
    }
  }
  cublasLtHandle_t handle = jit::cublaslt_handle(device);
  if (!have) {
    Preference pref(workspace_bytes);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    // NOT_SUPPORTED (seen on the H100 for the BGRADB epilogue with one row, m = 1 or n = 1) means the
    // same as finding nothing: Unsupported, which callers with a plainer fallback catch.
    cublasStatus_t st = jit::cublaslt().cublasLtMatmulAlgoGetHeuristic(handle, desc.h, la.h, lb.h, ld.h, ld.h, pref.h,
                                                                        1, &result, &found);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) found = 0;
    else if (st != CUBLAS_STATUS_SUCCESS)
      jit::throw_cublas_error(st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
    KSPEC_CHECK_AS(found > 0, Unsupported, "gemm: cuBLASLt has no algorithm for ", describe(g), " (",
                   dtype_name(c.ab_dtype), " -> ", dtype_name(c.d_dtype), ", epilogue ", static_cast<int>(c.epilogue),
                   ")");
    algo = result.algo;
    std::lock_guard<std::mutex> lock(mu);
    algos.emplace(key, algo);
  }
  float alpha = 1.f, beta = c.beta;
  CUBLAS_CHECK(cublasLtMatmul(handle, desc.h, &alpha, c.a, la.h, c.b, lb.h, &beta, c.d, ld.h, c.d, ld.h, &algo,
                              workspace, workspace_bytes, reinterpret_cast<cudaStream_t>(stream)));
}

}  // namespace kspec::gemm
