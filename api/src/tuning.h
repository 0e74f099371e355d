// The api side of the tuning database: its keys (specialization + shape bucket), the file for a device,
// and the config dispatch uses for a problem (forced, tuned, or the op's heuristic).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "api/src/op.h"
#include "kspec/tune.h"

namespace kspec {

// The op's bucket of a problem's runtime dims (OpDef::tune_bucket, else each Var dim rounded up to a
// power of two: "rows=16384").
std::string tune_bucket(const Problem& p);
// The default bucket: each Var dim the problem has, but `skip`, rounded up to a power of two.
std::string pow2_bucket(const Problem& p, std::string_view skip = {});
// The database key: the problem signature (op, arch, dtypes, compiled dims and params, alignment,
// derived keys) and the bucket, "<signature>#<bucket>".
std::string tuning_key(const Problem& p);
std::string gpu_name(int device);  // "no-gpu" when there is none

struct ConfigChoice {
  Config config;
  std::string source;  // "forced", "tuned", "heuristic"
  std::string db_path, key, note;
};
// The config a call uses. device < 0: no device (compile requests, plans without a GPU).
// `may_autotune`: KSPEC_TUNE=auto may tune this problem now (a call outside graph capture).
ConfigChoice choose_config(const OpDef& op, const Problem& p, const Config* forced, int device,
                           bool may_autotune = false);
// KSPEC_TUNE, as dispatch reads it: On uses tuned configs where the database has them, Off ignores the
// database (heuristics only), Auto also tunes a problem on its first call.
enum class TuneMode { On, Off, Auto };
TuneMode tune_mode();

// Whether the database for the device has any entry for this signature (then plans differ by bucket).
bool tuning_has_signature(const std::string& signature, int device);
// Bumped whenever this process writes a database: plans built before are rebuilt.
uint64_t tuning_generation();
void tuning_changed();

// The tuner's core, for a problem already built (tune() and KSPEC_TUNE=auto).
TuneResult tune_problem(const OpDef& op, const Problem& p, const TuneRequest& options, const TuneCallback& progress);

}  // namespace kspec
