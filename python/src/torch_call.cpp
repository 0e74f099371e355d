// kspec._C's torch fast path (call_torch): torch tensors read through the Python C API, outputs
// allocated with torch.empty, the op run on torch's current stream.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kspec/kspec.h"
#include "python/src/bindings.h"

namespace py = pybind11;

namespace kspec_py {
namespace {

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

}  // namespace

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

}  // namespace kspec_py
