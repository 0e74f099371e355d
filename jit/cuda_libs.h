// Where the CUDA libraries kspec opens at run time (NVRTC, cuBLASLt) are looked for: kspec links none of
// them, so one wheel works with the toolkit anywhere, with pip's nvidia wheels (which torch brings), or
// with CUDA 12 or 13. No CUDA header here: the Python bindings include it to pass pip's directories in.
// Error contract: nothing here throws; open_first() reports every place it tried in its result.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kspec::jit {

// The directories of pip's `nvidia` namespace package (site-packages/nvidia), given by the Python package
// at import; empty for C++ programs. CUDA 13 wheels put libraries in nvidia/cu13/lib and headers in
// nvidia/cu13/include; CUDA 12 wheels in nvidia/<component>/lib and include.
void set_nvidia_package_dirs(std::vector<std::string> dirs);
std::vector<std::string> nvidia_package_dirs();

// One place a library is looked for: `source` says why ("KSPEC_NVRTC", "pip nvidia wheel", "CUDA_HOME",
// "loader path"), `file` is a path, or a bare soname for the dynamic loader's own search.
struct LibraryCandidate {
  std::string source;
  std::string file;
};

// The places, in order: the override variable alone when it is set (an explicit choice is not second-
// guessed); else each soname in pip's nvidia wheels (`wheel_subdirs` under each nvidia dir), $CUDA_HOME,
// $CUDA_PATH, the loader path (LD_LIBRARY_PATH, ld.so.cache), and /usr/local/cuda.
std::vector<LibraryCandidate> library_candidates(const char* override_name,
                                                 const std::optional<std::string>& override_value,
                                                 const std::vector<std::string>& sonames,
                                                 const std::vector<std::string>& wheel_subdirs);

struct OpenedLibrary {
  void* handle = nullptr;     // dlopen handle (RTLD_LOCAL), never closed; null when nothing was usable
  std::string path;           // the file that was loaded
  std::vector<std::string> tried;  // "source file: why not" for every candidate before the one used
};

// dlopens the candidates in order; `accept(handle)` returns "" to take a library or why it is unusable
// (a missing entry point, too old a version), in which case the search goes on.
OpenedLibrary open_first(const std::vector<LibraryCandidate>& candidates,
                         const std::function<std::string(void*)>& accept);

// The file a loaded symbol comes from ("" if unknown).
std::string library_of(const void* symbol);

}  // namespace kspec::jit
