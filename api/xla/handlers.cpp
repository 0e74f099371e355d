// The XLA FFI handlers (XLA's typed FFI API): each converts its operands, results and attributes into
// kspec::call of one op — the registry call C++ and Python make (validation, plan cache, tuning database):
// no op is implemented twice. Built only with XLA's FFI headers (jax.ffi.include_dir(); see xla.cmake).
//
// Compilation happens before execution: each target has an initialize-stage handler beside its execute
// handler. XLA runs it before the execution (and before any command buffer records one), with the
// buffers' shapes and addresses but not their contents; it validates the call and builds its plan —
// kernels compiled (NVRTC, or the disk cache) and loaded — without launching (prepare_call), so the
// execute stage finds the plan cached. The instantiate stage cannot: it sees attributes but no buffers,
// and kspec's specializations depend on shapes (hidden, dstate, n). No handler declares
// XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE either (adamw's runtime params are read back on the
// stream, which a capture cannot do), so XLA runs every execution as an ordinary thunk.
#include <cuda.h>

#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "api/src/c_abi.h"
#include "api/src/plan.h"
#include "api/xla/targets.h"
#include "jit/driver.h"
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

// A buffer as kspec's view. With layout "bld" the scan's sequence tensors arrive as [batch, seqlen, dim] and
// B/C as [batch, seqlen, (groups,) dstate] whose memory is in bdl order (the operands' XLA layouts say so):
// the view only renames the dimensions, nothing is moved. (The op's own layout "bld", whose kernels read
// row-major [batch, seqlen, dim] in place, is not used here yet: the H100 run of this session failed every
// bld case of tests/python/test_gpu_jax.py through it, its log lost; see tools/bench/NOTES.md.)
TensorView view_of(const ffi::AnyBuffer& b, const TensorDef& def, bool bld, int device, const std::string& what) {
  TensorView v;
  v.data = b.untyped_data();
  v.dtype = dtype_of(b.element_type(), what);
  v.device = device;
  const auto dims = b.dimensions();
  std::vector<int64_t> shape(dims.begin(), dims.end());
  const bool seq = def.shape == std::vector<std::string>{"batch", "dim", "seqlen"};
  const bool bc = def.shape == std::vector<std::string>{"batch", "groups", "dstate", "seqlen"};
  if (seq && bld && shape.size() == 3) shape = {shape[0], shape[2], shape[1]};
  if (bc && shape.size() == 3) shape = bld ? std::vector<int64_t>{shape[0], 1, shape[2], shape[1]}
                                           : std::vector<int64_t>{shape[0], 1, shape[1], shape[2]};
  else if (bc && bld && shape.size() == 4) shape = {shape[0], shape[2], shape[3], shape[1]};
  KSPEC_CHECK(shape.size() <= size_t(kMaxRank), what, ": rank ", shape.size(), " exceeds ", kMaxRank);
  v.rank = int(shape.size());
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = shape[size_t(d)];
    v.strides[d] = stride;
    stride *= shape[size_t(d)] > 0 ? shape[size_t(d)] : 1;
  }
  return v;
}

// A runtime param given as a one-element operand (a learning rate or step count that changes every call
// without recompiling the XLA program): read back on the call's stream. The wait makes this call
// synchronous with its stream, which is why only params the caller names in `inputs` take this path.
ParamValue read_scalar(const ffi::AnyBuffer& b, const ParamDef& p, Stream stream, int device, const std::string& what) {
  KSPEC_CHECK(b.element_count() == 1, what, ": a param operand holds one element, got ", b.element_count());
  const DType dt = dtype_of(b.element_type(), what);
  KSPEC_CHECK(dt == DType::f32 || dt == DType::f64 || dt == DType::i32 || dt == DType::i64, what,
              ": a param operand is f32, f64, s32 or s64, got ", dtype_name(dt));
  unsigned char raw[8] = {};
  {
    jit::ContextGuard context(device);
    CU_CHECK(cuStreamSynchronize(stream));
    CU_CHECK(cuMemcpyDtoH(raw, reinterpret_cast<CUdeviceptr>(b.untyped_data()), size_t(dtype_size(dt))));
  }
  double x = 0;
  int64_t n = 0;
  switch (dt) {
    case DType::f32: { float f; std::memcpy(&f, raw, 4); x = f; n = int64_t(f); break; }
    case DType::f64: std::memcpy(&x, raw, 8); n = int64_t(x); break;
    case DType::i32: { int32_t i; std::memcpy(&i, raw, 4); n = i; x = double(i); break; }
    default: std::memcpy(&n, raw, 8); x = double(n); break;
  }
  switch (p.type) {
    case ParamType::Int: return n;
    case ParamType::Float: return x;
    case ParamType::Bool: return n != 0;
    case ParamType::Choice: break;
  }
  throw InvalidArgument(detail::concat(what, ": a choice param cannot come from an operand"));
}

// The call of one execution (execute: true), or its preparation (the initialize stage: no stream, buffers
// not yet written, so a runtime param's operand is not read; the plan does not depend on it).
void run(const Target& t, bool execute, Stream stream, int device, const ffi::RemainingArgs& args,
         const ffi::RemainingRets& rets, const ffi::Dictionary& dict) {
  const OpInfo& op = op_info(t.op);
  Attrs a = read_attrs(t, op, dict);
  if (!a.given_inputs)
    for (const auto& d : op.inputs)
      if (!d.optional) a.inputs.push_back(d.name);

  std::vector<TensorView> ins(op.inputs.size());
  std::vector<std::vector<TensorView>> lists;  // the items of list inputs, alive for the call
  lists.reserve(op.inputs.size());
  size_t next = 0;
  auto operand = [&](const std::string& what) {
    KSPEC_CHECK(next < args.size(), t.name, ": ", what, ": expected an operand, but only ", args.size(),
                " were given (inputs=\"", [&] { std::string s; for (auto& n : a.inputs) s += (s.empty() ? "" : ",") + n; return s; }(), "\")");
    auto b = args.get<ffi::AnyBuffer>(next++);
    if (!b.has_value()) throw InvalidArgument(detail::concat(t.name, ": ", what, ": ", b.error().message()));
    return b.value();
  };
  for (const auto& name : a.inputs) {
    const int i = index_of(op.inputs, name);
    if (i < 0) {
      const ParamDef* p = param_def(op, name);
      KSPEC_CHECK(p && p->runtime, t.name, ": inputs names '", name, "', which is neither an input of ", t.op,
                  " nor a runtime param");
      const ffi::AnyBuffer b = operand("param '" + name + "'");
      if (execute) a.params.set(name, read_scalar(b, *p, stream, device, "operand '" + name + "'"));
      continue;
    }
    const TensorDef& def = op.inputs[size_t(i)];
    KSPEC_CHECK(!ins[size_t(i)].defined(), t.name, ": input '", name, "' is named twice in inputs");
    if (def.list) {
      KSPEC_CHECK(a.tensors >= 0, t.name, ": list input '", name, "' needs the attribute '", kTensorsAttr, "'");
      lists.emplace_back();
      for (int64_t k = 0; k < a.tensors; ++k) {
        const std::string what = detail::concat("input '", name, "' item ", k);
        lists.back().push_back(view_of(operand(what), def, a.bld, device, what));
      }
      ins[size_t(i)] = TensorView::list(lists.back().data(), a.tensors);
    } else {
      ins[size_t(i)] = view_of(operand("input '" + name + "'"), def, a.bld, device, "input '" + name + "'");
    }
  }
  KSPEC_CHECK(next == args.size(), t.name, ": ", args.size(), " operands given, but inputs names ", next);

  if (!a.given_outputs)
    for (const auto& d : op.outputs)
      if (d.present_with.empty() ? !d.optional : present_with(op, d, ins, a.params)) a.outputs.push_back(d.name);
  std::vector<TensorView> outs(op.outputs.size());
  size_t r = 0;
  auto result = [&](const std::string& what) {
    KSPEC_CHECK(r < rets.size(), t.name, ": ", what, ": expected a result, but only ", rets.size(), " exist");
    auto b = rets.get<ffi::AnyBuffer>(r++);
    if (!b.has_value()) throw InvalidArgument(detail::concat(t.name, ": ", what, ": ", b.error().message()));
    return *b.value();
  };
  for (const auto& name : a.outputs) {
    const int o = index_of(op.outputs, name);
    if (o >= 0) {
      outs[size_t(o)] = view_of(result("output '" + name + "'"), op.outputs[size_t(o)], a.bld, device, "output '" + name + "'");
      continue;
    }
    // An input updated in place: XLA gives its result the operand's buffer (input_output_aliases).
    const int i = index_of(op.inputs, name);
    KSPEC_CHECK(i >= 0 && ins[size_t(i)].defined(), t.name, ": outputs names '", name,
                "', which is neither an output of ", t.op, " nor a given input");
    const TensorView& in = ins[size_t(i)];
    const int64_t n = in.is_list() ? in.list_size() : 1;
    for (int64_t k = 0; k < n; ++k) {
      const std::string what = detail::concat("result '", name, "'", in.is_list() ? detail::concat(" item ", k) : "");
      const void* want = in.is_list() ? in.item(k).data : in.data;
      KSPEC_CHECK(result(what).untyped_data() == want, t.name, ": ", what,
                  " must be its operand's buffer (alias it with input_output_aliases)");
    }
  }
  KSPEC_CHECK(r == rets.size(), t.name, ": ", rets.size(), " results, but outputs names ", r);
  if (execute)
    call(t.op, ins, outs, a.params, stream);
  else
    prepare_call(t.op, ins, outs, a.params);
}

ffi::Error run_ffi(const char* target, bool execute, Stream stream, int32_t device, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, ffi::Dictionary attrs) noexcept {
  try {
    const Target* t = find_target(target);
    if (!t) throw InternalError(detail::concat("no XLA target ", target, " in the table"));
    run(*t, execute, stream, device, args, rets, attrs);
    return ffi::Error::Success();
  } catch (...) {
    const kspec_status st = c_abi::capture_error();
    const ffi::ErrorCode code = st == KSPEC_ERROR_INVALID_ARGUMENT ? ffi::ErrorCode::kInvalidArgument
                                : st == KSPEC_ERROR_UNSUPPORTED     ? ffi::ErrorCode::kUnimplemented
                                                                    : ffi::ErrorCode::kInternal;
    return ffi::Error(code, std::string(target) + ": " + kspec_last_error());
  }
}

}  // namespace
}  // namespace kspec::xla

// A target's execute handler `sym` and its initialize handler `sym##_init` (no stream: the initialize
// stage need not have one, and preparing launches nothing).
#define KSPEC_XLA_HANDLER(sym, target)                                                                            \
  static ffi::Error sym##_impl(kspec::Stream stream, int32_t device, ffi::RemainingArgs args,                     \
                               ffi::RemainingRets rets, ffi::Dictionary attrs) {                                   \
    return kspec::xla::run_ffi(target, true, stream, device, args, rets, attrs);                                 \
  }                                                                                                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(sym, sym##_impl,                                                                   \
                                ffi::Ffi::Bind()                                                                   \
                                    .Ctx<ffi::PlatformStream<kspec::Stream>>()                                     \
                                    .Ctx<ffi::DeviceOrdinal>()                                                     \
                                    .RemainingArgs()                                                               \
                                    .RemainingRets()                                                               \
                                    .Attrs<ffi::Dictionary>());                                                    \
  static ffi::Error sym##_init_impl(int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets,             \
                                    ffi::Dictionary attrs) {                                                       \
    return kspec::xla::run_ffi(target, false, nullptr, device, args, rets, attrs);                               \
  }                                                                                                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(sym##_init, sym##_init_impl,                                                       \
                                ffi::Ffi::BindInitialize()                                                         \
                                    .Ctx<ffi::DeviceOrdinal>()                                                     \
                                    .RemainingArgs()                                                               \
                                    .RemainingRets()                                                               \
                                    .Attrs<ffi::Dictionary>())

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
