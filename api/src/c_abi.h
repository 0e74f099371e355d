// What the C ABI (c_abi.cpp) shares with the other C entry points (api/xla): the per-thread last error and
// the one mapping from kspec's exception classes to kspec_status.
#pragma once

#include <string>

#include "kspec/kspec_c.h"
#include "kspec/registry.h"

namespace kspec::c_abi {

// Call inside a catch (...) block: classifies the exception in flight, records it as this thread's last
// error and returns its status. Never throws.
kspec_status capture_error() noexcept;
// Records a failure found by the C layer itself (a NULL pointer, a bad dtype code).
kspec_status set_error(kspec_status code, const std::string& message) noexcept;

// A JSON object of params ({"eps": 1e-5, "norm": "rmsnorm"}) as kspec::Params, typed by the op's schema;
// a name the op does not declare or a value of the wrong JSON type throws InvalidArgument.
Params params_from_json(const OpInfo& op, const char* json);

}  // namespace kspec::c_abi
