// The autotuner and the tuning database seen from the public API (`kspec tune`, kspec.tune(),
// kspec.explain()). A tuned configuration is stored per (op, specialization, shape bucket, arch) in a
// JSON file per GPU model and toolkit; dispatch uses it when present (KSPEC_TUNE=on, the default),
// ignores it with KSPEC_TUNE=off, and with KSPEC_TUNE=auto tunes a problem on its first call.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kspec/registry.h"

namespace kspec {

// One problem to tune: an op, its dtype, its dims (runtime ones too: rows=16384, hidden=4096), params.
struct TuneRequest {
  // The problem as a compile request: every dim in params (runtime ones too); its arch is used only
  // without a GPU (compile_only), else the device's; its config is ignored (the tuner searches).
  CompileRequest problem;
  int device = 0;
  double budget_s = 60;                 // wall-clock budget (compiles and timing; the default is always timed)
  bool all_configs = false;             // time every legal config, whatever the budget
  bool compile_only = false;            // prune and compile, time nothing (works without a GPU)
  bool write_db = true;                 // record the winner in the tuning database
  int batches = 15;                     // timed batches per config (the median is kept)
  int max_candidates = 16;              // library ops (gemm): the heuristic's top candidates to time
  uint64_t seed = 0;                    // input data (0: fixed default seed)
};

struct TuneCandidate {
  Config config;
  bool is_default = false;
  // "ok" (timed and verified), "pruned" (ruled out before compiling), "compile error", "spills",
  // "too many registers", "launch failed", "mismatch" (outputs differ from the default's),
  // "not timed" (budget spent, or compile_only).
  std::string status = "not timed";
  std::string why;
  double median_ms = -1, min_ms = -1;
  double error = -1;                    // relative difference of its outputs from the default config's
  int registers = -1, spill_bytes = -1, shared_bytes = -1;
  double compile_ms = 0;
};

struct TuneResult {
  std::string op, gpu, arch, signature, bucket, key, shape, db_path;
  Config default_config, best_config;
  double default_ms = -1, best_ms = -1;
  // The default first, then every combination of the axes (or, for a library op such as gemm, the
  // library's candidates for the problem, found on the GPU, and any the op builds from their timings).
  std::vector<TuneCandidate> candidates;
  bool timed = false;                     // false without a GPU or with compile_only
  bool written = false;                   // the winner was recorded in db_path
  double seconds = 0;
  int batch_calls = 0;                    // calls per timed batch (for the default)
  int input_sets = 0;                     // input sets rotated so that L2 does not flatter small problems
  std::string note;                       // e.g. why nothing could be timed
};

struct TuneProgress {
  std::string phase;  // "compile" or "time"
  int done = 0, total = 0;
  const TuneCandidate* candidate = nullptr;  // the one just finished
};
using TuneCallback = std::function<void(const TuneProgress&)>;

// Enumerates and prunes the op's tuning space for the problem, compiles the legal configs in parallel
// (KSPEC_COMPILE_THREADS threads), drops those that spill or cannot launch, then on the GPU times each
// (warm-up, CUDA events around batches of calls queued behind a spin kernel, median of batches,
// inputs rotated over sets larger than L2, random data) after checking its outputs against the default
// config's, and records the fastest in the tuning database. Throws InvalidArgument/Unsupported for a
// bad request or an op without a tuning space.
TuneResult tune(const TuneRequest& request, const TuneCallback& progress = {});

// The tuning database file dispatch reads for a device (-1: no device; the GPU part is "no-gpu").
std::string tuning_db_path(int device = 0);
// Its entries as JSON text (an object key → record; "{}" when the file is missing or unusable).
std::string tuning_db_entries(const std::string& path = "");
// Writes the database (or `path`) to `file` (the same format). Returns the number of entries.
int64_t tuning_export(const std::string& file, const std::string& path = "");
// Merges `file` into the database for the GPU and toolkit named in its header (or KSPEC_TUNING_DB's
// file); for a key in both, the faster measured record is kept. Returns the entries merged.
int64_t tuning_import(const std::string& file);

// What a call would use: the specialization, the config and where it came from, the tuning
// database's file and key, and each kernel's cache entry.
struct PlanInfo {
  struct Kernel {
    std::string name, arch, key, cache_path;
  };
  std::string op, signature, bucket, config;
  std::string config_source;  // "forced", "tuned" or "heuristic"
  std::string note;           // why a database entry was not used, if one was found
  std::string tuning_db, tuning_key, tune_mode;
  std::vector<Kernel> kernels;
  std::string str() const;
};
PlanInfo explain_plan(std::string_view op, const std::vector<TensorView>& inputs,
                      const std::vector<TensorView>& outputs, const Params& params = {});
// The same without tensors (no GPU needed): the request's params may give runtime dims too.
PlanInfo explain_request(const CompileRequest& request);

}  // namespace kspec
