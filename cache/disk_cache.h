// The on-disk binary cache: content-addressed entries (<dir>/v1/<k0k1>/<key>.bin + <key>.json), each
// with a metadata record carrying the binary's checksum and a checksum over the whole record. It knows
// bytes and keys, not ops.
//
// An entry is committed when its metadata is renamed into place (the binary is written first): a .bin
// without metadata is a write in progress, or an orphan once it is a minute old, which list() shows and
// verify/prune/clear remove. Everything that removes an entry (eviction, verify, prune, clear) holds the
// entry's lock and re-reads it first, so it never removes an entry another process is writing, nor
// reports one another process just removed.
//
// Error contract: lookups and stores never throw for I/O problems. A truncated, corrupt, foreign or
// unsafe entry is reported once, removed and reported as a miss; a read-only or full directory keeps
// compiled kernels in memory with one warning, and every later store tries the disk again (the
// directories are recreated after another process's clear). Only clear() throws CacheError (it could
// not remove everything); prune and verify report what they did.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lock.h"

namespace kspec::cache {

struct Entry {
  std::string binary;
  nlohmann::json meta;  // caller's fields plus key, binary_sha256, binary_size, created, kspec_cache
};

struct EntryInfo {
  std::string key;
  std::string path;  // the .bin file
  int64_t bytes = 0;  // binary + metadata
  int64_t last_used = 0;  // seconds since the epoch (metadata mtime, refreshed on every hit)
  nlohmann::json meta;
  bool orphan = false;  // a .bin without metadata (an interrupted write)
};

struct Stats {
  std::string dir;
  bool enabled = false;
  bool writable = false;
  int64_t entries = 0;
  int64_t bytes = 0;
  int64_t max_bytes = 0;
};

struct VerifyResult {
  int64_t ok = 0;
  int64_t removed = 0;
  // "key: reason (removed)" or "key: reason (not removed: why)" for each entry that failed
  std::vector<std::string> bad;
};

class DiskCache {
 public:
  // A cache over `dir` holding at most `max_bytes`; `enabled` false keeps everything in memory. The cache
  // reads no environment: api builds the process's cache from the knobs (kspec::disk_cache()).
  DiskCache(std::string dir, bool enabled, int64_t max_bytes);

  bool enabled() const { return enabled_; }
  bool writable() const;
  const std::string& dir() const { return dir_; }
  int64_t max_bytes() const { return max_bytes_; }

  std::optional<Entry> load(const std::string& key);
  // Writes atomically (temporary file + rename, binary before metadata). Returns the .bin path, or ""
  // when the entry stayed in memory only (cache disabled, or the directory cannot be written).
  std::string store(const std::string& key, const std::string& binary, nlohmann::json meta);
  // Holds the per-key inter-process lock (not held when disabled or the directory is read-only).
  FileLock lock(const std::string& key, bool wait = true);
  std::string entry_path(const std::string& key) const;  // the .bin path, whether it exists or not
  // The layout directory (<dir>/v1), created and checked; "" when the cache is off or unusable.
  std::string ready_dir();

  Stats stats() const;
  std::vector<EntryInfo> list() const;
  VerifyResult verify();
  // Removes orphans, then least-recently-used entries, until the cache holds at most max_bytes; entries
  // another process holds (being written or loaded) are skipped. Returns how many were removed;
  // `failure`, when given, says why some could not be (read-only directory).
  int64_t prune(int64_t max_bytes, std::string* failure = nullptr);
  // Removes every entry (each under its lock) and the layout directory; returns how many entries.
  // Throws CacheError when some could not be removed.
  int64_t clear();

 private:
  std::optional<Entry> read_entry(const std::string& key, std::string* why) const;
  // Under the entry's lock, re-reads it and removes it only if it is still bad. `wait` false: an entry
  // whose lock is held elsewhere is left to its holder. Returns whether it was removed; `why` is the
  // reason it is bad ("" when it is good or gone by now), `err` why it could not be removed.
  bool recheck_and_remove(const std::string& key, bool wait, std::string* why, std::string* err);
  bool remove_orphan(const EntryInfo& e, bool any_age, std::string* err);
  void make_unwritable(const std::string& why);
  bool check_root();
  std::string sub_dir(const std::string& key) const;

  std::string dir_;   // root given by the user
  std::string vdir_;  // dir_/v1: the layout version
  bool enabled_;
  int64_t max_bytes_;
  mutable std::mutex mu_;
  bool writable_ = true;    // the last store reached the disk
  bool root_checked_ = false;  // the root exists and is ours and private (checked once)
  std::set<std::string> reported_;
};

}  // namespace kspec::cache
