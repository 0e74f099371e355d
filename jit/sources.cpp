// Template text (embedded or from KSPEC_TEMPLATE_DIR), CUDA include discovery and include closures.
#include "sources.h"


#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "kspec/error.h"
#include "kspec/knobs.h"
#include "nvrtc.h"

// Generated at build time from templates/ (jit/embed_templates.cmake).
namespace kspec::embedded {
struct EmbeddedFile {
  const char* name;
  const char* content;
  unsigned long size;
};
extern const EmbeddedFile kTemplates[];
extern const unsigned long kTemplateCount;
}  // namespace kspec::embedded

namespace fs = std::filesystem;

namespace kspec::jit {
namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

bool is_template_file(const fs::path& p) {
  auto ext = p.extension().string();
  return ext == ".cuh" || ext == ".h" || ext == ".cu" || ext == ".inc";
}

}  // namespace

TemplateSource TemplateSource::embedded() {
  TemplateSource s;
  s.origin_ = "embedded";
  for (unsigned long i = 0; i < embedded::kTemplateCount; ++i)
    s.files_.emplace(embedded::kTemplates[i].name,
                     std::string(embedded::kTemplates[i].content, embedded::kTemplates[i].size));
  return s;
}

TemplateSource TemplateSource::from_directory(const std::string& dir) {
  TemplateSource s;
  s.origin_ = dir;
  std::error_code ec;
  KSPEC_CHECK(fs::is_directory(dir, ec), "KSPEC_TEMPLATE_DIR: '", dir, "' is not a directory");
  for (auto it = fs::recursive_directory_iterator(dir, ec); it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (ec) break;
    if (!it->is_regular_file() || !is_template_file(it->path())) continue;
    s.files_.emplace(fs::relative(it->path(), dir).generic_string(), read_file(it->path()));
  }
  return s;
}

const TemplateSource& TemplateSource::global() {
  static const TemplateSource source = [] {
    auto dir = knobs::template_dir();
    return dir ? from_directory(*dir) : embedded();
  }();
  return source;
}

bool TemplateSource::has(const std::string& name) const { return files_.count(name) > 0; }

const std::string& TemplateSource::read(const std::string& name) const {
  auto it = files_.find(name);
  KSPEC_CHECK(it != files_.end(), "template '", name, "' not found in ", origin_, " templates");
  return it->second;
}

std::vector<std::string> TemplateSource::names() const {
  std::vector<std::string> out;
  for (const auto& kv : files_) out.push_back(kv.first);
  return out;
}

std::vector<std::pair<std::string, bool>> parse_includes(const std::string& text) {
  std::vector<std::pair<std::string, bool>> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    size_t i = line.find_first_not_of(" \t");
    if (i == std::string::npos || line[i] != '#') continue;
    i = line.find_first_not_of(" \t", i + 1);
    if (i == std::string::npos || line.compare(i, 7, "include") != 0) continue;
    i = line.find_first_of("\"<", i + 7);
    if (i == std::string::npos) continue;
    char close = line[i] == '"' ? '"' : '>';
    size_t j = line.find(close, i + 1);
    if (j == std::string::npos) continue;
    out.emplace_back(line.substr(i + 1, j - i - 1), close == '"');
  }
  return out;
}

std::vector<TemplateFile> TemplateSource::kspec_closure(const std::string& header) const {
  std::vector<TemplateFile> out;
  std::set<std::string> seen;
  std::vector<std::string> stack{header};
  while (!stack.empty()) {
    std::string name = stack.back();
    stack.pop_back();
    if (!seen.insert(name).second) continue;
    const std::string& text = read(name);
    out.push_back({name, text});
    for (const auto& [inc, quoted] : parse_includes(text)) {
      if (has(inc)) {
        stack.push_back(inc);
      } else {
        KSPEC_CHECK(!quoted, "template '", name, "' includes \"", inc,
                    "\", which is not a kspec template (kspec templates include each other by their "
                    "path under templates/, e.g. \"common/dtype.cuh\")");
      }
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

std::vector<std::string> TemplateSource::system_includes(const std::string& header) const {
  std::set<std::string> names;
  for (const auto& f : kspec_closure(header))
    for (const auto& [inc, quoted] : parse_includes(f.content))
      if (!has(inc)) names.insert(inc);
  return {names.begin(), names.end()};
}

std::vector<TemplateFile> TemplateSource::system_closure(const std::string& header) const {
  std::vector<TemplateFile> out;
  const std::string& inc_dir = cuda_include_dir();
  std::set<std::string> seen;
  std::vector<std::string> stack = system_includes(header);
  while (!stack.empty()) {
    std::string name = stack.back();
    stack.pop_back();
    if (!seen.insert(name).second || inc_dir.empty()) continue;
    fs::path p = fs::path(inc_dir) / name;
    std::error_code ec;
    if (!fs::is_regular_file(p, ec)) continue;  // an NVRTC built-in header: covered by its version
    std::string text = read_file(p);
    for (const auto& [inc, quoted] : parse_includes(text)) {
      // Quoted includes inside CUDA headers are relative to the including file's directory.
      fs::path rel = fs::path(name).parent_path() / inc;
      stack.push_back(quoted ? rel.generic_string() : inc);
    }
    out.push_back({name, std::move(text)});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

std::vector<std::pair<std::string, std::string>> cuda_include_candidates() {
  std::vector<std::pair<std::string, std::string>> out;
  if (auto v = knobs::cuda_include()) out.emplace_back("KSPEC_CUDA_INCLUDE", *v);
  // The headers of NVRTC's own toolkit or wheel set first: NVRTC 12 cannot parse CUDA 13's headers.
  std::string lib;
  try {
    lib = nvrtc().path;
  } catch (const CudaError&) {  // no NVRTC: nothing compiles, but the search is still shown (doctor)
  }
  if (!lib.empty()) {
    fs::path dir = fs::path(lib).parent_path();
    out.emplace_back("next to libnvrtc", (dir.parent_path() / "include").string());
    out.emplace_back("next to libnvrtc", (dir.parent_path().parent_path() / "include").string());
    out.emplace_back("next to libnvrtc", (dir.parent_path() / "targets/x86_64-linux/include").string());
  }
  for (const auto& nv : nvidia_package_dirs())
    for (const char* sub : {"cu13/include", "cuda_runtime/include"})
      out.emplace_back("pip nvidia wheel", (fs::path(nv) / sub).string());
  if (auto v = knobs::env("CUDA_HOME")) out.emplace_back("CUDA_HOME", *v + "/include");
  if (auto v = knobs::env("CUDA_PATH")) out.emplace_back("CUDA_PATH", *v + "/include");
  out.emplace_back("/usr/local/cuda", "/usr/local/cuda/include");
#ifdef KSPEC_BUILD_CUDA_INCLUDE
  out.emplace_back("the toolkit kspec was built with", KSPEC_BUILD_CUDA_INCLUDE);
#endif
  return out;
}

const std::string& cuda_include_dir() {
  static const std::string dir = [] {
    for (const auto& [source, c] : cuda_include_candidates()) {
      std::error_code ec;
      if (!c.empty() && fs::is_regular_file(fs::path(c) / "cuda_fp16.h", ec))
        return fs::weakly_canonical(c).string();
    }
    return std::string();
  }();
  return dir;
}

}  // namespace kspec::jit
