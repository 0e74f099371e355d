// A kernel specialization as a value: which template, which kernel, which compile-time arguments,
// for which architecture and with which options. Its canonical text identifies it; its content key
// (key.h) additionally covers the bytes of every header it includes and the compiler's version.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace kspec::jit {

struct KernelSpec {
  std::string header;                  // template file, relative to templates/: "norm_act/norm_act.cuh"
  std::string kernel;                  // kernel template name: "kspec::norm_act_fwd_kernel"
  std::vector<std::string> targs;      // template arguments, in order: "__nv_bfloat16", "4096", "true"
  std::vector<std::pair<std::string, std::string>> defines;  // -D NAME=VALUE
  std::vector<std::string> options;    // extra NVRTC options, e.g. "--use_fast_math"
  std::string arch;                    // "sm_90a", "sm_80"; "compute_XX" asks for PTX

  // "kspec::f<a, b>" : the name expression NVRTC instantiates.
  std::string name_expression() const;
  // One line, stable across runs and platforms: header|kernel<targs>|defines|options|arch.
  std::string canonical() const;
  // The generated translation unit that NVRTC compiles (defines, include, nothing else).
  std::string source() const;
};

// The architecture to compile for: "sm_90" → "sm_90a" (Hopper's arch-specific target),
// "90" → "sm_90a", "sm_80" → "sm_80"; validated against what NVRTC supports. An architecture NVRTC
// does not know as SASS falls back to PTX ("compute_NN") of the highest one it knows below it.
std::string resolve_arch(const std::string& requested);
std::string arch_for_compute_capability(int major, int minor);
// The compute capability an architecture string names, as major * 10 + minor: "sm_90a" → 90,
// "compute_80" → 80, "sm_100f" → 100; 0 for text that names none (so rules like "sm_90 or newer"
// are false for it).
int compute_capability(const std::string& arch);

}  // namespace kspec::jit
