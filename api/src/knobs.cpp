// The knobs table and its accessors: the only getenv() calls in kspec. Every knob is declared once below
// (name, accepted values, default, meaning); a value it does not take is an InvalidArgument naming the
// variable and what it takes, thrown by the accessor wherever the knob is read.
#include "kspec/knobs.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "kspec/error.h"

namespace kspec::knobs {
namespace {

const KnobInfo kCacheDir{"KSPEC_CACHE_DIR", "path", "$XDG_CACHE_HOME/kspec or ~/.cache/kspec",
                         "disk cache directory (created 0700)"};
const KnobInfo kCache{"KSPEC_CACHE", "on|off", "on", "off: keep compiled kernels in memory only"};
const KnobInfo kCacheMaxBytes{"KSPEC_CACHE_MAX_BYTES", "bytes", "2147483648",
                              "disk cache size cap; least recently used entries are pruned"};
const KnobInfo kTemplateDir{"KSPEC_TEMPLATE_DIR", "path", "(embedded)",
                            "read kernel templates from this directory instead of the copies built into the library"};
const KnobInfo kCudaInclude{"KSPEC_CUDA_INCLUDE", "path", "(auto)",
                            "CUDA include directory for NVRTC (else CUDA_HOME, CUDA_PATH, next to libnvrtc)"};
const KnobInfo kVerbose{"KSPEC_VERBOSE", "int", "0", "1 (or on): log compilations and cache events to stderr"};
const KnobInfo kDebugDir{"KSPEC_DEBUG_DIR", "path", "(system temp dir)",
                         "where the source of a failing specialization is written"};
const KnobInfo kCompileThreads{"KSPEC_COMPILE_THREADS", "int", "(hardware threads)",
                               "threads for kspec precompile and kspec tune's compiles"};
const KnobInfo kTuningDb{"KSPEC_TUNING_DB", "path", "<cache dir>/tuning",
                         "tuning database: a .json file, or a directory with one file per GPU model and toolkit"};
const KnobInfo kTune{"KSPEC_TUNE", "on|off|auto", "on",
                     "on: dispatch uses tuned configs where the database has them; off: heuristics only; auto: also "
                     "tune a problem on first use"};
const KnobInfo kTuneBudget{"KSPEC_TUNE_BUDGET", "seconds", "10", "time KSPEC_TUNE=auto may spend tuning one problem"};

// How every boolean knob may be spelled (any case); named in the errors.
constexpr const char* kBoolSpellings = "on/off, 1/0, true/false, yes/no (any case)";

std::string lower_trimmed(const std::string& v) {
  size_t b = v.find_first_not_of(" \t"), e = v.find_last_not_of(" \t");
  std::string s = b == std::string::npos ? std::string() : v.substr(b, e - b + 1);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::optional<bool> as_bool(const std::string& v) {
  std::string s = lower_trimmed(v);
  if (s == "on" || s == "1" || s == "true" || s == "yes") return true;
  if (s == "off" || s == "0" || s == "false" || s == "no") return false;
  return std::nullopt;
}

[[noreturn]] void bad_value(const KnobInfo& k, const std::string& expected, const std::string& v) {
  throw InvalidArgument(std::string(k.name) + ": expected " + expected + ", got '" + v + "'");
}

std::optional<std::string> read(const KnobInfo& k) { return env(k.name); }

bool read_bool(const KnobInfo& k, bool fallback) {
  auto v = read(k);
  if (!v) return fallback;
  if (auto b = as_bool(*v)) return *b;
  bad_value(k, kBoolSpellings, *v);
}

// An integer in lo..hi; `also_bool`: on/off and the other boolean spellings stand for 1 and 0.
int64_t read_int(const KnobInfo& k, int64_t fallback, int64_t lo, int64_t hi, bool also_bool = false) {
  auto v = read(k);
  if (!v) return fallback;
  const std::string expected = "an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
                               (also_bool ? std::string(" or ") + kBoolSpellings : std::string());
  if (also_bool)
    if (auto b = as_bool(*v)) return *b ? 1 : 0;
  std::string s = lower_trimmed(*v);
  try {
    size_t pos = 0;
    long long x = std::stoll(s, &pos);
    if (pos == s.size() && x >= lo && x <= hi) return x;
  } catch (const std::exception&) {  // not a number, or out of range: reported below
  }
  bad_value(k, expected, *v);
}

}  // namespace

const std::vector<KnobInfo>& all() {
  static const std::vector<KnobInfo> table = {kCacheDir, kCache,    kCacheMaxBytes, kTemplateDir, kCudaInclude, kVerbose,
                                              kDebugDir, kCompileThreads, kTuningDb, kTune,        kTuneBudget};
  return table;
}

void validate() {
  cache_enabled();
  cache_max_bytes();
  verbose();
  compile_threads();
  tune_mode();
  tune_budget();
}

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

std::string cache_dir() {
  if (auto v = read(kCacheDir)) return *v;
  if (auto v = env("XDG_CACHE_HOME")) return *v + "/kspec";
  if (auto v = env("HOME")) return *v + "/.cache/kspec";
  return (std::filesystem::temp_directory_path() / "kspec-cache").string();
}

bool cache_enabled() { return read_bool(kCache, true); }

int64_t cache_max_bytes() { return read_int(kCacheMaxBytes, int64_t(2) << 30, 0, INT64_MAX); }

std::optional<std::string> template_dir() { return read(kTemplateDir); }
std::optional<std::string> cuda_include() { return read(kCudaInclude); }

int verbose() { return static_cast<int>(read_int(kVerbose, 0, 0, INT32_MAX, true)); }

std::string debug_dir() {
  if (auto v = read(kDebugDir)) return *v;
  return std::filesystem::temp_directory_path().string();
}

int compile_threads() {
  // More threads than this would only exhaust the process's threads, never compile faster.
  constexpr int64_t kMaxThreads = 1024;
  const int64_t hw = std::min<int64_t>(kMaxThreads, std::max(1u, std::thread::hardware_concurrency()));
  return static_cast<int>(read_int(kCompileThreads, hw, 1, kMaxThreads));
}

std::optional<std::string> tuning_db() { return read(kTuningDb); }

TuneMode tune_mode() {
  auto v = read(kTune);
  if (!v) return TuneMode::On;
  if (lower_trimmed(*v) == "auto") return TuneMode::Auto;
  if (auto b = as_bool(*v)) return *b ? TuneMode::On : TuneMode::Off;
  bad_value(kTune, std::string("auto or ") + kBoolSpellings, *v);
}

double tune_budget() {
  auto v = read(kTuneBudget);
  if (!v) return 10.0;
  std::string s = lower_trimmed(*v);
  try {
    size_t pos = 0;
    double x = std::stod(s, &pos);
    if (pos == s.size() && std::isfinite(x) && x > 0) return x;
  } catch (const std::exception&) {  // reported below
  }
  bad_value(kTuneBudget, "a positive number of seconds", *v);
}

}  // namespace kspec::knobs
