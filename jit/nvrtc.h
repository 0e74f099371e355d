// Compiling one specialization with NVRTC: CUBIN for a real architecture, PTX for a compute_NN one,
// the template instantiated through a name expression, resource use read from ptxas's report.
// NVRTC itself is dlopen-ed on first use (12.x or 13.x, found as jit/cuda_libs.h says), never linked.
// Error contract: compile() throws CompileError (log, options, spec, and the specialized source
// written to a file named in the message) when NVRTC rejects the code; InvalidArgument for a
// template that does not exist; CudaError for NVRTC API failures unrelated to the code (NVRTC_CHECK:
// the call, NVRTC's error string and code, file:line), and from nvrtc() when no usable NVRTC is found
// (naming every place searched).
#pragma once

#include <nvrtc.h>

#include <string>
#include <vector>

#include "cuda_libs.h"
#include "spec.h"

namespace kspec::jit {

// Every NVRTC entry point kspec calls; all exist with the same prototypes in NVRTC 12 and 13.
#define KSPEC_NVRTC_FUNCS(X)                                                                          \
  X(nvrtcVersion) X(nvrtcGetErrorString) X(nvrtcCreateProgram) X(nvrtcDestroyProgram)                  \
  X(nvrtcAddNameExpression) X(nvrtcCompileProgram) X(nvrtcGetProgramLogSize) X(nvrtcGetProgramLog)     \
  X(nvrtcGetLoweredName) X(nvrtcGetCUBINSize) X(nvrtcGetCUBIN) X(nvrtcGetPTXSize) X(nvrtcGetPTX)      \
  X(nvrtcGetNumSupportedArchs) X(nvrtcGetSupportedArchs)

struct Nvrtc {
#define KSPEC_DECLARE_NVRTC_PFN(name) decltype(&::name) name = nullptr;
  KSPEC_NVRTC_FUNCS(KSPEC_DECLARE_NVRTC_PFN)
#undef KSPEC_DECLARE_NVRTC_PFN
  std::string path;  // the library file loaded
  int major = 0, minor = 0;
};

// The oldest NVRTC kspec accepts: its templates use C++17 and bf16, and 12 is the oldest toolkit tested.
constexpr int kMinNvrtcMajor = 12;

// Loads NVRTC from `candidates` (the first that opens, has every entry point and is kMinNvrtcMajor or
// newer); on failure `error` names every candidate and why it was passed over.
struct NvrtcLoad {
  Nvrtc api;
  std::string error;  // empty when loaded
};
NvrtcLoad load_nvrtc(const std::vector<LibraryCandidate>& candidates);
// Where this process looks for NVRTC: KSPEC_NVRTC, else pip's wheels, CUDA_HOME/CUDA_PATH, the loader.
std::vector<LibraryCandidate> nvrtc_candidates();
// This process's NVRTC, loaded once; CudaError (the search, every place and why) when there is none.
const Nvrtc& nvrtc();

struct Resources {
  int registers = -1;         // per thread; -1 when unknown (PTX)
  int spill_bytes = -1;       // spill stores + spill loads
  int stack_bytes = -1;       // local memory frame per thread
  int static_shared_bytes = -1;
  int max_threads = -1;       // filled at load time from the driver
};

struct CompiledKernel {
  std::string binary;        // CUBIN or PTX (NUL-terminated text)
  bool is_cubin = true;
  std::string lowered_name;  // mangled kernel symbol for cuModuleGetFunction
  Resources resources;
  double compile_ms = 0;
  std::string log;           // NVRTC + ptxas log
};

class TemplateSource;

// Compiles against `src` (default: TemplateSource::global(), i.e. embedded or KSPEC_TEMPLATE_DIR).
CompiledKernel compile(const KernelSpec& spec, const TemplateSource* src = nullptr);

// "13.0"; CudaError as nvrtc() when NVRTC cannot be loaded.
std::string nvrtc_version();

// The options kspec passes for a spec (for keys and for messages).
std::vector<std::string> compile_options(const KernelSpec& spec);

// Parses ptxas -v output for one kernel.
Resources parse_ptxas_log(const std::string& log);

[[noreturn]] void throw_nvrtc_error(nvrtcResult r, const char* call, const char* file, int line);

}  // namespace kspec::jit

#define NVRTC_CHECK(call)                                                             \
  do {                                                                                \
    nvrtcResult kspec_nvrtc_result_ = ::kspec::jit::nvrtc().call;                    \
    if (kspec_nvrtc_result_ != NVRTC_SUCCESS)                                         \
      ::kspec::jit::throw_nvrtc_error(kspec_nvrtc_result_, #call, __FILE__, __LINE__); \
  } while (0)
