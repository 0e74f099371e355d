// Every KSPEC_* environment variable, declared once below as a typed Knob{name, default, parse, doc}.
// Nothing else in kspec calls getenv(): a layer reads a knob by calling it (knobs::verbose()), every time,
// so a changed environment is seen by the next call. Values are read in any case; every boolean takes
// on/off, 1/0, true/false, yes/no. A value a knob does not take is an InvalidArgument naming the variable,
// what it takes and what it got ("KSPEC_CACHE: expected on/off, ..., got 'maybe'"), thrown by the read.
// The knobs are part of kspec's bottom layer (jit/base): they say how a variable is spelt and parsed;
// what a value means to an op (the tune mode) stays in the layer that uses it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kspec::knobs {

// Read a variable from the environment (the one place that does); unset and empty are both nullopt.
// Exposed for the variables kspec honours but does not own (CUDA_HOME, CUDA_PATH, XDG_CACHE_HOME).
std::optional<std::string> env(const char* name);

// The value a knob has when its variable is unset or empty: `text` for listings, `value` computed at read
// time (a default may itself depend on the environment, e.g. $HOME).
template <typename T>
struct Default {
  const char* text;
  T (*value)();
};

// How a knob's text becomes a T: `read` returns nullopt for a text the knob does not take; `expected`
// names the values it takes (in errors); `type` is the short form in listings.
template <typename T>
struct Parse {
  const char* type;
  std::string (*expected)();
  std::optional<T> (*read)(const std::string& text);
};

// Throws InvalidArgument "NAME: expected EXPECTED, got 'GOT'".
[[noreturn]] void bad_value(const char* name, const std::string& expected, const std::string& got);

template <typename T>
struct Knob {
  const char* name;
  Default<T> fallback;
  Parse<T> parse;
  const char* doc;

  // The current value; InvalidArgument for a value the knob does not take.
  T operator()() const {
    auto v = value_set();
    return v ? *v : fallback.value();
  }
  // The value the variable is set to, nullopt when unset or empty (the default is not computed);
  // InvalidArgument for a value the knob does not take.
  std::optional<T> value_set() const {
    auto text = env(name);
    if (!text) return std::nullopt;
    if (auto v = parse.read(*text)) return v;
    bad_value(name, parse.expected(), *text);
  }
};

// ---- parsers (any case, surrounding blanks ignored) ----

// The boolean spellings, as named in errors.
std::string bool_spellings();
std::optional<bool> read_bool(const std::string& text);
// An integer in lo..hi; also_bool: the boolean spellings stand for 1 and 0.
std::optional<int64_t> read_int(const std::string& text, int64_t lo, int64_t hi, bool also_bool);
std::string int_expected(int64_t lo, int64_t hi, bool also_bool);

constexpr Parse<bool> kBoolean{"on|off", bool_spellings, read_bool};

template <int64_t kLo, int64_t kHi, bool kAlsoBool = false>
constexpr Parse<int64_t> integer(const char* type) {
  return {type, [] { return int_expected(kLo, kHi, kAlsoBool); },
          [](const std::string& t) { return read_int(t, kLo, kHi, kAlsoBool); }};
}

// Any non-empty text: a path, taken as given.
constexpr Parse<std::string> kPath{"path", [] { return std::string("a path"); },
                                   [](const std::string& t) { return std::optional<std::string>(t); }};
constexpr Parse<std::optional<std::string>> kOptionalPath{
    "path", [] { return std::string("a path"); },
    [](const std::string& t) { return std::optional<std::optional<std::string>>(t); }};

// A positive finite number.
std::optional<double> read_positive(const std::string& text);
constexpr Parse<double> kPositive{"number", [] { return std::string("a positive number of seconds"); },
                                  read_positive};

// A boolean that may also be left to kspec: on, off or auto.
enum class Switch { Off, On, Auto };
std::optional<Switch> read_switch(const std::string& text);
constexpr Parse<Switch> kSwitch{"on|off|auto", [] { return "auto or " + bool_spellings(); }, read_switch};

// ---- the knobs ----

std::string default_cache_dir();
std::string temp_dir();
int64_t hardware_threads();

inline constexpr Knob<std::string> cache_dir{
    "KSPEC_CACHE_DIR", {"$XDG_CACHE_HOME/kspec or ~/.cache/kspec", default_cache_dir}, kPath,
    "disk cache directory (created 0700)"};
inline constexpr Knob<bool> cache_enabled{"KSPEC_CACHE", {"on", [] { return true; }}, kBoolean,
                                          "off: keep compiled kernels in memory only"};
inline constexpr Knob<int64_t> cache_max_bytes{"KSPEC_CACHE_MAX_BYTES",
                                               {"2147483648", [] { return int64_t(2) << 30; }},
                                               integer<0, INT64_MAX>("bytes"),
                                               "disk cache size cap; least recently used entries are pruned"};
inline constexpr Knob<std::optional<std::string>> template_dir{
    "KSPEC_TEMPLATE_DIR", {"(embedded)", [] { return std::optional<std::string>(); }}, kOptionalPath,
    "read kernel templates from this directory instead of the copies built into the library"};
inline constexpr Knob<std::optional<std::string>> cuda_include{
    "KSPEC_CUDA_INCLUDE", {"(auto)", [] { return std::optional<std::string>(); }}, kOptionalPath,
    "CUDA include directory for NVRTC (else next to libnvrtc, pip's nvidia wheels, CUDA_HOME, CUDA_PATH, "
    "/usr/local/cuda)"};
inline constexpr Knob<std::optional<std::string>> nvrtc{
    "KSPEC_NVRTC", {"(auto)", [] { return std::optional<std::string>(); }}, kOptionalPath,
    "path of the libnvrtc.so to load (else pip's nvidia wheels, CUDA_HOME, CUDA_PATH, the loader path, "
    "/usr/local/cuda)"};
inline constexpr Knob<std::optional<std::string>> libcuda{
    "KSPEC_LIBCUDA", {"(auto)", [] { return std::optional<std::string>(); }}, kOptionalPath,
    "path of the CUDA driver library to load instead of libcuda.so.1 (a testing aid: tests/mock_cuda's "
    "stand-in measures the host path on a machine without a GPU)"};
inline constexpr Knob<std::optional<std::string>> libcublaslt{
    "KSPEC_LIBCUBLASLT", {"(auto)", [] { return std::optional<std::string>(); }}, kOptionalPath,
    "path of the cuBLASLt library to load instead of searching for libcublasLt.so.13 (a testing aid, as "
    "KSPEC_LIBCUDA: tests/mock_cuda's stand-in counts the gemm ops' cuBLASLt calls)"};
inline constexpr Knob<int64_t> verbose{"KSPEC_VERBOSE", {"0", [] { return int64_t(0); }},
                                       integer<0, INT32_MAX, true>("int"),
                                       "1 (or on): log compilations and cache events to stderr"};
inline constexpr Knob<std::string> debug_dir{"KSPEC_DEBUG_DIR", {"(system temp dir)", temp_dir}, kPath,
                                             "where the source of a failing specialization is written"};
// More threads than this would only exhaust the process's threads, never compile faster.
constexpr int64_t kMaxCompileThreads = 1024;
inline constexpr Knob<int64_t> compile_threads{"KSPEC_COMPILE_THREADS", {"(hardware threads)", hardware_threads},
                                               integer<1, kMaxCompileThreads>("int"),
                                               "threads for kspec precompile and kspec tune's compiles"};
inline constexpr Knob<std::optional<std::string>> tuning_db{
    "KSPEC_TUNING_DB", {"<cache dir>/tuning", [] { return std::optional<std::string>(); }}, kOptionalPath,
    "tuning database: a .json file, or a directory with one file per GPU model and toolkit"};
inline constexpr Knob<Switch> tune{"KSPEC_TUNE", {"on", [] { return Switch::On; }}, kSwitch,
                                   "on: dispatch uses tuned configs where the database has them; off: heuristics "
                                   "only; auto: also tune a problem on first use"};
inline constexpr Knob<double> tune_budget{"KSPEC_TUNE_BUDGET", {"10", [] { return 10.0; }}, kPositive,
                                          "seconds KSPEC_TUNE=auto may spend tuning one problem"};
inline constexpr Knob<bool> torch_ext{"KSPEC_TORCH_EXT", {"on", [] { return true; }}, kBoolean,
                                      "off: Python takes its pure path even where the torch extension "
                                      "(kspec._torch_ext) is built"};

// ---- the table ----

struct KnobInfo {
  const char* name;
  const char* type;
  const char* default_value;
  const char* doc;
  void (*check)();  // reads the variable: InvalidArgument for a value it does not take (no default computed)
};

// Every knob above, in order: for `kspec doctor`, the README's table and Python's kspec.knobs().
const std::vector<KnobInfo>& all();

// Reads every knob: throws InvalidArgument for the first value a knob does not take. Run where kspec starts
// to compile or plan (obtain a binary, compile, explain), so that a misspelt knob fails there whether or
// not that path reads it.
void validate();

}  // namespace kspec::knobs
