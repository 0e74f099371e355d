// Where kspec's diagnostics go. By default warnings (a corrupt cache entry rebuilt, a read-only cache, a
// stale tuning record) are written to stderr, and info lines (compilations, cache events) too when
// KSPEC_VERBOSE=1. An application routes them into its own logging by installing a sink; the Python
// module installs one that forwards to the `kspec` logger and to `warnings`.
#pragma once

#include <functional>
#include <string>

namespace kspec {

enum class LogLevel { Info, Warning };

// Called with each message (without a trailing newline). It may be called from any thread, including
// compile threads and threads that are inside a kspec call, possibly from several at once; kspec holds
// none of its own locks while calling it, so a sink may block (e.g. to take an interpreter lock) or log.
// Exceptions it throws are swallowed: a diagnostic never fails a call.
using LogSink = std::function<void(LogLevel, const std::string&)>;

// Installs `sink` and returns the one it replaces; an empty sink restores the default (stderr). Info
// lines are only produced with KSPEC_VERBOSE=1, whatever the sink.
LogSink set_log_sink(LogSink sink);

}  // namespace kspec
