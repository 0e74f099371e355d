// The CUDA Driver API, loaded at run time with dlopen so that kspec imports and compiles kernels on a
// machine with no GPU and no libcuda (CI). Every driver call goes through driver() and CU_CHECK.
// Error contract: driver() throws CudaError when libcuda cannot be loaded or cuInit fails;
// CU_CHECK throws CudaError naming the call, the code, its name and file:line.
#pragma once

#include <cuda.h>

#include <atomic>
#include <string>

#include "kspec/error.h"

namespace kspec::jit {

#define KSPEC_DRIVER_FUNCS(X)                                                             \
  X(cuInit) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetAttribute) \
  X(cuDeviceGetName) X(cuDeviceTotalMem) X(cuDevicePrimaryCtxRetain) X(cuCtxGetCurrent)   \
  X(cuCtxSetCurrent) X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuCtxGetDevice)             \
  X(cuCtxSynchronize) X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction)       \
  X(cuFuncSetAttribute) X(cuFuncGetAttribute) X(cuLaunchKernel) X(cuLaunchKernelEx)        \
  X(cuGetErrorName) X(cuGetErrorString) X(cuStreamIsCapturing) X(cuStreamSynchronize)     \
  X(cuStreamGetCtx) X(cuMemAlloc) X(cuMemFree) X(cuMemAllocAsync) X(cuMemFreeAsync)        \
  X(cuMemcpyHtoD) X(cuMemcpyHtoDAsync) X(cuMemcpyDtoH) X(cuMemcpyDtoDAsync)               \
  X(cuMemsetD8) X(cuMemsetD32Async) X(cuPointerGetAttribute) X(cuStreamCreate)            \
  X(cuStreamDestroy) X(cuEventCreate) X(cuEventRecord) X(cuEventSynchronize) X(cuEventQuery) \
  X(cuEventElapsedTime) X(cuEventDestroy) X(cuMemGetInfo) X(cuStreamBeginCapture)            \
  X(cuStreamEndCapture) X(cuGraphInstantiate) X(cuGraphLaunch) X(cuGraphDestroy)             \
  X(cuGraphExecDestroy) X(cuOccupancyMaxActiveBlocksPerMultiprocessor)

struct Driver {
#define KSPEC_DECLARE_PFN(name) decltype(&::name) name = nullptr;
  KSPEC_DRIVER_FUNCS(KSPEC_DECLARE_PFN)
#undef KSPEC_DECLARE_PFN
};

namespace driver_detail {
// Set once the driver has loaded: driver() is then one load, inline at every CU_CHECK (a kspec call's hit
// path makes three or four driver calls; each went through a function-local static's guard).
extern std::atomic<const Driver*> g_driver;
const Driver& load_driver();
// The primary contexts retained so far, by device ordinal (below kFastDevices): read without a lock.
constexpr int kFastDevices = 64;
extern std::atomic<CUcontext> g_retained[kFastDevices];
}  // namespace driver_detail

// Loads libcuda and calls cuInit(0) once; throws CudaError if either fails.
inline const Driver& driver() {
  if (const Driver* d = driver_detail::g_driver.load(std::memory_order_acquire)) return *d;
  return driver_detail::load_driver();
}
// True when a driver is loadable and reports at least one device. Never throws.
bool driver_available();
int device_count();  // 0 when no driver
std::string driver_error_text(CUresult r);

// The primary context of a device, retained once per process and kept for its lifetime.
CUcontext retain_primary_context(int device);
inline CUcontext primary_context(int device) {
  if (device >= 0 && device < driver_detail::kFastDevices)
    if (CUcontext c = driver_detail::g_retained[device].load(std::memory_order_acquire)) return c;
  return retain_primary_context(device);
}

// Makes the device's primary context current for the scope, restoring the caller's afterwards; but a thread
// with no current context that ran on device 0 keeps device 0's primary context (what the CUDA runtime binds
// there on its own first call anyway, so the thread's current device stays 0).
// Inline: every kspec call makes one, and where the context is already current (an application's usual
// state) it is one cuCtxGetCurrent.
class ContextGuard {
 public:
  explicit ContextGuard(int device) {
    CUcontext target = primary_context(device);
    CUresult r = driver().cuCtxGetCurrent(&previous_);
    if (r != CUDA_SUCCESS || previous_ != target) switch_to(r, target, device);
  }
  ~ContextGuard() {
    if (switched_) driver().cuCtxSetCurrent(previous_);
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  // cuCtxGetCurrent's result checked, then `target` made current.
  void switch_to(CUresult got_current, CUcontext target, int device);

  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

[[noreturn]] void throw_cuda_error(CUresult r, const char* call, const char* file, int line);

}  // namespace kspec::jit

#define CU_CHECK(call)                                                              \
  do {                                                                              \
    CUresult kspec_cu_result_ = ::kspec::jit::driver().call;                        \
    if (kspec_cu_result_ != CUDA_SUCCESS)                                           \
      ::kspec::jit::throw_cuda_error(kspec_cu_result_, #call, __FILE__, __LINE__);  \
  } while (0)
