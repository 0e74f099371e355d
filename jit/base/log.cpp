// stderr logging with a per-process "once" set.
#include "log.h"

#include <cstdio>
#include <mutex>
#include <set>

#include "kspec/knobs.h"

namespace kspec::jit {
namespace {
std::mutex& mu() {
  static std::mutex m;
  return m;
}
}  // namespace

void warn(const std::string& msg) {
  std::lock_guard<std::mutex> lock(mu());
  std::fprintf(stderr, "[kspec] warning: %s\n", msg.c_str());
}

void warn_once(const std::string& tag, const std::string& msg) {
  static std::set<std::string> seen;
  {
    std::lock_guard<std::mutex> lock(mu());
    if (!seen.insert(tag).second) return;
  }
  warn(msg);
}

void info(const std::string& msg) {
  if (knobs::verbose() < 1) return;
  std::lock_guard<std::mutex> lock(mu());
  std::fprintf(stderr, "[kspec] %s\n", msg.c_str());
}

}  // namespace kspec::jit
