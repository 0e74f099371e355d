// The content key of a specialization: SHA-256 over its canonical text, the bytes of every kspec
// template and CUDA header it includes, the NVRTC options and version, and kspec's version. An
// edited template or a new toolkit therefore never reuses a stale binary.
#pragma once

#include <string>

#include "spec.h"

namespace kspec::jit {

// Memoized per process for each distinct canonical spec (templates do not change under a running
// process; a new process re-reads KSPEC_TEMPLATE_DIR).
std::string content_key(const KernelSpec& spec);

// Uncached variant, for tests that edit templates.
std::string compute_content_key(const KernelSpec& spec, const class TemplateSource& src);

const char* kspec_version();

}  // namespace kspec::jit
