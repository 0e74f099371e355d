// adamw: fused multi-tensor AdamW (decoupled weight decay) over lists of tensors of any sizes, with
// optional AMSGrad, maximize, fp32 master weights for bf16/fp16 parameters, gradient clipping by the
// global norm and gradient unscaling with an inf/nan check that skips the step. The launcher builds a
// table of tensors and fixed-size chunks in kspec's workspace (one host-to-device copy on the stream);
// a BoundCall (kspec.optim.AdamW, step after step) builds and uploads it once.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "api/src/device_data.h"
#include "api/src/op.h"
#include "jit/driver.h"
#include "templates/adamw/params.h"

namespace kspec {
namespace {

constexpr const char* kHeader = "adamw/adamw.cuh";
constexpr unsigned kFinalizeThreads = 256;

size_t round_up(size_t b) { return (b + 255) / 256 * 256; }

bool device_scalars(const Problem& p) { return p.present("device_step") || p.present("device_lr"); }

bool valid_config(const Problem& p, const Config& c, std::string* why) {
  if (c.get("vec") > 1 && p.align_bytes < 16) {
    if (why) *why = "a tensor is not 16-byte aligned: vectors of 4 need it";
    return false;
  }
  // ptxas (NVRTC 13.0, sm_90a) spilled 32 B in the bf16-param update with 512 threads and scalar
  // accesses; 512 threads are only worth trying with wide vectors anyway.
  if (c.get("threads") == 512 && c.get("vec") == 1) {
    if (why) *why = "512 threads only with vec 4";
    return false;
  }
  return true;
}

// Measured decisions belong to the tuning database; without one, wide vectors, 256 threads and 64 K
// elements per chunk (about 5400 blocks for GPT-350M's 353.6 M parameters, each thread 64 vectors).
Config heuristic(const Problem& p) {
  return Config{{{"threads", 256}, {"vec", p.align_bytes >= 16 ? 4 : 1}, {"chunk", 65536}}};
}

std::vector<jit::KernelSpec> kernels(const Problem& p, const Config& c) {
  auto spec = [&](const char* name, std::vector<std::string> targs) {
    return kernel_spec(p, kHeader, name, std::move(targs));
  };
  std::string threads = std::to_string(c.get("threads")), chunk = std::to_string(c.get("chunk"));
  const char* tg = dtype_cuda_type(p.dtype("grads"));
  return {spec("kspec::adamw_grad_norm_kernel", {tg, threads, chunk}),
          spec("kspec::adamw_finalize_kernel", {std::to_string(kFinalizeThreads)}),
          spec("kspec::adamw_update_kernel",
               {dtype_cuda_type(p.dtype("params")), tg, p.present("master") ? "true" : "false",
                p.present("max_exp_avg_sq") ? "true" : "false", p.param_bool("maximize") ? "true" : "false",
                device_scalars(p) ? "true" : "false", threads,
                std::to_string(c.get("vec")), chunk})};
}

void check_call(const Call& call) {
  const std::string& op = call.problem.op->info.name;
  bool low = call.problem.dtype("params") != DType::f32;
  KSPEC_CHECK(low == call.problem.present("master"), op, ": ",
              low ? "bf16/fp16 'params' need 'master' (their fp32 copy, updated with them)"
                  : "'master' is only for bf16/fp16 'params'");
  const Params& ps = call.problem.params;
  auto f = [&](const char* n) { return std::get<double>(*ps.find(n)); };
  // The schema bounds the params (ParamDef::min/max); 1 itself is no decay rate (1 - beta^step = 0).
  KSPEC_CHECK(f("beta1") < 1 && f("beta2") < 1, op, ": betas must be in [0, 1), got ", f("beta1"), ", ", f("beta2"));
  const TensorView& params = call.in("params");
  for (int64_t i = 0; i < params.list_size(); ++i)
    KSPEC_CHECK(params.item(i).numel() < (int64_t(1) << 62), op, ": tensor ", i, " is too large");
}

// The table the kernels read: one AdamwTensor per tensor, then one AdamwChunk per `chunk` elements of each
// (5400 chunks for GPT-350M's 354.8 M parameters at 65536), as bytes; tensors_bytes is the chunks' offset.
struct Table {
  std::vector<unsigned char> bytes;
  size_t tensors_bytes = 0;
  int n_chunks = 0;
};

Table build_table(const Call& call, int64_t chunk) {
  const TensorView &params = call.in("params"), &grads = call.in("grads"), &m = call.in("exp_avg"),
                   &v = call.in("exp_avg_sq"), &master = call.in("master"), &vmax = call.in("max_exp_avg_sq");
  std::vector<AdamwTensor> tensors;
  std::vector<AdamwChunk> chunks;
  tensors.reserve(params.list_size());
  for (int64_t i = 0; i < params.list_size(); ++i) {
    int64_t n = params.item(i).numel();
    tensors.push_back({params.item(i).data, grads.item(i).data, static_cast<float*>(m.item(i).data),
                       static_cast<float*>(v.item(i).data),
                       master.defined() ? static_cast<float*>(master.item(i).data) : nullptr,
                       vmax.defined() ? static_cast<float*>(vmax.item(i).data) : nullptr, n});
    for (int64_t s = 0; s < n; s += chunk) chunks.push_back({static_cast<int>(i), 0, s});
  }
  Table t;
  t.tensors_bytes = round_up(tensors.size() * sizeof(AdamwTensor));
  t.n_chunks = static_cast<int>(chunks.size());
  t.bytes.resize(t.tensors_bytes + round_up(chunks.size() * sizeof(AdamwChunk)));
  if (!tensors.empty()) std::memcpy(t.bytes.data(), tensors.data(), tensors.size() * sizeof(AdamwTensor));
  if (!chunks.empty()) std::memcpy(t.bytes.data() + t.tensors_bytes, chunks.data(), chunks.size() * sizeof(AdamwChunk));
  return t;
}

// A bound call's table, uploaded once (an optimizer's parameter lists do not move between steps).
struct BoundTable final : BoundData {
  DeviceBuffer buffer;
  size_t tensors_bytes = 0;
  int n_chunks = 0;
  explicit BoundTable(size_t bytes) : buffer(bytes) {}
};

std::unique_ptr<BoundData> bind(const Call& call, const Config& c) {
  Table t = build_table(call, c.get("chunk"));
  auto b = std::make_unique<BoundTable>(t.bytes.size());
  b->tensors_bytes = t.tensors_bytes;
  b->n_chunks = t.n_chunks;
  if (!t.bytes.empty()) CU_CHECK(cuMemcpyHtoD(b->buffer.ptr, t.bytes.data(), t.bytes.size()));
  return b;
}

void launch(const Call& call, const Config& c, Launcher& l) {
  const Problem& p = call.problem;
  const TensorView &scale = call.in("grad_scale"), &device_step = call.in("device_step"),
                   &device_lr = call.in("device_lr");
  const TensorView &found_inf = call.out("found_inf"), &grad_norm = call.out("grad_norm");
  CUstream stream = reinterpret_cast<CUstream>(call.stream);
  void *tensors_dev = nullptr, *chunks_dev = nullptr;
  int n_chunks = 0;
  char* ws = nullptr;
  if (auto* bound = dynamic_cast<const BoundTable*>(call.bound)) {
    n_chunks = bound->n_chunks;
    tensors_dev = reinterpret_cast<void*>(bound->buffer.ptr);
    chunks_dev = reinterpret_cast<char*>(bound->buffer.ptr) + bound->tensors_bytes;
    ws = static_cast<char*>(l.workspace(round_up(n_chunks * sizeof(double)) + 256));
  } else {
    Table t = build_table(call, c.get("chunk"));
    n_chunks = t.n_chunks;
    char* base = static_cast<char*>(l.workspace(t.bytes.size() + round_up(n_chunks * sizeof(double)) + 256));
    // One copy of the table; from pageable memory, cuMemcpyHtoDAsync stages it before returning, so the
    // host vector may go away at once (and the host does not wait for the stream).
    if (!t.bytes.empty()) CU_CHECK(cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(base), t.bytes.data(), t.bytes.size(), stream));
    tensors_dev = base;
    chunks_dev = base + t.tensors_bytes;
    ws = base + t.bytes.size();
  }
  const size_t partial_bytes = round_up(n_chunks * sizeof(double));
  void* partial = ws;
  float* result = reinterpret_cast<float*>(ws + partial_bytes);

  const double lr = p.param_float("lr"), b1 = p.param_float("beta1"), b2 = p.param_float("beta2");
  const double step = static_cast<double>(p.param_int("step"));
  const bool bc = p.param_bool("bias_correction");
  const double bc1 = bc ? 1.0 - std::pow(b1, step) : 1.0, bc2 = bc ? 1.0 - std::pow(b2, step) : 1.0;
  float max_norm = static_cast<float>(p.param_float("max_norm"));
  AdamwScalars s{static_cast<float>(lr), static_cast<float>(b1), static_cast<float>(b2),
                 static_cast<float>(p.param_float("eps")), static_cast<float>(p.param_float("weight_decay")),
                 static_cast<float>(lr / bc1), static_cast<float>(std::sqrt(bc2)), max_norm};

  const unsigned threads = static_cast<unsigned>(c.get("threads"));
  const unsigned grid = static_cast<unsigned>(n_chunks);
  const float* gs = scale.defined() ? static_cast<const float*>(scale.data) : nullptr;
  float* fi = found_inf.defined() ? static_cast<float*>(found_inf.data) : nullptr;
  float* gn = grad_norm.defined() ? static_cast<float*>(grad_norm.data) : nullptr;
  const bool first_pass = max_norm > 0.f || fi || gn;
  const float* res = nullptr;
  // Without bias correction the step is not read, from the host or the device.
  const float* dstep = bc && device_step.defined() ? static_cast<const float*>(device_step.data) : nullptr;
  const float* dlr = device_lr.defined() ? static_cast<const float*>(device_lr.data) : nullptr;
  if (first_pass || device_scalars(p)) {  // the pass that writes what the update reads from `result`
    if (first_pass && grid > 0) {
      void* a0[] = {&tensors_dev, &chunks_dev, &partial};
      l.launch(0, {grid}, {threads}, 0, a0);
    }
    int summed = first_pass ? n_chunks : 0;
    void* a1[] = {&partial, &summed, &gs, &max_norm, &result, &fi, &gn, &s, &dstep, &dlr};
    l.launch(1, {1}, {kFinalizeThreads}, 0, a1);
    res = result;
  }
  void* a2[] = {&tensors_dev, &chunks_dev, &s, &res, &gs};
  l.launch(2, {grid}, {threads}, 0, a2);
}

OpDef make_adamw() {
  OpDef op;
  OpInfo& i = op.info;
  i.name = "adamw";
  i.family = "adamw";
  i.doc = "fused multi-tensor AdamW step (torch.optim.AdamW semantics) over lists of tensors, updated in place";
  auto list = [](const char* name, std::vector<DType> dts, bool optional, const char* doc) {
    TensorDef t{name, {"tensors"}, std::move(dts), "", false, optional, "", Layout::Contiguous, doc};
    t.list = true;
    if (std::string(name) != "params") t.same_shapes_as = "params";
    return t;
  };
  const std::vector<DType> kParamTypes = {DType::f32, DType::bf16, DType::f16};
  i.inputs = {
      list("params", kParamTypes, false, "parameters, updated in place"),
      list("grads", kParamTypes, false, "gradients (possibly scaled by grad_scale)"),
      list("exp_avg", {DType::f32}, false, "first moments, updated in place"),
      list("exp_avg_sq", {DType::f32}, false, "second moments, updated in place"),
      list("master", {DType::f32}, true, "fp32 copies of bf16/fp16 params, updated in place (required for them)"),
      list("max_exp_avg_sq", {DType::f32}, true, "AMSGrad's running max of exp_avg_sq (its presence enables AMSGrad)"),
      {"grad_scale", {"1"}, {DType::f32}, "", false, true, "", Layout::Contiguous,
       "gradients are divided by it (AMP loss scale)"},
      // capturable (a CUDA graph replays the launch's arguments, so these must live on the device)
      {"device_step", {"1"}, {DType::f32}, "", false, true, "", Layout::Contiguous,
       "the step being taken, read by the kernel (CUDA-graph capturable): replaces param 'step'"},
      {"device_lr", {"1"}, {DType::f32}, "", false, true, "", Layout::Contiguous,
       "the learning rate, read by the kernel (CUDA-graph capturable): replaces param 'lr'"},
  };
  i.outputs = {
      {"found_inf", {"1"}, {DType::f32}, "", false, true, "", Layout::Contiguous,
       "1 when a gradient is inf/nan (nothing is updated), else 0"},
      {"grad_norm", {"1"}, {DType::f32}, "", false, true, "", Layout::Contiguous,
       "the global L2 norm of the unscaled gradients (before clipping)"},
  };
  auto rt = [](ParamDef d) {
    d.runtime = true;
    return d;
  };
  i.params = {
      rt({"lr", ParamType::Float, 1e-3, {}, "learning rate", false, 0.0}),
      rt({"beta1", ParamType::Float, 0.9, {}, "first-moment decay (< 1)", false, 0.0, 1.0}),
      rt({"beta2", ParamType::Float, 0.999, {}, "second-moment decay (< 1)", false, 0.0, 1.0}),
      rt({"eps", ParamType::Float, 1e-8, {}, "added to the denominator", false, 0.0}),
      rt({"weight_decay", ParamType::Float, 1e-2, {}, "decoupled: p *= 1 - lr * weight_decay"}),
      rt({"step", ParamType::Int, int64_t(1), {}, "the step being taken (1 for the first: bias correction)", false, 1.0}),
      rt({"bias_correction", ParamType::Bool, true, {}, "divide the moments by 1 - beta^step"}),
      rt({"max_norm", ParamType::Float, 0.0, {}, "> 0: clip gradients to this global L2 norm first", false, 0.0}),
      {"maximize", ParamType::Bool, false, {}, "ascend instead of descend"},
  };
  i.dims = {{"tensors", DimKind::Var, {}, "number of tensors in each list"}};
  op.tuning.axes = {{"threads", {256, 512}}, {"vec", {1, 4}}, {"chunk", {16384, 65536}}};
  op.tuning.valid = valid_config;
  op.tuning.heuristic = heuristic;
  i.tuning_axes = op.tuning.axes;
  i.reference = "api/ops/adamw/reference.cpp (python/kspec/reference/adamw.py)";
  op.kernels = kernels;
  op.check_call = check_call;
  op.launch = launch;
  op.bind = bind;
  op.reference = [](const Problem&, const std::vector<HostTensor>&) -> std::vector<HostTensor> {
    throw Unsupported("adamw: list inputs: the generic checker does not build lists; see ref::adamw_ref and "
                      "tests/python/test_gpu_adamw.py");
  };
  auto cs = [](std::string name, std::vector<std::pair<std::string, DType>> td, std::vector<std::string> without,
               bool maximize, bool capturable = false) {
    Case k;
    k.name = std::move(name);
    k.dims = {{"tensors", 3}};
    k.params = {{"maximize", maximize}};
    k.tensor_dtypes = std::move(td);
    k.without = std::move(without);
    if (!capturable) k.without.insert(k.without.end(), {"device_step", "device_lr"});
    k.representative = true;
    return k;
  };
  op.cases = {
      cs("fp32", {{"params", DType::f32}, {"grads", DType::f32}}, {"master", "max_exp_avg_sq"}, false),
      cs("fp32_amsgrad_maximize", {{"params", DType::f32}, {"grads", DType::f32}}, {"master"}, true),
      cs("bf16_master", {{"params", DType::bf16}, {"grads", DType::bf16}}, {"max_exp_avg_sq"}, false),
      cs("fp16_master_amsgrad", {{"params", DType::f16}, {"grads", DType::f16}}, {}, false),
      cs("bf16_params_fp32_grads", {{"params", DType::bf16}, {"grads", DType::f32}}, {"max_exp_avg_sq"}, false),
      // the step count and lr read on the device (kspec.optim.AdamW(capturable=True))
      cs("fp16_amsgrad_capturable", {{"params", DType::f16}, {"grads", DType::f16}}, {}, false, true),
  };
  op.dtypes = {DType::f32};
  op.generic_check = false;
  return op;
}

}  // namespace

void register_adamw(Registry& r) { r.add(make_adamw()); }

}  // namespace kspec
