// Validation of a call against its op's schema, before anything is launched. Every message names the
// op, the argument and what was expected.
// The per-tensor checks are in validate_tensor.cpp, the Problem accessors and param checks in problem.cpp.
#include <algorithm>
#include <cstdint>
#include <sstream>

#include "api/src/validate.h"

namespace kspec {

using namespace validation;

// ---- shapes ----

namespace {

// Whether an output's present_with names a param (a bool: norm_act.fwd's save_stats) rather than an input.
bool is_param(const OpInfo& info, const std::string& name) {
  return std::any_of(info.params.begin(), info.params.end(), [&](const ParamDef& d) { return d.name == name; });
}
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
                  def.present_with, def.present_with.empty() ? "" : is_param(info, def.present_with) ? "' is true" : "' is given");
      continue;
    }
    KSPEC_CHECK(def.present_with.empty() || needed, info.name, ": ", what, " must be None when '",
                def.present_with, is_param(info, def.present_with) ? "' is false" : "' is None");
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
