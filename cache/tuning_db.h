// The tuning database: one human-readable JSON file per GPU model and toolkit, mapping a key (op,
// specialization, shape bucket, arch: built by the api layer) to the record of the winning config.
// It knows files, keys and records, not ops. File layout (versioned by "version"):
//   {"version": 1, "kind": "kspec-tuning", "gpu": "...", "toolkit": "13.0",
//    "entries": {"<key>": {"config": "warps=4,items=8", "time_ms": ..., ...}, ...}}
//
// Error contract: nothing here throws for I/O or content problems. A missing file is an empty
// database; an unreadable, corrupt, too large (kMaxTuningDbBytes) or too deeply nested, foreign-version
// or untrusted file (a symlink, another user's, writable by group or others) is ignored with one warning
// per process (its entries are not used) and is never overwritten blindly: a writer first moves it aside
// to <file>.corrupt (a rename: a symlink there is replaced, not followed), then starts a fresh file.
// Writers create the directory 0700 and refuse one that is not this user's private directory, hold an
// flock on <file>.lock, re-read the file, merge, and replace it atomically, so concurrent tuners lose
// no entries.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace kspec::cache {

constexpr int kTuningDbVersion = 1;

class TuningDb {
 public:
  // `user_file`: a file the user named to read (an import), which may be anyone's and a symlink; the
  // size and depth bounds still apply.
  explicit TuningDb(std::string path, bool user_file = false) : path_(std::move(path)), user_file_(user_file) {}
  const std::string& path() const { return path_; }

  // The "entries" object of the file (empty when missing, unreadable or corrupt). `problem`, when
  // given, says why the file was not usable ("" for a missing file or a good one).
  nlohmann::json entries(std::string* problem = nullptr) const;
  // The whole document (header and entries); a fresh one when the file is missing or unusable.
  nlohmann::json document(std::string* problem = nullptr) const;
  std::optional<nlohmann::json> get(const std::string& key) const;

  // Decides, for a key present in both, whether the incoming record replaces the existing one.
  using Prefer = std::function<bool(const nlohmann::json& existing, const nlohmann::json& incoming)>;
  static bool prefer_incoming(const nlohmann::json&, const nlohmann::json&) { return true; }

  // Locks, re-reads, merges `incoming` (key → record) and replaces the file atomically. `header`
  // fields (gpu, toolkit) fill a new file. False (with a warning and `err`) when it cannot write.
  bool merge(const nlohmann::json& incoming, const nlohmann::json& header, const Prefer& prefer = prefer_incoming,
             std::string* err = nullptr);

 private:
  std::string path_;
  bool user_file_;
};

// A file name part from free text (a GPU name, a toolkit version: data, never a path): letters, digits,
// '_' and '.' are kept, every other run becomes one '-', at most 64 characters; nothing usable (or only
// dots) gives "unknown". "NVIDIA H100 80GB HBM3" → "NVIDIA-H100-80GB-HBM3", "/../x" → "..-x".
std::string sanitize_file_part(const std::string& text);

}  // namespace kspec::cache
