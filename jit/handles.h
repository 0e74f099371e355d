// Owners of toolkit handles (device memory, driver streams and events, NVRTC programs, cuBLASLt
// descriptors), kept
// together so that every handle kspec creates has one RAII type. Each destroys its handle once and
// ignores the result: a destructor has no one to report to.
#pragma once

#include <cuda.h>
#include <nvrtc.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "jit/cublaslt.h"
#include "jit/driver.h"
#include "jit/nvrtc.h"

namespace kspec::jit {

// A move-only owner of one handle. Create into out() (only while empty); Destroy is a functor.
template <typename Handle, typename Destroy>
class Owned {
 public:
  Owned() = default;
  ~Owned() {
    if (h_) Destroy{}(h_);
  }
  Owned(Owned&& o) noexcept : h_(std::exchange(o.h_, Handle{})) {}
  Owned& operator=(Owned&&) = delete;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;

  Handle get() const { return h_; }
  Handle* out() { return &h_; }

 private:
  Handle h_{};
};

struct StreamDestroy {
  void operator()(CUstream s) const { driver().cuStreamDestroy(s); }
};
struct EventDestroy {
  void operator()(CUevent e) const { driver().cuEventDestroy(e); }
};
struct NvrtcProgramDestroy {
  void operator()(nvrtcProgram p) const { nvrtc().nvrtcDestroyProgram(&p); }
};
struct LtMatmulDescDestroy {
  void operator()(cublasLtMatmulDesc_t h) const { cublaslt().cublasLtMatmulDescDestroy(h); }
};
struct LtMatrixLayoutDestroy {
  void operator()(cublasLtMatrixLayout_t h) const { cublaslt().cublasLtMatrixLayoutDestroy(h); }
};
struct LtMatmulPreferenceDestroy {
  void operator()(cublasLtMatmulPreference_t h) const { cublaslt().cublasLtMatmulPreferenceDestroy(h); }
};

using OwnedStream = Owned<CUstream, StreamDestroy>;
using OwnedEvent = Owned<CUevent, EventDestroy>;
using NvrtcProgram = Owned<nvrtcProgram, NvrtcProgramDestroy>;
using LtMatmulDesc = Owned<cublasLtMatmulDesc_t, LtMatmulDescDestroy>;
using LtMatrixLayout = Owned<cublasLtMatrixLayout_t, LtMatrixLayoutDestroy>;
using LtMatmulPreference = Owned<cublasLtMatmulPreference_t, LtMatmulPreferenceDestroy>;

// An owning device allocation (at least 16 bytes, so that even an empty tensor has an address) in the
// current context; CU_CHECK's CudaError if the driver refuses.
struct DeviceBuffer {
  CUdeviceptr ptr = 0;
  size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : bytes(n) { CU_CHECK(cuMemAlloc(&ptr, std::max<size_t>(n, 16))); }
  ~DeviceBuffer() {
    if (ptr) driver().cuMemFree(ptr);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(std::exchange(o.ptr, 0)), bytes(o.bytes) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {  // the old allocation leaves with `o`
    std::swap(ptr, o.ptr);
    std::swap(bytes, o.bytes);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* data() const { return reinterpret_cast<void*>(ptr); }
};

// A stream / event in the current context; CU_CHECK's CudaError if the driver refuses.
inline OwnedStream create_stream(unsigned flags) {
  OwnedStream s;
  CU_CHECK(cuStreamCreate(s.out(), flags));
  return s;
}
inline OwnedEvent create_event(unsigned flags) {
  OwnedEvent e;
  CU_CHECK(cuEventCreate(e.out(), flags));
  return e;
}

// cuBLASLt descriptors; CUBLAS_CHECK's CudaError if the library refuses. A descriptor's attributes are set
// by value with set_attribute (the size is the value's).
inline LtMatmulDesc create_matmul_desc(cublasComputeType_t compute, cudaDataType_t scale) {
  LtMatmulDesc d;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(d.out(), compute, scale));
  return d;
}
inline LtMatrixLayout create_matrix_layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
  LtMatrixLayout l;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(l.out(), type, rows, cols, ld));
  return l;
}
inline LtMatmulPreference create_matmul_preference() {
  LtMatmulPreference p;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(p.out()));
  return p;
}
template <typename T>
void set_attribute(const LtMatmulDesc& d, cublasLtMatmulDescAttributes_t a, const T& v) {
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.get(), a, &v, sizeof(v)));
}
template <typename T>
void set_attribute(const LtMatrixLayout& l, cublasLtMatrixLayoutAttribute_t a, const T& v) {
  CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l.get(), a, &v, sizeof(v)));
}
template <typename T>
void set_attribute(const LtMatmulPreference& p, cublasLtMatmulPreferenceAttributes_t a, const T& v) {
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p.get(), a, &v, sizeof(v)));
}

}  // namespace kspec::jit
