// The disk cache seen from the public API (the CLI's `kspec cache …` and `kspec doctor`).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kspec {

struct CacheStats {
  std::string dir;
  bool enabled = false, writable = false;
  int64_t entries = 0, bytes = 0, max_bytes = 0;
};

struct CacheEntryInfo {
  std::string key, path, spec, kernel, arch;
  int64_t bytes = 0, last_used = 0;
  int registers = -1, spill_bytes = -1, shared_bytes = -1;
  double compile_ms = 0;
};

CacheStats cache_stats();
std::vector<CacheEntryInfo> cache_entries();  // most recently used first
// Checks every entry's checksums (binary and metadata), under each entry's lock; bad ones are removed.
// Returns (ok count, "key: reason (removed)" or "key: reason (not removed: why)" for each bad one).
std::pair<int64_t, std::vector<std::string>> cache_verify();
// Removes least recently used entries down to max_bytes (-1: KSPEC_CACHE_MAX_BYTES); returns how many
// were removed. CacheError when some could not be (a read-only directory).
int64_t cache_prune(int64_t max_bytes = -1);
int64_t cache_clear();  // returns how many entries were removed; CacheError when some could not be

// Facts for `kspec doctor`: "name" → "value" lines, in order.
std::vector<std::pair<std::string, std::string>> doctor();

}  // namespace kspec
