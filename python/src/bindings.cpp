// pybind11 bindings: kspec._C. Tensors arrive as (ptr, dtype, shape, strides, device) tuples built by
// python/kspec/_tensors.py from torch, CuPy, DLPack or __cuda_array_interface__ objects; the C++ side
// does all validation. Each kspec::Error maps to one Python exception class.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kspec/kspec.h"

namespace py = pybind11;

namespace {

std::string type_name(const py::handle& h) { return py::str(py::type::handle_of(h).attr("__name__")); }

// A descriptor is built by python/kspec/_tensors.py, which checks the caller's object; this checks the
// tuple itself (types, rank, sizes) so that no value reaches validation as garbage.
int64_t int_field(const py::handle& v, const char* what) {
  if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v))
    throw kspec::InvalidArgument(std::string("tensor descriptor: ") + what + ": expected an int, got " +
                                 type_name(v));
  try {
    return v.cast<int64_t>();
  } catch (const py::cast_error&) {
    throw kspec::InvalidArgument(std::string("tensor descriptor: ") + what + " " + std::string(py::str(v)) +
                                 " does not fit in 64 bits");
  }
}

py::tuple tuple_field(const py::handle& v, const char* what) {
  if (!py::isinstance<py::tuple>(v) && !py::isinstance<py::list>(v))
    throw kspec::InvalidArgument(std::string("tensor descriptor: ") + what + ": expected a tuple of ints, got " +
                                 type_name(v));
  return py::tuple(py::reinterpret_borrow<py::sequence>(v));
}

// (ptr, dtype, shape, strides, device[, read_only]): read_only is given (True) only for a read-only
// buffer, which may be an input but not an output.
kspec::TensorView to_view(const py::handle& h) {
  kspec::TensorView t;
  if (h.is_none()) return t;
  if (!py::isinstance<py::tuple>(h))
    throw kspec::InvalidArgument("tensor descriptor: expected (ptr, dtype, shape, strides, device), got " +
                                 type_name(h));
  auto tup = py::reinterpret_borrow<py::tuple>(h);
  if (tup.size() != 5 && tup.size() != 6)
    throw kspec::InvalidArgument("tensor descriptor: expected (ptr, dtype, shape, strides, device)");
  try {
    t.data = reinterpret_cast<void*>(tup[0].cast<uintptr_t>());
  } catch (const py::cast_error&) {
    throw kspec::InvalidArgument("tensor descriptor: pointer " + std::string(py::str(tup[0])) +
                                 " is not an address (an int from 0 to 2**64-1)");
  }
  if (!py::isinstance<py::str>(tup[1])) throw kspec::InvalidArgument("tensor descriptor: dtype must be a str");
  t.dtype = kspec::parse_dtype(tup[1].cast<std::string>());
  auto shape = tuple_field(tup[2], "shape");
  auto strides = tuple_field(tup[3], "strides");
  if (shape.size() > static_cast<size_t>(kspec::kMaxRank))
    throw kspec::InvalidArgument("tensor of rank " + std::to_string(shape.size()) + " exceeds kspec's maximum rank " +
                                 std::to_string(kspec::kMaxRank));
  if (strides.size() != shape.size()) throw kspec::InvalidArgument("tensor descriptor: shape and strides differ in length");
  t.rank = static_cast<int>(shape.size());
  int64_t numel = 1;
  for (int i = 0; i < t.rank; ++i) {
    t.shape[i] = int_field(shape[i], "shape");
    t.strides[i] = int_field(strides[i], "strides");
    if (t.shape[i] < 0) throw kspec::InvalidArgument("tensor descriptor: negative size " + std::to_string(t.shape[i]) + " in its shape");
    if (__builtin_mul_overflow(numel, t.shape[i], &numel))
      throw kspec::InvalidArgument("tensor descriptor: its shape has more than 2**63 elements");
  }
  int64_t device = int_field(tup[4], "device");
  if (device < kspec::kCpuDevice || device > INT32_MAX)
    throw kspec::InvalidArgument("tensor descriptor: device " + std::to_string(device) + " out of range");
  t.device = static_cast<int>(device);
  return t;
}

// "norm_act.fwd: input 'x'" (with "[k]" for the k-th tensor of a list), for messages about a descriptor.
std::string arg_name(const std::string& op, bool output, size_t i, int64_t item = -1) {
  const auto& info = kspec::op_info(op);
  const auto& defs = output ? info.outputs : info.inputs;
  std::string s = op + (output ? ": output " : ": input ") + (i < defs.size() ? "'" + defs[i].name + "'" : std::to_string(i));
  return item >= 0 ? s + "[" + std::to_string(item) + "]" : s;
}

kspec::TensorView arg_view(const std::string& op, bool output, size_t i, const py::handle& h, int64_t item = -1) {
  try {
    return to_view(h);
  } catch (const kspec::InvalidArgument& e) {
    throw kspec::InvalidArgument(arg_name(op, output, i, item) + ": " + e.what());
  }
}

// A Python list in an argument slot is a TensorList: its views live in `lists` for the call.
std::vector<kspec::TensorView> to_inputs(const std::string& op, const py::sequence& seq,
                                         std::vector<std::vector<kspec::TensorView>>* lists) {
  std::vector<kspec::TensorView> out;
  out.reserve(seq.size());
  size_t i = 0;
  for (auto h : seq) {
    if (py::isinstance<py::list>(h)) {
      std::vector<kspec::TensorView> items;
      int64_t k = 0;
      for (auto item : py::reinterpret_borrow<py::list>(h)) items.push_back(arg_view(op, false, i, item, k++));
      lists->push_back(std::move(items));  // moving keeps the items' buffer where it is
      out.push_back(kspec::TensorView::list(lists->back().data(), static_cast<int64_t>(lists->back().size())));
    } else {
      out.push_back(arg_view(op, false, i, h));
    }
    ++i;
  }
  return out;
}

// Outputs are written: a read-only buffer (a __cuda_array_interface__ with data's read-only flag) is
// refused as one, by the output's name.
std::vector<kspec::TensorView> to_outputs(const std::string& op, const py::sequence& seq) {
  std::vector<kspec::TensorView> out;
  out.reserve(seq.size());
  size_t i = 0;
  for (auto h : seq) {
    if (py::isinstance<py::list>(h))
      throw kspec::InvalidArgument(arg_name(op, true, i) + ": a list of tensors is not accepted as an output");
    if (py::isinstance<py::tuple>(h) && py::len(h) == 6 && py::reinterpret_borrow<py::tuple>(h)[5].ptr() == Py_True)
      throw kspec::InvalidArgument(arg_name(op, true, i) + ": the buffer is read-only (its "
                                   "__cuda_array_interface__ data flag); outputs are written");
    out.push_back(arg_view(op, true, i, h));
    ++i;
  }
  return out;
}

// A Python int as a param: one past 64 bits is an InvalidArgument naming it (pybind's cast_error said
// only "Unable to cast").
int64_t int64_param(const std::string& name, const py::handle& v) {
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (overflow != 0)
    throw kspec::InvalidArgument("parameter '" + name + "': " + std::string(py::str(v)) +
                                 " does not fit in a 64-bit integer");
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  return x;
}

kspec::Params to_params(const py::dict& d) {
  kspec::Params p;
  for (auto [k, v] : d) {
    std::string name = k.cast<std::string>();
    if (py::isinstance<py::bool_>(v)) p.set(name, v.cast<bool>());
    else if (py::isinstance<py::int_>(v)) p.set(name, int64_param(name, v));
    else if (py::isinstance<py::float_>(v)) p.set(name, v.cast<double>());
    else if (py::isinstance<py::str>(v)) p.set(name, v.cast<std::string>());
    else
      throw kspec::InvalidArgument("parameter '" + name + "': expected int, float, bool or str, got " +
                                   type_name(v));
  }
  return p;
}

py::object param_to_py(const kspec::ParamValue& v) {
  if (auto p = std::get_if<int64_t>(&v)) return py::int_(*p);
  if (auto p = std::get_if<double>(&v)) return py::float_(*p);
  if (auto p = std::get_if<bool>(&v)) return py::bool_(*p);
  return py::str(std::get<std::string>(v));
}

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

kspec::CompileRequest to_request(const std::string& op, const std::string& dtype, const std::string& arch,
                                 const py::dict& params, const std::vector<std::string>& without,
                                 const std::map<std::string, std::string>& tensor_dtypes,
                                 const std::vector<std::string>& alt_shapes) {
  kspec::CompileRequest req;
  req.op = op;
  req.dtype = kspec::parse_dtype(dtype);
  req.arch = arch;
  req.params = to_params(params);
  req.without = without;
  for (const auto& [k, v] : tensor_dtypes) req.tensor_dtypes.emplace_back(k, kspec::parse_dtype(v));
  req.alt_shapes = alt_shapes;
  return req;
}

// kspec::BoundCall with its op's name, for the messages about its outputs.
struct BoundCall {
  std::string op;
  std::unique_ptr<kspec::BoundCall> call;
};

// The DLPack ABI (stable since v0.6), declared here rather than vendored.
struct DLDevice { int32_t device_type; int32_t device_id; };
struct DLDataType { uint8_t code; uint8_t bits; uint16_t lanes; };
struct DLTensor {
  void* data; DLDevice device; int32_t ndim; DLDataType dtype; int64_t* shape; int64_t* strides; uint64_t byte_offset;
};
struct DLManagedTensor { DLTensor dl_tensor; void* manager_ctx; void (*deleter)(DLManagedTensor*); };

// The device types kspec reads (dlpack.h's DLDeviceType): CUDA memory is taken; host memory (pageable
// or pinned) is described as such, and validation refuses it by the argument's name.
constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;

// A capsule comes from any object's __dlpack__(): every field is checked before anything is read
// through a pointer, and a capsule that fails is left as it came (its producer's deleter frees it).
py::tuple dlpack_describe(const py::handle& obj) {
  using kspec::InvalidArgument;
  if (!PyCapsule_CheckExact(obj.ptr()))
    throw InvalidArgument("DLPack: __dlpack__() returned a " + type_name(obj) +
                          ", expected a 'dltensor' capsule");
  const char* name = PyCapsule_GetName(obj.ptr());
  std::string cap_name = name ? name : "";
  if (cap_name == "used_dltensor") throw InvalidArgument("DLPack: the capsule was already consumed ('used_dltensor')");
  if (cap_name != "dltensor")
    throw InvalidArgument("DLPack: expected a capsule named 'dltensor', got '" + cap_name + "'");
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(obj.ptr(), "dltensor"));
  if (!m) {
    PyErr_Clear();
    throw InvalidArgument("DLPack: the 'dltensor' capsule holds a null pointer");
  }
  const DLTensor& t = m->dl_tensor;
  int device = kspec::kCpuDevice;
  switch (t.device.device_type) {
    case kDLCUDA:
    case kDLCUDAManaged:
      if (t.device.device_id < 0)
        throw InvalidArgument("DLPack: negative CUDA device id " + std::to_string(t.device.device_id));
      device = t.device.device_id;
      break;
    case kDLCPU:
    case kDLCUDAHost: break;
    default:
      throw InvalidArgument("DLPack: device type " + std::to_string(t.device.device_type) +
                            " is not CUDA memory (kspec takes kDLCUDA = 2 and kDLCUDAManaged = 13)");
  }
  std::string dt;
  if (t.dtype.lanes != 1)
    throw InvalidArgument("DLPack: vector dtypes are not supported (lanes " + std::to_string(t.dtype.lanes) + ")");
  if (t.dtype.code == 2 && t.dtype.bits == 32) dt = "float32";
  else if (t.dtype.code == 2 && t.dtype.bits == 16) dt = "float16";
  else if (t.dtype.code == 2 && t.dtype.bits == 64) dt = "float64";
  else if (t.dtype.code == 4 && t.dtype.bits == 16) dt = "bfloat16";
  else if (t.dtype.code == 0 && t.dtype.bits == 32) dt = "int32";
  else if (t.dtype.code == 0 && t.dtype.bits == 64) dt = "int64";
  else if (t.dtype.code == 1 && t.dtype.bits == 8) dt = "uint8";
  else
    throw InvalidArgument("DLPack: unsupported dtype code " + std::to_string(t.dtype.code) + " bits " +
                          std::to_string(t.dtype.bits) + " (kspec takes float16/32/64, bfloat16, int32, int64, uint8)");
  if (t.ndim < 0 || t.ndim > kspec::kMaxRank)
    throw InvalidArgument("DLPack: ndim " + std::to_string(t.ndim) + " is outside 0.." + std::to_string(kspec::kMaxRank));
  if (t.ndim > 0 && !t.shape) throw InvalidArgument("DLPack: ndim " + std::to_string(t.ndim) + " with a null shape");
  int64_t numel = 1;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) throw InvalidArgument("DLPack: negative size " + std::to_string(t.shape[d]) + " in dim " + std::to_string(d));
    if (__builtin_mul_overflow(numel, t.shape[d], &numel))
      throw InvalidArgument("DLPack: the shape has more than 2**63 elements");
  }
  if (numel > 0 && !t.data) throw InvalidArgument("DLPack: null data pointer for a tensor of " + std::to_string(numel) + " elements");
  uintptr_t ptr = 0;
  if (__builtin_add_overflow(reinterpret_cast<uintptr_t>(t.data), t.byte_offset, &ptr))
    throw InvalidArgument("DLPack: data pointer plus byte_offset " + std::to_string(t.byte_offset) + " overflows");
  // Null strides: a compact row-major tensor (DLPack >= 0.6).
  py::tuple shape(t.ndim), strides(t.ndim);
  int64_t s = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    shape[d] = py::int_(t.shape[d]);
    strides[d] = py::int_(t.strides ? t.strides[d] : s);
    if (__builtin_mul_overflow(s, t.shape[d], &s)) s = 0;  // only with a zero-size dim: nothing is read
  }
  return py::make_tuple(ptr, dt, shape, strides, device);
}

// ---- the torch fast path ----
// kspec.call's common case: torch tensors in, outputs allocated with torch (or given), the op on torch's
// current stream. Each tensor is described here in one pass through the Python C API (data_ptr(), shape,
// stride(), dtype, get_device(): about 0.3 us against 1.5 us for _tensors.describe), outputs come from
// torch.empty called once per output with cached dtype and device objects, and the params dict goes
// straight to kspec::Params. Anything else (another framework, a TensorList, a tensor this cannot read)
// returns NotImplemented and kspec.call takes its general path, which gives every error its message.
// Not a torch C++ extension: that would tie the build to one torch version and add minutes of compile
// for about 0.2 us per tensor more.
struct TorchApi {
  bool ready = false;
  PyObject* tensor_type = nullptr;  // torch.Tensor (subclasses too: nn.Parameter)
  PyObject* empty = nullptr;        // torch.empty
  PyObject* raw_stream = nullptr;   // torch._C._cuda_getCurrentRawStream
  PyObject* empty_kwnames = nullptr;
  PyObject* s_data_ptr = nullptr;
  PyObject* s_shape = nullptr;
  PyObject* s_stride = nullptr;
  PyObject* s_dtype = nullptr;
  PyObject* s_get_device = nullptr;
  std::vector<std::pair<PyObject*, kspec::DType>> dtypes;  // torch.dtype object -> DType
  PyObject* torch_dtype[8] = {};                           // DType -> torch.dtype object
  std::vector<PyObject*> devices;                          // ordinal -> torch.device("cuda", ordinal)
};

// The torch objects, looked up once torch is imported (never imports it: kspec works without torch). The
// references are kept for the life of the process.
TorchApi* torch_api() {
  static TorchApi api;
  if (api.ready) return &api;
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
  if (!torch) return nullptr;
  try {
    py::object t = py::reinterpret_borrow<py::object>(torch);
    py::object c = t.attr("_C");
    if (!py::hasattr(c, "_cuda_getCurrentRawStream")) return nullptr;
    api.raw_stream = py::object(c.attr("_cuda_getCurrentRawStream")).release().ptr();
    api.tensor_type = py::object(t.attr("Tensor")).release().ptr();
    api.empty = py::object(t.attr("empty")).release().ptr();
    api.empty_kwnames = py::make_tuple("dtype", "device").release().ptr();
    api.s_data_ptr = py::str("data_ptr").release().ptr();
    api.s_shape = py::str("shape").release().ptr();
    api.s_stride = py::str("stride").release().ptr();
    api.s_dtype = py::str("dtype").release().ptr();
    api.s_get_device = py::str("get_device").release().ptr();
    const std::pair<const char*, kspec::DType> names[] = {
        {"float32", kspec::DType::f32}, {"float16", kspec::DType::f16}, {"bfloat16", kspec::DType::bf16},
        {"float64", kspec::DType::f64}, {"int32", kspec::DType::i32},   {"int64", kspec::DType::i64},
        {"uint8", kspec::DType::u8}};
    for (const auto& [name, dt] : names) {
      PyObject* d = py::object(t.attr(name)).release().ptr();
      api.dtypes.emplace_back(d, dt);
      api.torch_dtype[static_cast<int>(dt)] = d;
    }
  } catch (py::error_already_set&) {
    PyErr_Clear();
    return nullptr;
  }
  api.ready = true;
  return &api;
}

// Reads a Python int sequence (torch.Size or a tuple) into `out`; false when it is not one.
bool read_ints(PyObject* seq, int64_t* out, int n) {
  if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) != n) return false;
  for (int i = 0; i < n; ++i) {
    long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    out[i] = v;
  }
  return true;
}

// A torch tensor as a view; false (no Python error set) when `o` is not one this path reads.
bool torch_view(const TorchApi& api, PyObject* o, kspec::TensorView* t) {
  if (!PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(api.tensor_type))) return false;
  py::object dtype = py::reinterpret_steal<py::object>(PyObject_GetAttr(o, api.s_dtype));
  py::object shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(o, api.s_shape));
  py::object strides = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(o, api.s_stride));
  py::object ptr = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(o, api.s_data_ptr));
  py::object device = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(o, api.s_get_device));
  if (!dtype || !shape || !strides || !ptr || !device) {  // a fake or meta tensor, a subclass that refuses
    PyErr_Clear();
    return false;
  }
  bool known = false;
  for (const auto& [obj, dt] : api.dtypes)
    if (obj == dtype.ptr()) {
      t->dtype = dt;
      known = true;
    }
  if (!known || !PyTuple_Check(shape.ptr())) return false;
  const Py_ssize_t rank = PyTuple_GET_SIZE(shape.ptr());
  if (rank > kspec::kMaxRank) return false;
  t->rank = static_cast<int>(rank);
  if (!read_ints(shape.ptr(), t->shape, t->rank) || !read_ints(strides.ptr(), t->strides, t->rank)) return false;
  unsigned long long p = PyLong_AsUnsignedLongLong(ptr.ptr());
  long dev = PyLong_AsLong(device.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  t->data = reinterpret_cast<void*>(static_cast<uintptr_t>(p));
  t->device = static_cast<int>(dev);
  return true;
}

// Arguments as views: None is an absent one; false for anything this path does not read.
bool torch_views(const TorchApi& api, PyObject* seq, std::vector<kspec::TensorView>* out, bool* any_tensor) {
  PyObject* fast = PySequence_Fast(seq, "");
  if (!fast) {
    PyErr_Clear();
    return false;
  }
  py::object hold = py::reinterpret_steal<py::object>(fast);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out->resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PySequence_Fast_GET_ITEM(fast, i);
    if (o == Py_None) continue;
    if (!torch_view(api, o, &(*out)[static_cast<size_t>(i)])) return false;
    *any_tensor = true;
  }
  return true;
}

PyObject* torch_device(TorchApi& api, int ordinal) {
  if (static_cast<size_t>(ordinal) >= api.devices.size()) api.devices.resize(static_cast<size_t>(ordinal) + 1, nullptr);
  PyObject*& d = api.devices[static_cast<size_t>(ordinal)];
  if (!d) {
    py::object torch = py::reinterpret_borrow<py::object>(PyDict_GetItemString(PyImport_GetModuleDict(), "torch"));
    d = torch.attr("device")("cuda", ordinal).release().ptr();
  }
  return d;
}

py::object call_torch(const std::string& op, const py::tuple& inputs, const py::object& out, const py::dict& params) {
  TorchApi* api = torch_api();
  if (!api) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  std::vector<kspec::TensorView> in, outs;
  bool any_tensor = false;
  if (!torch_views(*api, inputs.ptr(), &in, &any_tensor) || !any_tensor)
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  int device = -1;
  for (const auto& t : in)
    if (t.rank >= 0) {
      device = t.device;
      break;
    }
  if (device < 0) return py::reinterpret_borrow<py::object>(Py_NotImplemented);  // host tensors: the general path says so
  kspec::Params p = to_params(params);
  py::object result;
  if (out.is_none()) {
    auto specs = kspec::infer_outputs(op, in, p);
    py::tuple allocated(specs.size());
    outs.resize(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      const auto& s = specs[i];
      if (!s.present) {
        allocated[i] = py::none();
        continue;
      }
      py::tuple shape(s.shape.size());
      for (size_t d = 0; d < s.shape.size(); ++d) shape[d] = py::int_(s.shape[d]);
      PyObject* args[] = {shape.ptr(), api->torch_dtype[static_cast<int>(s.dtype)], torch_device(*api, device)};
      PyObject* t = PyObject_Vectorcall(api->empty, args, 1, api->empty_kwnames);
      if (!t) throw py::error_already_set();
      allocated[i] = py::reinterpret_steal<py::object>(t);
      if (!torch_view(*api, t, &outs[i])) throw kspec::Error("torch.empty returned a tensor kspec cannot read");
    }
    result = allocated;
  } else {
    bool any_out = false;
    if (!(py::isinstance<py::tuple>(out) || py::isinstance<py::list>(out)) ||
        !torch_views(*api, out.ptr(), &outs, &any_out))
      return py::reinterpret_borrow<py::object>(Py_NotImplemented);
    result = py::tuple(out);
  }
  PyObject* s = PyObject_CallOneArg(api->raw_stream, py::int_(device).ptr());
  if (!s) throw py::error_already_set();
  auto stream = reinterpret_cast<kspec::Stream>(static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(s)));
  Py_DECREF(s);
  {
    py::gil_scoped_release release;
    kspec::call(op, in, outs, p, stream);
  }
  return result;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kspec native core (validation, NVRTC specialization, cache, launch)";

  // Every class is a kspec.Error and keeps the builtin base a caller may catch instead (ValueError, ...).
  auto base = py::register_exception<kspec::Error>(m, "Error", PyExc_RuntimeError);
  auto error_and = [&base](PyObject* builtin) { return py::make_tuple(base, py::handle(builtin)); };
  py::register_exception<kspec::InvalidArgument>(m, "InvalidArgument", error_and(PyExc_ValueError));
  py::register_exception<kspec::Unsupported>(m, "Unsupported", error_and(PyExc_NotImplementedError));
  // CompileError carries the NVRTC log, options, spec and the path of the specialized source.
  static PyObject* compile_error_type = [&] {
    py::exception<kspec::CompileError> t(m, "CompileError", base.ptr());
    Py_INCREF(t.ptr());  // lives as long as the interpreter
    return t.ptr();
  }();
  py::register_exception<kspec::CudaError>(m, "CudaError", base.ptr());
  py::register_exception<kspec::CacheError>(m, "CacheError", error_and(PyExc_OSError));
  py::register_exception<kspec::InternalError>(m, "InternalError", base.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kspec::CompileError& e) {
      py::object type = py::reinterpret_borrow<py::object>(compile_error_type);
      py::object exc = type(py::str(e.what()));
      exc.attr("log") = e.log();
      exc.attr("options") = e.options();
      exc.attr("spec") = e.spec();
      exc.attr("source_path") = e.source_path();
      PyErr_SetObject(compile_error_type, exc.ptr());
    }
  });

  m.def("version", &kspec::version);
  m.def("dlpack_describe", &dlpack_describe);
  m.def("pointer_device", [](uintptr_t p) { return kspec::pointer_device(reinterpret_cast<const void*>(p)); });
  m.def("list_ops", &kspec::list_ops);
  m.def("tolerances", [] {  // the one table, by dtype name (ops scale it: op_info(op)["tolerances"])
    py::dict d;
    for (auto dt : {kspec::DType::f32, kspec::DType::f16, kspec::DType::bf16, kspec::DType::f64})
      d[kspec::dtype_name(dt)] = kspec::tolerance_for(dt);
    return d;
  });
  m.def("op_info", &op_info_dict);
  m.def("describe_op", [](const std::string& n) { return kspec::describe_op(n); });

  m.def("call_torch", &call_torch, py::arg("op"), py::arg("inputs"), py::arg("out"), py::arg("params"));
  m.def("call",
        [](const std::string& op, const py::sequence& inputs, const py::sequence& outputs, const py::dict& params,
           uintptr_t stream, const py::object& config) {
          std::vector<std::vector<kspec::TensorView>> lists;
          lists.reserve(inputs.size());
          auto in = to_inputs(op, inputs, &lists);
          auto out = to_outputs(op, outputs);
          auto p = to_params(params);
          kspec::Config cfg;
          kspec::CallOptions opts;
          if (!config.is_none()) {
            cfg = kspec::Config::parse(config.cast<std::string>(), kspec::op_info(op));
            opts.config = &cfg;
          }
          py::gil_scoped_release release;
          kspec::call(op, in, out, p, reinterpret_cast<kspec::Stream>(stream), opts);
        },
        py::arg("op"), py::arg("inputs"), py::arg("outputs"), py::arg("params"), py::arg("stream") = 0,
        py::arg("config") = py::none());

  // A call validated once and run many times on the same tensors (kspec.optim.AdamW's steps).
  py::class_<BoundCall>(m, "BoundCall")
      .def(py::init([](const std::string& op, const py::sequence& inputs, const py::sequence& outputs,
                       const py::dict& params) {
             std::vector<std::vector<kspec::TensorView>> lists;
             lists.reserve(inputs.size());
             auto in = to_inputs(op, inputs, &lists);
             auto out = to_outputs(op, outputs);
             auto p = to_params(params);
             py::gil_scoped_release release;
             return std::make_unique<BoundCall>(BoundCall{op, std::make_unique<kspec::BoundCall>(op, in, out, p)});
           }),
           py::arg("op"), py::arg("inputs"), py::arg("outputs"), py::arg("params"))
      .def("run",
           [](BoundCall& b, const py::dict& params, const py::sequence& outputs, uintptr_t stream) {
             auto out = to_outputs(b.op, outputs);
             auto p = to_params(params);
             py::gil_scoped_release release;
             b.call->run(p, out, reinterpret_cast<kspec::Stream>(stream));
           },
           py::arg("params"), py::arg("outputs"), py::arg("stream") = 0)
      .def_property_readonly("config", [](const BoundCall& b) { return b.call->config(); })
      .def_property_readonly("runs", [](const BoundCall& b) { return b.call->runs(); })
      .def("idle", [](const BoundCall& b) { return b.call->idle(); });

  m.def("infer_outputs", [](const std::string& op, const py::sequence& inputs, const py::dict& params) {
    py::list out;
    std::vector<std::vector<kspec::TensorView>> lists;
    lists.reserve(inputs.size());
    for (const auto& s : kspec::infer_outputs(op, to_inputs(op, inputs, &lists), to_params(params))) {
      if (!s.present) out.append(py::none());
      else out.append(py::make_tuple(kspec::dtype_name(s.dtype), py::tuple(py::cast(s.shape))));
    }
    return out;
  });

  m.def("explain", [](const std::string& op, const py::sequence& inputs, const py::sequence& outputs,
                      const py::dict& params) {
    std::vector<std::vector<kspec::TensorView>> lists;
    lists.reserve(inputs.size());
    return kspec::explain(op, to_inputs(op, inputs, &lists), to_outputs(op, outputs), to_params(params));
  });

  m.def("explain_plan", [](const std::string& op, const py::sequence& inputs, const py::sequence& outputs,
                           const py::dict& params) {
    std::vector<std::vector<kspec::TensorView>> lists;
    lists.reserve(inputs.size());
    return plan_dict(kspec::explain_plan(op, to_inputs(op, inputs, &lists), to_outputs(op, outputs), to_params(params)));
  });
  m.def("explain_request",
        [](const std::string& op, const std::string& dtype, const std::string& arch, const py::dict& params,
           const std::vector<std::string>& without, const std::map<std::string, std::string>& tensor_dtypes,
           const std::vector<std::string>& alt_shapes) {
          return plan_dict(kspec::explain_request(to_request(op, dtype, arch, params, without, tensor_dtypes, alt_shapes)));
        },
        py::arg("op"), py::arg("dtype"), py::arg("arch") = "sm_90", py::arg("params") = py::dict(),
        py::arg("without") = std::vector<std::string>{}, py::arg("tensor_dtypes") = std::map<std::string, std::string>{},
        py::arg("alt_shapes") = std::vector<std::string>{});

  m.def("tune",
        [](const std::string& op, const std::string& dtype, const py::dict& params, const std::vector<std::string>& without,
           const std::map<std::string, std::string>& tensor_dtypes, const std::vector<std::string>& alt_shapes,
           int device, const std::string& arch, double budget, bool all_configs, bool compile_only, bool write_db,
           int batches, uint64_t seed, const py::object& progress, int max_candidates) {
          kspec::TuneRequest req;
          req.problem = to_request(op, dtype, arch, params, without, tensor_dtypes, alt_shapes);
          req.device = device;
          req.budget_s = budget;
          req.all_configs = all_configs;
          req.compile_only = compile_only;
          req.write_db = write_db;
          req.batches = batches;
          req.seed = seed;
          req.max_candidates = max_candidates;
          kspec::TuneCallback cb;
          if (!progress.is_none())
            cb = [&progress, &op](const kspec::TuneProgress& ev) {
              py::gil_scoped_acquire gil;
              try {  // runs on the tuner's compile threads: a Python error must not escape them
                progress(ev.phase, ev.done, ev.total,
                         ev.candidate ? py::object(candidate_dict(*ev.candidate, kspec::op_info(op))) : py::object(py::none()));
              } catch (py::error_already_set& e) {
                e.discard_as_unraisable("kspec.tune progress callback");
              }
            };
          kspec::TuneResult r;
          {
            py::gil_scoped_release release;
            r = kspec::tune(req, cb);
          }
          py::dict d;
          d["op"] = r.op;
          d["gpu"] = r.gpu;
          d["arch"] = r.arch;
          d["signature"] = r.signature;
          d["bucket"] = r.bucket;
          d["key"] = r.key;
          d["shape"] = r.shape;
          d["db_path"] = r.db_path;
          d["default_config"] = r.default_config.str(kspec::op_info(r.op));
          d["best_config"] = r.best_config.str(kspec::op_info(r.op));
          d["default_ms"] = r.default_ms;
          d["best_ms"] = r.best_ms;
          d["timed"] = r.timed;
          d["written"] = r.written;
          d["seconds"] = r.seconds;
          d["batch_calls"] = r.batch_calls;
          d["input_sets"] = r.input_sets;
          d["note"] = r.note;
          py::list cands;
          for (const auto& c : r.candidates) cands.append(candidate_dict(c, kspec::op_info(r.op)));
          d["candidates"] = cands;
          return d;
        },
        py::arg("op"), py::arg("dtype"), py::arg("params"), py::arg("without"), py::arg("tensor_dtypes"),
        py::arg("alt_shapes"), py::arg("device") = 0, py::arg("arch") = "sm_90", py::arg("budget") = 60.0,
        py::arg("all_configs") = false, py::arg("compile_only") = false, py::arg("write_db") = true,
        py::arg("batches") = 15, py::arg("seed") = 0, py::arg("progress") = py::none(),
        py::arg("max_candidates") = 16);
  m.def("tuning_db_path", &kspec::tuning_db_path, py::arg("device") = 0);
  m.def("tuning_db_entries", &kspec::tuning_db_entries, py::arg("path") = "");
  m.def("tuning_export", &kspec::tuning_export, py::arg("file"), py::arg("path") = "");
  m.def("tuning_import",
        [](const std::string& file) {
          // The file is anyone's: a JSON value of the wrong type is the file's error, not a crash.
          try {
            return kspec::tuning_import(file);
          } catch (const kspec::Error&) {
            throw;
          } catch (const std::exception& e) {
            throw kspec::InvalidArgument("kspec tune --import: " + file + ": " + e.what());
          }
        },
        py::arg("file"));

  m.def("compile",
        [](const std::string& op, const std::string& dtype, const std::string& arch, const py::dict& params,
           const std::vector<std::string>& without, const std::map<std::string, std::string>& tensor_dtypes,
           const py::object& config, const std::vector<std::string>& alt_shapes) {
          auto req = to_request(op, dtype, arch, params, without, tensor_dtypes, alt_shapes);
          if (!config.is_none()) req.config = kspec::Config::parse(config.cast<std::string>(), kspec::op_info(op));
          std::vector<kspec::CompileReport> reports;
          {
            py::gil_scoped_release release;
            reports = kspec::compile(req);
          }
          py::list out;
          for (const auto& r : reports) out.append(report_dict(r));
          return out;
        },
        py::arg("op"), py::arg("dtype"), py::arg("arch") = "sm_90", py::arg("params") = py::dict(),
        py::arg("without") = std::vector<std::string>{}, py::arg("tensor_dtypes") = std::map<std::string, std::string>{},
        py::arg("config") = py::none(), py::arg("alt_shapes") = std::vector<std::string>{});

  m.def("precompile_plan", [](const std::vector<std::string>& archs, const std::vector<std::string>& ops) {
    py::list out;
    for (const auto& r : kspec::precompile_plan(archs, ops)) {
      py::dict d;
      d["op"] = r.op;
      d["dtype"] = kspec::dtype_short(r.dtype);
      d["arch"] = r.arch;
      py::dict params;
      for (const auto& [k, v] : r.params.items()) params[py::str(k)] = param_to_py(v);
      d["params"] = params;
      d["without"] = r.without;
      std::map<std::string, std::string> td;
      for (const auto& [k, v] : r.tensor_dtypes) td[k] = kspec::dtype_short(v);
      d["tensor_dtypes"] = td;
      d["alt_shapes"] = r.alt_shapes;
      d["config"] = r.config ? py::object(py::str(r.config->str())) : py::object(py::none());
      out.append(d);
    }
    return out;
  });

  m.def("counters", [] {
    auto c = kspec::counters();
    py::dict d;
    d["compiled"] = c.compiled;
    d["disk_hits"] = c.disk_hits;
    d["memory_hits"] = c.memory_hits;
    d["launches"] = c.launches;
    return d;
  });

  m.def("check_op",
        [](const std::string& op, const std::string& case_name, const std::vector<std::string>& dtypes, int device,
           bool include_large, const py::object& config, uint64_t seed) {
          kspec::CheckOptions o;
          o.case_name = case_name;
          for (const auto& d : dtypes) o.dtypes.push_back(kspec::parse_dtype(d));
          o.device = device;
          o.include_large = include_large;
          o.seed = seed;
          if (py::isinstance<py::str>(config)) {
            o.config = kspec::Config::parse(config.cast<std::string>(), kspec::op_info(op));
          } else if (!config.is_none()) {  // several configs on one draw of inputs, a row each
            for (const auto& c : config.cast<std::vector<std::string>>()) o.configs.push_back(kspec::Config::parse(c, kspec::op_info(op)));
          }
          std::vector<kspec::CheckRow> rows;
          {
            py::gil_scoped_release release;
            rows = kspec::check_op(op, o);
          }
          py::list out;
          for (const auto& r : rows) {
            py::dict d;
            d["op"] = r.op;
            d["case"] = r.case_name;
            d["dtype"] = r.dtype;
            d["shape"] = r.shape;
            d["config"] = r.config;
            d["errors"] = r.errors;
            d["tolerance"] = r.tolerance;
            d["passed"] = r.passed;
            d["message"] = r.message;
            d["seed"] = r.seed;
            out.append(d);
          }
          return out;
        },
        py::arg("op"), py::arg("case") = "", py::arg("dtypes") = std::vector<std::string>{}, py::arg("device") = 0,
        py::arg("include_large") = false, py::arg("config") = py::none(), py::arg("seed") = 0);
  m.def("case_names", &kspec::case_names);
  m.def("configs_for_case", [](const std::string& op, const std::string& case_name, const std::string& dtype) {
    std::vector<std::string> out;
    for (const auto& c : kspec::configs_for_case(op, case_name, kspec::parse_dtype(dtype))) out.push_back(c.str(kspec::op_info(op)));
    return out;
  });

  m.def("cache_stats", [] {
    auto s = kspec::cache_stats();
    py::dict d;
    d["dir"] = s.dir;
    d["enabled"] = s.enabled;
    d["writable"] = s.writable;
    d["entries"] = s.entries;
    d["bytes"] = s.bytes;
    d["max_bytes"] = s.max_bytes;
    return d;
  });
  m.def("cache_entries", [] {
    py::list out;
    for (const auto& e : kspec::cache_entries()) {
      py::dict d;
      d["key"] = e.key;
      d["path"] = e.path;
      d["spec"] = e.spec;
      d["kernel"] = e.kernel;
      d["arch"] = e.arch;
      d["bytes"] = e.bytes;
      d["last_used"] = e.last_used;
      d["registers"] = e.registers;
      d["spill_bytes"] = e.spill_bytes;
      d["shared_bytes"] = e.shared_bytes;
      d["compile_ms"] = e.compile_ms;
      out.append(d);
    }
    return out;
  });
  m.def("cache_verify", &kspec::cache_verify);
  m.def("cache_prune", &kspec::cache_prune, py::arg("max_bytes") = -1);
  m.def("cache_clear", &kspec::cache_clear);
  m.def("doctor", &kspec::doctor);
  m.def("compile_threads", [] { return kspec::knobs::compile_threads(); });
  m.def("knobs", [] {
    py::list out;
    for (const auto& k : kspec::knobs::all()) out.append(py::make_tuple(k.name, k.type, k.default_value, k.doc));
    return out;
  });
}
