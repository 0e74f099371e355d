// The C ABI (kspec/kspec_c.h): C structs and JSON in, kspec::call out, every exception caught at the
// boundary and kept as the calling thread's last error.
#include "c_abi.h"

#include <exception>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kspec/error.h"
#include "kspec/kspec.h"

namespace kspec::c_abi {
namespace {

struct LastError {
  kspec_status code = KSPEC_OK;
  std::string message;
};
thread_local LastError last_error;
thread_local std::string op_info_buffer;

nlohmann::json param_value_json(const ParamValue& v) {
  return std::visit([](const auto& x) { return nlohmann::json(x); }, v);
}

nlohmann::json tensor_def_json(const TensorDef& t) {
  std::vector<std::string> dtypes;
  for (DType d : t.dtypes) dtypes.push_back(dtype_name(d));
  return {{"name", t.name},         {"shape", t.shape},       {"alt_shape", t.alt_shape},
          {"dtypes", dtypes},       {"dtype_of", t.dtype_of}, {"or_float32", t.or_float32},
          {"optional", t.optional}, {"present_with", t.present_with},
          {"in_place_of", t.in_place_of}, {"list", t.list}, {"doc", t.doc}};
}

const char* param_type_name(ParamType t) {
  switch (t) {
    case ParamType::Int: return "int";
    case ParamType::Float: return "float";
    case ParamType::Bool: return "bool";
    case ParamType::Choice: return "choice";
  }
  return "?";
}

nlohmann::json op_info_json(const OpInfo& i) {
  nlohmann::json j = {{"name", i.name}, {"family", i.family}, {"doc", i.doc}, {"reference", i.reference}};
  j["inputs"] = nlohmann::json::array();
  j["outputs"] = nlohmann::json::array();
  for (const auto& t : i.inputs) j["inputs"].push_back(tensor_def_json(t));
  for (const auto& t : i.outputs) j["outputs"].push_back(tensor_def_json(t));
  j["params"] = nlohmann::json::array();
  for (const auto& p : i.params) {
    nlohmann::json pj = {{"name", p.name}, {"type", param_type_name(p.type)}, {"default", param_value_json(p.default_value)},
                         {"choices", p.choices}, {"runtime", p.runtime}, {"doc", p.doc}};
    pj["min"] = p.min ? nlohmann::json(*p.min) : nlohmann::json();
    pj["max"] = p.max ? nlohmann::json(*p.max) : nlohmann::json();
    j["params"].push_back(pj);
  }
  j["dims"] = nlohmann::json::array();
  for (const auto& d : i.dims)
    j["dims"].push_back({{"name", d.name},
                         {"kind", d.kind == DimKind::Var ? "runtime" : d.kind == DimKind::Const ? "compile-time" : "bucketed"},
                         {"doc", d.doc}});
  j["constants"] = nlohmann::json::object();
  for (const auto& [k, v] : i.constants) j["constants"][k] = v;
  j["tolerances"] = nlohmann::json::object();
  for (DType dt : {DType::f32, DType::f16, DType::bf16, DType::f64}) j["tolerances"][dtype_name(dt)] = op_tolerance(i.name, dt);
  return j;
}

// One C tensor as a TensorView; `items` keeps a list's element views alive for the call.
TensorView view_of(const kspec_tensor& t, const std::string& what, std::vector<std::vector<TensorView>>& items) {
  if (t.rank == KSPEC_ABSENT) return TensorView();
  if (t.rank == KSPEC_LIST) {
    KSPEC_CHECK(t.count >= 0 && (t.count == 0 || t.data), what, ": a list (rank KSPEC_LIST) needs data pointing to ",
                "count >= 0 kspec_tensor items, got count ", t.count, t.data ? "" : " and data NULL");
    const auto* elems = static_cast<const kspec_tensor*>(t.data);
    std::vector<TensorView> views;
    views.reserve(size_t(t.count));
    for (int64_t i = 0; i < t.count; ++i) {
      const std::string item_what = what + " item " + std::to_string(i);
      KSPEC_CHECK(elems[i].rank >= 0, item_what, ": expected a tensor (rank >= 0), got rank ", elems[i].rank);
      views.push_back(view_of(elems[i], item_what, items));
    }
    items.push_back(std::move(views));
    return TensorView::list(items.back().data(), t.count);
  }
  KSPEC_CHECK(t.rank >= 0 && t.rank <= KSPEC_MAX_RANK, what, ": rank must be 0..", KSPEC_MAX_RANK,
              ", KSPEC_ABSENT (-1) or KSPEC_LIST (-2), got ", t.rank);
  KSPEC_CHECK(t.dtype >= KSPEC_F32 && t.dtype <= KSPEC_U8, what, ": dtype code ", t.dtype,
              " is not a kspec_dtype (0..6: f32, f16, bf16, f64, i32, i64, u8)");
  KSPEC_CHECK(t.rank == 0 || t.shape, what, ": shape is NULL for a rank-", t.rank, " tensor");
  TensorView v;
  v.data = t.data;
  v.dtype = static_cast<DType>(t.dtype);
  v.rank = t.rank;
  v.device = t.device;
  int64_t stride = 1;
  for (int d = t.rank - 1; d >= 0; --d) {
    KSPEC_CHECK(t.shape[d] >= 0, what, ": shape[", d, "] is negative (", t.shape[d], ")");
    v.shape[d] = t.shape[d];
    v.strides[d] = t.strides ? t.strides[d] : stride;
    stride *= t.shape[d] > 0 ? t.shape[d] : 1;
  }
  return v;
}

std::vector<TensorView> views_of(const kspec_tensor* ts, size_t n, const std::vector<TensorDef>& defs, const char* kind,
                                 const std::string& op, std::vector<std::vector<TensorView>>& items) {
  KSPEC_CHECK(n == 0 || ts, op, ": ", kind, "s is NULL with n_", kind, "s = ", n);
  KSPEC_CHECK(n <= defs.size(), op, ": expected at most ", defs.size(), " ", kind, "s, got ", n);
  std::vector<TensorView> views(defs.size());  // trailing optionals left out stay absent
  for (size_t i = 0; i < n; ++i)
    views[i] = view_of(ts[i], std::string(kind) + " '" + defs[i].name + "'", items);
  return views;
}

}  // namespace

kspec_status set_error(kspec_status code, const std::string& message) noexcept {
  try {
    last_error.code = code;
    last_error.message = message;
  } catch (...) {  // out of memory copying the message: the code still says what happened
    last_error.message.clear();
  }
  return code;
}

kspec_status capture_error() noexcept {
  try {
    throw;
  } catch (const InvalidArgument& e) {
    return set_error(KSPEC_ERROR_INVALID_ARGUMENT, e.what());
  } catch (const Unsupported& e) {
    return set_error(KSPEC_ERROR_UNSUPPORTED, e.what());
  } catch (const CompileError& e) {
    return set_error(KSPEC_ERROR_COMPILE, std::string(e.what()) + "\n" + e.log());
  } catch (const CudaError& e) {
    return set_error(KSPEC_ERROR_CUDA, e.what());
  } catch (const CacheError& e) {
    return set_error(KSPEC_ERROR_CACHE, e.what());
  } catch (const InternalError& e) {
    return set_error(KSPEC_ERROR_INTERNAL, e.what());
  } catch (const nlohmann::json::exception& e) {  // params_json that is not JSON
    return set_error(KSPEC_ERROR_INVALID_ARGUMENT, std::string("params_json: ") + e.what());
  } catch (const std::exception& e) {
    return set_error(KSPEC_ERROR_UNKNOWN, e.what());
  } catch (...) {
    return set_error(KSPEC_ERROR_UNKNOWN, "unknown exception");
  }
}

Params params_from_json(const OpInfo& op, const char* json) {
  Params params;
  if (!json || !*json) return params;
  const auto j = nlohmann::json::parse(json);
  KSPEC_CHECK(j.is_object(), op.name, ": params_json must be a JSON object, got ", j.type_name());
  for (const auto& [name, value] : j.items()) {
    const ParamDef* def = nullptr;
    for (const auto& p : op.params)
      if (p.name == name) def = &p;
    if (!def) {
      std::string known;
      for (const auto& p : op.params) known += (known.empty() ? "" : ", ") + p.name;
      throw InvalidArgument(detail::concat(op.name, ": unknown param '", name, "' (params: ", known.empty() ? "none" : known, ")"));
    }
    const auto wrong = [&](const char* expected) {
      return InvalidArgument(detail::concat(op.name, ": param '", name, "' expects ", expected, ", got JSON ", value.dump()));
    };
    switch (def->type) {
      case ParamType::Int:
        if (!value.is_number_integer()) throw wrong("an integer");
        params.set(name, value.get<int64_t>());
        break;
      case ParamType::Float:
        if (!value.is_number()) throw wrong("a number");
        params.set(name, value.get<double>());
        break;
      case ParamType::Bool:
        if (!value.is_boolean()) throw wrong("true or false");
        params.set(name, value.get<bool>());
        break;
      case ParamType::Choice:
        if (!value.is_string()) throw wrong("a string");
        params.set(name, value.get<std::string>());
        break;
    }
  }
  return params;
}

}  // namespace kspec::c_abi

using kspec::c_abi::capture_error;
using kspec::c_abi::set_error;

extern "C" {

int kspec_c_version(void) { return KSPEC_C_ABI_VERSION; }

const char* kspec_version_string(void) { return kspec::version(); }

const char* kspec_list_ops(void) {
  // Built once (the registry is fixed after static initialization); a failure leaves "".
  static const std::string names = [] {
    try {
      std::string s;
      for (const auto& n : kspec::list_ops()) s += n + "\n";
      return s;
    } catch (...) {
      capture_error();
      return std::string();
    }
  }();
  return names.c_str();
}

const char* kspec_op_info_json(const char* op) {
  if (!op) {
    set_error(KSPEC_ERROR_INVALID_ARGUMENT, "kspec_op_info_json: op is NULL");
    return nullptr;
  }
  try {
    kspec::c_abi::op_info_buffer = kspec::c_abi::op_info_json(kspec::op_info(op)).dump();
    return kspec::c_abi::op_info_buffer.c_str();
  } catch (...) {
    capture_error();
    return nullptr;
  }
}

kspec_status kspec_call(const char* op, const kspec_tensor* inputs, size_t n_inputs, const kspec_tensor* outputs,
                        size_t n_outputs, const char* params_json, void* stream) {
  if (!op) return set_error(KSPEC_ERROR_INVALID_ARGUMENT, "kspec_call: op is NULL");
  try {
    const kspec::OpInfo& info = kspec::op_info(op);
    std::vector<std::vector<kspec::TensorView>> items;
    const auto ins = kspec::c_abi::views_of(inputs, n_inputs, info.inputs, "input", info.name, items);
    const auto outs = kspec::c_abi::views_of(outputs, n_outputs, info.outputs, "output", info.name, items);
    kspec::call(info.name, ins, outs, kspec::c_abi::params_from_json(info, params_json), static_cast<kspec::Stream>(stream));
    return KSPEC_OK;
  } catch (...) {
    return capture_error();
  }
}

const char* kspec_last_error(void) { return kspec::c_abi::last_error.message.c_str(); }

kspec_status kspec_last_error_code(void) { return kspec::c_abi::last_error.code; }

}  // extern "C"
