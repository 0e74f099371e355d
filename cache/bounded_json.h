// The one JSON parser for every file kspec reads (cache metadata, tuning databases, imports): it refuses,
// before parsing, a text that is too long or nested too deep. nlohmann::json copies and compares
// values recursively, so a file nested 100k levels deep (280 KB) overflowed the stack; kspec's own
// files nest at most 5 levels.
//
// Error contract: never throws; a refused or malformed text gives nullopt and `why`.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace kspec::cache {

constexpr int kMaxJsonDepth = 64;
constexpr int64_t kMaxMetadataBytes = int64_t(1) << 20;   // a cache entry's record (its log is cut at 4 KB)
constexpr int64_t kMaxTuningDbBytes = int64_t(32) << 20;  // ~60k tuned problems

std::optional<nlohmann::json> parse_json_bounded(std::string_view text, int64_t max_bytes, std::string* why,
                                                 int max_depth = kMaxJsonDepth);

// Reads and parses a file through jit::read_file (`own`: a file kspec wrote, so it must be this user's
// private regular file; else a file the user named). `missing` is set for a file that does not exist.
std::optional<nlohmann::json> read_json_file(const std::string& path, int64_t max_bytes, bool own, std::string* why,
                                             bool* missing = nullptr);

}  // namespace kspec::cache
