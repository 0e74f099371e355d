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

// The CUDA headers' part of a key: SHA-256 over the bytes of every toolkit header the template
// includes, directly or not (about 1.6 MB for cuda_bf16.h: several ms per process). With a memo
// directory, the hash is remembered in a file with each header's size and mtime; a later process
// re-checks those with stat() alone and rehashes when any differ (as ccache's manifests do).
std::string system_headers_hash(const class TemplateSource& src, const std::string& header,
                                const std::string& memo_dir);
// Where content_key() keeps that memo ("" = nowhere; set by the cache layer to its directory).
void set_header_memo_dir(const std::string& dir);

}  // namespace kspec::jit
