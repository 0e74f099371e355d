// Logging through a replaceable sink (stderr by default), with a per-process "once" set.
#include "log.h"

#include <cstdio>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "kspec/knobs.h"
#include "kspec/log.h"

namespace kspec {
namespace {

std::mutex& mu() {
  static std::mutex m;
  return m;
}

// The installed sink, replaced as a whole: a message is delivered through a copy of the pointer taken
// under the lock and called after it is released, so a sink that blocks (Python's GIL held by a thread
// that is itself about to log) or logs again cannot deadlock on kspec's lock.
std::shared_ptr<const LogSink>& sink_slot() {
  static std::shared_ptr<const LogSink> s;
  return s;
}

void emit(LogLevel level, const std::string& msg) {
  std::shared_ptr<const LogSink> sink;
  {
    std::lock_guard<std::mutex> lock(mu());
    sink = sink_slot();
    if (!sink) {  // the default: one fprintf per line under the lock, so lines from threads never interleave
      std::fprintf(stderr, level == LogLevel::Warning ? "[kspec] warning: %s\n" : "[kspec] %s\n", msg.c_str());
      return;
    }
  }
  try {
    (*sink)(level, msg);
  } catch (...) {  // a diagnostic never fails the call that logged it
  }
}

}  // namespace

LogSink set_log_sink(LogSink sink) {
  auto next = sink ? std::make_shared<const LogSink>(std::move(sink)) : nullptr;
  std::lock_guard<std::mutex> lock(mu());
  auto prev = std::exchange(sink_slot(), std::move(next));
  return prev ? *prev : LogSink();
}

namespace jit {

void warn(const std::string& msg) { emit(LogLevel::Warning, msg); }

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
  emit(LogLevel::Info, msg);
}

}  // namespace jit
}  // namespace kspec
