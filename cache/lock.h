// An exclusive, inter-process lock on a file beside a cache entry (POSIX flock), so that N processes
// missing the same kernel compile it once: the first holds the lock while compiling; the others wait,
// then find the entry on disk. The lock is released when the object dies (or the process does).
// Also the two file helpers every cache file uses: a whole-file read and an atomic replace.
#pragma once

#include <string>

namespace kspec::cache {

class FileLock {
 public:
  FileLock() = default;
  // Blocks until the lock is held. When the lock file cannot be created (read-only directory) the
  // lock is not held (held() is false) and the caller proceeds without cross-process exclusion.
  explicit FileLock(const std::string& path);
  ~FileLock();
  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Reads a whole file; false when it cannot be opened or read.
bool read_file(const std::string& path, std::string* out);

// Writes to a unique temporary file in the same directory (mode 0600), fsyncs, then renames it over
// `path`: readers see the old file or the new one, never a half-written one. False with `err` set
// when any step fails (the temporary file is removed).
bool write_file_atomic(const std::string& path, const std::string& bytes, std::string* err);

}  // namespace kspec::cache
