// A stand-in for libcuda with no GPU behind it, for measuring and testing kspec's host path on a CPU
// machine (KSPEC_LIBCUDA=<this library>): one sm_90 "device" whose memory is host memory, modules and
// functions that are tokens, and launches that only count themselves. Exports every entry point kspec
// resolves (jit/driver.h), under the versioned names cuda.h maps them to, plus kspec_mock_launches().
#include <cuda.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace {

std::atomic<long long> g_launches{0};
std::atomic<long long> g_dtod_copies{0};  // device-to-device copies (the XLA handlers' scalar slots)
std::atomic<long long> g_stream_queries{0};  // cuStreamIsCapturing and cuEventRecord: driver calls a hit path avoids
// What a host path must not do per call once warm (a cuMemAlloc, a wait on the GPU, a memset, a kernel
// attribute set), counted for kspec_mock_count(): tests/python/test_host_path.py's scan steps.
std::atomic<long long> g_allocs{0}, g_frees{0}, g_syncs{0}, g_memsets{0}, g_attribute_sets{0};
int g_context_token, g_module_token, g_function_token, g_event_token, g_graph_token;
thread_local CUcontext t_current = nullptr;
// The first argument of this thread's last cuLaunchKernel (kspec's kernels take one params struct), its
// first t_arg_bytes kept where a test asked for them (kspec_mock_record_arg): which buffers a launcher passed.
thread_local unsigned char t_last_arg[256];
thread_local size_t t_arg_bytes = 0;

CUcontext the_context() { return reinterpret_cast<CUcontext>(&g_context_token); }

// The attributes an H100 SXM reports for what kspec reads; 0 for anything else.
int attribute(CUdevice_attribute a) {
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return 9;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return 0;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return 132;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: return 48 * 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: return 227 * 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: return 228 * 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: return 65536;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: return 32;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: return 1;
    default: return 0;
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) long long kspec_mock_launches() { return g_launches.load(); }
__attribute__((visibility("default"))) long long kspec_mock_dtod_copies() { return g_dtod_copies.load(); }
__attribute__((visibility("default"))) long long kspec_mock_stream_queries() { return g_stream_queries.load(); }
// From now on this thread's launches keep the first n bytes (at most 256: the size of the kernels' params
// struct, so that nothing past it is read) of their first argument; 0 stops it.
__attribute__((visibility("default"))) void kspec_mock_record_arg(size_t n) {
  t_arg_bytes = n < sizeof(t_last_arg) ? n : sizeof(t_last_arg);
}
// What the last launch kept (kspec_mock_record_arg's bytes).
__attribute__((visibility("default"))) void kspec_mock_last_arg(void* out) { std::memcpy(out, t_last_arg, t_arg_bytes); }
// One counter by name: "allocs" (cuMemAlloc, cuMemAllocAsync), "frees", "syncs" (stream, context and event
// synchronizes), "memsets", "attribute_sets" (cuFuncSetAttribute), "launches"; -1 for any other name.
__attribute__((visibility("default"))) long long kspec_mock_count(const char* what) {
  const std::pair<const char*, std::atomic<long long>*> counters[] = {
      {"allocs", &g_allocs}, {"frees", &g_frees}, {"syncs", &g_syncs}, {"memsets", &g_memsets},
      {"attribute_sets", &g_attribute_sets}, {"launches", &g_launches}};
  for (const auto& [name, counter] : counters)
    if (std::strcmp(what, name) == 0) return counter->load();
  return -1;
}

CUresult CUDAAPI cuInit(unsigned int) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuDriverGetVersion(int* v) { *v = 13000; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetCount(int* n) { *n = 1; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice) { *v = attribute(a); return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetName(char* name, int len, CUdevice) {
  std::strncpy(name, "kspec mock device (no GPU)", static_cast<size_t>(len));
  if (len > 0) name[len - 1] = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceTotalMem(size_t* bytes, CUdevice) { *bytes = size_t(80) << 30; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) { *c = the_context(); return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetCurrent(CUcontext* c) { *c = t_current; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetCurrent(CUcontext c) { t_current = c; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxPushCurrent(CUcontext c) { t_current = c; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxPopCurrent(CUcontext* c) {
  if (c) *c = t_current;
  t_current = nullptr;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxGetDevice(CUdevice* d) { *d = 0; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSynchronize(void) {
  g_syncs.fetch_add(1);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuModuleLoadData(CUmodule* m, const void*) {
  *m = reinterpret_cast<CUmodule>(&g_module_token);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuModuleUnload(CUmodule) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuModuleGetFunction(CUfunction* f, CUmodule, const char*) {
  *f = reinterpret_cast<CUfunction>(&g_function_token);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetAttribute(CUfunction, CUfunction_attribute, int) {
  g_attribute_sets.fetch_add(1);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncGetAttribute(int* v, CUfunction_attribute a, CUfunction) {
  *v = a == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024 : a == CU_FUNC_ATTRIBUTE_NUM_REGS ? 32 : 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                CUstream, void** args, void**) {
  if (args && args[0] && t_arg_bytes) std::memcpy(t_last_arg, args[0], t_arg_bytes);
  g_launches.fetch_add(1, std::memory_order_relaxed);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig*, CUfunction, void**, void**) {
  g_launches.fetch_add(1, std::memory_order_relaxed);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGetErrorName(CUresult, const char** s) { *s = "CUDA_ERROR_MOCK"; return CUDA_SUCCESS; }
CUresult CUDAAPI cuGetErrorString(CUresult, const char** s) { *s = "an error of the mock driver"; return CUDA_SUCCESS; }
CUresult CUDAAPI cuStreamIsCapturing(CUstream, CUstreamCaptureStatus* s) {
  g_stream_queries.fetch_add(1, std::memory_order_relaxed);
  *s = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamSynchronize(CUstream) { g_syncs.fetch_add(1); return CUDA_SUCCESS; }
CUresult CUDAAPI cuStreamGetCtx(CUstream, CUcontext* c) { *c = the_context(); return CUDA_SUCCESS; }
// Device memory is host memory, 256-byte aligned as cuMemAlloc's.
CUresult CUDAAPI cuMemAlloc(CUdeviceptr* p, size_t bytes) {
  g_allocs.fetch_add(1);
  void* q = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  if (!q) return CUDA_ERROR_OUT_OF_MEMORY;
  *p = reinterpret_cast<CUdeviceptr>(q);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemFree(CUdeviceptr p) {
  g_frees.fetch_add(1);
  std::free(reinterpret_cast<void*>(p));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr* p, size_t bytes, CUstream) { return cuMemAlloc(p, bytes); }
CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr p, CUstream) { return cuMemFree(p); }
CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr d, const void* s, size_t n) {
  std::memcpy(reinterpret_cast<void*>(d), s, n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr d, const void* s, size_t n, CUstream) { return cuMemcpyHtoD(d, s, n); }
CUresult CUDAAPI cuMemcpyDtoH(void* d, CUdeviceptr s, size_t n) {
  std::memcpy(d, reinterpret_cast<const void*>(s), n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream) {
  g_dtod_copies.fetch_add(1, std::memory_order_relaxed);
  std::memcpy(reinterpret_cast<void*>(d), reinterpret_cast<const void*>(s), n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemsetD8(CUdeviceptr d, unsigned char v, size_t n) {
  g_memsets.fetch_add(1);
  std::memset(reinterpret_cast<void*>(d), v, n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream) {
  g_memsets.fetch_add(1);
  auto* p = reinterpret_cast<unsigned int*>(d);
  for (size_t i = 0; i < n; ++i) p[i] = v;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuPointerGetAttribute(void* data, CUpointer_attribute a, CUdeviceptr) {
  if (a == CU_POINTER_ATTRIBUTE_MEMORY_TYPE) *static_cast<unsigned int*>(data) = CU_MEMORYTYPE_DEVICE;
  else if (a == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) *static_cast<int*>(data) = 0;
  else return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamCreate(CUstream* s, unsigned int) {
  *s = reinterpret_cast<CUstream>(&g_event_token);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamDestroy(CUstream) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuEventCreate(CUevent* e, unsigned int) { *e = reinterpret_cast<CUevent>(&g_event_token); return CUDA_SUCCESS; }
CUresult CUDAAPI cuEventRecord(CUevent, CUstream) {
  g_stream_queries.fetch_add(1, std::memory_order_relaxed);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventSynchronize(CUevent) {
  g_syncs.fetch_add(1);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventQuery(CUevent) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuEventElapsedTime(float* ms, CUevent, CUevent) { *ms = 0.001f; return CUDA_SUCCESS; }
CUresult CUDAAPI cuEventDestroy(CUevent) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemGetInfo(size_t* free_bytes, size_t* total) {
  *free_bytes = *total = size_t(80) << 30;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamBeginCapture(CUstream, CUstreamCaptureMode) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult CUDAAPI cuStreamEndCapture(CUstream, CUgraph*) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult CUDAAPI cuGraphInstantiate(CUgraphExec* g, CUgraph, unsigned long long) {
  *g = reinterpret_cast<CUgraphExec>(&g_graph_token);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphLaunch(CUgraphExec, CUstream) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuGraphDestroy(CUgraph) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuGraphExecDestroy(CUgraphExec) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, CUfunction, int, size_t) {
  *blocks = 4;
  return CUDA_SUCCESS;
}

}  // extern "C"
