// Checking ops on a GPU against their float64 references: fresh random inputs (never zeros), outputs
// poisoned with NaN before the call, relative error ‖out−ref‖/‖ref‖ per output against the dtype's
// tolerance. Used by `kspec check` (the main job on a GPU) and by the GoogleTest GPU suite.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kspec/registry.h"

namespace kspec {

struct CheckRow {
  std::string op, case_name, dtype, config, shape;
  std::vector<std::pair<std::string, double>> errors;  // output name → relative error
  double tolerance = 0;
  bool passed = false;
  std::string message;  // why it failed (or the exception text)
  uint64_t seed = 0;
};

struct CheckOptions {
  std::string case_name;         // "" = every case
  std::vector<DType> dtypes;     // empty = the op's dtypes
  int device = 0;
  bool include_large = false;
  std::optional<Config> config;  // force a config (else the heuristic's)
  // Several configs on the same inputs, one row each against one reference (in place of `config`).
  std::vector<Config> configs;
  uint64_t seed = 0;             // 0 = fresh from std::random_device
  // Worker threads for the float64 references, which run while the GPU checks the next case
  // (0 = the machine's cores, at most 16).
  int threads = 0;
};

std::vector<CheckRow> check_op(const std::string& op, const CheckOptions& options = {});
std::vector<std::string> case_names(const std::string& op);
// Every legal tuning configuration of an op's case for a dtype (to check them all).
std::vector<Config> configs_for_case(const std::string& op, const std::string& case_name, DType dtype,
                                     const std::string& arch = "sm_90");

}  // namespace kspec
