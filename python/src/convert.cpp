// kspec._C's conversions from Python: tensor descriptors (the tuples python/kspec/_tensors.py builds),
// params dicts, compile requests, and DLPack capsules read into descriptors. Every bad value is an
// InvalidArgument naming the argument.
#include <cstddef>
#include <cstdint>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kspec/kspec.h"
#include "python/src/bindings.h"

namespace py = pybind11;

namespace kspec_py {
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

}  // namespace

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

namespace {

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

}  // namespace

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


namespace {

// The DLPack ABI as dlpack.h v1.0 defines it (no package kspec's set-up can install ships a v1 header:
// Debian's libdlpack-dev is 0.6). Both capsules a producer may return are read: "dltensor" (a
// DLManagedTensor, every version) and "dltensor_versioned" (a DLManagedTensorVersioned, v1.0+, asked for
// with __dlpack__(max_version=(1, 0)), which adds the version and the read-only flag).
struct DLDevice { int32_t device_type; int32_t device_id; };
struct DLDataType { uint8_t code; uint8_t bits; uint16_t lanes; };
struct DLTensor {
  void* data; DLDevice device; int32_t ndim; DLDataType dtype; int64_t* shape; int64_t* strides; uint64_t byte_offset;
};
struct DLManagedTensor { DLTensor dl_tensor; void* manager_ctx; void (*deleter)(DLManagedTensor*); };
struct DLPackVersion { uint32_t major; uint32_t minor; };
struct DLManagedTensorVersioned {
  DLPackVersion version; void* manager_ctx; void (*deleter)(DLManagedTensorVersioned*); uint64_t flags; DLTensor dl_tensor;
};
// dlpack.h's layout on LP64, which producers compiled from the real header use.
static_assert(sizeof(DLTensor) == 48 && offsetof(DLTensor, shape) == 24 && offsetof(DLTensor, byte_offset) == 40);
static_assert(sizeof(DLManagedTensor) == 64 && offsetof(DLManagedTensorVersioned, dl_tensor) == 32);
constexpr uint32_t kDLPackMajor = 1;
constexpr uint64_t kDLPackFlagReadOnly = 1ull << 0;

// The device types kspec reads (dlpack.h's DLDeviceType): CUDA memory is taken; pageable host memory
// is described as such for validation to refuse by the argument's name; pinned host memory is refused
// here (a kernel could read it over PCIe, silently and slowly: the caller should copy it to the GPU).
constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;

}  // namespace

// A capsule comes from any object's __dlpack__(): every field is checked before anything is read
// through a pointer, and a capsule that fails is left as it came (its producer's deleter frees it).
py::tuple dlpack_describe(const py::handle& obj) {
  using kspec::InvalidArgument;
  if (!PyCapsule_CheckExact(obj.ptr()))
    throw InvalidArgument("DLPack: __dlpack__() returned a " + type_name(obj) +
                          ", expected a 'dltensor' or 'dltensor_versioned' capsule");
  const char* name = PyCapsule_GetName(obj.ptr());
  std::string cap_name = name ? name : "";
  if (cap_name == "used_dltensor" || cap_name == "used_dltensor_versioned")
    throw InvalidArgument("DLPack: the capsule was already consumed ('" + cap_name + "')");
  if (cap_name != "dltensor" && cap_name != "dltensor_versioned")
    throw InvalidArgument("DLPack: expected a capsule named 'dltensor' or 'dltensor_versioned', got '" + cap_name + "'");
  void* raw = PyCapsule_GetPointer(obj.ptr(), cap_name.c_str());
  if (!raw) {
    PyErr_Clear();
    throw InvalidArgument("DLPack: the '" + cap_name + "' capsule holds a null pointer");
  }
  bool read_only = false;
  const DLTensor* tp = nullptr;
  if (cap_name == "dltensor_versioned") {
    auto* mv = static_cast<DLManagedTensorVersioned*>(raw);
    // A different major version may lay the struct out differently: nothing past `version` is read.
    if (mv->version.major != kDLPackMajor)
      throw InvalidArgument("DLPack: the capsule is version " + std::to_string(mv->version.major) + "." +
                            std::to_string(mv->version.minor) + "; kspec reads major version " +
                            std::to_string(kDLPackMajor));
    read_only = (mv->flags & kDLPackFlagReadOnly) != 0;
    tp = &mv->dl_tensor;
  } else {
    tp = &static_cast<DLManagedTensor*>(raw)->dl_tensor;
  }
  const DLTensor& t = *tp;
  int device = kspec::kCpuDevice;
  switch (t.device.device_type) {
    case kDLCUDA:
    case kDLCUDAManaged:
      if (t.device.device_id < 0)
        throw InvalidArgument("DLPack: negative CUDA device id " + std::to_string(t.device.device_id));
      device = t.device.device_id;
      break;
    case kDLCPU: break;
    case kDLCUDAHost:
      throw InvalidArgument("DLPack: pinned host memory (kDLCUDAHost) is not GPU memory; copy the tensor to the "
                            "GPU first (kspec takes kDLCUDA = 2 and kDLCUDAManaged = 13)");
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
  if (read_only) return py::make_tuple(ptr, dt, shape, strides, device, true);  // refused as an output
  return py::make_tuple(ptr, dt, shape, strides, device);
}

}  // namespace kspec_py
