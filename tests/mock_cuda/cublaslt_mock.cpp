// A stand-in for libcublasLt beside the mock driver (KSPEC_LIBCUBLASLT=<the mock library>): descriptors
// that are host blocks, a heuristic that offers one algorithm, and matmuls that only count, so that the
// gemm ops' host path runs on a machine without a GPU and its cuBLASLt calls can be counted:
// kspec_mock_lt_matmuls() (cublasLtMatmul) and kspec_mock_lt_setup_calls() (every other call that
// creates, sets or queries something: what a repeated problem should no longer make), and
// kspec_mock_lt_last_bias() (the bias pointer the last matmul's descriptor held: a reused descriptor must
// still carry the call's own).
#include <cublasLt.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace {

std::atomic<long long> g_matmuls{0};
std::atomic<long long> g_setup_calls{0};
std::atomic<const void*> g_last_bias{nullptr};
int g_handle_token;

cublasStatus_t counted() {
  g_setup_calls.fetch_add(1, std::memory_order_relaxed);
  return CUBLAS_STATUS_SUCCESS;
}

template <typename Opaque>
cublasStatus_t create(Opaque** out) {
  *out = static_cast<Opaque*>(std::calloc(1, sizeof(Opaque)));
  return *out ? counted() : CUBLAS_STATUS_ALLOC_FAILED;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) long long kspec_mock_lt_matmuls() { return g_matmuls.load(); }
__attribute__((visibility("default"))) long long kspec_mock_lt_setup_calls() { return g_setup_calls.load(); }
__attribute__((visibility("default"))) const void* kspec_mock_lt_last_bias() { return g_last_bias.load(); }

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  *h = reinterpret_cast<cublasLtHandle_t>(&g_handle_token);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t) { return CUBLAS_STATUS_SUCCESS; }
const char* cublasLtGetStatusName(cublasStatus_t) { return "CUBLAS_STATUS_MOCK"; }
const char* cublasLtGetStatusString(cublasStatus_t) { return "a status of the mock cuBLASLt"; }
size_t cublasLtGetVersion(void) { return 130000; }

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t, cudaDataType_t) {
  return create(d);
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  std::free(d);
  return CUBLAS_STATUS_SUCCESS;
}
// The bias pointer is kept in the descriptor's first word (its block is the opaque type's size).
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void* buf,
                                              size_t size) {
  if (a == CUBLASLT_MATMUL_DESC_BIAS_POINTER && size == sizeof(void*)) std::memcpy(&d->data[0], buf, sizeof(void*));
  return counted();
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType, uint64_t, uint64_t, int64_t) {
  return create(l);
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  std::free(l);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t, cublasLtMatrixLayoutAttribute_t, const void*,
                                                size_t) {
  return counted();
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) { return create(p); }
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  std::free(p);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t,
                                                    const void*, size_t) {
  return counted();
}
// One algorithm (all attributes 0), no workspace.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
                                              cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                              cublasLtMatmulPreference_t, int requested,
                                              cublasLtMatmulHeuristicResult_t* results, int* found) {
  *found = requested > 0 ? 1 : 0;
  if (requested > 0) {
    std::memset(&results[0], 0, sizeof(results[0]));
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.f;
  }
  return counted();
}
cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t d, const void*, const void*, cublasLtMatrixLayout_t,
                              const void*, cublasLtMatrixLayout_t, const void*, const void*, cublasLtMatrixLayout_t,
                              void*, cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t*, void*, size_t,
                              cudaStream_t) {
  const void* bias;
  std::memcpy(&bias, &d->data[0], sizeof(bias));
  g_last_bias.store(bias);
  g_matmuls.fetch_add(1, std::memory_order_relaxed);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulAlgoInit(cublasLtHandle_t, cublasComputeType_t, cudaDataType_t, cudaDataType_t,
                                      cudaDataType_t, cudaDataType_t, cudaDataType_t, int, cublasLtMatmulAlgo_t* a) {
  std::memset(a, 0, sizeof(*a));
  return counted();
}
cublasStatus_t cublasLtMatmulAlgoCheck(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
                                       cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                       const cublasLtMatmulAlgo_t*, cublasLtMatmulHeuristicResult_t* r) {
  std::memset(r, 0, sizeof(*r));
  r->state = CUBLAS_STATUS_SUCCESS;
  return counted();
}
cublasStatus_t cublasLtMatmulAlgoConfigSetAttribute(cublasLtMatmulAlgo_t*, cublasLtMatmulAlgoConfigAttributes_t,
                                                    const void*, size_t) {
  return counted();
}
// Every attribute reads 0.
cublasStatus_t cublasLtMatmulAlgoConfigGetAttribute(const cublasLtMatmulAlgo_t*, cublasLtMatmulAlgoConfigAttributes_t,
                                                    void* buf, size_t size, size_t* written) {
  std::memset(buf, 0, size);
  if (written) *written = size;
  return counted();
}

}  // extern "C"
