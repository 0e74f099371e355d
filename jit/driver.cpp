// Loads libcuda with dlopen and resolves each entry point by the versioned symbol (_v2, _v3) that
// cuda.h maps it to, so every call matches the prototype kspec was compiled against.
#include "driver.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <vector>

#include "kspec/knobs.h"

namespace kspec::jit {
namespace {

struct Loaded {
  Driver driver;
  std::string error;  // empty when loaded
  int device_count = 0;
};

Loaded load() {
  Loaded out;
  // Read once: the driver stays loaded for the process (a bad value is reported as the driver's error).
  std::optional<std::string> given;
  try {
    given = knobs::libcuda();
  } catch (const Error& e) {
    out.error = e.what();
    return out;
  }
  void* lib = given ? dlopen(given->c_str(), RTLD_NOW | RTLD_LOCAL) : dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib && !given) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    out.error = std::string("the CUDA driver (") + (given ? "KSPEC_LIBCUDA " + *given : "libcuda.so.1") +
                ") could not be loaded: " + (e ? e : "?") +
                ". Compile-only features (kspec compile/precompile) work without it.";
    return out;
  }
  // Each entry point is looked up under the exact symbol cuda.h maps its name to (cuMemAlloc →
  // cuMemAlloc_v2), so the ABI matches the prototype kspec was compiled against. (cuGetProcAddress
  // would hand out the newest ABI of the requested CUDA version instead: with 13.0 that is
  // cuCtxSynchronize_v2(CUcontext), which takes an argument the plain prototype does not pass.)
#define KSPEC_STR2(x) #x
#define KSPEC_STR(x) KSPEC_STR2(x)
#define KSPEC_RESOLVE(name)                                                                \
  {                                                                                        \
    void* fn = dlsym(lib, KSPEC_STR(name));                                                \
    if (!fn) {                                                                             \
      out.error = "the CUDA driver lacks " KSPEC_STR(name) " (driver older than the toolkit?)"; \
      return out;                                                                          \
    }                                                                                      \
    out.driver.name = reinterpret_cast<decltype(out.driver.name)>(fn);                    \
  }
  KSPEC_DRIVER_FUNCS(KSPEC_RESOLVE)
#undef KSPEC_RESOLVE
  CUresult r = out.driver.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    out.driver.cuGetErrorName(r, &name);
    out.error = std::string("cuInit failed: ") + (name ? name : "?") + " (no usable GPU?)";
    return out;
  }
  if (out.driver.cuDeviceGetCount(&out.device_count) != CUDA_SUCCESS) out.device_count = 0;
  return out;
}

const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace

namespace driver_detail {

std::atomic<const Driver*> g_driver{nullptr};
std::atomic<CUcontext> g_retained[kFastDevices];

const Driver& load_driver() {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw CudaError(l.error);
  g_driver.store(&l.driver, std::memory_order_release);
  return l.driver;
}

}  // namespace driver_detail

bool driver_available() { return loaded().error.empty() && loaded().device_count > 0; }

int device_count() { return loaded().error.empty() ? loaded().device_count : 0; }

std::string driver_error_text(CUresult r) {
  const Loaded& l = loaded();
  if (!l.error.empty()) return "CUresult " + std::to_string(static_cast<int>(r));
  const char* name = nullptr;
  const char* text = nullptr;
  l.driver.cuGetErrorName(r, &name);
  l.driver.cuGetErrorString(r, &text);
  return std::string(name ? name : "?") + " (" + std::to_string(static_cast<int>(r)) + "): " +
         (text ? text : "");
}

void throw_cuda_error(CUresult r, const char* call, const char* file, int line) {
  throw CudaError(detail::concat(call, " failed with ", driver_error_text(r), " at ", file, ":", line));
}

// Every call makes its device's context current (ContextGuard): a retained context is read without the
// lock (primary_context, inline). Contexts are retained once and never released, so a pointer once seen
// stays valid.
CUcontext retain_primary_context(int device) {
  static std::mutex mu;
  static std::vector<CUcontext> contexts;
  int count = device_count();
  KSPEC_CHECK(device >= 0 && device < count, "device ", device, " does not exist (", count,
              " CUDA device(s) visible)");
  std::lock_guard<std::mutex> lock(mu);
  if (contexts.empty()) contexts.assign(count, nullptr);
  if (!contexts[device]) {
    CUdevice dev;
    CU_CHECK(cuDeviceGet(&dev, device));
    CU_CHECK(cuDevicePrimaryCtxRetain(&contexts[device], dev));
    if (device < driver_detail::kFastDevices) driver_detail::g_retained[device].store(contexts[device], std::memory_order_release);
  }
  return contexts[device];
}

// torch's autograd worker for device 0 starts with no current context (c10's SetDevice skips cudaSetDevice
// for the device it already reports, 0), and the runtime binds device 0's primary context at its first call
// there. Unbinding it again after each kspec call made every backward node on that thread cost two context
// switches of ours and a rebind of the runtime's (norm_act's training step, issue 28). Keeping device 0's
// primary context is what the runtime would do: the thread's current device stays 0. For another device, a
// thread without a context gets none back (its runtime would report that device as current otherwise).
void ContextGuard::switch_to(CUresult got_current, CUcontext target, int device) {
  if (got_current != CUDA_SUCCESS) throw_cuda_error(got_current, "cuCtxGetCurrent(&previous_)", __FILE__, __LINE__);
  if (previous_ == target) return;
  CU_CHECK(cuCtxSetCurrent(target));
  switched_ = previous_ != nullptr || device != 0;
}

}  // namespace kspec::jit
