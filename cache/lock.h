// An exclusive, inter-process lock on a file beside a cache entry or tuning database (POSIX flock), so
// that N processes missing the same kernel compile it once: the first holds the lock while compiling; the
// others wait, then find the entry on disk. The lock is released when the object dies (or the process does).
//
// A lock file may be removed while it is held (pruning removes an entry's lock with it): a process that
// then acquires the removed file notices and locks the new one, so two holders never coexist. A lock file
// that is a symlink, or is not this user's private regular file, is never opened (it is not held).
#pragma once

#include <string>

namespace kspec::cache {

class FileLock {
 public:
  FileLock() = default;
  // Blocks until the lock is held (`wait` false: gives up at once when another descriptor holds it, in
  // this process or another). When the lock file cannot be created or is not trusted (read-only or
  // foreign directory) the lock is not held (held() is false) and the caller proceeds without
  // cross-process exclusion.
  explicit FileLock(const std::string& path, bool wait = true);
  ~FileLock();
  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  bool held() const { return fd_ >= 0; }
  // Why it is not held: EWOULDBLOCK when another holder has it (wait false), else the open's errno
  // (EACCES in a read-only directory, ELOOP for a symlink, EPERM for a file that is not this user's).
  int error() const { return error_; }

 private:
  int fd_ = -1;
  int error_ = 0;
};

}  // namespace kspec::cache
