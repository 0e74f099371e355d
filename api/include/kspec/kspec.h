// kspec: JIT-specialized GPU kernels for sequence models. One include for the whole public API.
#pragma once

#include "kspec/cache.h"
#include "kspec/check.h"
#include "kspec/error.h"
#include "kspec/knobs.h"
#include "kspec/log.h"
#include "kspec/registry.h"
#include "kspec/tensor.h"
#include "kspec/tune.h"
#include "kspec/ops/gemm.h"
#include "kspec/ops/norm_act.h"
#include "kspec/ops/selective_scan.h"

namespace kspec {
const char* version();
}  // namespace kspec
