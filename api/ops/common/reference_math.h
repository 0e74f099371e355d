// Float64 helpers shared by the op references (api/ops/<family>/reference.cpp): numerically stable
// sigmoid and softplus, and the size check every reference applies to its inputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kspec::ref::detail {

inline double sigmoid(double x) {
  if (x >= 0.0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

// log1p(exp(x)) without overflow for large x and without losing the tail for very negative x.
inline double softplus(double x) { return x > 0.0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }

// Throws std::invalid_argument unless v holds `expected` elements (or is empty and optional).
inline void check_size(const std::vector<double>& v, int64_t expected, const char* op, const char* name,
                       bool optional) {
  if (optional && v.empty()) return;
  if (static_cast<int64_t>(v.size()) != expected)
    throw std::invalid_argument(std::string(op) + " reference: " + name + " has " + std::to_string(v.size()) +
                                " elements, expected " + std::to_string(expected));
}

}  // namespace kspec::ref::detail
