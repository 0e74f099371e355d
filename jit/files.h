// The files kspec keeps on its own behalf (kernel cache, tuning database, header memo, debug sources):
// one place that creates its directories, decides whether an existing file or directory is trusted,
// and opens, reads and replaces files without following links others could have planted.
//
// Error contract: nothing here throws; each call returns false with `why` saying what was wrong.
#pragma once

#include <cstdint>
#include <string>

namespace kspec::jit {

// Creates `path` and any missing parents as directories of mode 0700, whatever the umask, and checks
// the directory: a directory (a symbolic link only when the link itself is this user's), owned by this
// user, not writable by group or others. False with `why` otherwise (then kspec must not use it).
bool make_private_dir(const std::string& path, std::string* why);

enum class FileTrust {
  Own,   // a file kspec wrote: not a symlink, a regular file, owned by this user, not group/other-writable
  Named  // a file the user named (an import): any owner, symlinks followed, but a regular file
};

// Reads a whole file of at most `max_bytes` (a longer one is refused before it is read). `missing` (may be
// null) is set when the file does not exist. False with `why` when it is missing, untrusted or unreadable.
bool read_file(const std::string& path, int64_t max_bytes, FileTrust trust, std::string* out, std::string* why,
               bool* missing = nullptr);

// Writes a fresh temporary file beside `path` (O_EXCL|O_NOFOLLOW, mode 0600), fsyncs it and renames it over
// `path`: readers see the old file or the new one, never a half-written one, and a symlink at `path` is
// replaced, not followed. False with `err` set when any step fails (the temporary file is removed).
bool write_file_atomic(const std::string& path, const std::string& bytes, std::string* err);

}  // namespace kspec::jit
