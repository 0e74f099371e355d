// The XLA custom-call targets: one row per target (its name and the kspec op it calls), the one table the
// handlers, kspec_xla_targets_json, kspec.jax and the README's Nx section read.
#pragma once

#include <string>
#include <vector>

namespace kspec::xla {

struct Target {
  const char* name;  // the custom call's target name
  const char* op;    // the kspec op it calls
  // Takes the `layout` attribute: "bdl" (mamba_ssm's [batch, dim, seqlen]) or "bld" ([batch, seqlen, dim],
  // [batch, seqlen, dstate]: Nx's order, row-major buffers read in place: the op's layout param).
  bool scan_layout;
};

const std::vector<Target>& targets();
const Target* find_target(const std::string& name);

// The attributes every target takes besides the op's params (name → doc), in the order documented.
extern const char* const kInputsAttr;   // "inputs"
extern const char* const kOutputsAttr;  // "outputs"
extern const char* const kLayoutAttr;   // "layout"
extern const char* const kTensorsAttr;  // "tensors"

std::string targets_json();

}  // namespace kspec::xla
