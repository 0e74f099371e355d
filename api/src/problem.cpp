// The Problem and Call accessors (dims, dtypes, params, the signature that keys the plan cache) and
// what the schema allows: dim ranges, tuning configs, and params completed with their defaults and
// checked against their types and ranges.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "api/src/validate.h"

namespace kspec {

using namespace validation;

// ---- Problem / Call accessors ----

void throw_unbound_dim(const Problem& p, std::string_view name) {
  throw InvalidArgument(detail::concat(p.op ? p.op->info.name : "?", ": dim '", name, "' is not bound"));
}

void throw_no_param(const Problem& p, std::string_view name) {
  throw InvalidArgument(detail::concat(p.op->info.name, ": no parameter '", name, "'"));
}

void throw_no_tensor(const Problem& p, const char* kind, std::string_view name) {
  throw InvalidArgument(detail::concat(p.op->info.name, ": no ", kind, " '", name, "'"));
}

size_t input_index(const OpInfo& info, std::string_view name) {
  const int i = schema_index(info.inputs, name);
  KSPEC_CHECK_AS(i >= 0, InternalError, info.name, ": its launcher reads an input '", name, "' it does not have");
  return static_cast<size_t>(i);
}

size_t output_index(const OpInfo& info, std::string_view name) {
  const int i = schema_index(info.outputs, name);
  KSPEC_CHECK_AS(i >= 0, InternalError, info.name, ": its launcher reads an output '", name, "' it does not have");
  return static_cast<size_t>(i);
}

namespace validation {
int tensor_index(const std::vector<TensorDef>& defs, std::string_view name) { return schema_index(defs, name); }
}  // namespace validation

DType Problem::dtype(std::string_view tensor) const {
  int i = tensor_index(op->info.inputs, tensor);
  if (i >= 0) return inputs[i].dtype;
  i = tensor_index(op->info.outputs, tensor);
  if (i >= 0) return outputs[i].dtype;
  throw InvalidArgument(detail::concat(op->info.name, ": no tensor named '", tensor, "'"));
}

bool Problem::alt(std::string_view tensor) const {
  int i = tensor_index(op->info.inputs, tensor);
  if (i >= 0) return inputs[i].alt;
  i = tensor_index(op->info.outputs, tensor);
  if (i >= 0) return outputs[i].alt;
  throw InvalidArgument(detail::concat(op->info.name, ": no tensor named '", tensor, "'"));
}

bool Problem::has_dim(std::string_view name) const {
  for (const auto& d : dims)
    if (d.first == name) return true;
  return false;
}

bool Problem::present(std::string_view tensor) const {
  int i = tensor_index(op->info.inputs, tensor);
  if (i >= 0) return inputs[i].present;
  i = tensor_index(op->info.outputs, tensor);
  if (i >= 0) return outputs[i].present;
  // An output's present_with may name a bool param instead (norm_act.fwd's save_stats).
  for (const auto& d : op->info.params)
    if (d.name == tensor && d.type == ParamType::Bool) return param_bool(tensor);
  throw InvalidArgument(detail::concat(op->info.name, ": no tensor named '", tensor, "'"));
}


std::string Problem::signature() const {
  // Built on every call (it keys the plan cache): plain appends, no streams.
  std::string s;
  s.reserve(128);
  s += op->info.name;
  s += '|';
  s += arch;
  s += '|';
  for (const auto& t : inputs) {
    s += t.present ? dtype_short(t.dtype) : "-";
    if (t.alt) s += '~';
    s += ',';
  }
  s += '|';
  for (const auto& t : outputs) {
    s += t.present ? dtype_short(t.dtype) : "-";
    if (t.alt) s += '~';
    s += ',';
  }
  s += '|';
  for (const auto& [name, v] : dims) {
    const DimDef* d = find_dim(op->info, name);
    if (!d || d->kind == DimKind::Var) continue;
    s += name;
    s += '=';
    s += std::to_string(d->kind == DimKind::Bucket ? bucket_of(*d, v) : v);
    s += ',';
  }
  s += '|';
  const auto& defs = op->info.params;
  for (size_t pi = 0; pi < params.items().size(); ++pi) {
    const auto& [name, v] = params.items()[pi];
    if (pi < defs.size() && defs[pi].name == name && defs[pi].runtime) continue;  // not compiled in
    s += name;
    s += '=';
    if (auto i = std::get_if<int64_t>(&v)) s += std::to_string(*i);
    else if (auto b = std::get_if<bool>(&v)) s += *b ? "1" : "0";
    else if (auto str = std::get_if<std::string>(&v)) s += *str;
    else {
      double x = std::get<double>(v);  // exact bits: two params differing in the last bit differ here
      uint64_t bits;
      std::memcpy(&bits, &x, sizeof(bits));
      s += std::to_string(bits);
    }
    s += ',';
  }
  s += "|a";
  s += std::to_string(align_bytes);
  if (op->derived_key) {
    s += '|';
    s += op->derived_key(*this);
  }
  return s;
}


int64_t Call::row_stride(const TensorView& t) const { return row_stride_of(t); }

// ---- ranges and configs: what the schema allows ----

std::pair<int64_t, int64_t> dim_range(const DimDef& d) {
  const bool template_arg = d.kind != DimKind::Var;
  return {d.min.value_or(template_arg ? 1 : 0),
          d.max.value_or(template_arg ? std::numeric_limits<int32_t>::max() : std::numeric_limits<int64_t>::max())};
}

void check_dims(const Problem& p) {
  const OpInfo& info = p.op->info;
  for (const auto& [name, v] : p.dims) {
    const DimDef* d = find_dim(info, name);
    if (!d) continue;
    const auto [lo, hi] = dim_range(*d);
    KSPEC_CHECK(v >= lo && v <= hi, info.name, ": dim '", name, "' must be in ", lo, "..", hi, ", got ", v);
  }
}

bool config_in_space(const OpDef& op, const Config& c, std::string* why) {
  auto no = [&](const std::string& w) {
    *why = "config {" + c.str(op.info) + "}: " + w;
    return false;
  };
  if (op.tuning.candidates) return true;  // a library's space: its own rules (TuningSpace::valid) judge
  const auto& axes = op.tuning.axes;
  for (size_t i = 0; i < c.values.size(); ++i) {
    const auto& [name, v] = c.values[i];
    auto axis = std::find_if(axes.begin(), axes.end(), [&](const auto& a) { return a.first == name; });
    if (axis == axes.end()) {
      std::string names;
      for (const auto& a : axes) names += (names.empty() ? "" : ", ") + a.first;
      return no("'" + name + "' is not an axis of " + op.info.name + "'s tuning space (" +
                (names.empty() ? std::string("it has none") : "its axes: " + names) + ")");
    }
    for (size_t j = 0; j < i; ++j)
      if (c.values[j].first == name) return no("'" + name + "' is given twice");
    if (std::find(axis->second.begin(), axis->second.end(), v) == axis->second.end()) {
      std::string values;
      for (int64_t a : axis->second) values += (values.empty() ? "" : ", ") + std::to_string(a);
      return no(name + "=" + std::to_string(v) + " is not one of the axis' values (" + values + ")");
    }
  }
  for (const auto& [axis, values] : axes)
    if (!c.has(axis)) return no("lacks a value for the axis '" + axis + "'");
  return true;
}

// ---- params ----

namespace {
std::string range_text(const ParamDef& d) {
  auto num = [&](double x) { return d.type == ParamType::Int ? std::to_string(static_cast<int64_t>(x)) : detail::concat(x); };
  if (d.min && d.max) return "in " + num(*d.min) + ".." + num(*d.max);
  return d.min ? ">= " + num(*d.min) : "<= " + num(*d.max);
}

// `value` is an Int or Float param's (already converted to its type).
void check_param_range(const OpInfo& info, const ParamDef& d, const ParamValue& value) {
  const double v = std::holds_alternative<int64_t>(value) ? static_cast<double>(std::get<int64_t>(value))
                                                          : std::get<double>(value);
  if ((!d.min || v >= *d.min) && (!d.max || v <= *d.max)) return;
  throw InvalidArgument(detail::concat(info.name, ": parameter '", d.name, "' must be ", range_text(d), ", got ",
                                       param_to_string(value)));
}
}  // namespace

Params complete_params(const OpDef& op, const Params& given) {
  const OpInfo& info = op.info;
  for (const auto& [name, value] : given.items()) {
    bool known = std::any_of(info.params.begin(), info.params.end(), [&](const ParamDef& d) { return d.name == name; });
    if (!known) {
      std::string names;
      for (const auto& d : info.params) names += (names.empty() ? "" : ", ") + d.name;
      throw InvalidArgument(detail::concat(info.name, ": unknown parameter '", name, "' (expected one of: ",
                                           names.empty() ? "none" : names, ")"));
    }
  }
  Params out;
  out.reserve(info.params.size());
  for (const auto& d : info.params) {
    const ParamValue* v = given.find(d.name);
    ParamValue value = v ? *v : d.default_value;
    switch (d.type) {
      case ParamType::Int:
        if (std::holds_alternative<double>(value)) {
          double x = std::get<double>(value);
          // 2^63 is exact in a double; the cast below is defined only inside (-2^63, 2^63).
          KSPEC_CHECK(std::isfinite(x) && std::fabs(x) < 9223372036854775808.0 &&
                          x == static_cast<double>(static_cast<int64_t>(x)),
                      info.name, ": parameter '", d.name, "': expected an integer, got ", x);
          value = static_cast<int64_t>(x);
        }
        KSPEC_CHECK(std::holds_alternative<int64_t>(value), info.name, ": parameter '", d.name,
                    "': expected an integer, got ", param_to_string(value));
        check_param_range(info, d, value);
        break;
      case ParamType::Float:
        if (std::holds_alternative<int64_t>(value)) value = static_cast<double>(std::get<int64_t>(value));
        KSPEC_CHECK(std::holds_alternative<double>(value), info.name, ": parameter '", d.name,
                    "': expected a number, got ", param_to_string(value));
        KSPEC_CHECK(std::isfinite(std::get<double>(value)), info.name, ": parameter '", d.name,
                    "': expected a finite number, got ", std::get<double>(value));
        check_param_range(info, d, value);
        break;
      case ParamType::Bool:
        if (std::holds_alternative<int64_t>(value) && (std::get<int64_t>(value) == 0 || std::get<int64_t>(value) == 1))
          value = std::get<int64_t>(value) == 1;
        KSPEC_CHECK(std::holds_alternative<bool>(value), info.name, ": parameter '", d.name,
                    "': expected true or false, got ", param_to_string(value));
        break;
      case ParamType::Choice: {
        KSPEC_CHECK(std::holds_alternative<std::string>(value), info.name, ": parameter '", d.name,
                    "': expected a string, got ", param_to_string(value));
        for (const auto& [alias, choice] : d.aliases)
          if (std::get<std::string>(value) == alias) value = choice;
        const auto& s = std::get<std::string>(value);
        if (std::find(d.choices.begin(), d.choices.end(), s) == d.choices.end()) {
          std::string names;
          for (const auto& c : d.choices) names += (names.empty() ? "" : ", ") + c;
          for (const auto& [alias, choice] : d.aliases)
            if (std::find(d.choices.begin(), d.choices.end(), choice) != d.choices.end())
              names += ", " + alias + " (= " + choice + ")";
          throw InvalidArgument(detail::concat(info.name, ": parameter '", d.name, "': expected one of ", names,
                                               ", got '", s, "'"));
        }
        break;
      }
    }
    out.set(d.name, value);
  }
  return out;
}

}  // namespace kspec
