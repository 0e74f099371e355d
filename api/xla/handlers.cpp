// The XLA FFI handlers (XLA's typed FFI API): each converts its operands, results and attributes into
// kspec::call of one op — the registry call C++ and Python make (validation, plan cache, tuning database):
// no op is implemented twice. Built only with XLA's FFI headers (jax.ffi.include_dir(); see xla.cmake).
//
// Compilation happens before execution: each target has an initialize-stage handler beside its execute
// handler. XLA runs it before the execution (and before any command buffer records one), with the
// buffers' shapes and addresses but not their contents; it validates the call and builds its plan —
// kernels compiled (NVRTC, or the disk cache) and loaded — without launching (prepare_call), so the
// execute stage finds the plan cached. The instantiate stage cannot: it sees attributes but no buffers,
// and kspec's specializations depend on shapes (hidden, dstate, n). XLA runs the initialize stage before
// every execution, so both stages find the call's conversion (a Binding) cached and do no parsing, string
// building or allocation of their own. No handler declares XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE
// (adamw's bound call is rebuilt when its buffers move, which a recorded command buffer would not see), so
// XLA runs every execution as an ordinary thunk.
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <string_view>
#include <vector>

#include "api/src/c_abi.h"
#include "api/src/plan.h"
#include "api/xla/targets.h"
#include "jit/driver.h"
#include "jit/handles.h"
#include "kspec/error.h"
#include "kspec/kspec_xla.h"
#include "kspec/registry.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = ::xla::ffi;

namespace kspec::xla {
namespace {

std::vector<std::string> split_names(std::string_view s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string_view::npos) end = s.size();
    std::string_view part = s.substr(start, end - start);
    while (!part.empty() && part.front() == ' ') part.remove_prefix(1);
    while (!part.empty() && part.back() == ' ') part.remove_suffix(1);
    if (!part.empty()) out.emplace_back(part);
    start = end + 1;
  }
  return out;
}

DType dtype_of(ffi::DataType t, const std::string& what) {
  switch (t) {
    case ffi::DataType::F32: return DType::f32;
    case ffi::DataType::F16: return DType::f16;
    case ffi::DataType::BF16: return DType::bf16;
    case ffi::DataType::F64: return DType::f64;
    case ffi::DataType::S32: return DType::i32;
    case ffi::DataType::S64: return DType::i64;
    case ffi::DataType::U8: return DType::u8;
    default: break;
  }
  throw InvalidArgument(detail::concat(what, ": XLA element type ", int(t), " has no kspec dtype (f32, f16, bf16, f64, s32, s64, u8)"));
}

int index_of(const std::vector<TensorDef>& defs, const std::string& name) {
  for (size_t i = 0; i < defs.size(); ++i)
    if (defs[i].name == name) return int(i);
  return -1;
}

// An output's present_with rule: the named input is given, or the named bool param is true (as given,
// else its default).
bool present_with(const OpInfo& op, const TensorDef& out, const std::vector<TensorView>& ins, const Params& params) {
  const int i = index_of(op.inputs, out.present_with);
  if (i >= 0) return ins[size_t(i)].defined();
  for (const auto& p : op.params) {
    if (p.name != out.present_with) continue;
    auto given = params.find(p.name);
    const ParamValue& v = given ? *given : p.default_value;
    return std::holds_alternative<bool>(v) && std::get<bool>(v);
  }
  return true;
}

const ParamDef* param_def(const OpInfo& op, std::string_view name) {
  for (const auto& p : op.params)
    if (p.name == name) return &p;
  return nullptr;
}

std::string known_names(const OpInfo& op, const Target& t) {
  std::string s = std::string(kInputsAttr) + ", " + kOutputsAttr;
  if (t.scan_layout) s += std::string(", ") + kLayoutAttr;
  for (const auto& d : op.inputs)
    if (d.list) {
      s += std::string(", ") + kTensorsAttr;
      break;
    }
  for (const auto& p : op.params) s += ", " + p.name;
  return s;
}

// By name: this XLA's Dictionary::get(Iterator) does not compile for every T.
template <typename T>
T attr(const ffi::Dictionary& attrs, const ffi::Dictionary::Iterator& it) {
  auto v = attrs.get<T>(*it);
  if (!v.has_value()) throw InvalidArgument(v.error().message());
  return v.value();
}

// The attributes: kspec's params by their schema types, and the target's own (inputs, outputs, layout, tensors).
struct Attrs {
  Params params;
  std::vector<std::string> inputs, outputs;
  bool given_inputs = false, given_outputs = false;
  bool bld = false;
  int64_t tensors = -1;
};

Attrs read_attrs(const Target& t, const OpInfo& op, const ffi::Dictionary& attrs) {
  Attrs a;
  for (auto it = attrs.begin(); it != attrs.end(); ++it) {
    const std::string name(*it);
    const std::string what = detail::concat("attribute '", name, "'");
    if (name == kInputsAttr || name == kOutputsAttr || name == kLayoutAttr) {
      KSPEC_CHECK(attrs.isa<std::string_view>(it), what, ": expected a string");
      const std::string_view v = attr<std::string_view>(attrs, it);
      if (name == kInputsAttr) {
        a.inputs = split_names(v);
        a.given_inputs = true;
      } else if (name == kOutputsAttr) {
        a.outputs = split_names(v);
        a.given_outputs = true;
      } else {
        KSPEC_CHECK(t.scan_layout, what, ": ", t.name, " takes no layout");
        KSPEC_CHECK(v == "bdl" || v == "bld", what, ": expected \"bdl\" or \"bld\", got \"", v, "\"");
        a.bld = v == "bld";
        a.params.set(name, std::string(v));  // the op's own layout param: its kernels read bld in place
      }
      continue;
    }
    if (name == kTensorsAttr) {
      KSPEC_CHECK(attrs.isa<int64_t>(it) || attrs.isa<int32_t>(it), what, ": expected an integer");
      a.tensors = attrs.isa<int64_t>(it) ? attr<int64_t>(attrs, it) : attr<int32_t>(attrs, it);
      KSPEC_CHECK(a.tensors >= 0, what, ": expected >= 0, got ", a.tensors);
      continue;
    }
    const ParamDef* p = param_def(op, name);
    KSPEC_CHECK(p, t.name, ": unknown ", what, " (attributes: ", known_names(op, t), ")");
    switch (p->type) {
      case ParamType::Int:
        if (attrs.isa<int64_t>(it)) a.params.set(name, attr<int64_t>(attrs, it));
        else if (attrs.isa<int32_t>(it)) a.params.set(name, int64_t(attr<int32_t>(attrs, it)));
        else throw InvalidArgument(detail::concat(t.name, ": ", what, ": expected an integer (i64 or i32)"));
        break;
      case ParamType::Float:
        if (attrs.isa<double>(it)) a.params.set(name, attr<double>(attrs, it));
        else if (attrs.isa<float>(it)) a.params.set(name, double(attr<float>(attrs, it)));
        else if (attrs.isa<int64_t>(it)) a.params.set(name, double(attr<int64_t>(attrs, it)));
        else throw InvalidArgument(detail::concat(t.name, ": ", what, ": expected a float (f64 or f32)"));
        break;
      case ParamType::Bool:
        if (attrs.isa<bool>(it)) a.params.set(name, attr<bool>(attrs, it));
        else if (attrs.isa<int64_t>(it)) a.params.set(name, attr<int64_t>(attrs, it) != 0);
        else throw InvalidArgument(detail::concat(t.name, ": ", what, ": expected a bool (i1)"));
        break;
      case ParamType::Choice:
        KSPEC_CHECK(attrs.isa<std::string_view>(it), t.name, ": ", what, ": expected a string");
        a.params.set(name, std::string(attr<std::string_view>(attrs, it)));
        break;
    }
  }
  return a;
}

// A buffer as kspec's view. XLA's buffers are dense row-major (kspec.jax asks for no other operand layouts,
// EXLA cannot). With layout "bld" the scan's sequence tensors arrive as [batch, seqlen, dim] and a variable
// B/C as [batch, seqlen, (groups,) dstate]: the view is the op's [batch, dim, seqlen] / [batch, groups,
// dstate, seqlen] over that memory (seqlen's stride dim, the op's own layout "bld"), so the time-major
// kernels read and write the buffers where they lie and XLA adds no transpose around the call.
TensorView view_of(const ffi::AnyBuffer& b, const TensorDef& def, bool bld, int device, const std::string& what) {
  TensorView v;
  v.data = b.untyped_data();
  v.dtype = dtype_of(b.element_type(), what);
  v.device = device;
  const auto dims = b.dimensions();
  std::vector<int64_t> shape(dims.begin(), dims.end());
  const bool seq = def.shape == std::vector<std::string>{"batch", "dim", "seqlen"};
  const bool bc = def.shape == std::vector<std::string>{"batch", "groups", "dstate", "seqlen"};
  if (bc && shape.size() == 3) shape.insert(shape.begin() + (bld ? 2 : 1), 1);  // one group, where it lies
  KSPEC_CHECK(shape.size() <= size_t(kMaxRank), what, ": rank ", shape.size(), " exceeds ", kMaxRank);
  v.rank = int(shape.size());
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {  // row-major strides of the buffer as it lies
    v.shape[d] = shape[size_t(d)];
    v.strides[d] = stride;
    stride *= shape[size_t(d)] > 0 ? shape[size_t(d)] : 1;
  }
  // bld: [batch, seqlen, rest...] memory viewed as [batch, rest..., seqlen] (seqlen's axis moved last).
  if (bld && ((seq && v.rank == 3) || (bc && v.rank == 4))) {
    const int64_t len = v.shape[1], len_stride = v.strides[1];
    for (int d = 1; d + 1 < v.rank; ++d) {
      v.shape[d] = v.shape[d + 1];
      v.strides[d] = v.strides[d + 1];
    }
    v.shape[v.rank - 1] = len;
    v.strides[v.rank - 1] = len_stride;
  }
  return v;
}

// A custom call converted once: which operand is which input (or list item), which result which output
// (or which operand it aliases), the params, and views with the buffers' dtypes and shapes (their data set
// per execution). Built the first time a signature (target, device, attributes, operands' and results'
// dtypes and shapes: `signature`) is seen; later executions only fill in pointers.
struct Binding {
  struct Operand {
    int input = -1;     // index in op.inputs
    int list = -1;      // a list input's index in `lists`, else -1
    int64_t item = -1;  // and the item
  };
  struct Result {
    int output = -1;   // index in op.outputs, or -1 for an input updated in place...
    int operand = -1;  // ...whose operand's buffer it must be
  };
  std::vector<uint64_t> sig;  // its signature's words (see signature)
  const Target* target = nullptr;
  const OpInfo* op = nullptr;
  Params params;
  std::vector<Operand> operands;
  std::vector<Result> results;
  std::vector<TensorView> ins, outs;            // list inputs point into `lists`
  std::vector<std::vector<TensorView>> lists;
  bool has_list = false;
  bool prepared = false;  // its initialize stage ran (plan built, kernels loaded)

  // List ops (adamw): kspec::call validates every item of every list each call (its call cache takes no
  // lists) and uploads the tensor table each step, so an execution runs a BoundCall instead, bound to
  // the list operands' addresses. Donated, aliased buffers keep theirs step after step; gradients made by
  // another jitted function tend to come back at one of a few (XLA's allocator reuses freed blocks), so
  // the last kBoundPerBinding bound calls are kept. A binding that has bound kMaxBinds calls and still
  // meets new addresses goes back to kspec::call (validation and the table's upload on every call).
  struct Bound {
    std::vector<const void*> ptrs;  // the list operands' addresses it was built with
    std::unique_ptr<BoundCall> call;
    uint64_t used = 0;              // the `clock` of its last run
  };
  // A list op's other operands (adamw's device_lr, device_step, grad_scale: one-element scalars that XLA
  // computes into temporaries, or a jit argument, at an address that changes from one execution to the
  // next) are copied on the stream into `slots`, the binding's own device memory, before a bound call
  // runs, and every bound call reads them there: a new scalar address then needs no new bound call.
  struct Slot {
    size_t operand = 0;  // index in `operands`
    size_t offset = 0;   // in `slots`
    size_t bytes = 0;
  };
  std::vector<Slot> slot_of;
  jit::DeviceBuffer slots;   // allocated with the first bound call
  Stream slot_stream = nullptr;  // the stream of the last copy into them
  bool slot_copied = false;
  std::mutex mu;
  std::vector<Bound> bound;
  std::vector<std::unique_ptr<BoundCall>> retired;  // evicted, possibly still running: freed once idle
  uint64_t clock = 0;
  int binds = 0;
};

constexpr size_t kBoundPerBinding = 4;
constexpr int kMaxBinds = 16;
constexpr size_t kMaxBindings = 4096;  // a process that sweeps shapes converts the rest on every call

std::unique_ptr<Binding> make_binding(const Target& t, int device, const ffi::RemainingArgs& args,
                                      const ffi::RemainingRets& rets, const ffi::Dictionary& dict) {
  auto bp = std::make_unique<Binding>();
  Binding& b = *bp;
  b.target = &t;
  b.op = &op_info(t.op);
  const OpInfo& op = *b.op;
  Attrs a = read_attrs(t, op, dict);
  b.params = std::move(a.params);
  if (!a.given_inputs)
    for (const auto& d : op.inputs)
      if (!d.optional) a.inputs.push_back(d.name);

  b.ins.resize(op.inputs.size());
  b.lists.reserve(op.inputs.size());
  size_t next = 0;
  auto operand = [&](const std::string& what) {
    KSPEC_CHECK(next < args.size(), t.name, ": ", what, ": expected an operand, but only ", args.size(),
                " were given (inputs=\"", [&] { std::string s; for (auto& n : a.inputs) s += (s.empty() ? "" : ",") + n; return s; }(), "\")");
    auto buf = args.get<ffi::AnyBuffer>(next++);
    if (!buf.has_value()) throw InvalidArgument(detail::concat(t.name, ": ", what, ": ", buf.error().message()));
    return buf.value();
  };
  for (const auto& name : a.inputs) {
    const int i = index_of(op.inputs, name);
    if (i < 0) {
      const ParamDef* p = param_def(op, name);
      KSPEC_CHECK(p && p->runtime, t.name, ": inputs names '", name, "', which is neither an input of ", t.op,
                  " nor a runtime param");
      // Reading it would make the handler wait for its stream; the op reads its device scalars itself.
      const std::string device_input = "device_" + name;
      throw InvalidArgument(detail::concat(
          t.name, ": runtime param '", name, "' cannot be an operand (the handler would wait on the stream to read it); ",
          index_of(op.inputs, device_input) >= 0 ? "pass it as the one-element f32 input '" + device_input + "'"
                                                 : "pass it as the attribute '" + name + "'"));
    }
    const TensorDef& def = op.inputs[size_t(i)];
    KSPEC_CHECK(!b.ins[size_t(i)].defined(), t.name, ": input '", name, "' is named twice in inputs");
    if (def.list) {
      KSPEC_CHECK(a.tensors >= 0, t.name, ": list input '", name, "' needs the attribute '", kTensorsAttr, "'");
      b.has_list = true;
      b.lists.emplace_back();
      for (int64_t k = 0; k < a.tensors; ++k) {
        const std::string what = detail::concat("input '", name, "' item ", k);
        b.lists.back().push_back(view_of(operand(what), def, a.bld, device, what));
        b.operands.push_back({i, int(b.lists.size() - 1), k});
      }
      b.ins[size_t(i)] = TensorView::list(b.lists.back().data(), a.tensors);
    } else {
      b.ins[size_t(i)] = view_of(operand("input '" + name + "'"), def, a.bld, device, "input '" + name + "'");
      b.operands.push_back({i, -1, -1});
    }
  }
  KSPEC_CHECK(next == args.size(), t.name, ": ", args.size(), " operands given, but inputs names ", next);
  if (b.has_list) {
    size_t offset = 0;
    for (size_t j = 0; j < b.operands.size(); ++j) {
      if (b.operands[j].list >= 0) continue;
      const TensorView& v = b.ins[size_t(b.operands[j].input)];
      const size_t bytes = size_t(v.numel()) * size_t(dtype_size(v.dtype));
      b.slot_of.push_back({j, offset, bytes});
      offset += (bytes + 255) / 256 * 256;  // each as aligned as cuMemAlloc's own
    }
  }

  if (!a.given_outputs)
    for (const auto& d : op.outputs)
      if (d.present_with.empty() ? !d.optional : present_with(op, d, b.ins, b.params)) a.outputs.push_back(d.name);
  b.outs.resize(op.outputs.size());
  size_t r = 0;
  auto result = [&](const std::string& what) {
    KSPEC_CHECK(r < rets.size(), t.name, ": ", what, ": expected a result, but only ", rets.size(), " exist");
    auto buf = rets.get<ffi::AnyBuffer>(r++);
    if (!buf.has_value()) throw InvalidArgument(detail::concat(t.name, ": ", what, ": ", buf.error().message()));
    return *buf.value();
  };
  for (const auto& name : a.outputs) {
    const int o = index_of(op.outputs, name);
    if (o >= 0) {
      b.outs[size_t(o)] = view_of(result("output '" + name + "'"), op.outputs[size_t(o)], a.bld, device, "output '" + name + "'");
      b.results.push_back({o, -1});
      continue;
    }
    // An input updated in place: XLA gives its result the operand's buffer (input_output_aliases).
    const int i = index_of(op.inputs, name);
    KSPEC_CHECK(i >= 0 && b.ins[size_t(i)].defined(), t.name, ": outputs names '", name,
                "', which is neither an output of ", t.op, " nor a given input");
    const TensorView& in = b.ins[size_t(i)];
    const int64_t n = in.is_list() ? in.list_size() : 1;
    for (int64_t k = 0; k < n; ++k) {
      const std::string what = detail::concat("result '", name, "'", in.is_list() ? detail::concat(" item ", k) : "");
      const void* want = in.is_list() ? in.item(k).data : in.data;
      KSPEC_CHECK(result(what).untyped_data() == want, t.name, ": ", what,
                  " must be its operand's buffer (alias it with input_output_aliases)");
      int j = 0;  // its operand (there is one: the input is given)
      while (b.operands[size_t(j)].input != i || b.operands[size_t(j)].item != (in.is_list() ? k : -1)) ++j;
      b.results.push_back({-1, j});
    }
  }
  KSPEC_CHECK(r == rets.size(), t.name, ": ", rets.size(), " results, but outputs names ", r);
  return bp;
}

// A scalar attribute's bytes (XLA_FFI_Scalar's dtype), 0 for a type no target takes.
size_t scalar_bytes(XLA_FFI_DataType t) {
  switch (t) {
    case XLA_FFI_DataType_PRED: case XLA_FFI_DataType_S8: case XLA_FFI_DataType_U8: return 1;
    case XLA_FFI_DataType_S16: case XLA_FFI_DataType_U16: case XLA_FFI_DataType_F16: case XLA_FFI_DataType_BF16: return 2;
    case XLA_FFI_DataType_S32: case XLA_FFI_DataType_U32: case XLA_FFI_DataType_F32: return 4;
    case XLA_FFI_DataType_S64: case XLA_FFI_DataType_U64: case XLA_FFI_DataType_F64: return 8;
    default: return 0;
  }
}

const XLA_FFI_Buffer* arg_buffer(const XLA_FFI_CallFrame& f, size_t i) {
  return f.args.types[i] == XLA_FFI_ArgType_BUFFER ? static_cast<const XLA_FFI_Buffer*>(f.args.args[i]) : nullptr;
}

const XLA_FFI_Buffer* ret_buffer(const XLA_FFI_CallFrame& f, size_t i) {
  return f.rets.types[i] == XLA_FFI_RetType_BUFFER ? static_cast<const XLA_FFI_Buffer*>(f.rets.rets[i]) : nullptr;
}

// A custom call's signature: everything a Binding is made from except the buffers' addresses (the target,
// the device, every attribute's name, type and value, every operand's and result's dtype and shape) as a
// stream of 64-bit words handed to `word` (which returns false to stop early; signature then returns
// false). Hashed to find a binding, compared with the binding's copy to confirm it, copied once when one is
// made: no string is built, nothing allocated. Read from XLA's call frame as it lies (the C API's arrays,
// attribute by index): the typed API's Dictionary::get(name) searched the names for every attribute, which
// with the buffers' decoding was ~2.9K host instructions a stage for norm_act's 6 attributes and 4 buffers
// (mock driver, callgrind), twice an execution. An attribute of a type no target takes (arrays,
// dictionaries, other scalars) goes in by name only: make_binding refuses it, so no binding is ever found
// for such a call.
template <typename Word>
bool signature(const Target& t, int32_t device, const XLA_FFI_CallFrame& f, Word&& word) {
  auto bytes = [&](const XLA_FFI_ByteSpan& v) {  // the length, then 8 bytes a word
    if (!word(v.len)) return false;
    for (size_t i = 0; i < v.len; i += 8) {
      uint64_t w = 0;
      std::memcpy(&w, v.ptr + i, std::min<size_t>(8, v.len - i));
      if (!word(w)) return false;
    }
    return true;
  };
  auto buffer = [&](const XLA_FFI_Buffer* b) {
    if (!b) return word(~uint64_t(0));
    if (!word(uint64_t(b->dtype) << 8 | uint64_t(b->rank))) return false;
    for (int64_t d = 0; d < b->rank; ++d)
      if (!word(uint64_t(b->dims[d]))) return false;
    return true;
  };
  const XLA_FFI_Attrs& attrs = f.attrs;
  if (!word(reinterpret_cast<uintptr_t>(&t)) || !word(uint64_t(uint32_t(device))) || !word(uint64_t(attrs.size)))
    return false;
  for (int64_t i = 0; i < attrs.size; ++i) {
    if (!bytes(*attrs.names[i])) return false;
    bool ok;
    if (attrs.types[i] == XLA_FFI_AttrType_STRING) {
      ok = word('s') && bytes(*static_cast<const XLA_FFI_ByteSpan*>(attrs.attrs[i]));
    } else if (attrs.types[i] == XLA_FFI_AttrType_SCALAR) {
      const auto* v = static_cast<const XLA_FFI_Scalar*>(attrs.attrs[i]);
      uint64_t bits = 0;
      const size_t n = scalar_bytes(v->dtype);
      std::memcpy(&bits, v->value, n);
      ok = n ? word('n' | uint64_t(v->dtype) << 8) && word(bits) : word('?');
    } else {
      ok = word('?');
    }
    if (!ok) return false;
  }
  if (!word(uint64_t(f.args.size))) return false;
  for (int64_t i = 0; i < f.args.size; ++i)
    if (!buffer(arg_buffer(f, size_t(i)))) return false;
  if (!word(uint64_t(f.rets.size))) return false;
  for (int64_t i = 0; i < f.rets.size; ++i)
    if (!buffer(ret_buffer(f, size_t(i)))) return false;
  return true;
}

uint64_t signature_hash(const Target& t, int32_t device, const XLA_FFI_CallFrame& f) {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  signature(t, device, f, [&](uint64_t w) {
    h = (h ^ w) * 0xff51afd7ed558ccdull;  // a multiply-xorshift step per word
    h ^= h >> 32;
    return true;
  });
  return h;
}

// Whether this call's signature is the binding's, word for word.
bool same_signature(const Binding& b, const Target& t, int32_t device, const XLA_FFI_CallFrame& f) {
  size_t i = 0;
  return signature(t, device, f, [&](uint64_t w) { return i < b.sig.size() && b.sig[i++] == w; }) &&
         i == b.sig.size();
}

// The binding of this call: the one this handler last ran if the signature is still its own (a jitted
// step repeats its calls), else found by the signature's hash and confirmed, else made (and kept while
// there is room). Never freed: an entry's bound call may still be running at exit, and plans (which it
// points to) are never freed either. `owned` holds one that did not fit (never made `last`).
Binding& binding_for(const Target& t, int32_t device, const XLA_FFI_CallFrame& f, std::atomic<Binding*>& last,
                     std::unique_ptr<Binding>& owned) {
  if (Binding* b = last.load(std::memory_order_acquire); b && same_signature(*b, t, device, f)) return *b;
  static std::shared_mutex mu;
  static auto& cache = *new std::unordered_multimap<uint64_t, std::unique_ptr<Binding>>();
  const uint64_t hash = signature_hash(t, device, f);
  auto find = [&]() -> Binding* {
    auto [lo, hi] = cache.equal_range(hash);
    for (auto it = lo; it != hi; ++it)
      if (same_signature(*it->second, t, device, f)) return it->second.get();
    return nullptr;
  };
  {
    std::shared_lock<std::shared_mutex> lock(mu);
    if (Binding* b = find()) {
      last.store(b, std::memory_order_release);
      return *b;
    }
  }
  // The typed API's views of the frame (its public constructors): the conversion runs once per signature.
  std::unique_ptr<Binding> b = make_binding(t, device, ffi::RemainingArgs(&f.args, 0), ffi::RemainingRets(&f.rets, 0),
                                            ffi::Dictionary(&f.attrs));
  signature(t, device, f, [&](uint64_t w) {
    b->sig.push_back(w);
    return true;
  });
  std::unique_lock<std::shared_mutex> lock(mu);
  if (Binding* made = find()) return *made;  // another thread made it first
  if (cache.size() >= kMaxBindings) {
    owned = std::move(b);
    return *owned;
  }
  Binding& kept = *b;
  cache.emplace(hash, std::move(b));
  last.store(&kept, std::memory_order_release);
  return kept;
}

// Operand i's address (a buffer: the binding was made from this signature, which make_binding checked).
void* operand_data(const XLA_FFI_CallFrame& f, size_t i) { return arg_buffer(f, i)->data; }

// The results' buffers into `outs` (a copy of the binding's), each aliased one checked against its operand.
void fill_results(const Binding& b, const XLA_FFI_CallFrame& f, std::vector<TensorView>& outs) {
  for (size_t r = 0; r < b.results.size(); ++r) {
    void* data = ret_buffer(f, r)->data;
    const Binding::Result& res = b.results[r];
    if (res.output >= 0) {
      outs[size_t(res.output)].data = data;
      continue;
    }
    KSPEC_CHECK(data == operand_data(f, size_t(res.operand)), b.target->name, ": result ", r,
                " must be its operand's buffer (alias it with input_output_aliases)");
  }
}

// The binding's input views at this call's addresses, list items included (their own copies: the
// binding's views are shared by the threads that run it).
struct Views {
  std::vector<TensorView> ins;
  std::vector<std::vector<TensorView>> lists;
};

Views views_at(const Binding& b, const XLA_FFI_CallFrame& f) {
  Views v{b.ins, b.lists};
  for (size_t j = 0; j < b.operands.size(); ++j) {
    const Binding::Operand& o = b.operands[j];
    void* data = operand_data(f, j);
    if (o.list >= 0) v.lists[size_t(o.list)][size_t(o.item)].data = data;
    else v.ins[size_t(o.input)].data = data;
  }
  for (size_t j = 0; j < b.operands.size(); ++j) {
    const Binding::Operand& o = b.operands[j];
    if (o.list >= 0 && o.item == 0) v.ins[size_t(o.input)] = TensorView::list(v.lists[size_t(o.list)].data(), int64_t(v.lists[size_t(o.list)].size()));
  }
  return v;
}

// The list operands' addresses (what picks a bound call; see Binding).
void list_ptrs(const Binding& b, const XLA_FFI_CallFrame& f, std::vector<const void*>& ptrs) {
  ptrs.clear();
  for (size_t j = 0; j < b.operands.size(); ++j)
    if (b.operands[j].list >= 0) ptrs.push_back(operand_data(f, j));
}

// This execution's other operands into the binding's slots, on the stream (see Binding::Slot). A bound
// call that last ran on another stream may still be reading them: that stream is waited for first
// (XLA runs a device's executions on one compute stream, so this does not happen step after step).
void copy_slots(Binding& b, Stream stream, const XLA_FFI_CallFrame& f) {
  if (b.slot_copied && b.slot_stream != stream)
    CU_CHECK(cuStreamSynchronize(reinterpret_cast<CUstream>(b.slot_stream)));
  for (const Binding::Slot& s : b.slot_of)
    CU_CHECK(cuMemcpyDtoDAsync(b.slots.ptr + s.offset, reinterpret_cast<CUdeviceptr>(operand_data(f, s.operand)),
                               s.bytes, reinterpret_cast<CUstream>(stream)));
  b.slot_stream = stream;
  b.slot_copied = true;
}

// A list op's execution (see Binding): the bound call made for these list operands' addresses, else a
// new one, else (after kMaxBinds) kspec::call.
void run_list_op(Binding& b, int device, Stream stream, const XLA_FFI_CallFrame& f) {
  std::lock_guard<std::mutex> lock(b.mu);
  thread_local std::vector<const void*> ptrs;
  list_ptrs(b, f, ptrs);
  thread_local std::vector<TensorView> outs;
  outs.assign(b.outs.begin(), b.outs.end());
  fill_results(b, f, outs);
  ++b.clock;
  jit::ContextGuard guard(device);
  for (auto& bc : b.bound)
    if (bc.ptrs == ptrs) {
      bc.used = b.clock;
      copy_slots(b, stream, f);
      bc.call->run({}, outs, stream);
      return;
    }
  Views v = views_at(b, f);
  if (b.binds >= kMaxBinds) {
    call(b.op->name, v.ins, outs, b.params, stream);
    return;
  }
  if (!b.slots.ptr && !b.slot_of.empty()) {
    const Binding::Slot& last = b.slot_of.back();
    b.slots = jit::DeviceBuffer(last.offset + last.bytes);
  }
  for (const Binding::Slot& s : b.slot_of)
    v.ins[size_t(b.operands[s.operand].input)].data = reinterpret_cast<void*>(b.slots.ptr + s.offset);
  b.retired.erase(std::remove_if(b.retired.begin(), b.retired.end(), [](const auto& c) { return c->idle(); }),
                  b.retired.end());
  if (b.bound.size() >= kBoundPerBinding) {  // the least recently run makes room
    auto lru = std::min_element(b.bound.begin(), b.bound.end(), [](const auto& x, const auto& y) { return x.used < y.used; });
    b.retired.push_back(std::move(lru->call));
    b.bound.erase(lru);
  }
  b.bound.push_back({ptrs, std::make_unique<BoundCall>(b.op->name, v.ins, outs, b.params), b.clock});
  ++b.binds;
  copy_slots(b, stream, f);
  b.bound.back().call->run({}, outs, stream);
}

// One execution (execute: true), or its preparation (the initialize stage: no stream, buffers not yet
// written; XLA runs it before every execution, so a binding prepared once returns at once).
void run(const Target& t, bool execute, Stream stream, int device, const XLA_FFI_CallFrame& f,
         std::atomic<Binding*>& last) {
  std::unique_ptr<Binding> owned;
  Binding& b = binding_for(t, device, f, last, owned);
  if (!execute) {
    std::lock_guard<std::mutex> lock(b.mu);
    if (b.prepared) return;
    Views v = views_at(b, f);
    std::vector<TensorView> outs = b.outs;
    fill_results(b, f, outs);
    prepare_call(b.op->name, v.ins, outs, b.params);
    b.prepared = true;
    return;
  }
  if (b.has_list) {
    run_list_op(b, device, stream, f);
    return;
  }
  // kspec::call's own cache finds the validated call by the views' signature and checks only what
  // depends on the pointers; the views go into this thread's vectors (no allocation once grown).
  thread_local std::vector<TensorView> ins, outs;
  ins.assign(b.ins.begin(), b.ins.end());
  outs.assign(b.outs.begin(), b.outs.end());
  for (size_t j = 0; j < b.operands.size(); ++j) ins[size_t(b.operands[j].input)].data = operand_data(f, j);
  fill_results(b, f, outs);
  call(b.op->name, ins, outs, b.params, stream);
}

XLA_FFI_Error* make_error(const XLA_FFI_Api* api, XLA_FFI_Error_Code code, const std::string& message) {
  XLA_FFI_Error_Create_Args args{XLA_FFI_Error_Create_Args_STRUCT_SIZE, nullptr, message.c_str(), code};
  return api->XLA_FFI_Error_Create(&args);
}

void drop_error(const XLA_FFI_Api* api, XLA_FFI_Error* err) {
  XLA_FFI_Error_Destroy_Args args{XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, nullptr, err};
  api->XLA_FFI_Error_Destroy(&args);
}

// The frame's device ordinal and (execute: true) its stream, through the C API as the typed binding's
// context decoding asks for them; false where XLA has none to give (the caller then lets the typed
// binding report it in XLA's own words).
bool frame_context(const XLA_FFI_CallFrame& f, bool execute, int32_t& device, Stream& stream) {
  XLA_FFI_DeviceOrdinal_Get_Args dev{XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE, nullptr, f.ctx, 0};
  if (XLA_FFI_Error* err = f.api->XLA_FFI_DeviceOrdinal_Get(&dev)) {
    drop_error(f.api, err);
    return false;
  }
  device = dev.device_ordinal;
  if (!execute) return true;
  XLA_FFI_Stream_Get_Args st{XLA_FFI_Stream_Get_Args_STRUCT_SIZE, nullptr, f.ctx, nullptr};
  if (XLA_FFI_Error* err = f.api->XLA_FFI_Stream_Get(&st)) {
    drop_error(f.api, err);
    return false;
  }
  stream = static_cast<Stream>(st.stream);
  return true;
}

// A handler's body: the call frame read as it lies (see signature). XLA's typed binding (`typed`, a
// handler of the same stage) answers what this does not read itself: XLA's metadata query (the API
// version and traits the binding declares), a frame of another layout (struct size) or stage, and a
// context without a device or stream, each with XLA's own message.
XLA_FFI_Error* handle(const Target* t, const char* target, XLA_FFI_ExecutionStage stage, XLA_FFI_CallFrame* f,
                      XLA_FFI_Handler* typed, std::atomic<Binding*>& last) noexcept {
  if (f->struct_size < XLA_FFI_CallFrame_STRUCT_SIZE || f->stage != stage ||
      (f->extension_start && f->extension_start->type == XLA_FFI_Extension_Metadata))
    return typed(f);
  const bool execute = stage == XLA_FFI_ExecutionStage_EXECUTE;
  int32_t device = 0;
  Stream stream = nullptr;
  if (!frame_context(*f, execute, device, stream)) return typed(f);
  try {
    if (!t) throw InternalError(detail::concat("no XLA target ", target, " in the table"));
    run(*t, execute, stream, device, *f, last);
    return nullptr;
  } catch (...) {
    const kspec_status st = c_abi::capture_error();
    const XLA_FFI_Error_Code code = st == KSPEC_ERROR_INVALID_ARGUMENT ? XLA_FFI_Error_Code_INVALID_ARGUMENT
                                    : st == KSPEC_ERROR_UNSUPPORTED     ? XLA_FFI_Error_Code_UNIMPLEMENTED
                                                                        : XLA_FFI_Error_Code_INTERNAL;
    return make_error(f->api, code, std::string(target) + ": " + kspec_last_error());
  }
}

}  // namespace
}  // namespace kspec::xla

// A target's execute handler `sym` and its initialize handler `sym##_init` (no stream: the initialize
// stage need not have one, and preparing launches nothing), each with the binding it last ran: `handle`
// over the call frame, behind XLA's typed binding of the same stage (`sym##_typed`), which declares the
// handler to XLA (its metadata) and reports a frame `handle` does not read; its body is never reached.
#define KSPEC_XLA_HANDLER(sym, target)                                                                            \
  static ffi::Error sym##_unreached(kspec::Stream, int32_t, ffi::RemainingArgs, ffi::RemainingRets,                 \
                                    ffi::Dictionary) {                                                             \
    return ffi::Error::Internal(target ": the typed binding's body ran (kspec's handler reads the frame itself)");  \
  }                                                                                                                \
  XLA_FFI_DEFINE_HANDLER(sym##_typed, sym##_unreached,                                                             \
                         ffi::Ffi::Bind()                                                                          \
                             .Ctx<ffi::PlatformStream<kspec::Stream>>()                                            \
                             .Ctx<ffi::DeviceOrdinal>()                                                            \
                             .RemainingArgs()                                                                      \
                             .RemainingRets()                                                                      \
                             .Attrs<ffi::Dictionary>());                                                           \
  static ffi::Error sym##_init_unreached(int32_t, ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {       \
    return ffi::Error::Internal(target ": the typed binding's body ran (kspec's handler reads the frame itself)");  \
  }                                                                                                                \
  XLA_FFI_DEFINE_HANDLER(sym##_init_typed, sym##_init_unreached,                                                   \
                         ffi::Ffi::BindInitialize()                                                                \
                             .Ctx<ffi::DeviceOrdinal>()                                                            \
                             .RemainingArgs()                                                                      \
                             .RemainingRets()                                                                      \
                             .Attrs<ffi::Dictionary>());                                                           \
  extern "C" XLA_FFI_Error* sym(XLA_FFI_CallFrame* f) {                                                            \
    static const kspec::xla::Target* const t = kspec::xla::find_target(target);                                  \
    static std::atomic<kspec::xla::Binding*> last{nullptr};                                                      \
    return kspec::xla::handle(t, target, XLA_FFI_ExecutionStage_EXECUTE, f, sym##_typed, last);                   \
  }                                                                                                                \
  extern "C" XLA_FFI_Error* sym##_init(XLA_FFI_CallFrame* f) {                                                     \
    static const kspec::xla::Target* const t = kspec::xla::find_target(target);                                  \
    static std::atomic<kspec::xla::Binding*> last{nullptr};                                                      \
    return kspec::xla::handle(t, target, XLA_FFI_ExecutionStage_INITIALIZE, f, sym##_init_typed, last);           \
  }

KSPEC_XLA_HANDLER(kspec_xla_selective_scan_fwd, "kspec_selective_scan_fwd");
KSPEC_XLA_HANDLER(kspec_xla_selective_scan_bwd, "kspec_selective_scan_bwd");
KSPEC_XLA_HANDLER(kspec_xla_selective_scan_step, "kspec_selective_scan_step");
KSPEC_XLA_HANDLER(kspec_xla_norm_act_fwd, "kspec_norm_act_fwd");
KSPEC_XLA_HANDLER(kspec_xla_norm_act_bwd, "kspec_norm_act_bwd");
KSPEC_XLA_HANDLER(kspec_xla_e79_fwd, "kspec_e79_fwd");
KSPEC_XLA_HANDLER(kspec_xla_e79_bwd, "kspec_e79_bwd");
KSPEC_XLA_HANDLER(kspec_xla_adamw, "kspec_adamw");

namespace {
struct Handler {
  const char* target;
  XLA_FFI_Handler* fn;    // execute
  XLA_FFI_Handler* init;  // initialize
};
#define KSPEC_XLA_ROW(target, sym) {target, sym, sym##_init}
// Every row of kspec::xla::targets() has its handlers here (tests/python/test_jax.py checks it).
const Handler kHandlers[] = {
    KSPEC_XLA_ROW("kspec_selective_scan_fwd", kspec_xla_selective_scan_fwd),
    KSPEC_XLA_ROW("kspec_selective_scan_bwd", kspec_xla_selective_scan_bwd),
    KSPEC_XLA_ROW("kspec_selective_scan_step", kspec_xla_selective_scan_step),
    KSPEC_XLA_ROW("kspec_norm_act_fwd", kspec_xla_norm_act_fwd),
    KSPEC_XLA_ROW("kspec_norm_act_bwd", kspec_xla_norm_act_bwd),
    KSPEC_XLA_ROW("kspec_e79_fwd", kspec_xla_e79_fwd),
    KSPEC_XLA_ROW("kspec_e79_bwd", kspec_xla_e79_bwd),
    KSPEC_XLA_ROW("kspec_adamw", kspec_xla_adamw),
};
#undef KSPEC_XLA_ROW

const Handler* find_handler(const char* target) {
  if (!target) return nullptr;
  for (const auto& h : kHandlers)
    if (std::strcmp(h.target, target) == 0) return &h;
  return nullptr;
}
}  // namespace

extern "C" {

int kspec_xla_available(void) { return 1; }

void* kspec_xla_handler(const char* target) {
  const Handler* h = find_handler(target);
  return h ? reinterpret_cast<void*>(h->fn) : nullptr;
}

void* kspec_xla_initialize_handler(const char* target) {
  const Handler* h = find_handler(target);
  return h ? reinterpret_cast<void*>(h->init) : nullptr;
}

kspec_status kspec_xla_register(const XLA_FFI_Api* api, const char* platform) {
  using kspec::c_abi::set_error;
  if (!api || !platform)
    return set_error(KSPEC_ERROR_INVALID_ARGUMENT, std::string("kspec_xla_register: ") + (api ? "platform" : "api") + " is NULL");
  if (api->api_version.major_version != XLA_FFI_API_MAJOR)
    return set_error(KSPEC_ERROR_UNSUPPORTED,
                     kspec::detail::concat("kspec_xla_register: the XLA FFI API is version ", api->api_version.major_version, ".",
                                           api->api_version.minor_version, ", kspec was built against ", XLA_FFI_API_MAJOR, ".",
                                           XLA_FFI_API_MINOR, " (rebuild kspec with that XLA's FFI headers)"));
  for (const auto& h : kHandlers) {
    XLA_FFI_Handler_Register_Args args;
    args.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.name = XLA_FFI_ByteSpan{h.target, std::strlen(h.target)};
    args.platform = XLA_FFI_ByteSpan{platform, std::strlen(platform)};
    args.bundle = XLA_FFI_Handler_Bundle{};  // newer APIs add stages (e.g. record): unset
    args.bundle.initialize = h.init;
    args.bundle.execute = h.fn;
    args.traits = 0;  // not command-buffer compatible: see the top of this file
    if (XLA_FFI_Error* err = api->XLA_FFI_Handler_Register(&args)) {
      // XLA's FFI API 0.4 (jaxlib 0.11.1) replaced GetMessage with GetDetails (the message and a code).
#if XLA_FFI_API_MAJOR > 0 || XLA_FFI_API_MINOR >= 4
      XLA_FFI_Error_GetDetails_Args msg{XLA_FFI_Error_GetDetails_Args_STRUCT_SIZE, nullptr, err, nullptr, {}};
      api->XLA_FFI_Error_GetDetails(&msg);
#else
      XLA_FFI_Error_GetMessage_Args msg{XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE, nullptr, err, nullptr};
      api->XLA_FFI_Error_GetMessage(&msg);
#endif
      const std::string text = msg.message ? msg.message : "(no message)";
      XLA_FFI_Error_Destroy_Args destroy{XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, nullptr, err};
      api->XLA_FFI_Error_Destroy(&destroy);
      return set_error(KSPEC_ERROR_UNKNOWN, std::string("kspec_xla_register: registering ") + h.target + " for " +
                                                platform + " failed: " + text);
    }
  }
  return KSPEC_OK;
}

}  // extern "C"
