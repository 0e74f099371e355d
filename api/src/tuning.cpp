// Tuning database keys, files and the dispatch-time choice of a config. The file is read once per
// process (and again after this process writes it); a stale or unusable entry falls back to the
// op's heuristic with one warning.
#include "api/src/tuning.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "cache/tuning_db.h"
#include "jit/base/log.h"
#include "jit/driver.h"
#include "jit/files.h"
#include "jit/nvrtc.h"
#include "kspec/knobs.h"

namespace kspec {
namespace {

std::atomic<uint64_t> g_generation{1};

int64_t next_pow2(int64_t v) {
  int64_t b = 1;
  while (b < v && b < (int64_t(1) << 62)) b <<= 1;
  return v <= 0 ? v : b;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

struct Snapshot {
  uint64_t generation = 0;
  std::map<std::string, nlohmann::json> records;
  std::set<std::string> signatures;
};

std::shared_ptr<const Snapshot> snapshot(const std::string& path) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const Snapshot>> snaps;
  uint64_t gen = g_generation.load();
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = snaps[path];
  if (slot && slot->generation == gen) return slot;
  auto s = std::make_shared<Snapshot>();
  s->generation = gen;
  nlohmann::json entries = cache::TuningDb(path).entries();
  for (auto it = entries.begin(); it != entries.end(); ++it) {
    s->records[it.key()] = it.value();
    auto hash = it.key().rfind('#');
    s->signatures.insert(it.key().substr(0, hash));
  }
  slot = s;
  return slot;
}

// Whether a recorded config is one the op's current tuning space allows for this problem.
bool usable(const OpDef& op, const Problem& p, const nlohmann::json& record, Config* out, std::string* why) {
  if (!record.is_object() || !record.contains("config") || !record["config"].is_string()) {
    *why = "the record has no \"config\" text";
    return false;
  }
  Config c;
  try {
    c = Config::parse(record["config"].get<std::string>(), op.info);
  } catch (const std::exception& e) {
    *why = e.what();
    return false;
  }
  if (op.tuning.candidates) {  // a library's space: the op's own rules judge the record
    std::string reason;
    if (op.tuning.valid && !op.tuning.valid(p, c, &reason)) {
      *why = "config {" + c.str(op.info) + "} is not valid for " + op.info.name + ": " + reason;
      return false;
    }
    *out = c;
    return true;
  }
  if (!config_in_space(op, c, why)) return false;
  // The database's order may differ from the axes' order: use the axes' order.
  Config ordered;
  for (const auto& [axis, values] : op.tuning.axes) ordered.values.emplace_back(axis, c.get(axis));
  std::string reason;
  if (op.tuning.valid && !op.tuning.valid(p, ordered, &reason)) {
    *why = "config {" + c.str(op.info) + "} is not valid for this problem: " + reason;
    return false;
  }
  *out = ordered;
  return true;
}

// KSPEC_TUNE=auto: tune a problem the first time it is seen without an entry (once per key and
// process, one at a time); any failure leaves the heuristic in place.
bool autotune(const OpDef& op, const Problem& p, int device, const std::string& key) {
  static std::mutex mu;
  static std::set<std::string> attempted;
  std::lock_guard<std::mutex> lock(mu);
  if (!attempted.insert(key + "#d" + std::to_string(device)).second) return false;
  try {
    TuneRequest opts;  // the problem is p; only the options are read
    opts.device = device;
    opts.budget_s = knobs::tune_budget();
    jit::info("KSPEC_TUNE=auto: tuning " + key + " (budget " + std::to_string(opts.budget_s) + " s)");
    TuneResult r = tune_problem(op, p, opts, {});
    return r.written;
  } catch (const std::exception& e) {
    jit::warn_once("autotune:" + key, "KSPEC_TUNE=auto could not tune " + op.info.name + " (" + e.what() +
                                          "); using the heuristic");
    return false;
  }
}

// The database file for a GPU model and toolkit. Both names come from data (a device's name, an
// imported file's header), so each is sanitized into a plain file-name part, never a path.
std::string tuning_file_in(const std::string& dir, const std::string& gpu, const std::string& toolkit) {
  return dir + "/tuning-" + cache::sanitize_file_part(gpu) + "-cuda" + cache::sanitize_file_part(toolkit) + ".json";
}

}  // namespace

std::string pow2_bucket(const Problem& p, std::string_view skip) {
  std::string s;
  for (const auto& d : p.op->info.dims) {
    if (d.kind != DimKind::Var || !p.has_dim(d.name) || d.name == skip) continue;
    s += (s.empty() ? "" : ",") + d.name + "=" + std::to_string(next_pow2(p.dim(d.name)));
  }
  return s;
}

std::string tune_bucket(const Problem& p) {
  if (p.op && p.op->tune_bucket) return p.op->tune_bucket(p);
  return pow2_bucket(p);
}

std::string tuning_key(const Problem& p) { return p.signature() + "#" + tune_bucket(p); }

std::string gpu_name(int device) {
  static std::mutex mu;
  static std::map<int, std::string> names;
  std::lock_guard<std::mutex> lock(mu);
  auto it = names.find(device);
  if (it != names.end()) return it->second;
  std::string name = "no-gpu";
  if (device >= 0 && jit::driver_available() && device < jit::device_count()) {
    char buf[256] = {0};
    CUdevice dev;
    if (jit::driver().cuDeviceGet(&dev, device) == CUDA_SUCCESS &&
        jit::driver().cuDeviceGetName(buf, sizeof(buf), dev) == CUDA_SUCCESS)
      name = buf;
  }
  return names.emplace(device, name).first->second;
}

std::string tuning_db_path(int device) {
  auto v = knobs::tuning_db();
  if (v && ends_with(*v, ".json")) return *v;
  std::string dir = v ? *v : knobs::cache_dir() + "/tuning";
  return tuning_file_in(dir, gpu_name(device), jit::nvrtc_version());
}

uint64_t tuning_generation() { return g_generation.load(std::memory_order_relaxed); }
void tuning_changed() { g_generation.fetch_add(1); }

TuneMode tune_mode() {
  switch (knobs::tune()) {
    case knobs::Switch::Off: return TuneMode::Off;
    case knobs::Switch::Auto: return TuneMode::Auto;
    case knobs::Switch::On: break;
  }
  return TuneMode::On;
}

bool tuning_has_signature(const std::string& signature, int device) {
  if (tune_mode() == TuneMode::Off) return false;
  auto snap = snapshot(tuning_db_path(device));
  return snap->signatures.count(signature) > 0;
}

ConfigChoice choose_config(const OpDef& op, const Problem& p, const Config* forced, int device, bool may_autotune) {
  ConfigChoice ch;
  if (forced) {
    std::string why;
    KSPEC_CHECK(config_in_space(op, *forced, &why), op.info.name, ": ", why);
    KSPEC_CHECK(!op.tuning.valid || op.tuning.valid(p, *forced, &why), op.info.name, ": config {", forced->str(op.info),
                "} is not valid for this problem: ", why);
    ch.config = *forced;
    ch.source = "forced";
    return ch;
  }
  TuneMode mode = tune_mode();
  if (mode != TuneMode::Off && !op.tuning.empty()) {
    ch.db_path = tuning_db_path(device);
    ch.key = tuning_key(p);
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto snap = snapshot(ch.db_path);
      auto it = snap->records.find(ch.key);
      if (it != snap->records.end()) {
        std::string why;
        if (usable(op, p, it->second, &ch.config, &why)) {
          ch.source = "tuned";
          return ch;
        }
        ch.note = "tuned entry ignored: " + why;
        jit::warn_once("stale-tuning:" + ch.db_path + ":" + ch.key,
                       "the tuning database " + ch.db_path + " has an entry for " + op.info.name +
                           " that no longer applies (" + why + "); using the heuristic (retune with kspec tune)");
        break;
      }
      if (attempt == 0 && mode == TuneMode::Auto && may_autotune && device >= 0) {
        if (!autotune(op, p, device, ch.key)) break;
        continue;  // read the entry it wrote
      }
      break;
    }
  }
  ch.config = op.tuning.heuristic ? op.tuning.heuristic(p) : Config{};
  ch.source = "heuristic";
  return ch;
}

// ---- the database from the public API ----

std::string tuning_db_entries(const std::string& path) {
  return cache::TuningDb(path.empty() ? tuning_db_path(0) : path).entries().dump(1);
}

int64_t tuning_export(const std::string& file, const std::string& path) {
  std::string problem;
  cache::TuningDb db(path.empty() ? tuning_db_path(0) : path);
  nlohmann::json doc = db.document(&problem);
  KSPEC_CHECK_AS(problem.empty(), CacheError, "tuning database ", db.path(), " is unusable: ", problem);
  std::string err;
  KSPEC_CHECK_AS(jit::write_file_atomic(file, doc.dump(1) + "\n", &err), CacheError, "kspec tune --export: ", err);
  return static_cast<int64_t>(doc["entries"].size());
}

namespace {

// An import larger than any real database (a few thousand records are ~2 MB) is refused before it is
// read: every process would parse it on its first dispatch (a 142 MB one cost each 6 s and 1.2 GB).
constexpr uintmax_t kMaxImportBytes = uintmax_t(16) << 20;
// A recorded time beyond this is no measurement of one kernel call.
constexpr double kMaxRecordMs = 3600.0 * 1000.0;

// The file to import exists, is a regular file and is not too large.
void check_import_file(const std::string& file) {
  std::error_code ec;
  const auto status = std::filesystem::status(file, ec);
  KSPEC_CHECK(std::filesystem::exists(status), "kspec tune --import: ", file, " does not exist");
  KSPEC_CHECK(std::filesystem::is_regular_file(status), "kspec tune --import: ", file, " is not a regular file");
  const uintmax_t size = std::filesystem::file_size(file, ec);
  KSPEC_CHECK(!ec, "kspec tune --import: cannot read the size of ", file, ": ", ec.message());
  KSPEC_CHECK(size <= kMaxImportBytes, "kspec tune --import: ", file, " has ", size, " bytes; the limit is ",
              kMaxImportBytes >> 20, " MiB");
}

// Why one imported record cannot be merged ("" when it can): the key names a known op, the record's
// fields have the types kspec writes, its config is in the op's current tuning space, its time is one.
std::string import_record_problem(const std::string& key, const nlohmann::json& rec) {
  if (key.empty() || key.size() > 4096 || key.find('#') == std::string::npos || key.find('|') == std::string::npos)
    return "the key is not '<signature>#<bucket>'";
  if (!rec.is_object()) return "the record is not an object";
  static const char* const kText[] = {"op", "config", "default_config", "shape", "bucket", "signature",
                                      "arch", "gpu",    "toolkit",        "kspec", "updated"};
  static const char* const kNumbers[] = {"time_ms", "default_ms", "speedup", "configs_timed", "configs_total"};
  for (const char* f : kText)
    if (rec.contains(f) && !rec[f].is_string()) return std::string("\"") + f + "\" is not text";
  for (const char* f : kNumbers)
    if (rec.contains(f) && (!rec[f].is_number() || !std::isfinite(rec[f].get<double>())))
      return std::string("\"") + f + "\" is not a finite number";
  if (!rec.contains("config")) return "the record has no \"config\"";
  const std::string op_name = key.substr(0, key.find('|'));
  if (rec.contains("op") && rec["op"].get<std::string>() != op_name)
    return "its \"op\" (" + rec["op"].get<std::string>() + ") is not the key's (" + op_name + ")";
  const OpDef* op = Registry::global().find(op_name);
  if (!op) return "'" + op_name + "' is not an op of this kspec";
  Config c;
  try {
    c = Config::parse(rec["config"].get<std::string>(), op->info);
  } catch (const Error& e) {
    return e.what();
  }
  std::string why;
  if (!config_in_space(*op, c, &why)) return why;
  if (rec.contains("time_ms")) {
    const double ms = rec["time_ms"].get<double>();
    if (!(ms > 0 && ms < kMaxRecordMs))
      return "time_ms = " + std::to_string(ms) + " is not a kernel time (expected 0 < ms < " +
             std::to_string(static_cast<int64_t>(kMaxRecordMs)) + ")";
  }
  return "";
}

// Every record of an import, before any is merged: the whole import is refused if one is bad, naming the
// first few.
void check_import_records(const std::string& file, const nlohmann::json& doc) {
  for (const char* f : {"gpu", "toolkit"})
    KSPEC_CHECK(!doc.contains(f) || doc[f].is_string(), "kspec tune --import: ", file, ": \"", f, "\" is not text");
  KSPEC_CHECK(doc.contains("entries") && doc["entries"].is_object(), "kspec tune --import: ", file,
              ": \"entries\" is not an object of records");
  std::string first;
  int bad = 0;
  for (auto it = doc["entries"].begin(); it != doc["entries"].end(); ++it) {
    std::string why = import_record_problem(it.key(), it.value());
    if (why.empty()) continue;
    if (++bad <= 3) first += "\n  " + it.key().substr(0, 200) + ": " + why;
  }
  KSPEC_CHECK(bad == 0, "kspec tune --import: ", file, ": ", bad, " of ", doc["entries"].size(),
              " records cannot be imported (nothing was merged):", first, bad > 3 ? "\n  ..." : "");
}

}  // namespace

int64_t tuning_import(const std::string& file) {
  check_import_file(file);
  std::string problem;
  cache::TuningDb src(file, /*user_file=*/true);
  nlohmann::json doc = src.document(&problem);
  KSPEC_CHECK(problem.empty(), "kspec tune --import: ", file, " is not a kspec tuning database: ", problem);
  check_import_records(file, doc);
  std::string gpu = doc.value("gpu", std::string("no-gpu")), toolkit = doc.value("toolkit", jit::nvrtc_version());
  auto v = knobs::tuning_db();
  std::string target;
  if (v && ends_with(*v, ".json")) {
    target = *v;
  } else {
    std::string dir = v ? *v : knobs::cache_dir() + "/tuning";
    target = tuning_file_in(dir, gpu, toolkit);
  }
  // The faster measurement wins; a record without a time never replaces one with a time.
  auto faster = [](const nlohmann::json& have, const nlohmann::json& in) {
    double h = have.value("time_ms", -1.0), i = in.value("time_ms", -1.0);
    if (i <= 0) return false;
    return h <= 0 || i < h;
  };
  std::string err;
  KSPEC_CHECK_AS(cache::TuningDb(target).merge(doc["entries"], {{"gpu", gpu}, {"toolkit", toolkit}}, faster, &err),
                 CacheError, "kspec tune --import: ", err);
  tuning_changed();
  return static_cast<int64_t>(doc["entries"].size());
}

}  // namespace kspec
