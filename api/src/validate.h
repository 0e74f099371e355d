// The helpers shared by validation's files: validate_tensor.cpp defines them and checks one argument;
// validate.cpp (validate_call, problem_from_request) and problem.cpp (the Problem accessors) use them.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "api/src/op.h"

namespace kspec::validation {

// "input 'x'" for messages, formatted only when a message is built (validation runs on every call).
struct What {
  const char* kind;
  const std::string& name;
};
std::ostream& operator<<(std::ostream& os, const What& w);

std::string join_dtypes(const std::vector<DType>& ds);
std::string shape_text(const std::vector<std::string>& shape);
std::string shape_text(const TensorDef& t);
const std::vector<std::string>& shape_for(const TensorDef& t, bool alt);
bool is_leading(const std::string& tok);
bool is_number(const std::string& s);
int64_t row_stride_of(const TensorView& t);
const DimDef* find_dim(const OpInfo& info, std::string_view name);
int64_t bucket_of(const DimDef& d, int64_t v);
// The index of the tensor named `name` in defs, -1 if none (problem.cpp).
int tensor_index(const std::vector<TensorDef>& defs, std::string_view name);

void check_tensor(Problem& p, const OpInfo& info, const TensorDef& def, const TensorView& t,
                  const What& what, int* device, bool is_output, TensorMeta& meta);
void check_list(Problem& p, const OpInfo& info, const TensorDef& def, const TensorView& list, const What& what,
                int* device);
void check_same_shapes(const std::string& op, const What& what, const TensorView& list, const std::string& other_name,
                       const TensorView& other);

}  // namespace kspec::validation
