// kspec._C's results as Python dicts: an op's schema (op_info), compile reports, plans and tuning
// candidates, for kspec.op_info, kspec.compile, kspec.explain_plan and kspec.tune.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kspec/kspec.h"
#include "python/src/bindings.h"

namespace py = pybind11;

namespace kspec_py {
namespace {

py::dict tensor_def(const kspec::TensorDef& t) {
  py::dict d;
  d["name"] = t.name;
  d["shape"] = t.shape;
  d["alt_shape"] = t.alt_shape;
  std::vector<std::string> dts;
  for (auto dt : t.dtypes) dts.push_back(kspec::dtype_name(dt));
  d["dtypes"] = dts;
  d["dtype_of"] = t.dtype_of;
  d["or_float32"] = t.or_float32;
  d["optional"] = t.optional;
  d["present_with"] = t.present_with;
  d["doc"] = t.doc;
  return d;
}

}  // namespace

py::dict op_info_dict(const std::string& name) {
  const kspec::OpInfo& i = kspec::op_info(name);
  py::dict d;
  d["name"] = i.name;
  d["family"] = i.family;
  d["doc"] = i.doc;
  py::list ins, outs, params, dims;
  for (const auto& t : i.inputs) ins.append(tensor_def(t));
  for (const auto& t : i.outputs) outs.append(tensor_def(t));
  for (const auto& p : i.params) {
    py::dict pd;
    pd["name"] = p.name;
    pd["type"] = p.type == kspec::ParamType::Int ? "int" : p.type == kspec::ParamType::Float ? "float"
                 : p.type == kspec::ParamType::Bool ? "bool" : "choice";
    pd["default"] = param_to_py(p.default_value);
    pd["choices"] = p.choices;
    py::dict aliases;
    for (const auto& [alias, choice] : p.aliases) aliases[py::str(alias)] = choice;
    pd["aliases"] = aliases;
    pd["doc"] = p.doc;
    params.append(pd);
  }
  for (const auto& dm : i.dims) {
    py::dict dd;
    dd["name"] = dm.name;
    dd["kind"] = dm.kind == kspec::DimKind::Var ? "runtime" : dm.kind == kspec::DimKind::Const ? "compile-time" : "bucketed";
    dd["doc"] = dm.doc;
    dims.append(dd);
  }
  d["inputs"] = ins;
  d["outputs"] = outs;
  d["params"] = params;
  d["dims"] = dims;
  d["tuning_axes"] = i.tuning_axes;
  d["tuning_names"] = i.tuning_names;
  d["tuning_note"] = i.tuning_note;
  d["reference"] = i.reference;
  py::dict constants, tolerances;
  for (const auto& [k, v] : i.constants) constants[py::str(k)] = v;
  for (auto dt : {kspec::DType::f32, kspec::DType::f16, kspec::DType::bf16, kspec::DType::f64})
    tolerances[kspec::dtype_name(dt)] = kspec::op_tolerance(name, dt);
  py::list cases;
  for (const auto& c : kspec::op_cases(name)) {
    py::dict cd, case_dims, ps, tds;
    for (const auto& [k, v] : c.dims) case_dims[py::str(k)] = v;
    for (const auto& [k, v] : c.params.items()) ps[py::str(k)] = param_to_py(v);
    for (const auto& [k, v] : c.tensor_dtypes) tds[py::str(k)] = kspec::dtype_name(v);
    cd["name"] = c.name;
    cd["dims"] = case_dims;
    cd["params"] = ps;
    cd["without"] = c.without;
    cd["tensor_dtypes"] = tds;
    cd["alt_shapes"] = c.alt_shapes;
    cd["large"] = c.large;
    cases.append(cd);
  }
  d["cases"] = cases;
  d["constants"] = constants;
  d["tolerances"] = tolerances;
  return d;
}

py::dict report_dict(const kspec::CompileReport& r) {
  py::dict d;
  d["op"] = r.op;
  d["kernel"] = r.kernel;
  d["spec"] = r.spec;
  d["key"] = r.key;
  d["source"] = r.source;
  d["compile_ms"] = r.compile_ms;
  d["load_ms"] = r.load_ms;
  d["registers"] = r.registers;
  d["spill_bytes"] = r.spill_bytes;
  d["stack_bytes"] = r.stack_bytes;
  d["shared_bytes"] = r.shared_bytes;
  d["arch"] = r.arch;
  d["path"] = r.path;
  d["config"] = r.config;
  d["log"] = r.log;
  return d;
}

py::dict plan_dict(const kspec::PlanInfo& i) {
  py::dict d;
  d["op"] = i.op;
  d["signature"] = i.signature;
  d["bucket"] = i.bucket;
  d["config"] = i.config;
  d["config_source"] = i.config_source;
  d["note"] = i.note;
  d["tuning_db"] = i.tuning_db;
  d["tuning_key"] = i.tuning_key;
  d["tune_mode"] = i.tune_mode;
  py::list ks;
  for (const auto& k : i.kernels) {
    py::dict kd;
    kd["name"] = k.name;
    kd["arch"] = k.arch;
    kd["key"] = k.key;
    kd["cache_entry"] = k.cache_path;
    ks.append(kd);
  }
  d["kernels"] = ks;
  d["text"] = i.str();
  return d;
}

py::dict candidate_dict(const kspec::TuneCandidate& c, const kspec::OpInfo& op) {
  py::dict d;
  d["config"] = c.config.str(op);
  d["default"] = c.is_default;
  d["status"] = c.status;
  d["why"] = c.why;
  d["median_ms"] = c.median_ms;
  d["min_ms"] = c.min_ms;
  d["error"] = c.error;
  d["registers"] = c.registers;
  d["spill_bytes"] = c.spill_bytes;
  d["shared_bytes"] = c.shared_bytes;
  d["compile_ms"] = c.compile_ms;
  return d;
}

}  // namespace kspec_py
