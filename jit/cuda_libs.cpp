// Finding the CUDA libraries kspec dlopens; see cuda_libs.h for the order and why.
#include "cuda_libs.h"

#include <dlfcn.h>

#include <filesystem>
#include <mutex>

#include "kspec/knobs.h"

namespace kspec::jit {
namespace fs = std::filesystem;
namespace {
std::mutex g_mu;
std::vector<std::string> g_nvidia_dirs;
}  // namespace

void set_nvidia_package_dirs(std::vector<std::string> dirs) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_nvidia_dirs = std::move(dirs);
}

std::vector<std::string> nvidia_package_dirs() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_nvidia_dirs;
}

std::vector<LibraryCandidate> library_candidates(const char* override_name,
                                                 const std::optional<std::string>& override_value,
                                                 const std::vector<std::string>& sonames,
                                                 const std::vector<std::string>& wheel_subdirs) {
  if (override_value) return {{override_name, *override_value}};
  std::vector<LibraryCandidate> out;
  auto in_dir = [&](const std::string& source, const fs::path& dir) {
    for (const auto& so : sonames) out.push_back({source, (dir / so).string()});
  };
  for (const auto& nv : nvidia_package_dirs())
    for (const auto& sub : wheel_subdirs) in_dir("pip nvidia wheel", fs::path(nv) / sub);
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"})
    if (auto root = knobs::env(var)) {
      in_dir(var, fs::path(*root) / "lib64");
      in_dir(var, fs::path(*root) / "lib");
    }
  for (const auto& so : sonames) out.push_back({"loader path", so});
  in_dir("/usr/local/cuda", "/usr/local/cuda/lib64");
  return out;
}

OpenedLibrary open_first(const std::vector<LibraryCandidate>& candidates,
                         const std::function<std::string(void*)>& accept) {
  OpenedLibrary out;
  for (const auto& c : candidates) {
    bool is_path = c.file.find('/') != std::string::npos;
    std::error_code ec;
    if (is_path && !fs::exists(c.file, ec)) {  // the common miss, said plainly (dlerror repeats the path)
      out.tried.push_back(c.source + " " + c.file + ": no such file");
      continue;
    }
    void* h = dlopen(c.file.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      out.tried.push_back(c.source + " " + c.file + ": " + (e ? e : "dlopen failed"));
      continue;
    }
    std::string why = accept(h);
    if (!why.empty()) {
      out.tried.push_back(c.source + " " + c.file + ": " + why);
      continue;  // not closed: unloading a CUDA library is not always safe, and this happens once
    }
    out.handle = h;
    out.path = c.file;
    return out;
  }
  return out;
}

std::string library_of(const void* symbol) {
  Dl_info info;
  return dladdr(symbol, &info) && info.dli_fname ? info.dli_fname : "";
}

}  // namespace kspec::jit
