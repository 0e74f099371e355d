// The XLA FFI handlers' host path on the mock driver, called as XLA calls them (a call frame of buffers and
// attributes, through a stand-in XLA_FFI_Api): an execution whose custom call was seen before converts
// nothing and allocates nothing (norm_act through kspec::call's cache, adamw through its bound call, lr and
// step as device operands), the initialize stage returns at once once prepared, and the errors still
// come back as XLA errors with kspec's message; the scan's bld buffers are read where they lie.
#include <gtest/gtest.h>

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "jit/driver.h"
#include "kspec/kspec.h"
#include "mock_test_process.h"
#include "kspec/kspec_xla.h"
#include "xla/ffi/api/c_api.h"

namespace {

long mock_launches() {
  static auto fn = reinterpret_cast<long long (*)()>(dlsym(dlopen(KSPEC_CUDA_MOCK, RTLD_NOW | RTLD_NOLOAD), "kspec_mock_launches"));
  return fn ? static_cast<long>(fn()) : -1;
}

long mock_dtod_copies() {
  static auto fn = reinterpret_cast<long long (*)()>(dlsym(dlopen(KSPEC_CUDA_MOCK, RTLD_NOW | RTLD_NOLOAD), "kspec_mock_dtod_copies"));
  return fn ? static_cast<long>(fn()) : -1;
}

// The XLA runtime's side of the FFI, as much of it as the handlers use: errors, the stream, the device.
std::string g_error;  // the last error's message (one error at a time in these tests)
int g_error_token;

XLA_FFI_Error* error_create(XLA_FFI_Error_Create_Args* args) {
  g_error = args->message ? args->message : "";
  return reinterpret_cast<XLA_FFI_Error*>(&g_error_token);
}

XLA_FFI_Error* stream_get(XLA_FFI_Stream_Get_Args* args) {
  args->stream = reinterpret_cast<void*>(uintptr_t(0x100));
  return nullptr;
}

XLA_FFI_Error* device_get(XLA_FFI_DeviceOrdinal_Get_Args* args) {
  args->device_ordinal = 0;
  return nullptr;
}

XLA_FFI_Api make_api() {
  XLA_FFI_Api api;
  std::memset(&api, 0, sizeof(api));
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.api_version = {XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
  api.XLA_FFI_Error_Create = error_create;
  api.XLA_FFI_Stream_Get = stream_get;
  api.XLA_FFI_DeviceOrdinal_Get = device_get;
  return api;
}
const XLA_FFI_Api kApi = make_api();

// One custom call's frame: fp32 buffers in mock device memory, and attributes (XLA sorts them by name).
class Frame {
 public:
  Frame() {
    // Reserved: buffers and attributes are pointed to, so their vectors never grow once filled.
    bufs_.reserve(64);
    dims_.reserve(64);
    names_.reserve(16);
    spans_.reserve(16);
    strings_.reserve(16);
    scalars_.reserve(16);
    values_.reserve(16);
  }
  ~Frame() {
    for (auto p : owned_) kspec::jit::driver().cuMemFree(p);
  }
  void* alloc(int64_t elems) {
    CUdeviceptr p = 0;
    CU_CHECK(cuMemAlloc(&p, size_t(elems) * 4));
    owned_.push_back(p);
    return reinterpret_cast<void*>(p);
  }
  // An operand (or a result) of dims, in new memory or at `data`.
  void* arg(std::vector<int64_t> d, void* data = nullptr) { return add(args_, std::move(d), data); }
  void* ret(std::vector<int64_t> d, void* data = nullptr) { return add(rets_, std::move(d), data); }
  void attr(const char* name, std::string value) {
    strings_.push_back(std::move(value));
    spans_.push_back({strings_.back().data(), strings_.back().size()});
    add_attr(name, XLA_FFI_AttrType_STRING, &spans_.back());
  }
  void attr(const char* name, double value) { scalar(name, XLA_FFI_DataType_F64, value); }
  void attr(const char* name, int64_t value) { scalar(name, XLA_FFI_DataType_S64, value); }
  // Results re-pointed (a fresh output buffer, as XLA may give each execution).
  void set_ret(size_t i, void* data) { bufs_[rets_[i]].data = data; }
  void set_arg(size_t i, void* data) { bufs_[args_[i]].data = data; }

  XLA_FFI_Error* call(const char* target, XLA_FFI_ExecutionStage stage) {
    const bool init = stage == XLA_FFI_ExecutionStage_INITIALIZE;
    return call_handler(init ? kspec_xla_initialize_handler(target) : kspec_xla_handler(target), stage);
  }
  // `handler` (kspec_xla_handler's or kspec_xla_initialize_handler's) with a frame of `stage` and `extension`.
  // The extension's type by decltype: XLA_FFI_Extension_Base in jaxlib 0.10, XLA_FFI_InternalExtension in 0.11.
  using Extension = std::remove_pointer_t<decltype(XLA_FFI_CallFrame::extension_start)>;
  XLA_FFI_Error* call_handler(void* handler, XLA_FFI_ExecutionStage stage, Extension* extension = nullptr) {
    build();
    frame_.stage = stage;
    frame_.extension_start = extension;
    return reinterpret_cast<XLA_FFI_Handler*>(handler)(&frame_);
  }

 private:
  template <typename T>
  void scalar(const char* name, XLA_FFI_DataType dt, T value) {
    values_.emplace_back();
    std::memcpy(values_.back().data(), &value, sizeof(T));
    scalars_.push_back({dt, values_.back().data()});
    add_attr(name, XLA_FFI_AttrType_SCALAR, &scalars_.back());
  }
  void add_attr(const char* name, XLA_FFI_AttrType type, void* value) {
    names_.push_back({name, std::strlen(name)});
    attrs_.push_back({type, value});
  }
  void* add(std::vector<size_t>& which, std::vector<int64_t> d, void* data) {
    int64_t n = 1;
    for (int64_t x : d) n *= x;
    dims_.push_back(std::move(d));
    XLA_FFI_Buffer b;
    b.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    b.extension_start = nullptr;
    b.dtype = XLA_FFI_DataType_F32;
    b.data = data ? data : alloc(n);
    b.rank = int64_t(dims_.back().size());
    b.dims = dims_.back().data();
    which.push_back(bufs_.size());
    bufs_.push_back(b);
    return b.data;
  }
  void build() {
    arg_ptrs_.clear();
    ret_ptrs_.clear();
    for (size_t i : args_) arg_ptrs_.push_back(&bufs_[i]);
    for (size_t i : rets_) ret_ptrs_.push_back(&bufs_[i]);
    arg_types_.assign(args_.size(), XLA_FFI_ArgType_BUFFER);
    ret_types_.assign(rets_.size(), XLA_FFI_RetType_BUFFER);
    order_.resize(names_.size());  // a member: building the frame allocates nothing once it has run
    for (size_t i = 0; i < order_.size(); ++i) order_[i] = i;
    std::sort(order_.begin(), order_.end(), [&](size_t a, size_t b) {
      return std::string_view(names_[a].ptr, names_[a].len) < std::string_view(names_[b].ptr, names_[b].len);
    });
    name_ptrs_.clear();
    attr_types_.clear();
    attr_ptrs_.clear();
    for (size_t i : order_) {
      name_ptrs_.push_back(&names_[i]);
      attr_types_.push_back(attrs_[i].first);
      attr_ptrs_.push_back(attrs_[i].second);
    }
    std::memset(&frame_, 0, sizeof(frame_));
    frame_.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
    frame_.api = &kApi;
    frame_.ctx = reinterpret_cast<XLA_FFI_ExecutionContext*>(uintptr_t(0x200));
    frame_.args = {XLA_FFI_Args_STRUCT_SIZE, nullptr, int64_t(arg_ptrs_.size()), arg_types_.data(),
                   reinterpret_cast<void**>(arg_ptrs_.data())};
    frame_.rets = {XLA_FFI_Rets_STRUCT_SIZE, nullptr, int64_t(ret_ptrs_.size()), ret_types_.data(),
                   reinterpret_cast<void**>(ret_ptrs_.data())};
    frame_.attrs = {XLA_FFI_Attrs_STRUCT_SIZE, nullptr, int64_t(name_ptrs_.size()), attr_types_.data(),
                    name_ptrs_.data(), attr_ptrs_.data()};
  }

  std::vector<CUdeviceptr> owned_;
  std::vector<XLA_FFI_Buffer> bufs_;
  std::vector<std::vector<int64_t>> dims_;
  std::vector<size_t> args_, rets_;
  std::vector<XLA_FFI_Buffer*> arg_ptrs_, ret_ptrs_;
  std::vector<XLA_FFI_ArgType> arg_types_;
  std::vector<XLA_FFI_RetType> ret_types_;
  std::vector<XLA_FFI_ByteSpan> names_, spans_;
  std::vector<std::string> strings_;
  std::vector<std::array<char, 8>> values_;
  std::vector<XLA_FFI_Scalar> scalars_;
  std::vector<std::pair<XLA_FFI_AttrType, void*>> attrs_;
  std::vector<size_t> order_;
  std::vector<XLA_FFI_ByteSpan*> name_ptrs_;
  std::vector<XLA_FFI_AttrType> attr_types_;
  std::vector<void*> attr_ptrs_;
  XLA_FFI_CallFrame frame_;
};

class XlaHandlers : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kMockSelected);
    ASSERT_TRUE(kspec_xla_available());
    ASSERT_TRUE(kspec::jit::driver_available()) << "the mock driver did not load from " KSPEC_CUDA_MOCK;
  }
};

constexpr auto kExecute = XLA_FFI_ExecutionStage_EXECUTE;
constexpr auto kInitialize = XLA_FFI_ExecutionStage_INITIALIZE;

void norm_act_frame(Frame& f, const char* act = "silu") {
  f.arg({4, 256});
  f.arg({256});
  f.arg({256});
  f.ret({4, 256});
  f.ret({4});
  f.ret({4});
  f.attr("inputs", "x,weight,bias");
  f.attr("outputs", "y,mean,rstd");
  f.attr("norm", "layernorm");
  f.attr("act", act);
  f.attr("eps", 1e-5);
}

// Each execution as XLA runs it: the initialize stage, then the execute stage, the output at one of two
// addresses (XLA may give each execution its own buffers).
TEST_F(XlaHandlers, NormActRepeatLaunchesOnceAndAllocatesNothing) {
  Frame f;
  norm_act_frame(f);
  void* const ys[2] = {f.alloc(4 * 256), f.alloc(4 * 256)};
  for (int i = 0; i < 2; ++i) {
    f.set_ret(0, ys[i]);
    ASSERT_EQ(f.call("kspec_norm_act_fwd", kInitialize), nullptr) << g_error;
    ASSERT_EQ(f.call("kspec_norm_act_fwd", kExecute), nullptr) << g_error;
  }
  const long launches = mock_launches(), allocations = g_allocations.load();
  constexpr int kCalls = 100;
  for (int i = 0; i < kCalls; ++i) {
    f.set_ret(0, ys[i % 2]);
    ASSERT_EQ(f.call("kspec_norm_act_fwd", kInitialize), nullptr) << g_error;
    ASSERT_EQ(f.call("kspec_norm_act_fwd", kExecute), nullptr) << g_error;
  }
  EXPECT_EQ(mock_launches() - launches, kCalls);
  EXPECT_EQ(g_allocations.load() - allocations, 0) << "heap allocations in " << kCalls << " executions";
}

// The handlers read XLA's call frame themselves; what they do not read goes to XLA's typed binding of the
// same stage: the metadata query XLA makes when a handler is registered (the FFI API version kspec was
// built with, no traits: not command-buffer compatible), and a frame of the other stage, refused with
// XLA's own message and nothing launched.
TEST_F(XlaHandlers, MetadataQueryAndWrongStageGoToXlasTypedBinding) {
  Frame f;
  norm_act_frame(f);
  for (void* handler : {kspec_xla_handler("kspec_norm_act_fwd"), kspec_xla_initialize_handler("kspec_norm_act_fwd")}) {
    XLA_FFI_Metadata metadata;
    std::memset(&metadata, 0xff, sizeof(metadata));
    metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
    XLA_FFI_Metadata_Extension ext;
    ext.extension_base = {XLA_FFI_Metadata_Extension_STRUCT_SIZE, XLA_FFI_Extension_Metadata, nullptr};
    ext.metadata = &metadata;
    const long launches = mock_launches();
    ASSERT_EQ(f.call_handler(handler, kExecute, &ext.extension_base), nullptr) << g_error;
    EXPECT_EQ(metadata.api_version.major_version, XLA_FFI_API_MAJOR);
    EXPECT_EQ(metadata.api_version.minor_version, XLA_FFI_API_MINOR);
    EXPECT_EQ(metadata.traits, 0u);
    EXPECT_EQ(mock_launches(), launches);
  }
  const long launches = mock_launches();
  ASSERT_NE(f.call_handler(kspec_xla_handler("kspec_norm_act_fwd"), kInitialize), nullptr);
  EXPECT_NE(g_error.find("stage"), std::string::npos) << g_error;
  ASSERT_NE(f.call_handler(kspec_xla_initialize_handler("kspec_norm_act_fwd"), kExecute), nullptr);
  EXPECT_NE(g_error.find("stage"), std::string::npos) << g_error;
  EXPECT_EQ(mock_launches(), launches);
}

// A handler first tries the binding it ran last (its signature compared word by word), so a call that
// differs from it in one buffer's shape or one attribute's value must still be converted (and here
// refused) on its own, right after the other ran; and the first runs again after it.
TEST_F(XlaHandlers, AnotherSignatureIsNotTheLastBinding) {
  Frame good;
  norm_act_frame(good);
  Frame bad_shape;
  bad_shape.arg({4, 256});
  bad_shape.arg({128});
  bad_shape.ret({4, 256});
  bad_shape.attr("inputs", "x,weight");
  bad_shape.attr("outputs", "y");
  Frame bad_attr;
  norm_act_frame(bad_attr, "nonsense");
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(good.call("kspec_norm_act_fwd", kExecute), nullptr) << g_error;
    ASSERT_NE(bad_shape.call("kspec_norm_act_fwd", kExecute), nullptr);
    EXPECT_NE(g_error.find("'weight'"), std::string::npos) << g_error;
    ASSERT_EQ(good.call("kspec_norm_act_fwd", kExecute), nullptr) << g_error;
    ASSERT_NE(bad_attr.call("kspec_norm_act_fwd", kExecute), nullptr);
    EXPECT_NE(g_error.find("nonsense"), std::string::npos) << g_error;
  }
}

// adamw over 3 fp32 tensors, lr and step as device operands, every state list updated in place.
struct AdamwFrame {
  static constexpr int kTensors = 3;
  Frame f;
  std::vector<void*> ins;
  explicit AdamwFrame(double max_norm) {
    const std::vector<std::vector<int64_t>> shapes = {{7, 33}, {33}, {1000}};
    f.arg({1});  // device_lr
    f.arg({1});  // device_step
    for (int list = 0; list < 4; ++list)
      for (const auto& s : shapes) ins.push_back(f.arg(s));
    for (int list : {0, 2, 3})  // params, exp_avg, exp_avg_sq: aliased results
      for (int k = 0; k < kTensors; ++k) f.ret(shapes[size_t(k)], ins[size_t(list * kTensors + k)]);
    std::string outs = "params,exp_avg,exp_avg_sq";
    if (max_norm > 0) {
      f.ret({1});
      outs += ",grad_norm";
    }
    f.attr("inputs", "device_lr,device_step,params,grads,exp_avg,exp_avg_sq");
    f.attr("outputs", outs);
    f.attr("tensors", int64_t(kTensors));
    f.attr("weight_decay", 0.1);
    f.attr("max_norm", max_norm);
  }
};

TEST_F(XlaHandlers, AdamwRepeatRunsItsBoundCallAndAllocatesNothing) {
  AdamwFrame a(1.0);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(a.f.call("kspec_adamw", kInitialize), nullptr) << g_error;
    ASSERT_EQ(a.f.call("kspec_adamw", kExecute), nullptr) << g_error;
  }
  const long launches = mock_launches(), allocations = g_allocations.load();
  constexpr int kSteps = 50;
  for (int i = 0; i < kSteps; ++i) {
    ASSERT_EQ(a.f.call("kspec_adamw", kInitialize), nullptr) << g_error;
    ASSERT_EQ(a.f.call("kspec_adamw", kExecute), nullptr) << g_error;
  }
  // The gradient norm's pass, the finalize kernel (the norm, and the device lr and step), the update.
  EXPECT_EQ(mock_launches() - launches, 3 * kSteps);
  // kspec::call would validate every item and build the tensor table (vectors) on every step.
  EXPECT_EQ(g_allocations.load() - allocations, 0) << "heap allocations in " << kSteps << " steps";
}

// Buffers that move (no donation): gradients at one of two addresses run their two bound calls, allocating
// nothing; ever new addresses are bound again up to a limit, then run through kspec::call; the results'
// aliasing is still checked on every path.
TEST_F(XlaHandlers, AdamwMovingBuffersStillRun) {
  AdamwFrame a(0.0);
  constexpr size_t kGrad0 = 2 + AdamwFrame::kTensors;  // grads item 0
  void* const grads[2] = {a.f.alloc(7 * 33), a.f.alloc(7 * 33)};
  for (int i = 0; i < 2; ++i) {
    a.f.set_arg(kGrad0, grads[i]);
    ASSERT_EQ(a.f.call("kspec_adamw", kExecute), nullptr) << g_error;
  }
  long launches = mock_launches();
  const long allocations = g_allocations.load();
  for (int i = 0; i < 20; ++i) {
    a.f.set_arg(kGrad0, grads[i % 2]);
    ASSERT_EQ(a.f.call("kspec_adamw", kExecute), nullptr) << g_error;
  }
  EXPECT_EQ(g_allocations.load() - allocations, 0) << "heap allocations in 20 steps over two bound calls";
  EXPECT_EQ(mock_launches() - launches, 2 * 20);  // finalize (device lr, step) and update
  launches = mock_launches();
  constexpr int kSteps = 20;  // past the handler's binding limit (16)
  for (int i = 0; i < kSteps; ++i) {
    a.f.set_arg(kGrad0, a.f.alloc(7 * 33));  // a new gradient buffer every step
    ASSERT_EQ(a.f.call("kspec_adamw", kExecute), nullptr) << "step " << i << ": " << g_error;
  }
  EXPECT_EQ(mock_launches() - launches, 2 * kSteps);
  a.f.set_ret(0, a.f.alloc(7 * 33));  // params item 0's result no longer its operand
  ASSERT_NE(a.f.call("kspec_adamw", kExecute), nullptr);
  EXPECT_NE(g_error.find("must be its operand's buffer"), std::string::npos) << g_error;
}

// lr and the step as XLA passes them: a jit argument or a temporary, at a new address every execution,
// while the donated lists stay put. The bound call stays (copied into the binding's slots, one
// device-to-device copy per scalar per step): no new bound call, no fallback to kspec::call past the
// binding limit (16), no heap allocation. Before, each new scalar address bound a new call (the tensor
// table built, validated and uploaded again), then after 16 ran kspec::call on every step.
TEST_F(XlaHandlers, AdamwScalarsAtNewAddressesKeepTheBoundCall) {
  AdamwFrame a(0.5);  // a max_norm of its own: a binding no other test has bound calls for
  ASSERT_EQ(a.f.call("kspec_adamw", kInitialize), nullptr) << g_error;
  ASSERT_EQ(a.f.call("kspec_adamw", kExecute), nullptr) << g_error;
  constexpr int kSteps = 40;
  std::vector<void*> lr, step;
  for (int i = 0; i < kSteps; ++i) {
    lr.push_back(a.f.alloc(1));
    step.push_back(a.f.alloc(1));
  }
  const long launches = mock_launches(), copies = mock_dtod_copies(), allocations = g_allocations.load();
  for (int i = 0; i < kSteps; ++i) {
    a.f.set_arg(0, lr[size_t(i)]);
    a.f.set_arg(1, step[size_t(i)]);
    ASSERT_EQ(a.f.call("kspec_adamw", kInitialize), nullptr) << g_error;
    ASSERT_EQ(a.f.call("kspec_adamw", kExecute), nullptr) << "step " << i << ": " << g_error;
  }
  EXPECT_EQ(g_allocations.load() - allocations, 0) << "heap allocations in " << kSteps << " steps";
  EXPECT_EQ(mock_launches() - launches, 3 * kSteps);  // the norm's pass, finalize, update
  EXPECT_EQ(mock_dtod_copies() - copies, 2 * kSteps);  // lr and step into the slots
}

// The scan's layout "bld" as XLA hands it over: dense row-major [batch, seqlen, dim] buffers and B/C as
// [batch, seqlen, (groups,) dstate] (one group as 3-D buffers, two as 4-D). The handler views them as the
// op's [batch, dim, seqlen] over that memory and passes layout "bld" to the op, whose validation takes only
// time-major strides there (contiguous views of the same buffers are refused), and its sequential kernels
// run on them: the forward and the backward validate, plan, compile and launch. That the op got "bld" shows
// where only its time-major path refuses: 4 channels a B/C group (a sequential block holds 16 or more).
// Before, the handler renamed the dimensions of contiguous buffers for the op's bdl path (XLA had been
// asked for bdl memory order, so it transposed around every call): the last check passed there.
TEST_F(XlaHandlers, ScanBldBuffersAreReadWhereTheyLie) {
  constexpr int64_t b = 2, len = 5, d = 64, n = 4, g = 2;  // 32 channels a group: a block of the sequential kernels
  for (const std::vector<int64_t>& bc : {std::vector<int64_t>{b, len, n}, std::vector<int64_t>{b, len, g, n}}) {
    const std::string at = bc.size() == 3 ? "3-D B/C" : "4-D B/C";
    Frame fwd;
    void* const u = fwd.arg({b, len, d});
    void* const delta = fwd.arg({b, len, d});
    void* const A = fwd.arg({d, n});
    void* const B = fwd.arg(bc);
    void* const C = fwd.arg(bc);
    fwd.ret({b, len, d});
    fwd.ret({b, d, n});
    void* const states = fwd.ret({b, d, 1, n});
    fwd.attr("inputs", "u,delta,A,B,C");
    fwd.attr("outputs", "out,last_state,states");
    fwd.attr("layout", "bld");
    long launches = mock_launches();
    ASSERT_EQ(fwd.call("kspec_selective_scan_fwd", kInitialize), nullptr) << at << ": " << g_error;
    ASSERT_EQ(fwd.call("kspec_selective_scan_fwd", kExecute), nullptr) << at << ": " << g_error;
    EXPECT_GE(mock_launches() - launches, 1) << at;

    Frame bwd;
    bwd.arg({b, len, d});  // dout
    bwd.arg({b, len, d}, u);
    bwd.arg({b, len, d}, delta);
    bwd.arg({d, n}, A);
    bwd.arg(bc, B);
    bwd.arg(bc, C);
    bwd.arg({b, d, 1, n}, states);
    bwd.ret({b, len, d});
    bwd.ret({b, len, d});
    bwd.ret({d, n});
    bwd.ret(bc);
    bwd.ret(bc);
    bwd.attr("inputs", "dout,u,delta,A,B,C,states");
    bwd.attr("outputs", "du,ddelta,dA,dB,dC");
    bwd.attr("layout", "bld");
    launches = mock_launches();
    ASSERT_EQ(bwd.call("kspec_selective_scan_bwd", kInitialize), nullptr) << at << ": " << g_error;
    ASSERT_EQ(bwd.call("kspec_selective_scan_bwd", kExecute), nullptr) << at << ": " << g_error;
    EXPECT_GE(mock_launches() - launches, 1) << at;
  }
  // A buffer in the other order (bdl's [batch, dim, seqlen] under layout "bld") is refused, naming it.
  Frame bad;
  bad.arg({b, len, d});
  bad.arg({b, d, len});
  bad.arg({d, n});
  bad.arg({b, len, n});
  bad.arg({b, len, n});
  bad.ret({b, len, d});
  bad.ret({b, d, n});
  bad.attr("inputs", "u,delta,A,B,C");
  bad.attr("outputs", "out,last_state");
  bad.attr("layout", "bld");
  ASSERT_NE(bad.call("kspec_selective_scan_fwd", kExecute), nullptr);
  EXPECT_NE(g_error.find("'delta'"), std::string::npos) << g_error;
  // The op's own rule for bld: 8 channels in 2 groups is not a problem its sequential kernels take.
  Frame narrow;
  narrow.arg({b, len, 8});
  narrow.arg({b, len, 8});
  narrow.arg({8, n});
  narrow.arg({b, len, g, n});
  narrow.arg({b, len, g, n});
  narrow.ret({b, len, 8});
  narrow.ret({b, 8, n});
  narrow.attr("inputs", "u,delta,A,B,C");
  narrow.attr("outputs", "out,last_state");
  narrow.attr("layout", "bld");
  ASSERT_NE(narrow.call("kspec_selective_scan_fwd", kExecute), nullptr);
  EXPECT_NE(g_error.find("layout \"bld\" runs the sequential algorithm"), std::string::npos) << g_error;
}

TEST_F(XlaHandlers, RuntimeParamOperandIsRefusedNamingTheDeviceInput) {
  Frame f;
  f.arg({1});
  for (int list = 0; list < 4; ++list) f.arg({8});
  f.ret({1});
  f.attr("inputs", "lr,params,grads,exp_avg,exp_avg_sq");
  f.attr("outputs", "grad_norm");
  f.attr("tensors", int64_t(1));
  ASSERT_NE(f.call("kspec_adamw", kExecute), nullptr);
  EXPECT_NE(g_error.find("runtime param 'lr' cannot be an operand"), std::string::npos) << g_error;
  EXPECT_NE(g_error.find("'device_lr'"), std::string::npos) << g_error;
}

}  // namespace
