// Compiling one specialization with NVRTC: CUBIN for a real architecture, PTX for a compute_NN one,
// the template instantiated through a name expression, resource use read from ptxas's report.
// Error contract: compile() throws CompileError (log, options, spec, and the specialized source
// written to a file named in the message) when NVRTC rejects the code; InvalidArgument for a
// template that does not exist; CudaError for NVRTC API failures unrelated to the code (NVRTC_CHECK:
// the call, NVRTC's error string and code, file:line).
#pragma once

#include <nvrtc.h>

#include <string>

#include "spec.h"

namespace kspec::jit {

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

// "13.0"
std::string nvrtc_version();

// The options kspec passes for a spec (for keys and for messages).
std::vector<std::string> compile_options(const KernelSpec& spec);

// Parses ptxas -v output for one kernel.
Resources parse_ptxas_log(const std::string& log);

[[noreturn]] void throw_nvrtc_error(nvrtcResult r, const char* call, const char* file, int line);

}  // namespace kspec::jit

#define NVRTC_CHECK(call)                                                             \
  do {                                                                                \
    nvrtcResult kspec_nvrtc_result_ = (call);                                         \
    if (kspec_nvrtc_result_ != NVRTC_SUCCESS)                                         \
      ::kspec::jit::throw_nvrtc_error(kspec_nvrtc_result_, #call, __FILE__, __LINE__); \
  } while (0)
