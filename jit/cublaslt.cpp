// Loads cuBLASLt with dlopen (the soname of the toolkit kspec is built against) and keeps one handle per
// device. Handles are never destroyed: ops may run from other static destructors, and the driver
// tears the contexts down at exit anyway.
#include "jit/cublaslt.h"

#include <dlfcn.h>

#include <map>
#include <mutex>

#include "jit/cuda_libs.h"
#include "jit/driver.h"
#include "kspec/knobs.h"

namespace kspec::jit {
namespace {

struct LoadedLt {
  CublasLt lt;
  std::string error;  // empty when loaded
};

LoadedLt load() {
  LoadedLt out;
  // Searched like NVRTC (pip's nvidia-cublas wheel, CUDA_HOME, the loader path, /usr/local/cuda); only
  // the CUDA 13 ABI kspec is compiled against.
  std::optional<std::string> given;
  try {
    given = knobs::libcublaslt();
  } catch (const Error& e) {
    out.error = e.what();
    return out;
  }
  OpenedLibrary opened = open_first(library_candidates("KSPEC_LIBCUBLASLT", given, {"libcublasLt.so.13"}, {"cu13/lib"}),
                                    [](void*) { return std::string(); });
  void* lib = opened.handle;
  if (!lib) {
    std::string tried;
    for (const auto& t : opened.tried) tried += "\n  " + t;
    out.error = "cuBLASLt (libcublasLt.so.13) could not be loaded. The gemm ops need it (install the CUDA "
                "toolkit's libcublas, or pip install nvidia-cublas); every other op works without it. Searched:" +
                tried;
    return out;
  }
#define KSPEC_LT_STR2(x) #x
#define KSPEC_LT_STR(x) KSPEC_LT_STR2(x)
#define KSPEC_LT_RESOLVE(name)                                                                  \
  {                                                                                             \
    void* fn = dlsym(lib, KSPEC_LT_STR(name));                                                  \
    if (!fn) {                                                                                  \
      out.error = "cuBLASLt lacks " KSPEC_LT_STR(name) " (older than the toolkit kspec was built with?)"; \
      return out;                                                                               \
    }                                                                                           \
    out.lt.name = reinterpret_cast<decltype(out.lt.name)>(fn);                                 \
  }
  KSPEC_CUBLASLT_FUNCS(KSPEC_LT_RESOLVE)
#undef KSPEC_LT_RESOLVE
  return out;
}

const LoadedLt& loaded() {
  static const LoadedLt l = load();
  return l;
}

}  // namespace

const CublasLt& cublaslt() {
  const LoadedLt& l = loaded();
  if (!l.error.empty()) throw Unsupported(l.error);
  return l.lt;
}

bool cublaslt_available() { return loaded().error.empty(); }

cublasLtHandle_t cublaslt_handle(int device) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  ContextGuard guard(device);  // the handle reads the current device's properties
  cublasLtHandle_t h = nullptr;
  CUBLAS_CHECK(cublasLtCreate(&h));
  handles.emplace(device, h);
  return h;
}

void throw_cublas_error(cublasStatus_t s, const char* call, const char* file, int line) {
  const LoadedLt& l = loaded();
  std::string name = l.error.empty() ? l.lt.cublasLtGetStatusName(s) : "?";
  std::string text = l.error.empty() ? l.lt.cublasLtGetStatusString(s) : "";
  throw CudaError(detail::concat(call, " failed with ", name, " (", static_cast<int>(s), "): ", text, " at ", file, ":",
                                 line));
}

}  // namespace kspec::jit
