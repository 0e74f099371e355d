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
#include <map>

#include "bounded_json.h"
#include "jit/base/hash.h"
#include "jit/base/log.h"
#include "jit/files.h"
#include "kspec/error.h"

namespace fs = std::filesystem;

namespace kspec::cache {
namespace {

constexpr const char* kLayout = "v1";
// A .bin without metadata younger than this may be a write in progress (binary, then metadata: well
// under a second apart); an older one is an orphan of an interrupted write.
constexpr int64_t kOrphanAgeSeconds = 60;
constexpr int64_t kMaxBinaryBytes = int64_t(1) << 30;

bool valid_key(const std::string& key) {
  return key.size() == 64 &&
         std::all_of(key.begin(), key.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

int64_t now_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The checksum over the whole record but itself: binary_sha256 ties the binary to it, so one value
// covers the entry. dump() orders keys, so the text is canonical.
std::string record_checksum(nlohmann::json meta) {
  meta.erase("checksum");
  return jit::sha256_hex(meta.dump());
}

std::string with_ext(const std::string& bin_path, const char* ext) {
  return bin_path.substr(0, bin_path.size() - 4) + ext;
}

bool exists_nofollow(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// Removes a file; true when it is gone (also when it was gone already).
bool remove_file(const std::string& path, std::string* err) {
  if (::unlink(path.c_str()) == 0 || errno == ENOENT) return true;
  *err = "cannot remove " + path + ": " + std::strerror(errno);
  return false;
}

}  // namespace

DiskCache::DiskCache(std::string dir, bool enabled, int64_t max_bytes)
    : dir_(std::move(dir)), enabled_(enabled), max_bytes_(max_bytes) {
  vdir_ = (fs::path(dir_) / kLayout).string();
}

bool DiskCache::writable() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!enabled_ || !writable_) return false;
  const std::string& probe = exists_nofollow(vdir_) ? vdir_ : dir_;
  return !exists_nofollow(probe) || ::faccessat(AT_FDCWD, probe.c_str(), W_OK, AT_EACCESS) == 0;
}

void DiskCache::make_unwritable(const std::string& why) {
  writable_ = false;
  jit::warn_once("cache-unwritable:" + dir_,
                 "the kernel cache directory " + dir_ + " cannot be written (" + why +
                     "); compiled kernels are kept in memory until it can be");
}

// The root must be ours and private (created 0700 when missing); an unsafe one disables the disk cache
// (we would load what others wrote). One that cannot be created is tried again by the next store.
bool DiskCache::check_root() {
  if (root_checked_) return enabled_;
  if (!enabled_) return false;
  std::string why;
  if (jit::make_private_dir(dir_, &why)) {
    root_checked_ = true;
    return true;
  }
  if (!exists_nofollow(dir_)) {
    make_unwritable(why);
    return false;
  }
  enabled_ = false;
  root_checked_ = true;
  jit::warn_once("cache-unsafe:" + dir_, "refusing to use the kernel cache directory: " + why +
                                             " (chmod 700 it, or set KSPEC_CACHE_DIR); the disk cache is off");
  return false;
}

std::string DiskCache::sub_dir(const std::string& key) const { return (fs::path(vdir_) / key.substr(0, 2)).string(); }

std::string DiskCache::entry_path(const std::string& key) const {
  return (fs::path(sub_dir(key)) / (key + ".bin")).string();
}

std::string DiskCache::ready_dir() {
  std::lock_guard<std::mutex> guard(mu_);
  if (!check_root()) return {};
  std::string why;
  return jit::make_private_dir(vdir_, &why) ? vdir_ : std::string();
}

FileLock DiskCache::lock(const std::string& key, bool wait) {
  {
    std::lock_guard<std::mutex> guard(mu_);
    if (!valid_key(key) || !check_root()) return FileLock();
  }
  std::string why;
  if (!jit::make_private_dir(sub_dir(key), &why)) return FileLock();
  return FileLock(with_ext(entry_path(key), ".lock"), wait);
}

std::optional<Entry> DiskCache::read_entry(const std::string& key, std::string* why) const {
  std::string bin_path = entry_path(key);
  std::string meta_path = with_ext(bin_path, ".json");
  why->clear();
  bool missing = false;
  std::string err;
  // The metadata is the commit point: without it there is no entry (a binary alone is a write in progress).
  auto meta = read_json_file(meta_path, kMaxMetadataBytes, /*own=*/true, &err, &missing);
  if (!meta) {
    if (!missing) *why = "metadata: " + err;
    return std::nullopt;
  }
  Entry e;
  e.meta = std::move(*meta);
  if (!e.meta.is_object() || !e.meta.contains("key") || e.meta["key"] != key ||
      !e.meta.contains("kspec_cache") || e.meta["kspec_cache"] != kLayout) {
    *why = "foreign metadata (key or layout does not match)";
    return std::nullopt;
  }
  auto sum = e.meta.find("checksum");
  if (sum == e.meta.end()) {
    *why = "metadata without a checksum (written by an older kspec)";
    return std::nullopt;
  }
  if (!sum->is_string() || *sum != record_checksum(e.meta)) {
    *why = "metadata checksum mismatch (corrupt metadata)";
    return std::nullopt;
  }
  auto size = e.meta.find("binary_size");
  auto bin_sum = e.meta.find("binary_sha256");
  if (size == e.meta.end() || !size->is_number_integer() || bin_sum == e.meta.end() || !bin_sum->is_string()) {
    *why = "metadata without binary_size or binary_sha256";
    return std::nullopt;
  }
  int64_t expected = size->get<int64_t>();
  if (!jit::read_file(bin_path, std::min(std::max<int64_t>(expected, 0), kMaxBinaryBytes), jit::FileTrust::Own,
                      &e.binary, &err, &missing)) {
    *why = missing ? "missing .bin" : "binary: " + err;
    return std::nullopt;
  }
  if (static_cast<int64_t>(e.binary.size()) != expected) {
    *why = "truncated binary (" + std::to_string(e.binary.size()) + " bytes, metadata says " +
           std::to_string(expected) + ")";
    return std::nullopt;
  }
  if (jit::sha256_hex(e.binary) != bin_sum->get<std::string>()) {
    *why = "checksum mismatch (corrupt binary)";
    return std::nullopt;
  }
  return e;
}

bool DiskCache::recheck_and_remove(const std::string& key, bool wait, std::string* why, std::string* err) {
  FileLock held = lock(key, wait);
  // Held elsewhere: its holder is writing it (or checking it); it is that holder's to fix.
  if (!held.held() && held.error() == EWOULDBLOCK) {
    why->clear();
    return false;
  }
  if (read_entry(key, why) || why->empty()) return false;
  std::string bin_path = entry_path(key);
  // Metadata first: once it is gone the entry is a miss for everyone, whatever happens to the binary.
  return remove_file(with_ext(bin_path, ".json"), err) && remove_file(bin_path, err);
}

std::optional<Entry> DiskCache::load(const std::string& key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!valid_key(key) || !check_root()) return std::nullopt;
  }
  std::string why;
  auto e = read_entry(key, &why);
  if (!e) {
    if (why.empty()) return std::nullopt;
    // Seen bad without the lock: maybe half-removed by a concurrent prune; look again under the lock.
    std::string err;
    bool removed = recheck_and_remove(key, /*wait=*/false, &why, &err);
    bool first;
    {
      std::lock_guard<std::mutex> lock(mu_);
      first = !why.empty() && reported_.insert(key).second;
    }
    if (first)
      jit::warn("kernel cache entry " + key.substr(0, 16) + "… in " + dir_ + " is invalid (" + why + "); " +
                (removed ? "removed it; recompiling" : "recompiling (it could not be removed: " + err + ")"));
    return std::nullopt;
  }
  // Refresh the LRU clock; a read-only cache simply keeps the old time.
  ::utimensat(AT_FDCWD, with_ext(entry_path(key), ".json").c_str(), nullptr, AT_SYMLINK_NOFOLLOW);
  return e;
}

std::string DiskCache::store(const std::string& key, const std::string& binary, nlohmann::json meta) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!valid_key(key) || !check_root()) return {};
  }
  meta["key"] = key;
  meta["kspec_cache"] = kLayout;
  meta["binary_size"] = static_cast<int64_t>(binary.size());
  meta["binary_sha256"] = jit::sha256_hex(binary);
  meta["created"] = now_seconds();
  meta["checksum"] = record_checksum(meta);
  std::string err;
  // Every store makes sure of its directories: another process's clear may have removed them.
  if (!jit::make_private_dir(sub_dir(key), &err)) {
    std::lock_guard<std::mutex> lock(mu_);
    make_unwritable(err);
    return {};
  }
  std::string bin_path = entry_path(key);
  std::string meta_path = with_ext(bin_path, ".json");
  if (!jit::write_file_atomic(bin_path, binary, &err)) {
    std::lock_guard<std::mutex> lock(mu_);
    make_unwritable(err);
    return {};
  }
  if (!jit::write_file_atomic(meta_path, meta.dump(2), &err)) {
    std::string ignored;
    remove_file(bin_path, &ignored);  // no orphan binary (an older entry's metadata may still be there: a miss)
    std::lock_guard<std::mutex> lock(mu_);
    make_unwritable(err);
    return {};
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    writable_ = true;
  }
  if (max_bytes_ > 0 && stats().bytes > max_bytes_) prune(max_bytes_);
  return bin_path;
}

std::vector<EntryInfo> DiskCache::list() const {
  std::vector<EntryInfo> out;
  std::error_code ec;
  if (!fs::is_directory(vdir_, ec)) return out;
  std::map<std::string, fs::path> bins;  // key → .bin, to find those without metadata
  for (auto it = fs::recursive_directory_iterator(vdir_, ec); it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (ec) break;
    const fs::path& p = it->path();
    if (!valid_key(p.stem().string()) || it->is_symlink(ec) || !it->is_regular_file(ec)) continue;
    if (p.extension() == ".bin") {
      bins.emplace(p.stem().string(), p);
      continue;
    }
    if (p.extension() != ".json") continue;
    EntryInfo info;
    info.key = p.stem().string();
    fs::path bin = p.parent_path() / (info.key + ".bin");
    info.path = bin.string();
    struct stat st;
    if (::lstat(p.c_str(), &st) == 0) {
      info.last_used = st.st_mtime;
      info.bytes += st.st_size;
    }
    if (::lstat(bin.c_str(), &st) == 0) info.bytes += st.st_size;
    std::string why;
    auto meta = read_json_file(p.string(), kMaxMetadataBytes, /*own=*/true, &why);
    info.meta = meta && meta->is_object() ? std::move(*meta) : nlohmann::json::object();
    out.push_back(std::move(info));
  }
  std::set<std::string> committed;
  for (const auto& e : out) committed.insert(e.key);
  for (const auto& [key, bin] : bins) {
    if (committed.count(key)) continue;
    EntryInfo info;
    struct stat st;
    if (::lstat(bin.c_str(), &st) != 0) continue;
    info.key = key;
    info.path = bin.string();
    info.bytes = st.st_size;
    info.last_used = st.st_mtime;
    info.meta = nlohmann::json::object();
    info.orphan = true;
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
  s.writable = writable();
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.enabled = enabled_;
  }
  for (const auto& e : list()) {
    s.entries += 1;
    s.bytes += e.bytes;
  }
  return s;
}

// An orphan binary is removed under its entry's lock, and only if no metadata appeared meanwhile and
// (unless `any_age`) it is old enough not to be a write in progress.
bool DiskCache::remove_orphan(const EntryInfo& e, bool any_age, std::string* err) {
  if (!any_age && now_seconds() - e.last_used < kOrphanAgeSeconds) return false;
  FileLock held = lock(e.key, /*wait=*/false);
  if (!held.held() && held.error() == EWOULDBLOCK) return false;
  if (exists_nofollow(with_ext(e.path, ".json"))) return false;
  return exists_nofollow(e.path) && remove_file(e.path, err);
}

VerifyResult DiskCache::verify() {
  VerifyResult r;
  for (const auto& e : list()) {
    std::string why, err;
    bool removed;
    if (e.orphan) {
      why = "a binary without metadata (an interrupted write)";
      removed = remove_orphan(e, /*any_age=*/false, &err);
      if (!removed && err.empty()) continue;  // young, or being written now
    } else {
      removed = recheck_and_remove(e.key, /*wait=*/true, &why, &err);
      if (why.empty()) {
        if (exists_nofollow(with_ext(e.path, ".json"))) r.ok += 1;  // else another process removed it meanwhile
        continue;
      }
    }
    r.removed += removed ? 1 : 0;
    r.bad.push_back(e.key + ": " + why + (removed ? " (removed)" : " (not removed: " + err + ")"));
  }
  return r;
}

int64_t DiskCache::prune(int64_t max_bytes, std::string* failure) {
  auto entries = list();  // newest first
  int64_t total = 0;
  for (const auto& e : entries) total += e.bytes;
  // Orphans first (once old enough), then committed entries from the least recently used.
  std::vector<const EntryInfo*> order;
  for (const auto& e : entries)
    if (e.orphan) order.push_back(&e);
  for (auto it = entries.rbegin(); it != entries.rend(); ++it)
    if (!it->orphan) order.push_back(&*it);
  int64_t removed = 0;
  for (const EntryInfo* e : order) {
    if (total <= max_bytes) break;
    std::string err;
    if (e->orphan) {
      if (remove_orphan(*e, /*any_age=*/false, &err)) total -= e->bytes;
      else if (failure && !err.empty()) *failure = err;
      continue;
    }
    FileLock held = lock(e->key, /*wait=*/false);
    if (!held.held() && held.error() == EWOULDBLOCK) continue;  // being written or checked right now
    std::string meta_path = with_ext(e->path, ".json");
    if (!exists_nofollow(meta_path)) {  // another process pruned it meanwhile
      total -= e->bytes;
      continue;
    }
    if (!remove_file(meta_path, &err)) {
      if (failure) *failure = err;
      continue;
    }
    remove_file(e->path, &err);
    remove_file(with_ext(e->path, ".lock"), &err);  // safe while held: FileLock notices a removed file
    total -= e->bytes;
    removed += 1;
  }
  return removed;
}

int64_t DiskCache::clear() {
  if (!exists_nofollow(vdir_)) return 0;
  int64_t removed = 0, failed = 0;
  std::string first_error;
  for (const auto& e : list()) {
    std::string err;
    FileLock held = lock(e.key);  // waits for a writer to finish: what it commits is cleared too
    bool ok = e.orphan ? remove_file(e.path, &err)
                       : remove_file(with_ext(e.path, ".json"), &err) && remove_file(e.path, &err);
    if (ok) {
      remove_file(with_ext(e.path, ".lock"), &err);
      removed += e.orphan ? 0 : 1;
    } else {
      failed += 1;
      if (first_error.empty()) first_error = err;
    }
  }
  // What is left: the header memo, stale temporary files, empty directories. A file another process is
  // writing right now survives (its directory then too).
  auto leftover = [](const fs::path& p) {
    std::string name = p.filename().string();
    struct stat st;
    bool stale = ::lstat(p.c_str(), &st) == 0 && now_seconds() - st.st_mtime >= kOrphanAgeSeconds;
    return p.extension() == ".lock" || name.rfind("headers-", 0) == 0 ||
           (name.find(".tmp.") != std::string::npos && stale);
  };
  std::error_code ec;
  std::vector<fs::path> dirs;
  for (auto it = fs::recursive_directory_iterator(vdir_, ec); it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (ec) break;
    if (it->is_directory(ec) && !it->is_symlink(ec)) dirs.push_back(it->path());
    else if (leftover(it->path())) ::unlink(it->path().c_str());
  }
  for (auto d = dirs.rbegin(); d != dirs.rend(); ++d) ::rmdir(d->c_str());
  ::rmdir(vdir_.c_str());
  if (failed > 0)
    throw CacheError("kspec cache clear: removed " + std::to_string(removed) + " entries from " + vdir_ +
                     " but could not remove " + std::to_string(failed) + " (" + first_error + ")");
  return removed;
}

}  // namespace kspec::cache
