// Private directories, trusted reads and atomic replaces (see files.h).
#include "files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

namespace fs = std::filesystem;

namespace kspec::jit {
namespace {

std::string errno_text(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

// Why an existing file or directory is not this user's own private one ("" when it is).
std::string untrusted(const struct stat& st) {
  if (st.st_uid != ::geteuid()) return "owned by another user (uid " + std::to_string(st.st_uid) + ")";
  if (st.st_mode & (S_IWGRP | S_IWOTH)) return "writable by group or others";
  return "";
}

}  // namespace

bool make_private_dir(const std::string& path, std::string* why) {
  if (path.empty()) {
    *why = "empty directory path";
    return false;
  }
  // The missing components, innermost first; each is created 0700 (then chmod: the umask may have
  // removed bits from mkdir's mode, never added any).
  std::vector<fs::path> missing;
  struct stat st;
  for (fs::path cur = fs::path(path).lexically_normal(); !cur.empty(); cur = cur.parent_path()) {
    if (::lstat(cur.c_str(), &st) == 0) break;
    if (errno != ENOENT) {
      *why = errno_text("cannot stat", cur.string());
      return false;
    }
    missing.push_back(cur);
    if (cur == cur.parent_path()) break;
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (::mkdir(it->c_str(), 0700) == 0) {
      ::chmod(it->c_str(), 0700);
    } else if (errno != EEXIST) {
      *why = errno_text("cannot create", it->string());
      return false;
    }
  }
  if (::lstat(path.c_str(), &st) != 0) {
    *why = errno_text("cannot stat", path);
    return false;
  }
  if (S_ISLNK(st.st_mode)) {
    // A link this user made (a cache moved to a bigger disk) is followed; one planted by another user is not.
    if (st.st_uid != ::geteuid()) {
      *why = path + " is a symbolic link owned by another user (uid " + std::to_string(st.st_uid) + ")";
      return false;
    }
    if (::stat(path.c_str(), &st) != 0) {
      *why = errno_text("cannot follow", path);
      return false;
    }
  }
  if (!S_ISDIR(st.st_mode)) {
    *why = path + " is not a directory";
    return false;
  }
  std::string bad = untrusted(st);
  if (!bad.empty()) {
    *why = path + " is " + bad;
    return false;
  }
  return true;
}

bool read_file(const std::string& path, int64_t max_bytes, FileTrust trust, std::string* out, std::string* why,
               bool* missing) {
  if (missing) *missing = false;
  // O_NONBLOCK: a FIFO planted or named in place of a file must not hang the open.
  int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | (trust == FileTrust::Own ? O_NOFOLLOW : 0);
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) {
    if (errno == ENOENT && missing) *missing = true;
    *why = errno == ELOOP ? path + " is a symbolic link" : errno_text("cannot open", path);
    return false;
  }
  struct stat st;
  std::string bad;
  if (::fstat(fd, &st) != 0) bad = errno_text("cannot stat", path);
  else if (!S_ISREG(st.st_mode)) bad = path + " is not a regular file";
  else if (trust == FileTrust::Own && !(bad = untrusted(st)).empty()) bad = path + " is " + bad;
  else if (st.st_size > max_bytes)
    bad = path + " is too large (" + std::to_string(st.st_size) + " bytes, at most " + std::to_string(max_bytes) +
          " are read)";
  if (!bad.empty()) {
    ::close(fd);
    *why = bad;
    return false;
  }
  out->clear();
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *why = errno_text("cannot read", path);
      ::close(fd);
      return false;
    }
    if (n == 0) break;
    out->append(buf, static_cast<size_t>(n));
    if (static_cast<int64_t>(out->size()) > max_bytes) {  // it grew while being read
      *why = path + " is too large (more than " + std::to_string(max_bytes) + " bytes)";
      ::close(fd);
      return false;
    }
  }
  ::close(fd);
  return true;
}

bool write_file_atomic(const std::string& path, const std::string& bytes, std::string* err) {
  static thread_local std::mt19937_64 rng(std::random_device{}() ^ static_cast<uint64_t>(::getpid()));
  std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(rng());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    *err = errno_text("cannot create", tmp);
    return false;
  }
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      *err = errno_text("cannot write", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return false;
    }
    done += static_cast<size_t>(n);
  }
  bool flushed = ::fsync(fd) == 0;
  if (!flushed) *err = errno_text("cannot flush", tmp);
  if (::close(fd) != 0 && flushed) {
    flushed = false;
    *err = errno_text("cannot close", tmp);
  }
  if (!flushed) {
    ::unlink(tmp.c_str());
    return false;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    *err = "cannot rename " + tmp + " to " + path + ": " + std::strerror(errno);
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace kspec::jit
