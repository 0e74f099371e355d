// The on-disk binary cache: content-addressed entries (<dir>/v1/<k0k1>/<key>.bin + <key>.json), each
// with a metadata record carrying the binary's checksum. It knows bytes and keys, not ops.
//
// Error contract: lookups and stores never throw for I/O problems. A truncated, corrupt, foreign or
// unsafe entry is reported once, removed and reported as a miss; a read-only or full directory turns
// the cache into a memory-only one with one warning. Only explicit maintenance calls (clear, prune on a
// directory that cannot be changed) throw CacheError.
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
  std::vector<std::string> bad;  // "key: reason" for each entry that failed (and was removed)
};

class DiskCache {
 public:
  // The process-wide cache configured by KSPEC_CACHE, KSPEC_CACHE_DIR, KSPEC_CACHE_MAX_BYTES.
  static DiskCache& global();
  // For tests and tools: a cache over a given directory.
  DiskCache(std::string dir, bool enabled, int64_t max_bytes);

  bool enabled() const { return enabled_; }
  bool writable() const;
  const std::string& dir() const { return dir_; }

  std::optional<Entry> load(const std::string& key);
  // Writes atomically (temporary file + rename, binary before metadata). Returns the .bin path, or ""
  // when the entry stayed in memory only (cache disabled, or the directory cannot be written).
  std::string store(const std::string& key, const std::string& binary, nlohmann::json meta);
  // Holds the per-key inter-process lock (no-op when disabled).
  FileLock lock(const std::string& key);
  std::string entry_path(const std::string& key) const;  // the .bin path, whether it exists or not
  // The layout directory (<dir>/v1), created and checked; "" when the cache is off or unusable.
  std::string ready_dir();

  Stats stats() const;
  std::vector<EntryInfo> list() const;
  VerifyResult verify();
  // Removes least-recently-used entries until the cache holds at most max_bytes. Returns the count.
  int64_t prune(int64_t max_bytes);
  int64_t prune() { return prune(max_bytes_); }
  int64_t clear();

 private:
  std::optional<Entry> read_entry(const std::string& key, std::string* why) const;
  void evict(const std::string& key, const std::string& why);
  void make_unwritable(const std::string& why);
  bool ensure_dir();

  std::string dir_;   // root given by the user
  std::string vdir_;  // dir_/v1: the layout version
  bool enabled_;
  int64_t max_bytes_;
  mutable std::mutex mu_;
  bool writable_ = true;
  bool dir_ready_ = false;
  std::set<std::string> reported_;
};

}  // namespace kspec::cache
