// Validation of a call against its op's schema, before anything is launched. Every message names the
// op, the argument and what was expected.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <sstream>

#include "api/src/op.h"

namespace kspec {
namespace {

std::string join_dtypes(const std::vector<DType>& ds) {
  std::string s;
  for (size_t i = 0; i < ds.size(); ++i) s += (i ? "|" : "") + std::string(dtype_name(ds[i]));
  return s;
}

std::string shape_text(const std::vector<std::string>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + shape[i];
  return s + "]";
}

std::string shape_text(const TensorDef& t) {
  return t.alt_shape.empty() ? shape_text(t.shape) : shape_text(t.shape) + " or " + shape_text(t.alt_shape);
}

// The shape a tensor is laid out in: its alternative one when the call (or request) chose that.
const std::vector<std::string>& shape_for(const TensorDef& t, bool alt) { return alt ? t.alt_shape : t.shape; }

// "input 'x'" for messages, formatted only when a message is built (validation runs on every call).
struct What {
  const char* kind;
  const std::string& name;
};
std::ostream& operator<<(std::ostream& os, const What& w) { return os << w.kind << " '" << w.name << "'"; }

bool is_leading(const std::string& tok) {
  return tok.size() >= 3 && tok[0] == '.' && tok[1] == '.' && tok[2] == '.';
}

// The distance between consecutive rows once the dims before the last are flattened: the stride of
// the innermost of them with more than one element (size-1 dims have arbitrary strides).
int64_t row_stride_of(const TensorView& t) {
  for (int j = t.rank - 2; j >= 0; --j)
    if (t.shape[j] > 1) return t.strides[j];
  return t.rank >= 1 ? t.shape[t.rank - 1] : 1;
}

const DimDef* find_dim(const OpInfo& info, std::string_view name) {
  for (const auto& d : info.dims)
    if (d.name == name) return &d;
  return nullptr;
}

int64_t bucket_of(const DimDef& d, int64_t v) {
  for (int64_t b : d.buckets)
    if (v <= b) return b;
  return v;  // above the largest bucket: exact
}

void bind_dim(Problem& p, const std::string& op, const What& what, const std::string& dim,
              int64_t value) {
  for (auto& [name, v] : p.dims) {
    if (name == dim) {
      KSPEC_CHECK(v == value, op, ": ", what, " has ", dim, " = ", value, " but an earlier argument has ",
                  dim, " = ", v);
      return;
    }
  }
  p.dims.emplace_back(dim, value);
}

bool is_number(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

int pow2_align(uint64_t x) {
  int a = 16;
  while (a > 1 && (x % a) != 0) a /= 2;
  return a;
}

// Checks one tensor's rank, dtype, dims and layout; binds its dims. Returns its row stride (elements).
void check_tensor(Problem& p, const OpInfo& info, const TensorDef& def, const TensorView& t,
                  const What& what, int* device, bool is_output, TensorMeta& meta) {
  const std::string& op = info.name;
  KSPEC_CHECK(t.rank <= kMaxRank, op, ": ", what, ": rank ", t.rank, " exceeds ", kMaxRank);
  // An alternative shape has no leading "..." dims and another rank than the main one: the rank decides.
  meta.alt = !def.alt_shape.empty() && t.rank == static_cast<int>(def.alt_shape.size());
  const std::vector<std::string>& shape = shape_for(def, meta.alt);
  bool leading = !shape.empty() && is_leading(shape[0]);
  int fixed = static_cast<int>(shape.size()) - (leading ? 1 : 0);
  KSPEC_CHECK(leading ? t.rank >= fixed : t.rank == fixed, op, ": ", what, ": expected shape ",
              shape_text(def), def.alt_shape.empty() ? " (rank " : " (main rank ", leading ? ">= " : "", fixed,
              "), got ", t.describe());
  // dtype
  if (!def.dtype_of.empty()) {
    DType want = p.dtype(def.dtype_of);
    KSPEC_CHECK(t.dtype == want || (def.or_float32 && t.dtype == DType::f32), op, ": ", what,
                ": expected dtype ", dtype_name(want), def.or_float32 ? " (or float32)" : "",
                " like '", def.dtype_of, "', got ", dtype_name(t.dtype));
  } else {
    KSPEC_CHECK(std::find(def.dtypes.begin(), def.dtypes.end(), t.dtype) != def.dtypes.end(), op, ": ",
                what, ": expected dtype ", join_dtypes(def.dtypes), ", got ", dtype_name(t.dtype));
  }
  // device and pointer
  KSPEC_CHECK(t.device != kCpuDevice, op, ": ", what, ": expected a CUDA tensor, got one in host memory (",
              t.describe(), ")");
  KSPEC_CHECK(t.device >= 0, op, ": ", what, ": invalid device ", t.device);
  if (*device < 0) *device = t.device;
  KSPEC_CHECK(t.device == *device, op, ": ", what, ": expected a tensor on cuda:", *device,
              " like the other arguments, got cuda:", t.device);
  if (t.numel() > 0) KSPEC_CHECK(t.data != nullptr, op, ": ", what, ": null data pointer for ", t.describe());
  auto addr = reinterpret_cast<uintptr_t>(t.data);
  KSPEC_CHECK(addr % dtype_size(t.dtype) == 0, op, ": ", what, ": data pointer 0x", std::hex, addr, std::dec,
              " is not aligned to its element size (", dtype_size(t.dtype), " bytes)");
  // dims
  int lead_count = t.rank - fixed;
  if (leading) {
    std::string dim = shape[0].substr(3);
    int64_t prod = 1;
    std::vector<int64_t> lead;
    for (int d = 0; d < lead_count; ++d) {
      prod *= t.shape[d];
      lead.push_back(t.shape[d]);
    }
    bind_dim(p, op, what, dim, prod);
    bool have = false;
    for (const auto& l : p.leading) have = have || l.first == dim;
    if (!have) p.leading.emplace_back(dim, lead);
  }
  for (int i = 0; i < fixed; ++i) {
    const std::string& tok = shape[(leading ? 1 : 0) + i];
    int64_t v = t.shape[lead_count + i];
    KSPEC_CHECK(v >= 0, op, ": ", what, ": negative size in ", t.describe());
    if (is_number(tok)) {
      KSPEC_CHECK(v == std::stoll(tok), op, ": ", what, ": dim ", lead_count + i, " must be ", tok,
                  ", got ", v);
    } else {
      bind_dim(p, op, what, tok, v);
    }
  }
  // layout
  if (t.numel() > 0 && def.layout == Layout::Strided) {
    p.align_bytes = std::min(p.align_bytes, pow2_align(addr));  // the op's check_call judges the strides
  } else if (t.numel() > 0) {
    if (def.layout == Layout::Contiguous) {
      KSPEC_CHECK(t.is_contiguous(), op, ": ", what, ": expected a contiguous tensor, got ", t.describe());
    } else {
      KSPEC_CHECK(t.rank == 0 || t.shape[t.rank - 1] == 1 || t.strides[t.rank - 1] == 1, op, ": ", what,
                  ": expected the last dim to be contiguous (stride 1), got ", t.describe());
      // Leading dims must collapse into one row index: stride[j] == stride[j+1] * shape[j+1].
      int rows_end = t.rank - 1;       // all dims but the last form the rows
      for (int j = 0; j + 1 < rows_end; ++j) {
        if (t.shape[j] == 1 || t.shape[j + 1] == 1) continue;
        KSPEC_CHECK(t.strides[j] == t.strides[j + 1] * t.shape[j + 1], op, ": ", what,
                    ": its leading dims cannot be flattened into rows without a copy (", t.describe(),
                    "); pass a tensor whose dims before the last have a single row stride");
      }
      if (t.rank >= 2) {
        int64_t rs = row_stride_of(t);
        if (is_output && t.numel() > t.shape[t.rank - 1])
          KSPEC_CHECK(rs >= t.shape[t.rank - 1], op, ": ", what, ": rows overlap (row stride ", rs,
                      " < row length ", t.shape[t.rank - 1], "); outputs must not alias themselves");
        p.align_bytes = std::min(p.align_bytes, pow2_align(static_cast<uint64_t>(rs) * dtype_size(t.dtype)));
      }
    }
    p.align_bytes = std::min(p.align_bytes, pow2_align(addr));
  }
}

// Checks a TensorList input: every element has the list's dtype, lives on the call's device, has the
// def's layout (Contiguous or any), a pointer aligned to its element size; binds the count dim.
void check_list(Problem& p, const OpInfo& info, const TensorDef& def, const TensorView& list, const What& what,
                int* device) {
  const std::string& op = info.name;
  KSPEC_CHECK(list.is_list(), op, ": ", what, ": expected a list of tensors, got ", list.describe());
  if (!def.shape.empty()) bind_dim(p, op, what, def.shape[0], list.list_size());
  DType want = list.list_size() > 0 ? list.item(0).dtype : (def.dtypes.empty() ? DType::f32 : def.dtypes.front());
  if (!def.dtype_of.empty()) {
    DType other = p.dtype(def.dtype_of);
    KSPEC_CHECK(want == other || (def.or_float32 && want == DType::f32), op, ": ", what, ": expected dtype ",
                dtype_name(other), def.or_float32 ? " (or float32)" : "", " like '", def.dtype_of, "', got ",
                dtype_name(want));
  } else {
    KSPEC_CHECK(std::find(def.dtypes.begin(), def.dtypes.end(), want) != def.dtypes.end(), op, ": ", what,
                ": expected dtype ", join_dtypes(def.dtypes), ", got ", dtype_name(want));
  }
  for (int64_t i = 0; i < list.list_size(); ++i) {
    const TensorView& t = list.item(i);
    KSPEC_CHECK(t.defined() && !t.is_list(), op, ": ", what, "[", i, "]: expected a tensor, got ", t.describe());
    KSPEC_CHECK(t.rank <= kMaxRank, op, ": ", what, "[", i, "]: rank ", t.rank, " exceeds ", kMaxRank);
    KSPEC_CHECK(t.dtype == want, op, ": ", what, "[", i, "]: expected dtype ", dtype_name(want),
                " like the list's first tensor, got ", dtype_name(t.dtype));
    KSPEC_CHECK(t.device != kCpuDevice, op, ": ", what, "[", i, "]: expected a CUDA tensor, got one in host memory");
    if (*device < 0) *device = t.device;
    KSPEC_CHECK(t.device == *device, op, ": ", what, "[", i, "]: expected a tensor on cuda:", *device,
                " like the other arguments, got cuda:", t.device);
    if (t.numel() == 0) continue;
    KSPEC_CHECK(t.data != nullptr, op, ": ", what, "[", i, "]: null data pointer for ", t.describe());
    auto addr = reinterpret_cast<uintptr_t>(t.data);
    KSPEC_CHECK(addr % dtype_size(t.dtype) == 0, op, ": ", what, "[", i, "]: data pointer 0x", std::hex, addr,
                std::dec, " is not aligned to its element size (", dtype_size(t.dtype), " bytes)");
    if (def.layout == Layout::Contiguous)
      KSPEC_CHECK(t.is_contiguous(), op, ": ", what, "[", i, "]: expected a contiguous tensor, got ", t.describe());
    p.align_bytes = std::min(p.align_bytes, pow2_align(addr));
  }
}

// Element i of `list` has the shape of element i of `other` (same length too).
void check_same_shapes(const std::string& op, const What& what, const TensorView& list, const std::string& other_name,
                       const TensorView& other) {
  KSPEC_CHECK(list.list_size() == other.list_size(), op, ": ", what, " has ", list.list_size(),
              " tensors but '", other_name, "' has ", other.list_size());
  for (int64_t i = 0; i < list.list_size(); ++i) {
    const TensorView &a = list.item(i), &b = other.item(i);
    bool same = a.rank == b.rank;
    for (int d = 0; same && d < a.rank; ++d) same = a.shape[d] == b.shape[d];
    KSPEC_CHECK(same, op, ": ", what, "[", i, "] has shape ", a.describe(), " but '", other_name, "'[", i,
                "] has ", b.describe());
  }
}

}  // namespace

// ---- Problem / Call accessors ----

int64_t Problem::dim(std::string_view name) const {
  for (const auto& [n, v] : dims)
    if (n == name) return v;
  throw InvalidArgument(detail::concat(op ? op->info.name : "?", ": dim '", name, "' is not bound"));
}

namespace {
int tensor_index(const std::vector<TensorDef>& defs, std::string_view name) {
  for (size_t i = 0; i < defs.size(); ++i)
    if (defs[i].name == name) return static_cast<int>(i);
  return -1;
}
}  // namespace

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
  throw InvalidArgument(detail::concat(op->info.name, ": no tensor named '", tensor, "'"));
}

namespace {
const ParamValue& get_param(const Problem& p, std::string_view name) {
  const ParamValue* v = p.params.find(name);
  if (!v) throw InvalidArgument(detail::concat(p.op->info.name, ": no parameter '", name, "'"));
  return *v;
}
}  // namespace

int64_t Problem::param_int(std::string_view name) const { return std::get<int64_t>(get_param(*this, name)); }
double Problem::param_float(std::string_view name) const { return std::get<double>(get_param(*this, name)); }
bool Problem::param_bool(std::string_view name) const { return std::get<bool>(get_param(*this, name)); }
const std::string& Problem::param_str(std::string_view name) const {
  return std::get<std::string>(get_param(*this, name));
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

const TensorView& Call::in(std::string_view name) const {
  int i = tensor_index(problem.op->info.inputs, name);
  KSPEC_CHECK(i >= 0, problem.op->info.name, ": no input '", name, "'");
  return inputs[i];
}

const TensorView& Call::out(std::string_view name) const {
  int i = tensor_index(problem.op->info.outputs, name);
  KSPEC_CHECK(i >= 0, problem.op->info.name, ": no output '", name, "'");
  return outputs[i];
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
        const auto& s = std::get<std::string>(value);
        if (std::find(d.choices.begin(), d.choices.end(), s) == d.choices.end()) {
          std::string names;
          for (const auto& c : d.choices) names += (names.empty() ? "" : ", ") + c;
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

// ---- shapes ----

namespace {
// Calls f(size) for each dim of t's shape under p, in order, until f returns false (then false).
// Whether p lays tensor t out in its alternative shape (outputs follow the input of the same name's
// choice through TensorMeta as well).
bool uses_alt(const TensorDef& t, const Problem& p) {
  if (t.alt_shape.empty() || !p.op) return false;
  const OpInfo& info = p.op->info;
  for (size_t i = 0; i < info.inputs.size() && i < p.inputs.size(); ++i)
    if (&info.inputs[i] == &t) return p.inputs[i].alt;
  for (size_t i = 0; i < info.outputs.size() && i < p.outputs.size(); ++i)
    if (&info.outputs[i] == &t) return p.outputs[i].alt;
  return false;
}

template <typename F>
bool for_each_dim(const TensorDef& t, const Problem& p, F&& f) {
  for (const auto& tok : shape_for(t, uses_alt(t, p))) {
    if (is_leading(tok)) {
      const std::vector<int64_t>* lead = nullptr;
      for (const auto& [name, l] : p.leading)
        if (name.compare(0, std::string::npos, tok, 3, std::string::npos) == 0) lead = &l;
      if (lead) {
        for (int64_t v : *lead)
          if (!f(v)) return false;
      } else if (!f(p.dim(tok.substr(3)))) {
        return false;
      }
    } else if (!f(is_number(tok) ? std::stoll(tok) : p.dim(tok))) {
      return false;
    }
  }
  return true;
}

// shape_of(t, p) == view's shape, without building a vector (validation runs on every call).
bool shape_matches(const TensorDef& t, const Problem& p, const TensorView& view) {
  int d = 0;
  return for_each_dim(t, p, [&](int64_t v) { return d < view.rank && view.shape[d++] == v; }) && d == view.rank;
}
}  // namespace

std::vector<int64_t> shape_of(const TensorDef& t, const Problem& p) {
  std::vector<int64_t> shape;
  for_each_dim(t, p, [&](int64_t v) {
    shape.push_back(v);
    return true;
  });
  return shape;
}

// ---- the call ----


// Trailing optional arguments may be left out: an op that gains an optional input or output keeps its
// callers. `given` itself when nothing is left out (no copy on the call path), else a copy padded with
// absent views in `storage`; any other count is left for the caller's check to report.
static const std::vector<TensorView>& pad_optional(const std::vector<TensorView>& given,
                                                   const std::vector<TensorDef>& defs,
                                                   std::vector<TensorView>& storage) {
  if (given.size() >= defs.size()) return given;
  for (size_t i = given.size(); i < defs.size(); ++i)
    if (!defs[i].optional) return given;
  storage = given;
  storage.resize(defs.size());
  return storage;
}

Call validate_call(const OpDef& op, const std::vector<TensorView>& inputs_given,
                   const std::vector<TensorView>& outputs_given, const Params& params, Stream stream,
                   bool inputs_only) {
  const OpInfo& info = op.info;
  std::vector<TensorView> in_storage, out_storage;
  const std::vector<TensorView>& inputs = pad_optional(inputs_given, info.inputs, in_storage);
  const std::vector<TensorView>& outputs =
      inputs_only ? outputs_given : pad_optional(outputs_given, info.outputs, out_storage);
  auto names = [](const std::vector<TensorDef>& defs) {
    std::string s;
    for (const auto& d : defs) s += (s.empty() ? "" : ", ") + d.name;
    return s;
  };
  KSPEC_CHECK(inputs.size() == info.inputs.size(), info.name, ": expected ", info.inputs.size(), " inputs (",
              names(info.inputs), "), got ", inputs.size());
  KSPEC_CHECK(inputs_only || outputs.size() == info.outputs.size(), info.name, ": expected ",
              info.outputs.size(), " outputs (", names(info.outputs), "), got ", outputs.size());
  Call call;
  Problem& p = call.problem;
  p.op = &op;
  p.params = complete_params(op, params);
  p.inputs.resize(inputs.size());
  p.outputs.resize(outputs.size());
  p.dims.reserve(4);
  int device = -1;
  // dtypes first (dtype_of may refer to a later tensor), then everything else in order.
  for (size_t i = 0; i < inputs.size(); ++i) {
    const TensorView& t = inputs[i];
    p.inputs[i] = {t.defined(), t.is_list() && t.list_size() > 0 ? t.item(0).dtype : t.dtype};
  }
  if (inputs_only) p.outputs.assign(info.outputs.size(), TensorMeta{});
  for (size_t i = 0; i < outputs.size(); ++i) p.outputs[i] = {outputs[i].defined(), outputs[i].dtype};
  for (size_t i = 0; i < inputs.size(); ++i) {
    const TensorDef& def = info.inputs[i];
    What what{"input", def.name};
    if (!inputs[i].defined()) {
      KSPEC_CHECK(def.optional, info.name, ": ", what, " is required (expected ", shape_text(def), ")");
      continue;
    }
    if (def.list) {
      check_list(p, info, def, inputs[i], what, &device);
      continue;
    }
    KSPEC_CHECK(!inputs[i].is_list(), info.name, ": ", what, ": expected one tensor, got ", inputs[i].describe());
    check_tensor(p, info, def, inputs[i], what, &device, false, p.inputs[i]);
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const TensorDef& def = info.inputs[i];
    if (!def.list || def.same_shapes_as.empty() || !inputs[i].defined()) continue;
    int j = tensor_index(info.inputs, def.same_shapes_as);
    if (j >= 0 && inputs[j].defined())
      check_same_shapes(info.name, What{"input", def.name}, inputs[i], def.same_shapes_as, inputs[j]);
  }
  // An output with an alternative shape follows the input of the same dtype source (dB like B).
  for (size_t i = 0; i < info.outputs.size(); ++i) {
    const TensorDef& def = info.outputs[i];
    if (!def.alt_shape.empty() && !def.dtype_of.empty()) p.outputs[i].alt = p.alt(def.dtype_of);
  }
  check_dims(p);
  if (op.check) op.check(p);
  if (inputs_only) {
    KSPEC_CHECK(device >= 0, info.name, ": no tensor arguments");
    call.inputs = inputs;
    call.device = device;
    return call;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    const TensorDef& def = info.outputs[i];
    What what{"output", def.name};
    bool needed = def.present_with.empty() ? !def.optional : p.present(def.present_with);
    if (!outputs[i].defined()) {
      KSPEC_CHECK(!needed, info.name, ": ", what, " is required", def.present_with.empty() ? "" : " when '",
                  def.present_with, def.present_with.empty() ? "" : "' is given");
      continue;
    }
    KSPEC_CHECK(def.present_with.empty() || needed, info.name, ": ", what, " must be None when '",
                def.present_with, "' is None");
    bool alt = p.outputs[i].alt;
    check_tensor(p, info, def, outputs[i], what, &device, true, p.outputs[i]);
    KSPEC_CHECK(p.outputs[i].alt == alt, info.name, ": ", what, ": expected shape ",
                shape_text(shape_for(def, alt)), " like '", def.dtype_of, "', got ", outputs[i].describe());
    if (!shape_matches(def, p, outputs[i])) {
      auto want = shape_of(def, p);
      std::ostringstream os;
      os << info.name << ": " << what << ": expected shape [";
      for (size_t k = 0; k < want.size(); ++k) os << (k ? ", " : "") << want[k];
      os << "], got " << outputs[i].describe();
      throw InvalidArgument(os.str());
    }
  }
  KSPEC_CHECK(device >= 0, info.name, ": no tensor arguments");
  call.inputs = inputs;
  call.outputs = outputs;
  call.device = device;
  call.stream = stream;
  if (op.check_call) op.check_call(call);
  check_no_overlap(info, inputs, outputs);
  return call;
}

Problem problem_from_request(const OpDef& op, const CompileRequest& req) {
  const OpInfo& info = op.info;
  Problem p;
  p.op = &op;
  Params scalars;
  for (const auto& [name, v] : req.params.items()) {
    if (find_dim(info, name)) {
      KSPEC_CHECK(std::holds_alternative<int64_t>(v), info.name, ": dim '", name, "' must be an integer");
      p.dims.emplace_back(name, std::get<int64_t>(v));
    } else {
      scalars.set(name, v);
    }
  }
  p.params = complete_params(op, scalars);
  for (const auto& [name, v] : op.compile_dims)
    if (!p.has_dim(name)) p.dims.emplace_back(name, v);
  for (const auto& [name, value] : op.derived_dims)
    if (!p.has_dim(name)) p.dims.emplace_back(name, value(p));
  for (const auto& d : info.dims) {
    const bool have = p.has_dim(d.name);
    KSPEC_CHECK(have || d.kind == DimKind::Var, info.name, ": needs a value for the compile-time dim '", d.name,
                "' (e.g. --param ", d.name, "=4096)");
    if (!have) p.dims.emplace_back(d.name, 1);
  }
  auto optional_named = [](const std::vector<TensorDef>& defs, const std::string& w) {
    return std::any_of(defs.begin(), defs.end(), [&](const TensorDef& t) { return t.name == w && t.optional; });
  };
  for (const auto& w : req.without)
    KSPEC_CHECK(optional_named(info.inputs, w) || optional_named(info.outputs, w), info.name, ": '", w,
                "' is not an optional input or output");
  auto pick = [&](const TensorDef& t, DType main) -> DType {
    for (const auto& [name, dt] : req.tensor_dtypes)
      if (name == t.name) return dt;
    if (!t.dtype_of.empty()) return main;  // resolved below
    if (std::find(t.dtypes.begin(), t.dtypes.end(), main) != t.dtypes.end()) return main;
    return t.dtypes.front();
  };
  p.inputs.resize(info.inputs.size());
  p.outputs.resize(info.outputs.size());
  for (size_t i = 0; i < info.inputs.size(); ++i) {
    bool absent = std::find(req.without.begin(), req.without.end(), info.inputs[i].name) != req.without.end();
    p.inputs[i] = {!absent, pick(info.inputs[i], req.dtype)};
  }
  for (size_t i = 0; i < info.outputs.size(); ++i) {
    const auto& def = info.outputs[i];
    bool absent = std::find(req.without.begin(), req.without.end(), def.name) != req.without.end();
    bool present = def.present_with.empty() ? !absent : p.present(def.present_with);
    p.outputs[i] = {present, pick(def, req.dtype)};
  }
  // dtype_of: copy the referenced tensor's dtype unless overridden (float32 allowed when or_float32).
  auto resolve = [&](const std::vector<TensorDef>& defs, std::vector<TensorMeta>& metas) {
    for (size_t i = 0; i < defs.size(); ++i) {
      if (defs[i].dtype_of.empty()) continue;
      bool overridden = false;
      for (const auto& [name, dt] : req.tensor_dtypes) {
        if (name != defs[i].name) continue;
        overridden = true;
        KSPEC_CHECK(dt == p.dtype(defs[i].dtype_of) || (defs[i].or_float32 && dt == DType::f32), info.name,
                    ": ", defs[i].name, " must have the dtype of ", defs[i].dtype_of,
                    defs[i].or_float32 ? " or float32" : "");
      }
      if (!overridden) metas[i].dtype = p.dtype(defs[i].dtype_of);
    }
  };
  resolve(info.inputs, p.inputs);
  resolve(info.outputs, p.outputs);
  for (const auto& name : req.alt_shapes) {
    int i = tensor_index(info.inputs, name);
    KSPEC_CHECK(i >= 0 && !info.inputs[i].alt_shape.empty(), info.name, ": '", name,
                "' is not an input with an alternative shape");
    p.inputs[i].alt = true;
  }
  for (size_t i = 0; i < info.outputs.size(); ++i) {
    const TensorDef& def = info.outputs[i];
    if (!def.alt_shape.empty() && !def.dtype_of.empty()) p.outputs[i].alt = p.alt(def.dtype_of);
  }
  for (size_t i = 0; i < info.inputs.size(); ++i) {
    const auto& def = info.inputs[i];
    if (def.dtype_of.empty())
      KSPEC_CHECK(std::find(def.dtypes.begin(), def.dtypes.end(), p.inputs[i].dtype) != def.dtypes.end(), info.name,
                  ": input '", def.name, "' does not support dtype ", dtype_name(p.inputs[i].dtype), " (expected ",
                  join_dtypes(def.dtypes), ")");
  }
  p.arch = jit::resolve_arch(req.arch);
  check_dims(p);
  if (op.check) op.check(p);
  return p;
}

}  // namespace kspec
