// The knobs table and its accessors: the only getenv() calls in kspec.
#include "kspec/knobs.h"

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "kspec/error.h"

namespace kspec::knobs {

const std::vector<KnobInfo>& all() {
  static const std::vector<KnobInfo> table = {
      {"KSPEC_CACHE_DIR", "path", "$XDG_CACHE_HOME/kspec or ~/.cache/kspec", "disk cache directory (created 0700)"},
      {"KSPEC_CACHE", "on|off", "on", "off: keep compiled kernels in memory only"},
      {"KSPEC_CACHE_MAX_BYTES", "bytes", "2147483648", "disk cache size cap; least recently used entries are pruned"},
      {"KSPEC_TEMPLATE_DIR", "path", "(embedded)", "read kernel templates from this directory instead of the copies built into the library"},
      {"KSPEC_CUDA_INCLUDE", "path", "(auto)", "CUDA include directory for NVRTC (else CUDA_HOME, CUDA_PATH, next to libnvrtc)"},
      {"KSPEC_VERBOSE", "int", "0", "1: log compilations and cache events to stderr"},
      {"KSPEC_DEBUG_DIR", "path", "(system temp dir)", "where the source of a failing specialization is written"},
      {"KSPEC_COMPILE_THREADS", "int", "(hardware threads)", "threads for kspec precompile and kspec tune's compiles"},
      {"KSPEC_TUNING_DB", "path", "<cache dir>/tuning", "tuning database: a .json file, or a directory with one file per GPU model and toolkit"},
      {"KSPEC_TUNE", "on|off|auto", "on", "on: dispatch uses tuned configs where the database has them; off: heuristics only; auto: also tune a problem on first use"},
      {"KSPEC_TUNE_BUDGET", "seconds", "10", "time KSPEC_TUNE=auto may spend tuning one problem"},
  };
  return table;
}

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

std::string cache_dir() {
  if (auto v = env("KSPEC_CACHE_DIR")) return *v;
  if (auto v = env("XDG_CACHE_HOME")) return *v + "/kspec";
  if (auto v = env("HOME")) return *v + "/.cache/kspec";
  return (std::filesystem::temp_directory_path() / "kspec-cache").string();
}

bool cache_enabled() {
  auto v = env("KSPEC_CACHE");
  if (!v) return true;
  if (*v == "off" || *v == "0" || *v == "false" || *v == "no") return false;
  if (*v == "on" || *v == "1" || *v == "true" || *v == "yes") return true;
  throw InvalidArgument("KSPEC_CACHE: expected on or off, got '" + *v + "'");
}

namespace {
int64_t parse_int(const char* name, const std::string& v) {
  try {
    size_t pos = 0;
    long long x = std::stoll(v, &pos);
    if (pos == v.size()) return x;
  } catch (const std::exception&) {
  }
  throw InvalidArgument(std::string(name) + ": expected an integer, got '" + v + "'");
}
}  // namespace

int64_t cache_max_bytes() {
  auto v = env("KSPEC_CACHE_MAX_BYTES");
  return v ? parse_int("KSPEC_CACHE_MAX_BYTES", *v) : int64_t(2) << 30;
}

std::optional<std::string> template_dir() { return env("KSPEC_TEMPLATE_DIR"); }
std::optional<std::string> cuda_include() { return env("KSPEC_CUDA_INCLUDE"); }

int verbose() {
  auto v = env("KSPEC_VERBOSE");
  return v ? static_cast<int>(parse_int("KSPEC_VERBOSE", *v)) : 0;
}

std::string debug_dir() {
  if (auto v = env("KSPEC_DEBUG_DIR")) return *v;
  return std::filesystem::temp_directory_path().string();
}

int compile_threads() {
  if (auto v = env("KSPEC_COMPILE_THREADS")) return std::max<int>(1, static_cast<int>(parse_int("KSPEC_COMPILE_THREADS", *v)));
  return std::max(1u, std::thread::hardware_concurrency());
}

std::optional<std::string> tuning_db() { return env("KSPEC_TUNING_DB"); }

TuneMode tune_mode() {
  auto v = env("KSPEC_TUNE");
  if (!v || *v == "on" || *v == "1") return TuneMode::On;
  if (*v == "off" || *v == "0") return TuneMode::Off;
  if (*v == "auto") return TuneMode::Auto;
  throw InvalidArgument("KSPEC_TUNE: expected on, off or auto, got '" + *v + "'");
}

double tune_budget() {
  auto v = env("KSPEC_TUNE_BUDGET");
  if (!v) return 10.0;
  try {
    size_t pos = 0;
    double x = std::stod(*v, &pos);
    if (pos == v->size() && x > 0) return x;
  } catch (const std::exception&) {
  }
  throw InvalidArgument("KSPEC_TUNE_BUDGET: expected a positive number of seconds, got '" + *v + "'");
}

}  // namespace kspec::knobs
