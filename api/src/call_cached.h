// kspec::call_cached (plan.cpp): for kspec._C's C ABI (python/src/ext_api.cpp), which builds without the CUDA
// headers that plan.h includes.
#pragma once

#include <string_view>
#include <vector>

#include "kspec/registry.h"

namespace kspec {

// kspec::call where the call is cached (its signature validated and planned before, the plan current): such a
// call compiles nothing and takes no lock, so a Python caller may keep the GIL for it. False, nothing done,
// otherwise (a miss, a null pointer: kspec::call then validates, and raises what it raises). Throws what a
// hit throws (overlap, the op's check_call, a failed launch).
bool call_cached(std::string_view op, const std::vector<TensorView>& inputs, const std::vector<TensorView>& outputs,
                 const Params& params, Stream stream);

}  // namespace kspec
