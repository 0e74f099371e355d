// The one activation vocabulary of the ops with an `act` parameter (norm_act, gemm); each op takes
// the subset it implements. Canonical names: none, relu, silu, gelu_tanh, gelu_erf. Two other
// spellings, used by earlier kspec versions and by neighbouring libraries, are accepted and mapped to
// the canonical name before anything else (specialization keys, tuning, kernels) sees the value.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace kspec {

// "gelu" is the tanh approximation in kspec (cuBLASLt's GELU epilogue, torch's approximate="tanh");
// torch's default GELU is gelu_erf.
inline const std::vector<std::pair<std::string, std::string>> kActivationAliases = {{"identity", "none"},
                                                                                   {"gelu", "gelu_tanh"}};

}  // namespace kspec
