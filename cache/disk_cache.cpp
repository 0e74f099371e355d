// Disk cache implementation: atomic writes, checksummed reads, per-key locks, LRU pruning.
#include "disk_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "jit/hash.h"
#include "jit/log.h"
#include "kspec/error.h"
#include "kspec/knobs.h"

namespace fs = std::filesystem;

namespace kspec::cache {
namespace {

constexpr const char* kLayout = "v1";

bool valid_key(const std::string& key) {
  return key.size() == 64 &&
         std::all_of(key.begin(), key.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

// An entry is trusted only if this user owns it and nobody else can write it.
bool safe_file(const std::string& path, std::string* why) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    *why = "missing " + fs::path(path).filename().string();
    return false;
  }
  if (st.st_uid != ::geteuid()) {
    *why = "owned by another user (uid " + std::to_string(st.st_uid) + ")";
    return false;
  }
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    *why = "writable by group or others";
    return false;
  }
  return true;
}

int64_t now_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

DiskCache& DiskCache::global() {
  static DiskCache cache(knobs::cache_dir(), knobs::cache_enabled(), knobs::cache_max_bytes());
  return cache;
}

DiskCache::DiskCache(std::string dir, bool enabled, int64_t max_bytes)
    : dir_(std::move(dir)), enabled_(enabled), max_bytes_(max_bytes) {
  vdir_ = (fs::path(dir_) / kLayout).string();
}

bool DiskCache::writable() const {
  std::lock_guard<std::mutex> lock(mu_);
  return enabled_ && writable_;
}

void DiskCache::make_unwritable(const std::string& why) {
  writable_ = false;
  jit::warn_once("cache-unwritable:" + dir_,
                 "the kernel cache directory " + dir_ + " cannot be written (" + why +
                     "); compiled kernels are kept in memory for this process only");
}

// Creates the cache directory private to the user (0700) and checks an existing one is ours and
// not writable by others; an unsafe directory disables the disk cache (we would load what others wrote).
bool DiskCache::ensure_dir() {
  if (dir_ready_) return true;
  std::error_code ec;
  fs::path root(dir_);
  if (!fs::exists(root, ec)) {
    fs::path parent = root.parent_path();
    if (!parent.empty()) fs::create_directories(parent, ec);
    if (::mkdir(root.c_str(), 0700) != 0 && errno != EEXIST) {
      make_unwritable(std::string("mkdir: ") + std::strerror(errno));
      return false;
    }
  }
  struct stat st;
  if (::stat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    enabled_ = false;
    jit::warn_once("cache-notdir:" + dir_, "the kernel cache path " + dir_ +
                                               " is not a directory; the disk cache is off");
    return false;
  }
  if (st.st_uid != ::geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH))) {
    enabled_ = false;
    jit::warn_once("cache-unsafe:" + dir_,
                   "the kernel cache directory " + dir_ +
                       " is owned by another user or writable by others; refusing to use it "
                       "(chmod 700 it, or set KSPEC_CACHE_DIR)");
    return false;
  }
  if (::mkdir(vdir_.c_str(), 0700) != 0 && errno != EEXIST) {
    make_unwritable(std::string("mkdir ") + vdir_ + ": " + std::strerror(errno));
  }
  dir_ready_ = true;
  return true;
}

std::string DiskCache::entry_path(const std::string& key) const {
  return (fs::path(vdir_) / key.substr(0, 2) / (key + ".bin")).string();
}

std::string DiskCache::ready_dir() {
  std::lock_guard<std::mutex> guard(mu_);
  if (!enabled_ || !ensure_dir()) return {};
  std::error_code ec;
  return fs::is_directory(vdir_, ec) ? vdir_ : std::string();
}

FileLock DiskCache::lock(const std::string& key) {
  {
    std::lock_guard<std::mutex> guard(mu_);
    if (!enabled_ || !valid_key(key) || !ensure_dir() || !writable_) return FileLock();
  }
  std::error_code ec;
  fs::path sub = fs::path(vdir_) / key.substr(0, 2);
  if (::mkdir(sub.c_str(), 0700) != 0 && errno != EEXIST) return FileLock();
  return FileLock((sub / (key + ".lock")).string());
}

std::optional<Entry> DiskCache::read_entry(const std::string& key, std::string* why) const {
  std::string bin_path = entry_path(key);
  std::string meta_path = bin_path.substr(0, bin_path.size() - 4) + ".json";
  std::error_code ec;
  if (!fs::exists(meta_path, ec) && !fs::exists(bin_path, ec)) {
    why->clear();  // a plain miss
    return std::nullopt;
  }
  if (!safe_file(meta_path, why) || !safe_file(bin_path, why)) return std::nullopt;
  Entry e;
  std::string meta_text;
  if (!read_file(meta_path, &meta_text)) {
    *why = "unreadable metadata";
    return std::nullopt;
  }
  try {
    e.meta = nlohmann::json::parse(meta_text);
  } catch (const std::exception& ex) {
    *why = std::string("corrupt metadata (") + ex.what() + ")";
    return std::nullopt;
  }
  if (!e.meta.is_object() || e.meta.value("key", std::string()) != key ||
      e.meta.value("kspec_cache", std::string()) != kLayout) {
    *why = "foreign metadata (key or layout does not match)";
    return std::nullopt;
  }
  if (!read_file(bin_path, &e.binary)) {
    *why = "unreadable binary";
    return std::nullopt;
  }
  if (static_cast<int64_t>(e.binary.size()) != e.meta.value("binary_size", int64_t(-1))) {
    *why = "truncated binary (" + std::to_string(e.binary.size()) + " bytes, metadata says " +
           std::to_string(e.meta.value("binary_size", int64_t(-1))) + ")";
    return std::nullopt;
  }
  if (jit::sha256_hex(e.binary) != e.meta.value("binary_sha256", std::string())) {
    *why = "checksum mismatch (corrupt binary)";
    return std::nullopt;
  }
  return e;
}

void DiskCache::evict(const std::string& key, const std::string& why) {
  std::string bin_path = entry_path(key);
  std::string meta_path = bin_path.substr(0, bin_path.size() - 4) + ".json";
  bool first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = reported_.insert(key).second;
  }
  if (first)
    jit::warn("kernel cache entry " + key.substr(0, 16) + "… in " + dir_ + " is invalid (" + why +
              "); removing it and recompiling");
  std::error_code ec;
  fs::remove(meta_path, ec);
  fs::remove(bin_path, ec);
}

std::optional<Entry> DiskCache::load(const std::string& key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!enabled_ || !valid_key(key) || !ensure_dir()) return std::nullopt;
  }
  std::string why;
  auto e = read_entry(key, &why);
  if (!e) {
    if (!why.empty()) evict(key, why);
    return std::nullopt;
  }
  // Refresh the LRU clock; a read-only cache simply keeps the old time.
  std::string bin_path = entry_path(key);
  std::string meta_path = bin_path.substr(0, bin_path.size() - 4) + ".json";
  ::utimensat(AT_FDCWD, meta_path.c_str(), nullptr, 0);
  return e;
}

std::string DiskCache::store(const std::string& key, const std::string& binary, nlohmann::json meta) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!enabled_ || !valid_key(key) || !ensure_dir() || !writable_) return {};
  }
  meta["key"] = key;
  meta["kspec_cache"] = kLayout;
  meta["binary_size"] = static_cast<int64_t>(binary.size());
  meta["binary_sha256"] = jit::sha256_hex(binary);
  meta["created"] = now_seconds();
  fs::path sub = fs::path(vdir_) / key.substr(0, 2);
  std::string err;
  if (::mkdir(sub.c_str(), 0700) != 0 && errno != EEXIST) {
    std::lock_guard<std::mutex> lock(mu_);
    make_unwritable(std::string("mkdir: ") + std::strerror(errno));
    return {};
  }
  std::string bin_path = entry_path(key);
  std::string meta_path = bin_path.substr(0, bin_path.size() - 4) + ".json";
  if (!write_file_atomic(bin_path, binary, &err) || !write_file_atomic(meta_path, meta.dump(2), &err)) {
    std::lock_guard<std::mutex> lock(mu_);
    make_unwritable(err);
    return {};
  }
  if (max_bytes_ > 0 && stats().bytes > max_bytes_) prune(max_bytes_);
  return bin_path;
}

std::vector<EntryInfo> DiskCache::list() const {
  std::vector<EntryInfo> out;
  std::error_code ec;
  if (!fs::is_directory(vdir_, ec)) return out;
  for (auto it = fs::recursive_directory_iterator(vdir_, ec); it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (ec) break;
    const fs::path& p = it->path();
    if (p.extension() != ".json" || !it->is_regular_file()) continue;
    EntryInfo info;
    info.key = p.stem().string();
    if (!valid_key(info.key)) continue;
    fs::path bin = p.parent_path() / (info.key + ".bin");
    info.path = bin.string();
    struct stat st;
    if (::stat(p.c_str(), &st) == 0) {
      info.last_used = st.st_mtime;
      info.bytes += st.st_size;
    }
    if (::stat(bin.c_str(), &st) == 0) info.bytes += st.st_size;
    std::string text;
    if (read_file(p.string(), &text)) {
      try {
        info.meta = nlohmann::json::parse(text);
      } catch (const std::exception&) {
        info.meta = nlohmann::json::object();
      }
    }
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(), [](const EntryInfo& a, const EntryInfo& b) {
    return a.last_used != b.last_used ? a.last_used > b.last_used : a.key < b.key;
  });
  return out;
}

Stats DiskCache::stats() const {
  Stats s;
  s.dir = dir_;
  s.max_bytes = max_bytes_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.enabled = enabled_;
    s.writable = enabled_ && writable_;
  }
  for (const auto& e : list()) {
    s.entries += 1;
    s.bytes += e.bytes;
  }
  return s;
}

VerifyResult DiskCache::verify() {
  VerifyResult r;
  for (const auto& e : list()) {
    std::string why;
    if (read_entry(e.key, &why)) {
      r.ok += 1;
    } else {
      r.bad.push_back(e.key + ": " + (why.empty() ? "missing" : why));
      evict(e.key, why.empty() ? "missing" : why);
    }
  }
  return r;
}

int64_t DiskCache::prune(int64_t max_bytes) {
  auto entries = list();  // newest first
  int64_t total = 0;
  for (const auto& e : entries) total += e.bytes;
  int64_t removed = 0;
  for (auto it = entries.rbegin(); it != entries.rend() && total > max_bytes; ++it) {
    std::error_code ec;
    fs::path bin(it->path);
    fs::remove(bin.parent_path() / (it->key + ".json"), ec);
    fs::remove(bin, ec);
    fs::remove(bin.parent_path() / (it->key + ".lock"), ec);
    total -= it->bytes;
    removed += 1;
  }
  return removed;
}

int64_t DiskCache::clear() {
  std::error_code ec;
  if (!fs::exists(vdir_, ec)) return 0;
  int64_t n = static_cast<int64_t>(list().size());
  fs::remove_all(vdir_, ec);
  if (ec) throw CacheError("cannot clear " + vdir_ + ": " + ec.message());
  std::lock_guard<std::mutex> lock(mu_);
  dir_ready_ = false;
  return n;
}

}  // namespace kspec::cache
