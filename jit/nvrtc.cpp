// NVRTC compilation of kernel specializations. Headers come from the template source (embedded or
// KSPEC_TEMPLATE_DIR) through NVRTC's header arrays; CUDA's own headers through -I.
#include "nvrtc.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include "files.h"
#include "handles.h"
#include "jit/base/hash.h"
#include "kspec/error.h"
#include "kspec/knobs.h"
#include "sources.h"

namespace kspec::jit {
namespace {

std::string program_log(nvrtcProgram p) {
  size_t n = 0;
  if (nvrtc().nvrtcGetProgramLogSize(p, &n) != NVRTC_SUCCESS || n <= 1) return {};
  std::string log(n, '\0');
  nvrtc().nvrtcGetProgramLog(p, log.data());
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  return log;
}

// The failing source goes to KSPEC_DEBUG_DIR when that is (or can be created as) this user's private
// directory; otherwise (the default, the shared temp dir) into a private directory made once per process
// inside it (mkdtemp, 0700): a predictable name in /tmp could be a symlink another user planted.
std::string write_failed_source(const KernelSpec& spec, const std::string& source) {
  static std::mutex mu;
  static std::map<std::string, std::string> private_dirs;  // debug dir → where this process writes
  std::string base = knobs::debug_dir(), why, dir;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = private_dirs.find(base);
    if (it == private_dirs.end()) {
      std::string chosen;
      if (make_private_dir(base, &why)) {
        chosen = base;
      } else {
        std::string templ = (std::filesystem::path(base) / "kspec-debug-XXXXXX").string();
        if (::mkdtemp(templ.data()) && ::chmod(templ.c_str(), 0700) == 0) chosen = templ;
        else why += "; mkdtemp " + templ + ": " + std::strerror(errno);
      }
      if (chosen.empty()) return "(could not write the source: " + why + ")";  // tried again next time
      it = private_dirs.emplace(base, chosen).first;
    }
    dir = it->second;
  }
  std::string name = "kspec-failed-" + sha256_hex(spec.canonical()).substr(0, 16) + ".cu";
  std::string path = (std::filesystem::path(dir) / name).string(), err;
  return write_file_atomic(path, source, &err) ? path : "(could not write " + path + ": " + err + ")";
}

// The whole specialized program as one file: the generated prologue with every kspec header
// inlined, so the file reproduces the failure with `nvcc -I<cuda include>` alone.
std::string flattened_source(const KernelSpec& spec, const TemplateSource& src) {
  std::string out = spec.source();
  out += "\n// ---- the kspec templates it includes, as compiled ----\n";
  for (const auto& f : src.kspec_closure(spec.header))
    out += "\n// ==== templates/" + f.name + " ====\n" + f.content;
  out += "\n// instantiated as: " + spec.name_expression() + "\n";
  return out;
}

}  // namespace

NvrtcLoad load_nvrtc(const std::vector<LibraryCandidate>& candidates) {
  NvrtcLoad out;
  auto accept = [&out](void* lib) -> std::string {
    Nvrtc api;
#define KSPEC_NVRTC_STR2(x) #x
#define KSPEC_NVRTC_STR(x) KSPEC_NVRTC_STR2(x)
#define KSPEC_NVRTC_RESOLVE(name)                                          \
  api.name = reinterpret_cast<decltype(api.name)>(dlsym(lib, KSPEC_NVRTC_STR(name))); \
  if (!api.name) return "not NVRTC, or too old: it lacks " KSPEC_NVRTC_STR(name);
    KSPEC_NVRTC_FUNCS(KSPEC_NVRTC_RESOLVE)
#undef KSPEC_NVRTC_RESOLVE
    if (api.nvrtcVersion(&api.major, &api.minor) != NVRTC_SUCCESS) return "nvrtcVersion failed";
    if (api.major < kMinNvrtcMajor)
      return detail::concat("NVRTC ", api.major, ".", api.minor, " is older than ", kMinNvrtcMajor,
                            ".0, the oldest kspec supports");
    out.api = std::move(api);
    return {};
  };
  OpenedLibrary lib = open_first(candidates, accept);
  if (lib.handle) {
    // A path as given (a wheel's symlink stays the wheel's); for a soname, the file the loader chose.
    out.api.path = lib.path.find('/') != std::string::npos
                       ? lib.path
                       : library_of(reinterpret_cast<const void*>(out.api.nvrtcVersion));
    return out;
  }
  std::string searched;
  for (const auto& t : lib.tried) searched += "\n  " + t;
  out.error = detail::concat(
      "NVRTC (libnvrtc.so.13 or .so.12) could not be loaded; kspec needs it to compile kernels. Searched, in "
      "order:", searched,
      "\nInstall the CUDA toolkit (and set CUDA_HOME), or `pip install nvidia-cuda-nvrtc nvidia-cuda-runtime`, "
      "or set KSPEC_NVRTC to the path of libnvrtc.so.");
  return out;
}

std::vector<LibraryCandidate> nvrtc_candidates() {
  // CUDA 13 wheels share nvidia/cu13/lib; CUDA 12's nvidia-cuda-nvrtc-cu12 has nvidia/cuda_nvrtc/lib.
  return library_candidates("KSPEC_NVRTC", knobs::nvrtc(), {"libnvrtc.so.13", "libnvrtc.so.12"},
                            {"cu13/lib", "cuda_nvrtc/lib"});
}

const Nvrtc& nvrtc() {
  static const NvrtcLoad loaded = load_nvrtc(nvrtc_candidates());
  if (!loaded.error.empty()) throw CudaError(loaded.error);
  return loaded.api;
}

// CudaError, not CompileError: these calls fail for reasons outside the code being compiled (out of
// memory, bad input from kspec itself); a rejected specialization is reported by compile() below.
void throw_nvrtc_error(nvrtcResult r, const char* call, const char* file, int line) {
  const Nvrtc& api = nvrtc();
  throw CudaError(detail::concat(call, " failed: ", api.nvrtcGetErrorString(r), " (", static_cast<int>(r), ") at ", file,
                                 ":", line, " (NVRTC ", api.major, ".", api.minor, ", ", api.path, ")"));
}

std::string nvrtc_version() {
  const Nvrtc& api = nvrtc();
  return std::to_string(api.major) + "." + std::to_string(api.minor);
}

std::vector<std::string> compile_options(const KernelSpec& spec) {
  std::vector<std::string> opts = {"-std=c++17", "-default-device",
                                   "-arch=" + spec.arch};
  if (spec.arch.rfind("sm_", 0) == 0) opts.push_back("-Xptxas=-v");
  const std::string& inc = cuda_include_dir();
  if (!inc.empty()) opts.push_back("-I" + inc);
  for (const auto& o : spec.options) opts.push_back(o);
  return opts;
}

namespace {
// The integer just before `tag` in `text` (searching from `from`), or -1. Hand-written instead of
// std::regex: regex's locale facets crash when another library (torch) brings its own libstdc++ state.
int number_before(const std::string& text, const std::string& tag, size_t from = 0) {
  size_t pos = text.find(tag, from);
  if (pos == std::string::npos) return -1;
  size_t end = pos;
  while (end > 0 && text[end - 1] == ' ') --end;
  size_t begin = end;
  while (begin > 0 && std::isdigit(static_cast<unsigned char>(text[begin - 1]))) --begin;
  if (begin == end) return -1;
  return std::stoi(text.substr(begin, end - begin));
}

// The integer just after `tag`, or -1.
int number_after(const std::string& text, const std::string& tag) {
  size_t pos = text.find(tag);
  if (pos == std::string::npos) return -1;
  pos += tag.size();
  size_t end = pos;
  while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
  return end > pos ? std::stoi(text.substr(pos, end - pos)) : -1;
}
}  // namespace

Resources parse_ptxas_log(const std::string& log) {
  Resources r;
  r.registers = number_after(log, "Used ");
  int stack = number_before(log, "bytes stack frame");
  int stores = number_before(log, "bytes spill stores");
  int loads = number_before(log, "bytes spill loads");
  if (stack >= 0) r.stack_bytes = stack;
  if (stores >= 0 && loads >= 0) r.spill_bytes = stores + loads;
  int smem = number_before(log, "bytes smem");
  r.static_shared_bytes = smem >= 0 ? smem : (r.registers >= 0 ? 0 : -1);
  return r;
}

CompiledKernel compile(const KernelSpec& spec, const TemplateSource* source) {
  const TemplateSource& src = source ? *source : TemplateSource::global();
  auto closure = src.kspec_closure(spec.header);  // throws InvalidArgument for unknown templates
  std::vector<const char*> header_texts, header_names;
  for (const auto& f : closure) {
    header_texts.push_back(f.content.c_str());
    header_names.push_back(f.name.c_str());
  }
  std::string program_text = spec.source();
  auto opts = compile_options(spec);
  std::vector<const char*> copts;
  for (const auto& o : opts) copts.push_back(o.c_str());
  std::string expr = spec.name_expression();

  auto t0 = std::chrono::steady_clock::now();
  NvrtcProgram prog;
  NVRTC_CHECK(nvrtcCreateProgram(prog.out(), program_text.c_str(), "kspec_specialization.cu",
                                 static_cast<int>(closure.size()), header_texts.data(),
                                 header_names.data()));
  NVRTC_CHECK(nvrtcAddNameExpression(prog.get(), expr.c_str()));
  nvrtcResult r = nvrtc().nvrtcCompileProgram(prog.get(), static_cast<int>(copts.size()), copts.data());
  CompiledKernel out;
  out.log = program_log(prog.get());
  if (r != NVRTC_SUCCESS) {
    std::string joined;
    for (const auto& o : opts) joined += (joined.empty() ? "" : " ") + o;
    std::string path = write_failed_source(spec, flattened_source(spec, src));
    std::string hint;
    if (cuda_include_dir().empty()) {
      hint = "\nhint: no CUDA include directory (one with cuda_fp16.h) was found; set KSPEC_CUDA_INCLUDE, or "
             "CUDA_HOME, or pip install nvidia-cuda-runtime. Searched:";
      for (const auto& [why, dir] : cuda_include_candidates()) hint += "\n  " + why + " " + dir;
    }
    throw CompileError(detail::concat("NVRTC failed to compile ", spec.name_expression(), " from ",
                                      spec.header, " for ", spec.arch, ": ", nvrtc().nvrtcGetErrorString(r),
                                      "\nspecialization: ", spec.canonical(), "\noptions: ", joined,
                                      "\nNVRTC ", nvrtc_version(), " from ", nvrtc().path,
                                      "\nsource written to: ", path, "\n--- NVRTC log ---\n", out.log,
                                      hint),
                       out.log, joined, spec.canonical(), path);
  }
  const char* lowered = nullptr;
  NVRTC_CHECK(nvrtcGetLoweredName(prog.get(), expr.c_str(), &lowered));
  out.lowered_name = lowered;
  out.is_cubin = spec.arch.rfind("sm_", 0) == 0;
  size_t n = 0;
  if (out.is_cubin) {
    NVRTC_CHECK(nvrtcGetCUBINSize(prog.get(), &n));
    out.binary.resize(n);
    NVRTC_CHECK(nvrtcGetCUBIN(prog.get(), out.binary.data()));
  } else {
    NVRTC_CHECK(nvrtcGetPTXSize(prog.get(), &n));
    out.binary.resize(n);
    NVRTC_CHECK(nvrtcGetPTX(prog.get(), out.binary.data()));
  }
  out.compile_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  out.resources = parse_ptxas_log(out.log);
  return out;
}

}  // namespace kspec::jit
