// kspec's diagnostics: warnings always, info lines with KSPEC_VERBOSE=1, to stderr or to the sink an
// application installs (kspec/log.h). warn_once() reports a recurring condition (a corrupt entry, a
// read-only cache) a single time per process.
// Part of the bottom layer (jit/base), so jit, cache and api all log the same way; the namespace stays jit::.
#pragma once

#include <string>

namespace kspec::jit {

void warn(const std::string& msg);
void warn_once(const std::string& tag, const std::string& msg);
void info(const std::string& msg);

}  // namespace kspec::jit
