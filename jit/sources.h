// Where kernel template text comes from: the copies embedded in the library at build time, or
// KSPEC_TEMPLATE_DIR for development (edit a template, rerun, get the new kernel). Also finds the CUDA
// headers NVRTC needs and computes the include closure whose bytes go into a kernel's content key.
// Error contract: read() throws InvalidArgument for an unknown template; include_closure() throws
// CompileError-free InvalidArgument when a quoted include cannot be found.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kspec::jit {

struct TemplateFile {
  std::string name;     // relative to templates/: "norm_act/norm_act.cuh"
  std::string content;
};

class TemplateSource {
 public:
  // The process-wide source: KSPEC_TEMPLATE_DIR when set, else the embedded templates.
  static const TemplateSource& global();
  // For tests: a source over an explicit directory.
  static TemplateSource from_directory(const std::string& dir);
  static TemplateSource embedded();

  bool has(const std::string& name) const;
  const std::string& read(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::string& origin() const { return origin_; }  // "embedded" or the directory

  // Every template file the header includes, directly or not (itself included), in a stable order.
  std::vector<TemplateFile> kspec_closure(const std::string& header) const;
  // The system headers (<cuda_fp16.h>, ...) the closure includes, resolved to files of the CUDA
  // include directory and recursively their includes: (path, content) pairs, sorted by path.
  std::vector<TemplateFile> system_closure(const std::string& header) const;
  // Only the system headers the kspec closure includes directly, sorted: cheap (no CUDA header read).
  std::vector<std::string> system_includes(const std::string& header) const;

 private:
  std::map<std::string, std::string> files_;
  std::string origin_;
};

// Where CUDA's headers (cuda_fp16.h, cuda_bf16.h) are looked for, in order, as (why, directory):
// KSPEC_CUDA_INCLUDE, the toolkit or wheel set of the loaded libnvrtc, pip's nvidia wheels, $CUDA_HOME,
// $CUDA_PATH, /usr/local/cuda, the toolkit kspec was built against.
std::vector<std::pair<std::string, std::string>> cuda_include_candidates();
// The first candidate holding cuda_fp16.h, found once per process; empty if none does.
const std::string& cuda_include_dir();

// Parses `#include "x"` and `#include <x>` lines (no macro expansion: kspec templates include by name).
std::vector<std::pair<std::string, bool>> parse_includes(const std::string& text);  // (name, quoted)

}  // namespace kspec::jit
