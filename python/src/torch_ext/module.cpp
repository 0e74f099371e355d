// kspec._torch_ext: the optional torch C++ extension (built when the building Python has torch). Three
// things torch's Python layer makes slow are done here in C++: torch tensors read as at::Tensor (no
// attribute calls), outputs allocated with at::empty (about 1 us against 6 us for torch.empty from
// Python on the H100), and kspec's registry ops registered with the torch dispatcher (kspec_ops::*,
// schemas generated from op_info by kspec._native), each a boxed kernel on the same path.
// kspec itself is reached through kspec._C's C ABI (python/src/ext_api.h): one registry, one call cache.
#include <Python.h>

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/record_function.h>
#include <ATen/core/DimVector.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <string>
#include <utility>
#include <vector>

#include "python/src/ext_api.h"

namespace {

const kspec_ext::Api* g_api = nullptr;

bool to_kspec(at::ScalarType s, kspec::DType* out) {
  switch (s) {
    case at::kFloat: *out = kspec::DType::f32; return true;
    case at::kHalf: *out = kspec::DType::f16; return true;
    case at::kBFloat16: *out = kspec::DType::bf16; return true;
    case at::kDouble: *out = kspec::DType::f64; return true;
    case at::kInt: *out = kspec::DType::i32; return true;
    case at::kLong: *out = kspec::DType::i64; return true;
    case at::kByte: *out = kspec::DType::u8; return true;
    default: return false;
  }
}

at::ScalarType to_torch(int dtype) {
  switch (static_cast<kspec::DType>(dtype)) {
    case kspec::DType::f32: return at::kFloat;
    case kspec::DType::f16: return at::kHalf;
    case kspec::DType::bf16: return at::kBFloat16;
    case kspec::DType::f64: return at::kDouble;
    case kspec::DType::i32: return at::kInt;
    case kspec::DType::i64: return at::kLong;
    default: return at::kByte;
  }
}

// A tensor as kspec's view; false for one kspec's general path must judge (a dtype kspec does not
// know, too many dims, a device other than CPU and CUDA). A CPU tensor is a view on kCpuDevice, so
// kspec's validation gives it the message it gives any host tensor.
// The sizes, strides and device read once each (per dim, size(d) and stride(d) each wrap and check the dim and
// ask the tensor's size policy: ~5.7K instructions of a selective_scan training step's ~34 views under callgrind).
bool view_of(const at::Tensor& t, bool writable, kspec::TensorView* v) {
  const c10::Device device = t.device();
  if (!to_kspec(t.scalar_type(), &v->dtype) || (!device.is_cuda() && !device.is_cpu())) return false;
  const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
  if (sizes.size() > static_cast<size_t>(kspec::kMaxRank)) return false;
  v->rank = static_cast<int>(sizes.size());
  for (int d = 0; d < v->rank; ++d) {
    v->shape[d] = sizes[static_cast<size_t>(d)];
    v->strides[d] = strides[static_cast<size_t>(d)];
  }
  v->data = writable ? t.mutable_data_ptr() : const_cast<void*>(t.const_data_ptr());
  v->device = device.is_cuda() ? device.index() : kspec::kCpuDevice;
  return true;
}

void* stream_of(const at::Device& device) {
  return device.is_cuda() ? c10::cuda::getCurrentCUDAStream(device.index()).stream() : nullptr;
}

// New contiguous tensors, as at::empty makes them, without the dispatcher's way there (the options' key set,
// BackendSelect, the CUDA kernel's device guard): the allocator at::empty's kernels call (CUDA's caching
// allocator, which allocates on the current device and stream; the CPU allocator), straight. at::empty itself
// on a device other than the current one, where torch fills new memory (deterministic algorithms with
// fill_uninitialized_memory), and where the dispatcher would record aten::empty (a profiler's RecordFunction
// callbacks, asked as the dispatcher asks). Those two are asked once per allocator (one call's outputs): each
// was a few hundred instructions under callgrind.
class OutputAllocator {
 public:
  OutputAllocator() {
    const auto& ctx = at::globalContext();
    direct_ = !(ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory()) &&
              !at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION).has_value();
  }

  at::Tensor operator()(c10::IntArrayRef shape, at::ScalarType dtype, const at::Device& device) const {
    if (direct_ && device.is_cuda() && device.index() == c10::cuda::current_device())
      return at::Tensor(at::detail::empty_generic(shape, c10::cuda::CUDACachingAllocator::get(),
                                                  c10::DispatchKeySet(c10::DispatchKey::CUDA), dtype, std::nullopt));
    if (direct_ && device.is_cpu())
      return at::Tensor(at::detail::empty_generic(shape, c10::GetCPUAllocator(),
                                                  c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, std::nullopt));
    return at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
  }

 private:
  bool direct_ = false;
};

// An output's shape given by the caller (call_some): for one the registry cannot size from the inputs.
struct Sized {
  bool given = false;
  std::vector<int64_t> shape;
};

// Outputs from the registry's infer_outputs, allocated on `device`: every present one into an empty
// `out`, else (`out` already holds the outputs given) only those left undefined there, with the shape in
// `sized` where one is given (the op's dtype for it either way); false when kspec raised (kept).
bool allocate(const char* op, const std::vector<kspec::TensorView>& in, const std::vector<kspec_ext::Param>& params,
              const at::Device& device, std::vector<at::Tensor>* out, const std::vector<Sized>* sized = nullptr,
              const std::vector<bool>* skip = nullptr) {
  kspec_ext::Output specs[kspec_ext::kMaxOutputs];
  int n = 0;
  if (g_api->infer_outputs(op, in.data(), static_cast<int>(in.size()), params.data(), static_cast<int>(params.size()),
                           specs, kspec_ext::kMaxOutputs, &n) != 0)
    return false;
  if (out->empty()) out->resize(static_cast<size_t>(n));
  const OutputAllocator empty_output;
  for (int i = 0; i < n && i < static_cast<int>(out->size()); ++i) {
    if ((*out)[i].defined() || (skip && static_cast<size_t>(i) < skip->size() && (*skip)[static_cast<size_t>(i)]))
      continue;
    const at::ScalarType dtype = to_torch(specs[i].dtype);
    if (sized && static_cast<size_t>(i) < sized->size() && (*sized)[static_cast<size_t>(i)].given)
      (*out)[i] = empty_output((*sized)[static_cast<size_t>(i)].shape, dtype, device);
    else if (specs[i].present)
      (*out)[i] = empty_output(c10::IntArrayRef(specs[i].shape, specs[i].rank), dtype, device);
  }
  return true;
}

int run(const char* op, const std::vector<kspec::TensorView>& in, const std::vector<kspec::TensorView>& out,
        const std::vector<kspec_ext::Param>& params, void* stream) {
  return g_api->call(op, in.data(), static_cast<int>(in.size()), out.data(), static_cast<int>(out.size()),
                     params.data(), static_cast<int>(params.size()), stream);
}

// run() without the GIL where this thread holds it (the launch may compile or wait for a lock), unless kspec has
// the call cached: that one compiles nothing and takes no lock, and runs with the GIL held as torch's own
// launches do (releasing and taking back the GIL was two mutexes and a condition signal per call).
int run_released(const char* op, const std::vector<kspec::TensorView>& in, const std::vector<kspec::TensorView>& out,
                 const std::vector<kspec_ext::Param>& params, void* stream) {
  if (!PyGILState_Check()) return run(op, in, out, params, stream);
  int rc = g_api->call_cached(op, in.data(), static_cast<int>(in.size()), out.data(), static_cast<int>(out.size()),
                              params.data(), static_cast<int>(params.size()), stream);
  if (rc != 1) return rc;
  Py_BEGIN_ALLOW_THREADS
  rc = run(op, in, out, params, stream);
  Py_END_ALLOW_THREADS
  return rc;
}

// ---- kspec.call's path: _torch_ext.call(op, inputs, out, params) ----

PyObject* not_implemented() {
  Py_RETURN_NOTIMPLEMENTED;
}

// One Python param as the C ABI's; false (no error set) for a name or value the general path must judge.
bool param_of(PyObject* k, PyObject* v, kspec_ext::Param* p) {
  *p = kspec_ext::Param{PyUnicode_Check(k) ? PyUnicode_AsUTF8(k) : nullptr, kspec_ext::kInt, 0, 0.0, nullptr};
  if (!p->name) return false;
  if (PyBool_Check(v)) {
    p->kind = kspec_ext::kBool;
    p->i = v == Py_True;
  } else if (PyLong_Check(v)) {
    int overflow = 0;
    p->i = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (p->i == -1 && PyErr_Occurred())) return false;
  } else if (PyFloat_Check(v)) {
    p->kind = kspec_ext::kFloat;
    p->f = PyFloat_AS_DOUBLE(v);
  } else if (PyUnicode_Check(v)) {
    p->kind = kspec_ext::kStr;
    p->s = PyUnicode_AsUTF8(v);
    if (!p->s) return false;
  } else {
    return false;
  }
  return true;
}

// Python params as the C ABI's: a dict, or (for call_grad) a pair of tuples (names, values), which a caller
// with fixed names builds without a dict per call. False (no error set) for a value the general path must
// judge.
bool params_of(PyObject* given, std::vector<kspec_ext::Param>* out) {
  bool ok = true;
  if (PyDict_Check(given)) {
    out->reserve(static_cast<size_t>(PyDict_Size(given)));
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (ok && PyDict_Next(given, &pos, &k, &v)) {
      out->emplace_back();
      ok = param_of(k, v, &out->back());
    }
  } else if (PyTuple_Check(given) && PyTuple_GET_SIZE(given) == 2 && PyTuple_Check(PyTuple_GET_ITEM(given, 0)) &&
             PyTuple_Check(PyTuple_GET_ITEM(given, 1)) &&
             PyTuple_GET_SIZE(PyTuple_GET_ITEM(given, 0)) == PyTuple_GET_SIZE(PyTuple_GET_ITEM(given, 1))) {
    PyObject *names = PyTuple_GET_ITEM(given, 0), *values = PyTuple_GET_ITEM(given, 1);
    out->resize(static_cast<size_t>(PyTuple_GET_SIZE(names)));
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(names); ++i)
      ok = param_of(PyTuple_GET_ITEM(names, i), PyTuple_GET_ITEM(values, i), &(*out)[static_cast<size_t>(i)]);
  } else {
    ok = false;
  }
  if (PyErr_Occurred()) PyErr_Clear();
  return ok;
}

// Tensors (None: absent) from a tuple or list; false (no error set) for anything else.
bool tensors_of(PyObject* seq, std::vector<at::Tensor>* out) {
  if (!PyTuple_Check(seq) && !PyList_Check(seq)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  out->resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PySequence_Fast_GET_ITEM(seq, i);
    if (o == Py_None) continue;
    if (!THPVariable_Check(o)) return false;
    (*out)[static_cast<size_t>(i)] = THPVariable_Unpack(o);
  }
  return true;
}

// call_some's outputs: a tensor (given), None (allocated where the op has it) or a tuple of ints (allocated
// with that shape); false (no error set) for anything else.
bool outputs_of(PyObject* seq, std::vector<at::Tensor>* out, std::vector<Sized>* sized) {
  if (!PyTuple_Check(seq) && !PyList_Check(seq)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  out->resize(static_cast<size_t>(n));
  sized->resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PySequence_Fast_GET_ITEM(seq, i);
    if (o == Py_None) continue;
    if (THPVariable_Check(o)) {
      (*out)[static_cast<size_t>(i)] = THPVariable_Unpack(o);
      continue;
    }
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) > kspec::kMaxRank) return false;
    Sized& s = (*sized)[static_cast<size_t>(i)];
    s.given = true;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(o); ++d) {
      const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(o, d));
      if (v < 0) {  // not an int (an error set), or negative: the general path's to judge
        PyErr_Clear();
        return false;
      }
      s.shape.push_back(v);
    }
  }
  return true;
}

bool views_of(const std::vector<at::Tensor>& ts, bool writable, std::vector<kspec::TensorView>* out) {
  out->resize(ts.size());
  for (size_t i = 0; i < ts.size(); ++i)
    if (ts[i].defined() && !view_of(ts[i], writable, &(*out)[i])) return false;
  return true;
}

// Views of n objects (None: absent) read from the tensors they hold, no at::Tensor copied (a copy and its
// release are two refcount updates, and in torch 2.15 a Python incref and decref through the interpreter, each
// taking the GIL: ~390 instructions a tensor under callgrind); `device` the first tensor's where given. The
// objects must outlive the views' use. False (no error set) for anything kspec.call's C++ path does not read.
bool borrowed_views(PyObject* const* items, Py_ssize_t n, bool writable, std::vector<kspec::TensorView>* out,
                    at::Device* device = nullptr) {
  out->resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (items[i] == Py_None) continue;
    if (!THPVariable_Check(items[i])) return false;
    const at::Tensor& t = THPVariable_Unpack(items[i]);
    if (!view_of(t, writable, &(*out)[static_cast<size_t>(i)])) return false;
    if (device) {
      *device = t.device();
      device = nullptr;
    }
  }
  return !device;  // a tensor was read where a device was asked for
}

// Output i as a Python object (None where absent or out of range).
PyObject* wrap_one(std::vector<at::Tensor>* out, Py_ssize_t i) {
  if (i < 0 || static_cast<size_t>(i) >= out->size() || !(*out)[static_cast<size_t>(i)].defined()) Py_RETURN_NONE;
  return THPVariable_Wrap(std::move((*out)[static_cast<size_t>(i)]));
}

// The outputs as a new tuple (None for an absent one).
PyObject* wrap(std::vector<at::Tensor>* out) {
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(out->size()));
  if (!result) return nullptr;
  for (size_t i = 0; i < out->size(); ++i) {
    PyObject* o = Py_None;
    if ((*out)[i].defined())
      o = THPVariable_Wrap(std::move((*out)[i]));
    else
      Py_INCREF(o);
    if (!o) {
      Py_DECREF(result);
      return nullptr;
    }
    PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), o);
  }
  return result;
}

// A forward call's inputs as call, call_some and call_grad take them: tensors, their views, the params and
// the device of the first tensor.
struct ForwardArgs {
  std::vector<at::Tensor> in;
  std::vector<kspec::TensorView> in_views;
  std::vector<kspec_ext::Param> params;
  at::Device device{at::kCPU};
};

// False (no error set) where kspec.call's general path must judge the call: an input or a param the C++
// path does not read, or no tensor at all.
bool forward_args(PyObject* inputs, PyObject* params, ForwardArgs* a) {
  if (!tensors_of(inputs, &a->in) || !views_of(a->in, false, &a->in_views) || !params_of(params, &a->params))
    return false;
  for (const auto& t : a->in)
    if (t.defined()) {
      a->device = t.device();
      return true;
    }
  return false;
}

enum class Ran { kOk, kDeclined, kRaised };

// op run on the device's current stream with these outputs; kRaised: kspec's error set as the Python exception.
Ran run_views(const char* op, const ForwardArgs& a, const std::vector<kspec::TensorView>& out_views) {
  if (run_released(op, a.in_views, out_views, a.params, stream_of(a.device)) != 0) {
    g_api->raise_error();
    return Ran::kRaised;
  }
  return Ran::kOk;
}

// The outputs missing from `out` allocated (allocate()'s rules; all of them into an empty `out`) unless
// `given`, then op run on the device's current stream. kDeclined (no error set): an output the C++ path
// does not read (the general path's); kRaised: kspec's error set as the Python exception.
Ran allocate_and_run(const char* op, const ForwardArgs& a, bool given, std::vector<at::Tensor>* out,
                     const std::vector<Sized>* shapes = nullptr) {
  if (!given && !allocate(op, a.in_views, a.params, a.device, out, shapes)) {
    g_api->raise_error();
    return Ran::kRaised;
  }
  std::vector<kspec::TensorView> out_views;
  if (!views_of(*out, true, &out_views)) return Ran::kDeclined;
  return run_views(op, a, out_views);
}

enum class Outputs { kGiven, kAllocated, kSome };

// call / call_some: kspec.call for torch tensors. NotImplemented for anything it does not read (another
// framework, a dtype or device kspec does not know, a param of another type): kspec.call's general path
// then runs and raises what it raises.
PyObject* call_with(PyObject* const* args, Py_ssize_t nargs, Outputs mode) {
  if (nargs != 4 || !PyUnicode_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "_torch_ext.call(op, inputs, out, params)");
    return nullptr;
  }
  const char* op = PyUnicode_AsUTF8(args[0]);
  if (!op) return nullptr;
  ForwardArgs a;
  if (!forward_args(args[1], args[3], &a)) return not_implemented();
  if (mode == Outputs::kAllocated && args[2] != Py_None) mode = Outputs::kGiven;
  std::vector<at::Tensor> out;
  std::vector<Sized> sized;
  if (mode == Outputs::kGiven && !tensors_of(args[2], &out)) return not_implemented();
  if (mode == Outputs::kSome && !outputs_of(args[2], &out, &sized)) return not_implemented();
  switch (allocate_and_run(op, a, mode == Outputs::kGiven, &out, mode == Outputs::kSome ? &sized : nullptr)) {
    case Ran::kDeclined: return not_implemented();
    case Ran::kRaised: return nullptr;
    case Ran::kOk: break;
  }
  if (mode == Outputs::kGiven) return PySequence_Tuple(args[2]);
  return wrap(&out);
}

// call(op, inputs, out, params): kspec.call for torch tensors (None or a sequence of outputs for `out`).
PyObject* py_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  return call_with(args, nargs, Outputs::kAllocated);
  END_HANDLE_TH_ERRORS
}

// call_some(op, inputs, out, params): `out` a sequence like the op's outputs, each a tensor (given), None
// (allocated here where the op has that output without being given it; an optional one stays absent) or
// a tuple of ints (allocated with that shape and the op's dtype for it: an output the registry cannot
// size from the inputs, the scan's states). at::empty costs ~1 us against ~6 us for torch.empty from
// Python on the H100. Returns every output (the given ones themselves).
PyObject* py_call_some(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  return call_with(args, nargs, Outputs::kSome);
  END_HANDLE_TH_ERRORS
}

// ---- kspec.call itself: _torch_ext.kspec_call ----

PyObject* g_call_python = nullptr;  // kspec._core._call_python: kspec.call for whatever kspec_call declines
PyObject* g_s_out = nullptr;        // the keyword names kspec.call takes besides params, interned
PyObject* g_s_config = nullptr;
PyObject* g_s_op = nullptr;

// Whether keyword name `k` is `interned` (a keyword name is almost always interned itself: then the pointers
// say it, and only a name made at run time, **{...} of built strings, is compared as text).
bool is_keyword(PyObject* k, PyObject* interned) {
  if (k == interned) return true;
  return !PyUnicode_CHECK_INTERNED(k) && PyUnicode_Compare(k, interned) == 0;
}

// kspec.call(op, *inputs, config=None, out=None, **params) as one vectorcall (kspec._native makes it kspec.call
// where the extension is loaded): no Python frame, no tuple of the inputs nor dict of the params, the params read
// from the call's keyword names. What it does not take (no op name, a config, an argument or param the C++ path
// does not read) goes to kspec._core._call_python with the same arguments: the pure path, which raises what
// kspec.call raises.
PyObject* py_kspec_call(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  auto python = [&] { return PyObject_Vectorcall(g_call_python, args, static_cast<size_t>(nargs), kwnames); };
  if (!g_call_python) {
    PyErr_SetString(PyExc_RuntimeError, "_torch_ext.kspec_call: set_call_fallback was not called");
    return nullptr;
  }
  if (nargs < 1 || !PyUnicode_Check(args[0])) return python();
  const char* op = PyUnicode_AsUTF8(args[0]);
  if (!op) return nullptr;
  ForwardArgs a;
  PyObject* out = Py_None;
  const Py_ssize_t n_kw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  a.params.reserve(static_cast<size_t>(n_kw));
  for (Py_ssize_t k = 0; k < n_kw; ++k) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, k);
    PyObject* value = args[nargs + k];
    if (is_keyword(name, g_s_out)) {
      out = value;
    } else if (is_keyword(name, g_s_config)) {
      if (value != Py_None) return python();
    } else if (is_keyword(name, g_s_op)) {
      return python();  // op given twice: Python's TypeError
    } else {
      a.params.emplace_back();
      if (!param_of(name, value, &a.params.back())) {
        PyErr_Clear();
        return python();
      }
    }
  }
  // the inputs read in place (the caller holds them for the call); a.in stays empty: nothing here needs it
  if (!borrowed_views(args + 1, nargs - 1, false, &a.in_views, &a.device)) return python();
  if (out != Py_None) {
    if (!PyTuple_Check(out) && !PyList_Check(out)) return python();
    // the result, made first: it holds the given outputs while their views are used (a list may change
    // while the GIL is released for a call kspec has not cached)
    PyObject* result = PySequence_Tuple(out);
    if (!result) return nullptr;
    std::vector<kspec::TensorView> out_views;
    if (!borrowed_views(PySequence_Fast_ITEMS(result), PyTuple_GET_SIZE(result), true, &out_views)) {
      Py_DECREF(result);
      return python();
    }
    if (run_views(op, a, out_views) == Ran::kOk) return result;
    Py_DECREF(result);
    return nullptr;
  }
  std::vector<at::Tensor> outs;
  switch (allocate_and_run(op, a, /*given=*/false, &outs)) {
    case Ran::kDeclined: return python();
    case Ran::kRaised: return nullptr;
    case Ran::kOk: break;
  }
  return wrap(&outs);
  END_HANDLE_TH_ERRORS
}

// set_call_fallback(fn): the Python function kspec_call hands what it does not take (kspec._core._call_python).
PyObject* py_set_call_fallback(PyObject*, PyObject* fn) {
  if (!PyCallable_Check(fn)) {
    PyErr_SetString(PyExc_TypeError, "set_call_fallback: a callable");
    return nullptr;
  }
  if (!g_s_out) {
    g_s_out = PyUnicode_InternFromString("out");
    g_s_config = PyUnicode_InternFromString("config");
    g_s_op = PyUnicode_InternFromString("op");
    if (!g_s_out || !g_s_config || !g_s_op) return nullptr;
  }
  Py_INCREF(fn);
  Py_XSETREF(g_call_python, fn);
  Py_RETURN_NONE;
}

// ---- the dispatcher ops: kspec_ops::<op> ----

// The Python error set on this thread as torch's python_error, fetched now: the autograd engine may
// rethrow it on another thread (a CUDA device's worker), where torch restores it for the caller.
[[noreturn]] void throw_python_error() {
  python_error e;
  e.persist();
  throw std::move(e);
}

// kspec's kept error as the Python exception kspec._C raises, carried through the dispatcher (and the
// autograd engine) as torch's python_error, which torch restores when the call returns to Python.
[[noreturn]] void throw_kept_error() {
  {
    pybind11::gil_scoped_acquire gil;
    g_api->raise_error();
  }
  throw_python_error();
}

// Python's value of a param IValue (None, bool, int, float or str: what the schema admits).
PyObject* param_to_py(const c10::IValue& v) {
  if (v.isBool()) return PyBool_FromLong(v.toBool());
  if (v.isInt()) return PyLong_FromLongLong(v.toInt());
  if (v.isDouble()) return PyFloat_FromDouble(v.toDouble());
  return PyUnicode_FromString(v.toStringRef().c_str());
}

// kspec.call's general path (kspec._core._call_general) for inputs the C++ path does not read (a dtype
// or device kspec only judges in Python): it raises what kspec.call raises for them, or runs the call.
std::vector<at::Tensor> general_path(const std::string& op, c10::ArrayRef<c10::IValue> args, size_t n_inputs,
                                     const std::vector<std::string>& names) {
  pybind11::gil_scoped_acquire gil;
  auto steal = [](PyObject* o) {
    if (!o) throw_python_error();
    return pybind11::reinterpret_steal<pybind11::object>(o);
  };
  pybind11::object core = steal(PyImport_ImportModule("kspec._core"));
  pybind11::object inputs = steal(PyTuple_New(static_cast<Py_ssize_t>(n_inputs)));
  for (size_t i = 0; i < n_inputs; ++i) {
    PyObject* o = args[i].isNone() ? (Py_INCREF(Py_None), Py_None) : THPVariable_Wrap(args[i].toTensor());
    PyTuple_SET_ITEM(inputs.ptr(), static_cast<Py_ssize_t>(i), steal(o).release().ptr());
  }
  pybind11::object params = steal(PyDict_New());
  for (size_t j = 0; j < names.size(); ++j)
    if (!args[n_inputs + j].isNone() &&
        PyDict_SetItemString(params.ptr(), names[j].c_str(), steal(param_to_py(args[n_inputs + j])).ptr()) != 0)
      throw_python_error();
  pybind11::object op_name = steal(PyUnicode_FromString(op.c_str()));
  pybind11::object result = steal(PyObject_CallMethod(core.ptr(), "_call_general", "OOOOO", op_name.ptr(),
                                                      inputs.ptr(), Py_None, Py_None, params.ptr()));
  std::vector<at::Tensor> out;
  for (pybind11::handle o : result)
    out.push_back(o.is_none() ? at::Tensor() : THPVariable_Unpack(o.ptr()));
  return out;
}

// One registry op as a boxed kernel. The schema (kspec._native.schema) lists the op's inputs in order
// (Tensor or Tensor?), then its params keyword-only and optional (None: not given, as kspec.call
// leaves them out), and returns every output (an empty tensor for an absent one, as custom ops must).
class RegistryKernel final : public c10::OperatorKernel {
 public:
  RegistryKernel(std::string op, const c10::FunctionSchema& schema) : op_(std::move(op)) {
    for (const auto& a : schema.arguments()) {
      if (a.kwarg_only())
        params_.push_back(a.name());
      else
        ++n_inputs_;
    }
  }

  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const size_t n_args = n_inputs_ + params_.size();
    auto args = torch::jit::last(*stack, n_args);
    std::vector<at::Tensor> in(n_inputs_), out;
    std::vector<kspec::TensorView> in_views(n_inputs_), out_views;
    const at::Tensor* first = nullptr;
    bool readable = true;
    for (size_t i = 0; i < n_inputs_; ++i) {
      if (args[i].isNone()) continue;
      in[i] = args[i].toTensor();
      readable = readable && view_of(in[i], false, &in_views[i]);
      if (!first) first = &in[i];
    }
    if (!readable) out = general_path(op_, args, n_inputs_, params_);
    std::vector<kspec_ext::Param> params;
    for (size_t j = 0; j < params_.size(); ++j) {
      const c10::IValue& v = args[n_inputs_ + j];
      kspec_ext::Param p{params_[j].c_str(), kspec_ext::kInt, 0, 0.0, nullptr};
      if (v.isNone()) continue;
      if (v.isBool()) {
        p.kind = kspec_ext::kBool;
        p.i = v.toBool();
      } else if (v.isInt()) {
        p.i = v.toInt();
      } else if (v.isDouble()) {
        p.kind = kspec_ext::kFloat;
        p.f = v.toDouble();
      } else {
        p.kind = kspec_ext::kStr;
        p.s = v.toStringRef().c_str();  // the IValue on the stack keeps the string alive
      }
      params.push_back(p);
    }
    TORCH_CHECK(first, op_, ": no tensor input");  // the schema has required tensors: never met
    if (readable) {
      const at::Device device = first->device();
      if (!allocate(op_.c_str(), in_views, params, device, &out)) throw_kept_error();
      TORCH_INTERNAL_ASSERT(views_of(out, true, &out_views));
      if (run_released(op_.c_str(), in_views, out_views, params, stream_of(device)) != 0) throw_kept_error();
    }
    torch::jit::drop(*stack, n_args);
    for (auto& t : out) torch::jit::push(*stack, t.defined() ? std::move(t) : at::empty({0}, first->options()));
  }

 private:
  std::string op_;
  size_t n_inputs_ = 0;
  std::vector<std::string> params_;
};

std::vector<std::unique_ptr<torch::Library>>& libraries() {
  static std::vector<std::unique_ptr<torch::Library>> libs;  // registrations live until exit
  return libs;
}

// define(ns, op, schema, module): defines ns::<schema's name> and registers the registry op `op` as its
// CPU and CUDA kernel (CPU tensors reach kspec's validation, which refuses them with its host-tensor
// message); `module` is the Python module that registers its fake kernel (torch requires the pystub).
PyObject* py_define(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 4, "_torch_ext.define(ns, op, schema, module)");
  const char* ns = PyUnicode_AsUTF8(args[0]);
  const char* op = PyUnicode_AsUTF8(args[1]);
  const char* schema = PyUnicode_AsUTF8(args[2]);
  const char* module = PyUnicode_AsUTF8(args[3]);
  if (!ns || !op || !schema || !module) return nullptr;
  c10::FunctionSchema parsed = torch::schema(schema);
  const std::string name = parsed.name();
  auto lib = std::make_unique<torch::Library>(torch::Library::FRAGMENT, ns, std::nullopt, __FILE__, __LINE__);
  lib->set_python_module(module);
  lib->def(c10::FunctionSchema(parsed));
  for (auto key : {c10::DispatchKey::CUDA, c10::DispatchKey::CPU})
    lib->impl(name.c_str(), torch::dispatch(key, torch::CppFunction::makeFromBoxedFunctor(
                                                     std::make_unique<RegistryKernel>(op, parsed))));
  libraries().push_back(std::move(lib));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// ---- the eager autograd node of a surface (kspec._surface) ----

// torch holds graph nodes by std::shared_ptr up to 2.14 (deleted through deleteNode, which frees a long graph
// without deep recursion) and by c10::intrusive_ptr from 2.15: Node::getptr(), in both, says which.
using NodePtr = decltype(std::declval<torch::autograd::Node&>().getptr());
template <typename P>
struct IsSharedPtr : std::false_type {};
template <typename X>
struct IsSharedPtr<std::shared_ptr<X>> : std::true_type {};

template <typename T, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (IsSharedPtr<NodePtr>::value) {
    // deleteNode found by argument-dependent lookup at instantiation (torch::autograd, T's base's namespace):
    // torch 2.15 has none, and this branch is not instantiated there
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...), [](T* p) { deleteNode(p); });
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// One graph node for a family's forward, made in C++ instead of a torch.autograd.Function (whose Python
// apply costs about 10 us on the H100). What it saves and how its backward is called is the family's
// spec, resolved in Python (kspec._surface.Surface): `backward` is the surface's function
// (saved tensors, gradients of the differentiable outputs, ctx) -> gradients of the tensor inputs.
class SurfaceBackward final : public torch::autograd::Node {
 public:
  SurfaceBackward(std::string name, PyObject* backward, PyObject* ctx, std::vector<bool> materialize)
      : name_(std::move(name)), backward_(backward), ctx_(ctx), materialize_(std::move(materialize)) {
    Py_INCREF(backward_);
    Py_INCREF(ctx_);
  }
  ~SurfaceBackward() override {
    pybind11::gil_scoped_acquire gil;
    Py_DECREF(backward_);
    Py_DECREF(ctx_);
  }
  std::string name() const override { return name_; }

  // An output it is the grad_fn of (an undefined one gets no gradient, not even materialized zeros).
  void add_output(const at::Tensor& t) {
    torch::autograd::set_history(t, getptr());
    output_defined_.push_back(t.defined());
  }

  void save(std::vector<at::Tensor> saved, const std::vector<bool>& is_output) {
    for (size_t i = 0; i < saved.size(); ++i) saved_.emplace_back(saved[i], is_output[i]);
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(!released_, name_, ": its saved tensors were freed by a backward that ran before; pass "
                "retain_graph=True to the first backward to run it twice");
    std::vector<at::Tensor> saved;
    for (auto& v : saved_) saved.push_back(v.unpack(getptr()));
    for (size_t i = 0; i < grads.size(); ++i)
      if (!grads[i].defined() && materialize_[i] && output_defined_[i]) grads[i] = input_metadata(i).zeros_like();
    pybind11::gil_scoped_acquire gil;
    auto to_tuple = [](const std::vector<at::Tensor>& ts) {
      pybind11::tuple t(ts.size());
      for (size_t i = 0; i < ts.size(); ++i)
        t[i] = ts[i].defined() ? pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(ts[i]))
                               : pybind11::none();
      return t;
    };
    pybind11::tuple saved_py = to_tuple(saved), grads_py = to_tuple(grads);
    PyObject* r = PyObject_CallFunctionObjArgs(backward_, saved_py.ptr(), grads_py.ptr(), ctx_, nullptr);
    if (!r) throw_python_error();
    pybind11::object result = pybind11::reinterpret_steal<pybind11::object>(r);
    torch::autograd::variable_list out;
    for (pybind11::handle g : result) out.push_back(g.is_none() ? at::Tensor() : THPVariable_Unpack(g.ptr()));
    TORCH_CHECK(out.size() == num_outputs(), name_, ": the backward gave ", out.size(), " gradients for ",
                num_outputs(), " inputs");
    return out;
  }

  void release_variables() override {
    saved_.clear();
    released_ = true;
  }

 private:
  std::string name_;
  PyObject* backward_;
  PyObject* ctx_;
  std::vector<bool> materialize_;  // per differentiable output: zeros for a gradient that did not come
  bool released_ = false;
  std::vector<bool> output_defined_;
  std::vector<torch::autograd::SavedVariable> saved_;
};

// record(name, backward, ctx, materialize, inputs, outputs, diff, saved): puts the forward that made
// `outputs` from `inputs` (tensors or None, computed without grad) into the autograd graph: a
// SurfaceBackward node whose inputs are outputs[diff] (they get it as grad_fn) and whose next edges are
// the tensor inputs'; it saves `saved` (outputs among them are saved as outputs, with no reference cycle).
// materialize: one bool per entry of diff, whether a gradient that did not come is passed as zeros (the
// backward needs it) or as None (no allocation and no fill kernel per step).
PyObject* py_record(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 8, "_torch_ext.record(name, backward, ctx, materialize, inputs, outputs, diff, saved)");
  const char* name = PyUnicode_AsUTF8(args[0]);
  if (!name) return nullptr;
  std::vector<at::Tensor> inputs, outputs, saved;
  TORCH_CHECK(tensors_of(args[4], &inputs) && tensors_of(args[5], &outputs) && tensors_of(args[7], &saved),
              name, ": inputs, outputs and saved must be sequences of tensors or None");
  PyObject* diff = PySequence_Fast(args[6], "diff: a sequence of output indices");
  if (!diff) return nullptr;
  pybind11::object hold = pybind11::reinterpret_steal<pybind11::object>(diff);
  PyObject* zeros = PySequence_Fast(args[3], "materialize: a sequence of bools, one per diff index");
  if (!zeros) return nullptr;
  pybind11::object hold_zeros = pybind11::reinterpret_steal<pybind11::object>(zeros);
  TORCH_CHECK(PySequence_Fast_GET_SIZE(zeros) == PySequence_Fast_GET_SIZE(diff), name,
              ": materialize needs one bool per diff index");
  std::vector<bool> materialize;
  for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(zeros); ++k) {
    const int v = PyObject_IsTrue(PySequence_Fast_GET_ITEM(zeros, k));
    if (v < 0) return nullptr;
    materialize.push_back(v == 1);
  }
  auto node = make_node<SurfaceBackward>(name, args[1], args[2], std::move(materialize));
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  std::vector<const at::TensorImpl*> with_history;
  for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(diff); ++k) {
    const long i = PyLong_AsLong(PySequence_Fast_GET_ITEM(diff, k));
    if (i == -1 && PyErr_Occurred()) return nullptr;
    TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < outputs.size(), name, ": diff index ", i, " out of range");
    node->add_output(outputs[static_cast<size_t>(i)]);
    if (outputs[static_cast<size_t>(i)].defined())
      with_history.push_back(outputs[static_cast<size_t>(i)].unsafeGetTensorImpl());
  }
  std::vector<bool> is_output;
  for (const auto& t : saved)
    is_output.push_back(t.defined() && std::find(with_history.begin(), with_history.end(),
                                                 t.unsafeGetTensorImpl()) != with_history.end());
  node->save(std::move(saved), is_output);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// ---- the eager autograd node of a family whose forward and backward are one registry call each ----

// The backward op's argument that is not a saved tensor: a gradient of forward output i is kGrad + i, or
// kGradOptional + i where the op takes it absent (no zeros made for one that did not come).
constexpr long kOut = 1000, kGrad = 2000, kGradOptional = 3000;

// The forward output whose gradient `code` names, or -1.
long grad_index(long code) { return code >= kGradOptional ? code - kGradOptional : code >= kGrad ? code - kGrad : -1; }

// Params of the C ABI with their strings owned (a node outlives the Python call that made it).
struct OwnedParams {
  std::vector<std::string> names, strings;
  std::vector<kspec_ext::Param> params;

  void reserve(size_t n) {
    names.reserve(n);
    strings.reserve(n);
    params.reserve(n);
  }
  void add(const kspec_ext::Param& p) {
    names.emplace_back(p.name);
    strings.emplace_back(p.s ? p.s : "");
    params.push_back(p);
  }
  // Pointers into names/strings, once they no longer move.
  void fix() {
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].name = names[i].c_str();
      if (params[i].kind == kspec_ext::kStr) params[i].s = strings[i].c_str();
    }
  }
};

// The graph node of call_grad: its backward is the registry's backward op, run here in C++ (no Python, no
// GIL unless kspec raises): arguments from `args_` (a saved tensor, a gradient made contiguous, or None),
// outputs allocated from its infer_outputs (those that are gradients of an absent input left out), each
// returned as the gradient of the forward input `grad_of_` names.
class OpBackward final : public torch::autograd::Node {
 public:
  OpBackward(std::string name, std::string op, OwnedParams params, std::vector<long> args, std::vector<long> grad_of)
      : name_(std::move(name)), op_(std::move(op)), params_(std::move(params)), args_(std::move(args)),
        grad_of_(std::move(grad_of)) {
    params_.fix();
    saved_.reserve(args_.size());
    diff_.reserve(args_.size());
  }
  std::string name() const override { return name_; }

  // Forward output `index`, which gets this node as grad_fn (the node's next input, in order).
  void add_output(const at::Tensor& t, long index) {
    torch::autograd::set_history(t, getptr());
    diff_.push_back(index);
  }
  // saved_: one per args_ entry that is a tensor (an input or an output), in args_'s order
  void save(const at::Tensor& t, bool is_output) { saved_.emplace_back(t, is_output); }
  // The forward's inputs as they were (an undefined one absent): a gradient the backward op leaves
  // optional (gemm.bwd's dbias) is allocated with its input's shape and dtype, as autograd wants it.
  // One vector of them, where three (absent, shape, dtype) were three allocations per forward call.
  void set_inputs(const std::vector<at::Tensor>& in) {
    inputs_.reserve(in.size());
    for (const auto& t : in)
      inputs_.push_back(t.defined() ? InputMeta{false, at::DimVector(t.sizes()), t.scalar_type()} : InputMeta{});
  }
  // The backward's arguments as call_grad was given them (read while the forward's call records the node).
  const std::vector<long>& args() const { return args_; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(!released_, name_, ": its saved tensors were freed by a backward that ran before; pass "
                "retain_graph=True to the first backward to run it twice");
    std::vector<at::Tensor> in(args_.size());
    size_t k = 0;
    for (size_t a = 0; a < args_.size(); ++a) {
      const long code = args_[a];
      if (code >= kGrad) {
        const size_t i = static_cast<size_t>(std::find(diff_.begin(), diff_.end(), grad_index(code)) - diff_.begin());
        if (!grads[i].defined() && code >= kGradOptional) continue;  // absent: the op reads it as zeros
        // a required gradient argument: zeros for one that did not come
        at::Tensor g = grads[i].defined() ? grads[i] : input_metadata(i).zeros_like();
        // autograd's gradient may be any view (y.sum() gives a broadcast one): the ops read rows of it
        in[a] = g.is_contiguous() ? g : g.contiguous();
      } else if (code >= 0) {
        in[a] = saved_[k++].unpack(getptr());
      }
    }
    std::vector<kspec::TensorView> in_views, out_views;
    TORCH_CHECK(views_of(in, false, &in_views), name_, ": ", op_,
                " cannot read a gradient of a dtype kspec does not know or on a device other than CPU/CUDA");
    const at::Tensor* first = nullptr;
    for (const auto& t : in)
      if (t.defined()) {
        first = &t;
        break;
      }
    TORCH_INTERNAL_ASSERT(first, name_, ": no tensor argument");
    // a gradient of an absent input (dbias without a bias) is not allocated, so not computed
    std::vector<bool> skip(kspec_ext::kMaxOutputs, false);
    for (size_t i = 0; i < grad_of_.size(); ++i)
      if (grad_of_[i] >= 0 && inputs_[i].absent) skip[static_cast<size_t>(grad_of_[i])] = true;
    std::vector<at::Tensor> out;
    const at::Device device = first->device();
    if (!allocate(op_.c_str(), in_views, params_.params, device, &out, nullptr, &skip)) throw_kept_error();
    for (size_t i = 0; i < grad_of_.size(); ++i) {
      const size_t j = static_cast<size_t>(grad_of_[i]);
      if (grad_of_[i] >= 0 && !inputs_[i].absent && j < out.size() && !out[j].defined())
        out[j] = at::empty(inputs_[i].shape, at::TensorOptions().dtype(inputs_[i].dtype).device(device));
    }
    TORCH_INTERNAL_ASSERT(views_of(out, true, &out_views));
    if (run_released(op_.c_str(), in_views, out_views, params_.params, stream_of(device)) != 0) throw_kept_error();
    // gradients only for the inputs this backward serves (one that does not require grad, or one outside
    // torch.autograd.grad's `inputs`, gets none; the op computes them all)
    torch::autograd::variable_list result(grad_of_.size());
    for (size_t i = 0; i < grad_of_.size(); ++i)
      if (grad_of_[i] >= 0 && static_cast<size_t>(grad_of_[i]) < out.size() && should_compute_output(i))
        result[i] = out[static_cast<size_t>(grad_of_[i])];
    return result;
  }

  void release_variables() override {
    saved_.clear();
    released_ = true;
  }

 private:
  std::string name_, op_;
  OwnedParams params_;
  std::vector<long> args_, grad_of_, diff_;
  struct InputMeta {
    bool absent = true;
    at::DimVector shape;  // inline up to 5 dims: no allocation per input
    at::ScalarType dtype = at::kFloat;
  };
  std::vector<InputMeta> inputs_;
  bool released_ = false;
  std::vector<torch::autograd::SavedVariable> saved_;
};

// A tuple of ints as a vector; false (a Python error set) for anything else.
bool ints_of(PyObject* seq, std::vector<long>* out) {
  if (!PyTuple_Check(seq)) {
    PyErr_SetString(PyExc_TypeError, "a tuple of ints");
    return false;
  }
  out->reserve(static_cast<size_t>(PyTuple_GET_SIZE(seq)));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); ++i) {
    const long v = PyLong_AsLong(PyTuple_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) return false;
    out->push_back(v);
  }
  return true;
}

// call_grad's `sized`: per forward output, None (sized by the registry's infer_outputs, or absent) or a tuple of
// (input, dim, divisor) triples, one per dim of the output: allocated as [ceil(inputs[input].size(dim) / divisor),
// ...] with the op's dtype for it. For an output whose dims no input binds, which infer_outputs therefore leaves
// absent: the scan's `states`, [batch, dim, ceil(seqlen / 16), dstate]. False with no error set where an input a
// rule reads is absent or has too few dims (kspec.call's path judges that call and raises what it raises); false
// with a TypeError set for a malformed rule.
bool sized_of(PyObject* rules, const std::vector<at::Tensor>& in, std::vector<Sized>* out) {
  if (!PyTuple_Check(rules)) {
    PyErr_SetString(PyExc_TypeError, "call_grad: sized must be a tuple (None or a tuple of triples per output)");
    return false;
  }
  out->resize(static_cast<size_t>(PyTuple_GET_SIZE(rules)));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(rules); ++i) {
    PyObject* rule = PyTuple_GET_ITEM(rules, i);
    if (rule == Py_None) continue;
    if (!PyTuple_Check(rule) || PyTuple_GET_SIZE(rule) > kspec::kMaxRank) {
      PyErr_SetString(PyExc_TypeError, "call_grad: an output's size rule must be a tuple of (input, dim, divisor)");
      return false;
    }
    Sized& s = (*out)[static_cast<size_t>(i)];
    s.given = true;
    s.shape.reserve(static_cast<size_t>(PyTuple_GET_SIZE(rule)));
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(rule); ++d) {
      PyObject* t = PyTuple_GET_ITEM(rule, d);
      long v[3] = {-1, -1, 0};
      if (PyTuple_Check(t) && PyTuple_GET_SIZE(t) == 3)
        for (Py_ssize_t k = 0; k < 3; ++k) v[k] = PyLong_AsLong(PyTuple_GET_ITEM(t, k));
      if (PyErr_Occurred() || v[0] < 0 || v[1] < 0 || v[2] < 1) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "call_grad: a size rule's dim is (input index, dim index, divisor >= 1)");
        return false;
      }
      const size_t input = static_cast<size_t>(v[0]);
      if (input >= in.size() || !in[input].defined() || v[1] >= in[input].dim()) return false;
      s.shape.push_back((in[input].size(v[1]) + v[2] - 1) / v[2]);
    }
  }
  return true;
}

// call_grad(name, fwd_op, bwd_op, inputs, params, bwd_params, bwd_args, grad_of[, public[, sized]]): the forward op's
// outputs (allocated, those `sized` gives a rule for with its shape; with `public`, those it names), recorded in the autograd graph as one OpBackward node
// named `name`, in one C++ call (no torch.autograd.Function, no Python in the backward). `params` the
// forward's (a dict, or (names, values)); `bwd_params` the names of those the backward op takes too;
// `bwd_args` the backward op's inputs in order, each an input index (saved), kOut + i (forward output i,
// saved), kGrad + i (the gradient of forward output i, which thereby gets this node as grad_fn;
// kGradOptional + i where the op takes it absent) or -1 (None); `grad_of` per input, the backward output
// that is its gradient (-1: none). NotImplemented, nothing recorded, where kspec.call's C++ path would
// decline the call.
PyObject* py_call_grad(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs >= 8 && nargs <= 10, "_torch_ext.call_grad(name, fwd_op, bwd_op, inputs, params, bwd_params, "
              "bwd_args, grad_of[, public[, sized]])");
  // public: the one output index returned alone, or a tuple of them; without it every output, as a tuple.
  // The outputs only saved for the backward (norm_act's mean and rstd) then get no Python object each (made,
  // then dropped with the tuple) per call.
  PyObject* public_out = nargs >= 9 && args[8] != Py_None ? args[8] : nullptr;
  if (public_out && !PyLong_Check(public_out) && !PyTuple_Check(public_out)) {
    PyErr_SetString(PyExc_TypeError, "call_grad: public must be an output index or a tuple of them");
    return nullptr;
  }
  const char* name = PyUnicode_AsUTF8(args[0]);
  const char* fwd_op = PyUnicode_AsUTF8(args[1]);
  const char* bwd_op = PyUnicode_AsUTF8(args[2]);
  if (!name || !fwd_op || !bwd_op) return nullptr;
  ForwardArgs a;
  if (!forward_args(args[3], args[4], &a)) return not_implemented();
  const std::vector<at::Tensor>& in = a.in;
  const std::vector<kspec_ext::Param>& params = a.params;
  std::vector<long> bwd_args, grad_of;
  if (!ints_of(args[6], &bwd_args) || !ints_of(args[7], &grad_of)) return nullptr;
  TORCH_CHECK(grad_of.size() == in.size(), name, ": grad_of needs one entry per input");
  for (long j : grad_of)
    TORCH_CHECK(j >= -1 && j < kspec_ext::kMaxOutputs, name, ": grad_of entry ", j, " is no backward output");
  std::vector<Sized> sized;
  if (nargs == 10 && args[9] != Py_None && !sized_of(args[9], in, &sized))
    return PyErr_Occurred() ? nullptr : not_implemented();
  std::vector<at::Tensor> out;
  switch (allocate_and_run(fwd_op, a, /*given=*/false, &out, &sized)) {
    case Ran::kDeclined: return not_implemented();
    case Ran::kRaised: return nullptr;
    case Ran::kOk: break;
  }
  OwnedParams bwd_params;
  if (!PyTuple_Check(args[5])) {
    PyErr_SetString(PyExc_TypeError, "bwd_params: a tuple of names");
    return nullptr;
  }
  bwd_params.reserve(static_cast<size_t>(PyTuple_GET_SIZE(args[5])));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[5]); ++i) {
    const char* pname = PyUnicode_AsUTF8(PyTuple_GET_ITEM(args[5], i));
    if (!pname) return nullptr;
    for (const auto& p : params)
      if (std::strcmp(p.name, pname) == 0) bwd_params.add(p);
  }
  // bwd_args and grad_of moved into the node (two vector copies a call before); bwd_args read back from it
  auto node = make_node<OpBackward>(name, bwd_op, std::move(bwd_params), std::move(bwd_args), std::move(grad_of));
  const std::vector<long>& codes = node->args();
  node->set_next_edges(torch::autograd::collect_next_edges(in));
  node->set_inputs(in);
  // the node's inputs: the forward outputs whose gradient the backward reads, in order of index
  std::vector<long> diff;
  diff.reserve(codes.size());
  for (long code : codes)
    if (code >= kGrad) diff.push_back(grad_index(code));
  std::sort(diff.begin(), diff.end());
  for (long i : diff) {
    TORCH_CHECK(static_cast<size_t>(i) < out.size() && out[static_cast<size_t>(i)].defined(), name,
                ": bwd_args names the gradient of output ", i, ", which the forward did not make");
    node->add_output(out[static_cast<size_t>(i)], i);
  }
  for (long code : codes) {
    if (code >= kGrad || code < 0) continue;
    if (code >= kOut) {
      const size_t i = static_cast<size_t>(code - kOut);
      TORCH_CHECK(i < out.size(), name, ": bwd_args names output ", i, " of ", out.size());
      node->save(out[i], std::binary_search(diff.begin(), diff.end(), static_cast<long>(i)));
    } else {
      TORCH_CHECK(static_cast<size_t>(code) < in.size(), name, ": bwd_args names input ", code, " of ", in.size());
      node->save(in[static_cast<size_t>(code)], false);
    }
  }
  if (!public_out) return wrap(&out);
  if (PyLong_Check(public_out)) {
    const Py_ssize_t i = PyLong_AsSsize_t(public_out);
    if (i == -1 && PyErr_Occurred()) return nullptr;
    return wrap_one(&out, i);
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(public_out);
  PyObject* result = PyTuple_New(n);
  if (!result) return nullptr;
  for (Py_ssize_t k = 0; k < n; ++k) {
    const Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(public_out, k));
    PyObject* o = i == -1 && PyErr_Occurred() ? nullptr : wrap_one(&out, i);
    if (!o) {
      Py_DECREF(result);
      return nullptr;
    }
    PyTuple_SET_ITEM(result, k, o);
  }
  return result;
  END_HANDLE_TH_ERRORS
}

// noop_grad(inputs): the floor a kspec step's host time is read against (tools/bench/selective_scan_host.py): one
// output like inputs[0], recorded with a C++ node (as call_grad's) whose backward allocates a gradient like each
// input that wants one and runs nothing. torch's engine, allocator and a C++ node without kspec: what remains of
// call_grad's step above it is kspec's (validation, the plan, launches, saved tensors).
class NoopBackward final : public torch::autograd::Node {
 public:
  explicit NoopBackward(const std::vector<at::Tensor>& in) {
    like_.reserve(in.size());
    for (const auto& t : in) like_.push_back(t.defined() ? t.options() : at::TensorOptions());
    shapes_.reserve(in.size());
    for (const auto& t : in) shapes_.emplace_back(t.defined() ? t.sizes() : at::IntArrayRef{});
  }
  std::string name() const override { return "NoopBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&&) override {
    torch::autograd::variable_list result(like_.size());
    for (size_t i = 0; i < like_.size(); ++i)
      if (should_compute_output(i)) result[i] = at::empty(shapes_[i], like_[i]);
    return result;
  }

 private:
  std::vector<at::TensorOptions> like_;
  std::vector<at::DimVector> shapes_;
};

// Bad arguments are refused as TypeErrors set here, before any C++ object or exception (run 36, torch 2.11 and
// Python 3.12: the refusals thrown as c10::Error from this METH_O function crashed the process).
PyObject* py_noop_grad(PyObject*, PyObject* seq) {
  if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) == 0 || !THPVariable_Check(PyTuple_GET_ITEM(seq, 0))) {
    PyErr_SetString(PyExc_TypeError, "noop_grad(inputs): a non-empty tuple of tensors (None allowed after the first)");
    return nullptr;
  }
  for (Py_ssize_t i = 1; i < PyTuple_GET_SIZE(seq); ++i) {
    PyObject* o = PyTuple_GET_ITEM(seq, i);
    if (o != Py_None && !THPVariable_Check(o)) {
      PyErr_Format(PyExc_TypeError, "noop_grad: input %zd is neither a tensor nor None", i);
      return nullptr;
    }
  }
  HANDLE_TH_ERRORS
  std::vector<at::Tensor> in(static_cast<size_t>(PyTuple_GET_SIZE(seq)));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); ++i) {
    PyObject* o = PyTuple_GET_ITEM(seq, i);
    if (o != Py_None) in[static_cast<size_t>(i)] = THPVariable_Unpack(o);
  }
  auto node = make_node<NoopBackward>(in);
  node->set_next_edges(torch::autograd::collect_next_edges(in));
  at::Tensor out = at::empty(in[0].sizes(), in[0].options());
  torch::autograd::set_history(out, node);
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// init(capsule): takes kspec._C's C ABI (kspec._C._ext_api).
PyObject* py_init(PyObject*, PyObject* capsule) {
  auto* api = static_cast<const kspec_ext::Api*>(PyCapsule_GetPointer(capsule, "kspec._C._ext_api"));
  if (!api) return nullptr;
  if (api->version != kspec_ext::kApiVersion) {
    PyErr_Format(PyExc_ImportError, "kspec._torch_ext: kspec._C offers C ABI version %d, the extension needs %d",
                 api->version, kspec_ext::kApiVersion);
    return nullptr;
  }
  g_api = api;
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"init", py_init, METH_O, "init(kspec._C._ext_api): connect to kspec's registry"},
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_call)), METH_FASTCALL,
     "call(op, inputs, out, params): kspec.call for torch tensors, or NotImplemented"},
    {"call_some", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_call_some)), METH_FASTCALL,
     "call_some(op, inputs, out, params): call with the outputs that are None in `out` allocated"},
    {"kspec_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_kspec_call)),
     METH_FASTCALL | METH_KEYWORDS,
     "kspec_call(op, /, *inputs, config=None, out=None, **params)\n--\n\n"
     "kspec.call where the torch extension is loaded: one C++ call for torch tensors, kspec._core._call_python "
     "for the rest"},
    {"set_call_fallback", py_set_call_fallback, METH_O, "set_call_fallback(fn): what kspec_call declines goes to fn"},
    {"define", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_define)), METH_FASTCALL,
     "define(ns, op, schema, module): a dispatcher op running registry op `op`"},
    {"noop_grad", py_noop_grad, METH_O,
     "noop_grad(inputs): an output like inputs[0] whose C++ node allocates the gradients and runs nothing (a floor)"},
    {"call_grad", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_call_grad)), METH_FASTCALL,
     "call_grad(name, fwd_op, bwd_op, inputs, params, bwd_params, bwd_args, grad_of[, public[, sized]]): the "
     "forward op's outputs (those `public` names) with a C++ autograd node running the backward op"},
    {"record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_record)), METH_FASTCALL,
     "record(name, backward, ctx, materialize, inputs, outputs, diff, saved): a C++ autograd node"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_torch_ext", "kspec's torch C++ extension", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__torch_ext() {
  return PyModule_Create(&kModule);
}
