// The pieces of kspec._C (python/src/bindings.cpp) defined in its other files: conversions from Python
// (convert.cpp), result dicts (dicts.cpp), the torch fast path (torch_call.cpp) and the C ABI of the
// torch extension (ext_api.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <map>
#include <string>
#include <vector>

#include "kspec/kspec.h"

namespace py = pybind11;

namespace kspec_py {

// convert.cpp
std::vector<kspec::TensorView> to_inputs(const std::string& op, const py::sequence& seq,
                                         std::vector<std::vector<kspec::TensorView>>* lists);
std::vector<kspec::TensorView> to_outputs(const std::string& op, const py::sequence& seq);
kspec::Params to_params(const py::dict& d);
py::object param_to_py(const kspec::ParamValue& v);
kspec::CompileRequest to_request(const std::string& op, const std::string& dtype, const std::string& arch,
                                 const py::dict& params, const std::vector<std::string>& without,
                                 const std::map<std::string, std::string>& tensor_dtypes,
                                 const std::vector<std::string>& alt_shapes);
py::tuple dlpack_describe(const py::handle& obj);

// dicts.cpp
py::dict op_info_dict(const std::string& name);
py::dict report_dict(const kspec::CompileReport& r);
py::dict plan_dict(const kspec::PlanInfo& i);
py::dict candidate_dict(const kspec::TuneCandidate& c, const kspec::OpInfo& op);

// torch_call.cpp: NotImplemented for anything but the torch case, which kspec.call then takes its
// general path for.
py::object call_torch(const std::string& op, const py::tuple& inputs, const py::object& out, const py::dict& params);

// xla.cpp: the XLA FFI handlers as capsules for kspec.jax (_xla_available, _xla_handlers, _xla_targets).
void bind_xla(py::module_& m);

// ext_api.cpp: the C ABI the optional torch extension calls kspec through (python/src/ext_api.h).
py::capsule ext_api_capsule();

}  // namespace kspec_py
