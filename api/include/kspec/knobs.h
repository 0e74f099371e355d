// Every KSPEC_* environment variable, declared once with its type, default and meaning.
// Nothing else in kspec calls getenv(); read a knob through these accessors (see api/src/knobs.cpp).
// Values are read case-insensitively; every boolean knob takes on/off, 1/0, true/false, yes/no. An
// accessor throws kspec::InvalidArgument naming the variable and the values it takes for any other value.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kspec::knobs {

struct KnobInfo {
  const char* name;
  const char* type;
  const char* default_value;
  const char* doc;
};

// The table of all knobs, for `kspec doctor`, the README and Python's kspec.knobs().
const std::vector<KnobInfo>& all();

// KSPEC_CACHE_DIR: the disk cache's directory (default $XDG_CACHE_HOME/kspec or ~/.cache/kspec).
std::string cache_dir();
// KSPEC_CACHE: on (default) or off (memory only, nothing read from or written to disk).
bool cache_enabled();
// KSPEC_CACHE_MAX_BYTES: size cap of the disk cache, pruned least-recently-used first (default 2 GiB).
int64_t cache_max_bytes();
// KSPEC_TEMPLATE_DIR: read kernel templates from this directory instead of the embedded copies.
std::optional<std::string> template_dir();
// KSPEC_CUDA_INCLUDE: the CUDA include directory for NVRTC (default: CUDA_HOME, CUDA_PATH, next to libnvrtc).
std::optional<std::string> cuda_include();
// KSPEC_VERBOSE: 0 or off quiet (default), 1 or on log compiles and cache events to stderr.
int verbose();
// KSPEC_DEBUG_DIR: where failing sources are written (default: the system temp directory).
std::string debug_dir();
// KSPEC_COMPILE_THREADS: threads for batch compilation, 1..1024 (default: hardware concurrency).
int compile_threads();

// KSPEC_TUNING_DB: the tuning database: a .json file (used for every GPU), or a directory holding one
// file per GPU model and toolkit (default: <cache dir>/tuning).
std::optional<std::string> tuning_db();
// KSPEC_TUNE: how dispatch uses the tuning database.
enum class TuneMode { On, Off, Auto };
// on (default: tuned configs where present), off (ignored), auto (tune on first use); on/off as any boolean.
TuneMode tune_mode();
// KSPEC_TUNE_BUDGET: seconds KSPEC_TUNE=auto may spend tuning one problem (default 10).
double tune_budget();

// Reads every knob that has a type: throws InvalidArgument for the first value a knob does not take. Run
// where kspec starts to compile or plan (obtain a binary, compile, explain), so that a misspelt knob
// fails there whether or not that path reads it.
void validate();

// Read a variable from the environment (the one place that does). Exposed for CUDA_HOME/CUDA_PATH.
std::optional<std::string> env(const char* name);

}  // namespace kspec::knobs
