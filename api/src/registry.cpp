// The registry and the call path: validate → plan (cached per problem signature and device) → launch.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <unordered_map>

#include "api/src/kernels.h"
#include "api/src/op.h"
#include "api/src/tuning.h"
#include "cache/disk_cache.h"
#include "jit/driver.h"
#include "jit/key.h"
#include "jit/log.h"
#include "kspec/knobs.h"

namespace kspec {

// ---- small value types ----

std::string param_to_string(const ParamValue& v) {
  if (auto p = std::get_if<int64_t>(&v)) return std::to_string(*p);
  if (auto p = std::get_if<double>(&v)) {  // the shortest text that reads back as the same double
    char buf[32];
    auto r = std::to_chars(buf, buf + sizeof(buf), *p);
    return std::string(buf, r.ptr);
  }
  if (auto p = std::get_if<bool>(&v)) return *p ? "true" : "false";
  return std::get<std::string>(v);
}

Params::Params(std::initializer_list<std::pair<std::string, ParamValue>> items) {
  for (const auto& [k, v] : items) set(k, v);
}

Params& Params::set(const std::string& name, ParamValue value) {
  for (auto& kv : items_)
    if (kv.first == name) {
      kv.second = std::move(value);
      return *this;
    }
  items_.emplace_back(name, std::move(value));
  return *this;
}

const ParamValue* Params::find(std::string_view name) const {
  for (const auto& kv : items_)
    if (kv.first == name) return &kv.second;
  return nullptr;
}

int64_t Config::get(std::string_view name) const {
  for (const auto& [k, v] : values)
    if (k == name) return v;
  throw InvalidArgument(detail::concat("config: no value for '", name, "' in {", str(), "}"));
}

bool Config::has(std::string_view name) const {
  return std::any_of(values.begin(), values.end(), [&](const auto& kv) { return kv.first == name; });
}

std::string Config::str() const {
  std::string s;
  for (const auto& [k, v] : values) s += (s.empty() ? "" : ",") + k + "=" + std::to_string(v);
  return s;
}

Config Config::parse(std::string_view text) {
  Config c;
  std::string s(text);
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    auto eq = item.find('=');
    KSPEC_CHECK(eq != std::string::npos, "config: expected name=value pairs separated by commas, got '", text, "'");
    try {
      c.values.emplace_back(item.substr(0, eq), std::stoll(item.substr(eq + 1)));
    } catch (const std::exception&) {
      throw InvalidArgument(detail::concat("config: '", item, "' is not name=integer"));
    }
  }
  return c;
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

double tolerance_for(DType dtype) {
  switch (dtype) {
    case DType::f32: return 1e-5;
    case DType::f64: return 1e-12;
    case DType::f16: return 1e-2;
    case DType::bf16: return 1e-2;
    default: return 0;
  }
}

std::vector<Config> TuningSpace::enumerate(const Problem& p) const {
  std::vector<Config> out;
  std::string why;  // some rules write their reason unconditionally
  for (Config& c : all_combinations())
    if (!valid || valid(p, c, &why)) out.push_back(std::move(c));
  return out;
}

std::vector<Config> TuningSpace::all_combinations() const {
  std::vector<Config> out;
  if (axes.empty()) return {Config{}};
  std::vector<size_t> idx(axes.size(), 0);
  while (true) {
    Config c;
    for (size_t i = 0; i < axes.size(); ++i) c.values.emplace_back(axes[i].first, axes[i].second[idx[i]]);
    out.push_back(std::move(c));
    size_t i = 0;
    for (; i < axes.size(); ++i) {
      if (++idx[i] < axes[i].second.size()) break;
      idx[i] = 0;
    }
    if (i == axes.size()) break;
  }
  return out;
}

// ---- registry ----

Registry& Registry::global() {
  static Registry* r = [] {
    auto* reg = new Registry();  // never destroyed: ops may be called from other static destructors
    register_all_ops(*reg);
    return reg;
  }();
  return *r;
}

void Registry::add(OpDef def) {
  KSPEC_CHECK(!find(def.info.name), "registry: op '", def.info.name, "' registered twice");
  ops_.push_back(std::make_unique<OpDef>(std::move(def)));
}

const OpDef* Registry::find(std::string_view name) const {
  for (const auto& op : ops_)
    if (op->info.name == name) return op.get();
  return nullptr;
}

const OpDef& Registry::get(std::string_view name) const {
  if (const OpDef* op = find(name)) return *op;
  std::string names;
  for (const auto& op : ops_) names += (names.empty() ? "" : ", ") + op->info.name;
  throw InvalidArgument(detail::concat("unknown op '", name, "' (registered: ", names, ")"));
}

std::vector<std::string> Registry::names() const {
  std::vector<std::string> out;
  for (const auto& op : ops_) out.push_back(op->info.name);
  return out;
}

std::vector<std::string> list_ops() { return Registry::global().names(); }

const OpInfo& op_info(std::string_view name) { return Registry::global().get(name).info; }

std::string describe_op(std::string_view name) {
  const OpDef& op = Registry::global().get(name);
  const OpInfo& i = op.info;
  std::ostringstream os;
  os << i.name << " — " << i.doc << "\n";
  auto tensor = [&](const TensorDef& t) {
    os << "    " << t.name << ": [";
    for (size_t k = 0; k < t.shape.size(); ++k) os << (k ? ", " : "") << t.shape[k];
    os << "] ";
    if (!t.alt_shape.empty()) {
      os << "or [";
      for (size_t k = 0; k < t.alt_shape.size(); ++k) os << (k ? ", " : "") << t.alt_shape[k];
      os << "] ";
    }
    if (!t.dtype_of.empty()) {
      os << "dtype of " << t.dtype_of << (t.or_float32 ? " or float32" : "");
    } else {
      for (size_t k = 0; k < t.dtypes.size(); ++k) os << (k ? "|" : "") << dtype_short(t.dtypes[k]);
    }
    if (t.optional) os << " (optional)";
    if (!t.present_with.empty()) os << " (present with " << t.present_with << ")";
    if (!t.doc.empty()) os << "  " << t.doc;
    os << "\n";
  };
  os << "  inputs:\n";
  for (const auto& t : i.inputs) tensor(t);
  os << "  outputs:\n";
  for (const auto& t : i.outputs) tensor(t);
  if (!i.params.empty()) {
    os << "  params:\n";
    for (const auto& p : i.params) {
      os << "    " << p.name << " = " << param_to_string(p.default_value);
      if (!p.choices.empty()) {
        os << "  {";
        for (size_t k = 0; k < p.choices.size(); ++k) os << (k ? ", " : "") << p.choices[k];
        os << "}";
      }
      if (p.min || p.max)
        os << "  [" << (p.min ? detail::concat(*p.min) : std::string()) << ".." << (p.max ? detail::concat(*p.max) : std::string())
           << "]";
      if (!p.doc.empty()) os << "  " << p.doc;
      os << "\n";
    }
  }
  os << "  dims:";
  for (const auto& d : i.dims)
    os << " " << d.name << (d.kind == DimKind::Var ? "(runtime)" : d.kind == DimKind::Const ? "(compile-time)" : "(bucketed)");
  os << "\n  tuning:";
  for (const auto& [axis, values] : i.tuning_axes) {
    os << " " << axis << "{";
    for (size_t k = 0; k < values.size(); ++k) os << (k ? "," : "") << values[k];
    os << "}";
  }
  if (!i.tuning_note.empty()) os << " " << i.tuning_note;
  os << "\n  reference: " << i.reference << "\n";
  return os.str();
}

// ---- the call path ----

// The compile target of a device ("sm_90a" on an H100), looked up once per device (kernels.h).
const std::string& device_arch(int device) {
  static std::mutex mu;
  static std::map<int, std::string> archs;
  std::lock_guard<std::mutex> lock(mu);
  auto it = archs.find(device);
  if (it != archs.end()) return it->second;
  jit::primary_context(device);  // validates the ordinal
  CUdevice dev;
  int major = 0, minor = 0;
  CU_CHECK(cuDeviceGet(&dev, device));
  CU_CHECK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
  CU_CHECK(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
  return archs.emplace(device, jit::arch_for_compute_capability(major, minor)).first->second;
}

namespace {

struct PlanEntry {
  Config config;
  std::vector<LoadedKernel*> kernels;
  uint64_t generation = 0;
  bool bucketed = false;  // a marker: the plan depends on the shape bucket (see plan_for)
};

// A device attribute, read once per device.
int device_attribute(int device, CUdevice_attribute attr) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, int> values;
  std::lock_guard<std::mutex> lock(mu);
  auto it = values.find({device, static_cast<int>(attr)});
  if (it != values.end()) return it->second;
  CUdevice dev;
  int n = 0;
  CU_CHECK(cuDeviceGet(&dev, device));
  CU_CHECK(cuDeviceGetAttribute(&n, attr, dev));
  return values.emplace(std::make_pair(device, static_cast<int>(attr)), n).first->second;
}
int device_sms(int device) { return device_attribute(device, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT); }
int device_cc_major(int device) { return device_attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR); }

// A library op (no kernels function) compiles nothing.
std::vector<jit::KernelSpec> kernel_specs(const OpDef& op, const Problem& p, const Config& c) {
  return op.kernels ? op.kernels(p, c) : std::vector<jit::KernelSpec>{};
}

// The plan of a problem on a device, cached by signature (and, when the tuning database has entries
// for that signature, by shape bucket too: the tuned config may differ between buckets). A plan built
// before this process last wrote the database is rebuilt once.
PlanEntry& plan_for(const OpDef& op, const Problem& p, int device, const Config* forced, Stream stream) {
  static std::shared_mutex mu;
  static std::unordered_map<std::string, std::unique_ptr<PlanEntry>> plans;
  static std::vector<std::unique_ptr<PlanEntry>> replaced;  // launches may still hold them
  uint64_t generation = tuning_generation();
  std::string key = p.signature();
  key += "#d";
  key += std::to_string(device);
  if (forced) key += "#" + forced->str();
  {
    std::shared_lock<std::shared_mutex> lock(mu);
    auto it = plans.find(key);
    if (it != plans.end() && it->second->generation == generation) {
      if (!it->second->bucketed) return *it->second;
      auto bt = plans.find(key + "#b" + tune_bucket(p));
      if (bt != plans.end() && bt->second->generation == generation) return *bt->second;
    }
  }
  bool bucketed = !forced && !op.tuning.empty() &&
                  (knobs::tune_mode() == knobs::TuneMode::Auto || tuning_has_signature(p.signature(), device));
  // KSPEC_TUNE=auto may tune now, but never inside a CUDA graph capture.
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  if (bucketed && knobs::tune_mode() == knobs::TuneMode::Auto)
    CU_CHECK(cuStreamIsCapturing(reinterpret_cast<CUstream>(stream), &capture));
  auto entry = std::make_unique<PlanEntry>();
  ConfigChoice choice = choose_config(op, p, forced, device, capture == CU_STREAM_CAPTURE_STATUS_NONE);
  entry->config = choice.config;
  entry->generation = generation;
  for (const auto& spec : kernel_specs(op, p, entry->config)) entry->kernels.push_back(&load_kernel(spec, device));
  std::unique_lock<std::shared_mutex> lock(mu);
  auto put = [&](const std::string& k, std::unique_ptr<PlanEntry> e) -> PlanEntry& {
    auto& slot = plans[k];
    if (slot) replaced.push_back(std::move(slot));
    slot = std::move(e);
    return *slot;
  };
  if (!bucketed) return put(key, std::move(entry));
  auto marker = std::make_unique<PlanEntry>();
  marker->bucketed = true;
  marker->generation = generation;
  put(key, std::move(marker));
  return put(key + "#b" + tune_bucket(p), std::move(entry));
}

struct Workspace {
  CUdeviceptr ptr = 0;
  size_t bytes = 0;
};

class DeviceLauncher final : public Launcher {
 public:
  DeviceLauncher(PlanEntry& plan, int device, Stream stream) : plan_(plan), device_(device), stream_(stream) {}
  // An op that threw mid-capture: its graph-owned workspace is freed on the stream all the same (the capture
  // is broken anyway; nothing to report from a destructor).
  ~DeviceLauncher() override {
    for (CUdeviceptr p : graph_owned_) jit::driver().cuMemFreeAsync(p, reinterpret_cast<CUstream>(stream_));
  }
  DeviceLauncher(const DeviceLauncher&) = delete;
  DeviceLauncher& operator=(const DeviceLauncher&) = delete;

  // After the op's launches: a captured call's workspace is freed in the graph, behind its kernels.
  void finish() {
    std::vector<CUdeviceptr> owned;
    owned.swap(graph_owned_);
    for (CUdeviceptr p : owned) CU_CHECK(cuMemFreeAsync(p, reinterpret_cast<CUstream>(stream_)));
  }

  void launch(size_t k, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args) override {
    LoadedKernel* lk = prepare(k, grid, shared_bytes);
    if (!lk) return;
    CUresult r = jit::driver().cuLaunchKernel(lk->fn, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                                              shared_bytes, reinterpret_cast<CUstream>(stream_), args, nullptr);
    if (r != CUDA_SUCCESS)
      throw CudaError(detail::concat("cuLaunchKernel(", lk->entry->spec, ", grid ", grid.x, "x", grid.y, "x", grid.z,
                                     ", block ", block.x, "x", block.y, "x", block.z, ", smem ", shared_bytes,
                                     ") failed: ", jit::driver_error_text(r)));
    count_launch();
  }

  void launch_clusters(size_t k, Dim3 grid, Dim3 block, Dim3 cluster, unsigned shared_bytes, void** args) override {
    CUlaunchAttribute attr{};
    attr.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = cluster.x;
    attr.value.clusterDim.y = cluster.y;
    attr.value.clusterDim.z = cluster.z;
    launch_ex(k, grid, block, shared_bytes, args, attr,
              detail::concat(", cluster ", cluster.x, "x", cluster.y, "x", cluster.z));
  }

  void launch_dependent(size_t k, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args) override {
    if (device_cc_major(device_) < 9) return launch(k, grid, block, shared_bytes, args);
    CUlaunchAttribute attr{};
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    launch_ex(k, grid, block, shared_bytes, args, attr, ", programmatic stream serialization");
  }

  // Outside capture: one buffer per (device, stream), grown on demand; kernels on one stream run one after
  // another, so they may share it, and kernels on two streams never do. Inside a capture (torch.cuda.graph
  // captures on a stream of its own that no warm-up ran on, and a graph may be replayed on any stream,
  // concurrently with eager work on the stream it was captured on): the workspace is a stream-ordered
  // allocation of the graph itself (cuMemAllocAsync, freed by finish() behind the op's kernels), so every
  // captured call has its own and no replay shares it with anything else; replays allocate nothing.
  void* workspace(size_t bytes) override {
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    CU_CHECK(cuStreamIsCapturing(reinterpret_cast<CUstream>(stream_), &status));
    if (status != CU_STREAM_CAPTURE_STATUS_NONE) {
      if (!graph_owned_.empty() && graph_bytes_ >= bytes) return reinterpret_cast<void*>(graph_owned_.back());
      // A larger request moves the workspace (as outside capture); the smaller one stays allocated until
      // finish(), as kernels already captured read it.
      CUdeviceptr p = 0;
      CUresult r = jit::driver().cuMemAllocAsync(&p, std::max<size_t>(bytes, 256), reinterpret_cast<CUstream>(stream_));
      KSPEC_CHECK_AS(r == CUDA_SUCCESS, Unsupported, "kspec could not allocate its workspace (", bytes,
                     " bytes) inside the CUDA graph being captured (cuMemAllocAsync: ", jit::driver_error_text(r),
                     "; graph memory nodes need a device with memory pools)");
      graph_owned_.push_back(p);
      graph_bytes_ = bytes;
      return reinterpret_cast<void*>(p);
    }
    static std::mutex mu;
    static std::map<std::pair<int, Stream>, Workspace> spaces;
    std::lock_guard<std::mutex> lock(mu);
    Workspace& w = spaces[{device_, stream_}];
    if (w.bytes >= bytes) return reinterpret_cast<void*>(w.ptr);
    if (w.ptr) {
      CU_CHECK(cuStreamSynchronize(reinterpret_cast<CUstream>(stream_)));  // pending kernels may still use it
      CU_CHECK(cuMemFree(w.ptr));
      w = Workspace{};
    }
    size_t grow = std::max(bytes, size_t(1) << 20);
    CU_CHECK(cuMemAlloc(&w.ptr, grow));
    w.bytes = grow;
    return reinterpret_cast<void*>(w.ptr);
  }

  int multiprocessors() const override { return device_sms(device_); }

  int occupancy(size_t k, unsigned block_threads, unsigned shared_bytes) override {
    KSPEC_CHECK_AS(k < plan_.kernels.size(), Error, "launcher: kernel ", k, " not in plan");
    LoadedKernel& lk = *plan_.kernels[k];
    int cached = lk.occupancy_for(block_threads, shared_bytes);
    if (cached > 0) return cached;
    int blocks = 0;
    CU_CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, lk.fn, static_cast<int>(block_threads), shared_bytes));
    lk.remember_occupancy(block_threads, shared_bytes, blocks);
    return blocks;
  }

 private:
  // cuLaunchKernelEx with one attribute (`what` describes it in the error). By value: CUlaunchConfig points
  // at a mutable attribute.
  void launch_ex(size_t k, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args, CUlaunchAttribute attr,
                 const std::string& what) {
    LoadedKernel* lk = prepare(k, grid, shared_bytes);
    if (!lk) return;
    CUlaunchConfig cfg{};
    cfg.gridDimX = grid.x;
    cfg.gridDimY = grid.y;
    cfg.gridDimZ = grid.z;
    cfg.blockDimX = block.x;
    cfg.blockDimY = block.y;
    cfg.blockDimZ = block.z;
    cfg.sharedMemBytes = shared_bytes;
    cfg.hStream = reinterpret_cast<CUstream>(stream_);
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CUresult r = jit::driver().cuLaunchKernelEx(&cfg, lk->fn, args, nullptr);
    if (r != CUDA_SUCCESS)
      throw CudaError(detail::concat("cuLaunchKernelEx(", lk->entry->spec, ", grid ", grid.x, "x", grid.y, "x",
                                     grid.z, what, ", block ", block.x, "x", block.y, "x", block.z, ", smem ",
                                     shared_bytes, ") failed: ", jit::driver_error_text(r)));
    count_launch();
  }

  // The plan's kernel k with room for shared_bytes of dynamic shared memory; null when the grid is
  // empty (nothing to do, e.g. zero rows).
  LoadedKernel* prepare(size_t k, Dim3 grid, unsigned shared_bytes) {
    KSPEC_CHECK_AS(k < plan_.kernels.size(), Error, "launcher: kernel ", k, " not in plan");
    LoadedKernel& lk = *plan_.kernels[k];
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) return nullptr;
    if (static_cast<int>(shared_bytes) > lk.dynamic_smem_limit.load(std::memory_order_relaxed)) {
      CU_CHECK(cuFuncSetAttribute(lk.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                  static_cast<int>(shared_bytes)));
      lk.dynamic_smem_limit.store(static_cast<int>(shared_bytes));
    }
    return &lk;
  }

  PlanEntry& plan_;
  int device_;
  Stream stream_;
  std::vector<CUdeviceptr> graph_owned_;  // this call's workspace(s) inside a capture
  size_t graph_bytes_ = 0;                // the size of graph_owned_.back()
};

}  // namespace

void call(std::string_view op_name, const std::vector<TensorView>& inputs, const std::vector<TensorView>& outputs,
          const Params& params, Stream stream, const CallOptions& options) {
  const OpDef& op = Registry::global().get(op_name);
  Call c = validate_call(op, inputs, outputs, params, stream);
  c.problem.arch = device_arch(c.device);
  PlanEntry& plan = plan_for(op, c.problem, c.device, options.config, stream);
  jit::ContextGuard guard(c.device);
  DeviceLauncher launcher(plan, c.device, stream);
  op.launch(c, plan.config, launcher);
  launcher.finish();
}

// ---- bound calls ----

struct BoundCall::Impl {
  const OpDef* op = nullptr;
  std::vector<std::vector<TensorView>> lists;  // the list inputs' items, owned here
  Call call;                                   // validated once; run() swaps params, outputs, stream
  PlanEntry* plan = nullptr;                   // plans are never freed (see plan_for)
  Config config;
  std::string config_text;
  std::unique_ptr<BoundData> data;
  CUevent done = nullptr;  // recorded after each run outside graph capture; the destructor waits for it
  bool recorded = false;
  int64_t runs = 0;
};

namespace {
int pointer_align(const void* p) {
  auto a = reinterpret_cast<uintptr_t>(p);
  int al = 16;
  while (al > 1 && a % al) al /= 2;
  return al;
}
}  // namespace

BoundCall::BoundCall(std::string_view op_name, const std::vector<TensorView>& inputs,
                     const std::vector<TensorView>& outputs, const Params& params)
    : impl_(std::make_unique<Impl>()) {
  Impl& b = *impl_;
  b.op = &Registry::global().get(op_name);
  std::vector<TensorView> ins = inputs;
  b.lists.reserve(ins.size());
  for (auto& t : ins) {
    if (!t.is_list()) continue;
    b.lists.emplace_back();
    for (int64_t i = 0; i < t.list_size(); ++i) b.lists.back().push_back(t.item(i));
    t = TensorView::list(b.lists.back().data(), t.list_size());
  }
  b.call = validate_call(*b.op, ins, outputs, params, nullptr);
  b.call.problem.arch = device_arch(b.call.device);
  b.plan = &plan_for(*b.op, b.call.problem, b.call.device, nullptr, nullptr);
  b.config = b.plan->config;
  b.config_text = b.config.str();
  jit::ContextGuard guard(b.call.device);
  if (b.op->bind) b.data = b.op->bind(b.call, b.config);
  b.call.bound = b.data.get();
  CU_CHECK(cuEventCreate(&b.done, CU_EVENT_DISABLE_TIMING));
}

BoundCall::~BoundCall() {
  if (!impl_) return;
  Impl& b = *impl_;
  if (b.done) {
    // Its kernels may still read the op's tables (device memory freed with `data`).
    if (b.recorded) jit::driver().cuEventSynchronize(b.done);
    jit::driver().cuEventDestroy(b.done);
  }
}

const std::string& BoundCall::config() const { return impl_->config_text; }
int64_t BoundCall::runs() const { return impl_->runs; }

bool BoundCall::idle() const {
  return !impl_->recorded || jit::driver().cuEventQuery(impl_->done) != CUDA_ERROR_NOT_READY;
}

void BoundCall::run(const Params& runtime_params, const std::vector<TensorView>& outputs, Stream stream) {
  Impl& b = *impl_;
  const OpInfo& info = b.op->info;
  Call c = b.call;
  if (!runtime_params.items().empty()) {
    Params merged = b.call.problem.params;
    for (const auto& [name, v] : runtime_params.items()) {
      auto d = std::find_if(info.params.begin(), info.params.end(), [&](const ParamDef& p) { return p.name == name; });
      KSPEC_CHECK(d != info.params.end(), info.name, ": unknown parameter '", name, "'");
      KSPEC_CHECK(d->runtime, info.name, ": parameter '", name,
                  "' is compiled into the bound call; bind the call again to change it");
      merged.set(name, v);
    }
    c.problem.params = complete_params(*b.op, merged);
  }
  KSPEC_CHECK(outputs.size() == b.call.outputs.size(), info.name, ": expected ", b.call.outputs.size(),
              " outputs, got ", outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    const TensorView &want = b.call.outputs[i], &got = outputs[i];
    const std::string& name = info.outputs[i].name;
    KSPEC_CHECK(want.defined() == got.defined(), info.name, ": output '", name, "' ",
                want.defined() ? "is required (the call was bound with it)" : "must be None (the call was bound without it)");
    if (!got.defined()) continue;
    bool same = got.dtype == want.dtype && got.rank == want.rank && got.device == want.device &&
                pointer_align(got.data) >= pointer_align(want.data) && (got.data || got.numel() == 0);
    for (int d = 0; same && d < got.rank; ++d) same = got.shape[d] == want.shape[d] && got.strides[d] == want.strides[d];
    KSPEC_CHECK(same, info.name, ": output '", name, "': expected a tensor laid out like the bound one (", want.describe(),
                "), got ", got.describe());
  }
  // Outputs laid out like the bound ones at the same addresses were checked by the bind (~10 us at
  // AdamW's 1000 tensors, spent only when an output moved).
  bool moved = false;
  for (size_t i = 0; i < outputs.size(); ++i) moved = moved || outputs[i].data != b.call.outputs[i].data;
  if (moved) check_no_overlap(info, b.call.inputs, outputs);
  c.outputs = outputs;
  c.stream = stream;
  if (b.op->check_call) b.op->check_call(c);  // the runtime params' rules
  jit::ContextGuard guard(c.device);
  DeviceLauncher launcher(*b.plan, c.device, stream);
  b.op->launch(c, b.config, launcher);
  launcher.finish();
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  CU_CHECK(cuStreamIsCapturing(reinterpret_cast<CUstream>(stream), &capture));
  if (capture == CU_STREAM_CAPTURE_STATUS_NONE) {
    CU_CHECK(cuEventRecord(b.done, reinterpret_cast<CUstream>(stream)));
    b.recorded = true;
  }
  ++b.runs;
}

std::vector<OutputSpec> infer_outputs(std::string_view op_name, const std::vector<TensorView>& inputs,
                                      const Params& params) {
  const OpDef& op = Registry::global().get(op_name);
  Problem p = validate_call(op, inputs, {}, params, nullptr, /*inputs_only=*/true).problem;
  std::vector<OutputSpec> out;
  for (size_t i = 0; i < op.info.outputs.size(); ++i) {
    const TensorDef& d = op.info.outputs[i];
    OutputSpec s;
    s.present = d.present_with.empty() ? !d.optional : p.present(d.present_with);
    if (!d.dtype_of.empty()) s.dtype = p.dtype(d.dtype_of);
    else s.dtype = d.dtypes.front();
    if (s.present) s.shape = shape_of(d, p);
    out.push_back(std::move(s));
  }
  return out;
}

namespace {

PlanInfo plan_info(const OpDef& op, const Problem& p, int device, const Call* call = nullptr) {
  knobs::validate();
  ConfigChoice ch = choose_config(op, p, nullptr, device);
  if (call && ch.source == "tuned" && op.tuning.applies) {
    // A library's tuned config may still be refused for this call (cuBLASLt checks the algorithm against
    // the call's layouts): say what the launch will really do.
    std::string why = op.tuning.applies(*call, ch.config);
    if (!why.empty()) {
      ch.note = "tuned entry {" + ch.config.str() + "} does not apply to this call: " + why;
      ch.config = op.tuning.heuristic ? op.tuning.heuristic(p) : Config{};
      ch.source = "heuristic";
    }
  }
  PlanInfo info;
  info.op = op.info.name;
  info.signature = p.signature();
  info.bucket = tune_bucket(p);
  info.config = ch.config.str();
  info.config_source = ch.source;
  info.note = ch.note;
  info.tuning_db = ch.db_path.empty() ? tuning_db_path(device) : ch.db_path;
  info.tuning_key = ch.key.empty() ? tuning_key(p) : ch.key;
  knobs::TuneMode mode = knobs::tune_mode();
  info.tune_mode = mode == knobs::TuneMode::Off ? "off" : mode == knobs::TuneMode::Auto ? "auto" : "on";
  for (const auto& spec : kernel_specs(op, p, ch.config)) {
    std::string key = jit::content_key(spec);
    info.kernels.push_back({spec.name_expression(), spec.arch, key, cache::DiskCache::global().entry_path(key)});
  }
  return info;
}

// A device to read the tuning database for when there are no tensors: the first GPU, if any.
int default_device() { return jit::driver_available() && jit::device_count() > 0 ? 0 : -1; }

}  // namespace

std::string PlanInfo::str() const {
  std::ostringstream os;
  os << "op: " << op << "\nspecialization: " << signature << "\nshape bucket: " << bucket << "\nconfig: " << config
     << " (" << config_source << ")\n";
  if (!note.empty()) os << "  note: " << note << "\n";
  os << "tuning database: " << tuning_db << " (KSPEC_TUNE=" << tune_mode << ")\n  key: " << tuning_key << "\n";
  if (kernels.empty()) os << "kernels: none (a library op, or nothing to launch)\n";
  for (const auto& k : kernels)
    os << "kernel: " << k.name << "\n  arch: " << k.arch << "\n  key: " << k.key << "\n  cache entry: " << k.cache_path
       << "\n";
  return os.str();
}

PlanInfo explain_plan(std::string_view op_name, const std::vector<TensorView>& inputs,
                      const std::vector<TensorView>& outputs, const Params& params) {
  const OpDef& op = Registry::global().get(op_name);
  Call c = validate_call(op, inputs, outputs, params, nullptr);
  c.problem.arch = device_arch(c.device);
  return plan_info(op, c.problem, c.device, &c);
}

PlanInfo explain_request(const CompileRequest& req) {
  const OpDef& op = Registry::global().get(req.op);
  Problem p = problem_from_request(op, req);
  return plan_info(op, p, default_device());
}

std::string explain(std::string_view op_name, const std::vector<TensorView>& inputs,
                    const std::vector<TensorView>& outputs, const Params& params) {
  return explain_plan(op_name, inputs, outputs, params).str();
}

// ---- compile without a GPU ----

std::vector<CompileReport> compile(const CompileRequest& req) {
  knobs::validate();  // also for an op with no kernel to obtain
  const OpDef& op = Registry::global().get(req.op);
  Problem p = problem_from_request(op, req);
  Config cfg = choose_config(op, p, req.config ? &*req.config : nullptr, default_device()).config;
  std::vector<CompileReport> out;  // empty for a library op or a problem that needs no kernel
  for (const auto& spec : kernel_specs(op, p, cfg)) {
    Obtained ob = obtain_binary(spec);
    CompileReport r;
    r.op = op.info.name;
    r.kernel = spec.name_expression();
    r.spec = spec.canonical();
    r.key = ob.entry->key;
    r.source = ob.source;
    r.compile_ms = ob.source == "compiled" ? ob.entry->compile_ms : 0;
    r.load_ms = ob.ms;
    r.registers = ob.entry->resources.registers;
    r.spill_bytes = ob.entry->resources.spill_bytes;
    r.stack_bytes = ob.entry->resources.stack_bytes;
    r.shared_bytes = ob.entry->resources.static_shared_bytes;
    r.arch = spec.arch;
    r.path = ob.entry->path;
    r.config = cfg.str();
    r.log = ob.entry->log;
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<CompileRequest> precompile_plan(const std::vector<std::string>& archs, const std::vector<std::string>& ops) {
  std::vector<CompileRequest> out;
  const Registry& reg = Registry::global();
  for (const auto& name : ops.empty() ? reg.names() : ops) {
    const OpDef& op = reg.get(name);
    if (!op.kernels) continue;  // a library op: nothing to compile
    // the algorithm axis (a tuning space's first axis), if any
    const std::string first = op.tuning.axes.empty() ? std::string() : op.tuning.axes.front().first;
    for (const auto& arch : archs) {
      std::map<std::string, bool> seen;  // one request per distinct kernel set
      bool any_rep = std::any_of(op.cases.begin(), op.cases.end(), [](const Case& c) { return c.representative; });
      for (const auto& cs : op.cases) {
        if (cs.large || (any_rep && !cs.representative)) continue;
        for (DType dt : op.dtypes) {
          CompileRequest req;
          req.op = name;
          req.dtype = dt;
          req.arch = arch;
          req.without = cs.without;
          req.tensor_dtypes = cs.tensor_dtypes;
          req.alt_shapes = cs.alt_shapes;
          for (const auto& [k, v] : cs.params.items()) req.params.set(k, v);
          for (const auto& [k, v] : cs.dims) {
            bool is_dim = false;
            for (const auto& d : op.info.dims) is_dim = is_dim || (d.name == k && d.kind != DimKind::Var);
            if (is_dim) req.params.set(k, v);
          }
          auto add = [&](const CompileRequest& base, const Problem& p, const Config& cfg) {
            std::string sig;
            for (const auto& spec : op.kernels(p, cfg)) sig += spec.canonical() + "\n";
            if (sig.empty() || seen[sig]) return;
            seen[sig] = true;
            CompileRequest r = base;
            r.config = cfg;
            out.push_back(std::move(r));
          };
          const Problem p = problem_from_request(op, req);
          std::set<int64_t> algos;  // values of the first axis (the algorithm) these dims admit
          for (const auto& cfg : op.tuning.enumerate(p)) {
            if (!first.empty()) algos.insert(cfg.get(first));
            add(req, p, cfg);
          }
          if (first.empty()) continue;
          // Then with the case's runtime dims too, for the algorithms that only they admit: selective_scan's
          // one-pass tile kernel needs a seqlen of whole 512-step tiles. The other algorithms' kernels for
          // those dims (e.g. the scans' kEven variants) are left to the JIT: they would double the scans'
          // share of this plan.
          CompileRequest full = req;
          for (const auto& [k, v] : cs.dims) full.params.set(k, v);
          const Problem pf = problem_from_request(op, full);
          for (const auto& cfg : op.tuning.enumerate(pf))
            if (!algos.count(cfg.get(first))) add(full, pf, cfg);
        }
      }
    }
  }
  return out;
}

}  // namespace kspec
