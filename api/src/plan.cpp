// The call path: validate → plan (cached per problem signature and device) → launch. Device attributes,
// the plan cache, the DeviceLauncher (launches, workspaces, occupancy) and kspec::call.
#include "api/src/plan.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>

#include "api/src/tuning.h"
#include "jit/driver.h"

namespace kspec {

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

struct Workspace {
  CUdeviceptr ptr = 0;
  size_t bytes = 0;
};

}  // namespace

std::vector<jit::KernelSpec> kernel_specs(const OpDef& op, const Problem& p, const Config& c) {
  return op.kernels ? op.kernels(p, c) : std::vector<jit::KernelSpec>{};
}

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
                  (tune_mode() == TuneMode::Auto || tuning_has_signature(p.signature(), device));
  // KSPEC_TUNE=auto may tune now, but never inside a CUDA graph capture.
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  if (bucketed && tune_mode() == TuneMode::Auto)
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

DeviceLauncher::~DeviceLauncher() {
  for (CUdeviceptr p : graph_owned_) jit::driver().cuMemFreeAsync(p, reinterpret_cast<CUstream>(stream_));
}

void DeviceLauncher::finish() {
  std::vector<CUdeviceptr> owned;
  owned.swap(graph_owned_);
  for (CUdeviceptr p : owned) CU_CHECK(cuMemFreeAsync(p, reinterpret_cast<CUstream>(stream_)));
}

void DeviceLauncher::launch(size_t k, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args) {
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

void DeviceLauncher::launch_clusters(size_t k, Dim3 grid, Dim3 block, Dim3 cluster, unsigned shared_bytes,
                                     void** args) {
  CUlaunchAttribute attr{};
  attr.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  attr.value.clusterDim.x = cluster.x;
  attr.value.clusterDim.y = cluster.y;
  attr.value.clusterDim.z = cluster.z;
  launch_ex(k, grid, block, shared_bytes, args, attr,
            detail::concat(", cluster ", cluster.x, "x", cluster.y, "x", cluster.z));
}

void DeviceLauncher::launch_dependent(size_t k, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args) {
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
void* DeviceLauncher::workspace(size_t bytes) {
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

int DeviceLauncher::multiprocessors() const { return device_sms(device_); }

int DeviceLauncher::occupancy(size_t k, unsigned block_threads, unsigned shared_bytes) {
  KSPEC_CHECK_AS(k < plan_.kernels.size(), InternalError, "launcher: kernel ", k, " not in plan");
  LoadedKernel& lk = *plan_.kernels[k];
  int cached = lk.occupancy_for(block_threads, shared_bytes);
  if (cached > 0) return cached;
  int blocks = 0;
  CU_CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, lk.fn, static_cast<int>(block_threads), shared_bytes));
  lk.remember_occupancy(block_threads, shared_bytes, blocks);
  return blocks;
}

void DeviceLauncher::launch_ex(size_t k, Dim3 grid, Dim3 block, unsigned shared_bytes, void** args,
                               CUlaunchAttribute attr, const std::string& what) {
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

LoadedKernel* DeviceLauncher::prepare(size_t k, Dim3 grid, unsigned shared_bytes) {
  KSPEC_CHECK_AS(k < plan_.kernels.size(), InternalError, "launcher: kernel ", k, " not in plan");
  LoadedKernel& lk = *plan_.kernels[k];
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return nullptr;
  if (static_cast<int>(shared_bytes) > lk.dynamic_smem_limit.load(std::memory_order_relaxed)) {
    CU_CHECK(cuFuncSetAttribute(lk.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                static_cast<int>(shared_bytes)));
    lk.dynamic_smem_limit.store(static_cast<int>(shared_bytes));
  }
  return &lk;
}

namespace {

template <typename T>
void append_raw(std::string& key, const T& v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

int pointer_alignment(const void* p) {
  auto a = reinterpret_cast<uintptr_t>(p);
  int al = 16;
  while (al > 1 && a % al) al /= 2;
  return al;
}

bool append_view(std::string& key, const TensorView& t) {
  if (t.is_list()) return false;
  const int8_t head[4] = {static_cast<int8_t>(t.rank), static_cast<int8_t>(t.dtype),
                          static_cast<int8_t>(pointer_alignment(t.data)), 0};
  append_raw(key, head);
  if (t.rank < 0) return true;
  append_raw(key, t.device);
  key.append(reinterpret_cast<const char*>(t.shape), sizeof(int64_t) * static_cast<size_t>(t.rank));
  key.append(reinterpret_cast<const char*>(t.strides), sizeof(int64_t) * static_cast<size_t>(t.rank));
  return true;
}

// A validated call kept for the next one with the same signature: its problem (params completed, arch
// set), device and padded argument counts, and the plan it used.
struct CachedCall {
  Call call;
  PlanEntry* plan = nullptr;
  uint64_t generation = 0;
};

// Bounded: a process that sweeps shapes stops adding after this many (its calls validate in full).
constexpr size_t kMaxCachedCalls = 4096;

}  // namespace

bool append_call_key(std::string& key, const OpDef& op, const std::vector<TensorView>& inputs,
                     const std::vector<TensorView>& outputs, const Params& params) {
  append_raw(key, &op);
  const uint16_t counts[2] = {static_cast<uint16_t>(inputs.size()), static_cast<uint16_t>(outputs.size())};
  append_raw(key, counts);
  for (const auto& t : inputs)
    if (!append_view(key, t)) return false;
  for (const auto& t : outputs)
    if (!append_view(key, t)) return false;
  for (const auto& [name, v] : params.items()) {
    append_raw(key, static_cast<uint32_t>(name.size()));
    key += name;
    append_raw(key, static_cast<uint8_t>(v.index()));
    if (auto i = std::get_if<int64_t>(&v)) append_raw(key, *i);
    else if (auto d = std::get_if<double>(&v)) append_raw(key, *d);
    else if (auto b = std::get_if<bool>(&v)) append_raw(key, *b);
    else {
      const auto& str = std::get<std::string>(v);
      append_raw(key, static_cast<uint32_t>(str.size()));
      key += str;
    }
  }
  return true;
}

// kspec::call validates a call's signature once: a later call with the same signature (see
// append_call_key) copies the validated problem and its plan, and checks only what depends on the
// pointers — null data, overlap between outputs and inputs, the op's own check_call — each with the
// message full validation gives (a null pointer goes through full validation, which names it).
void call(std::string_view op_name, const std::vector<TensorView>& inputs, const std::vector<TensorView>& outputs,
          const Params& params, Stream stream, const CallOptions& options) {
  static std::shared_mutex mu;
  static std::unordered_map<std::string, std::unique_ptr<CachedCall>> cache;
  const OpDef& op = Registry::global().get(op_name);
  // Local, not thread_local: plan_for may tune (KSPEC_TUNE=auto), and the tuner's own calls come back here.
  std::string key;
  key.reserve(256);
  const bool cacheable = !options.config && append_call_key(key, op, inputs, outputs, params);
  const CachedCall* hit = nullptr;
  if (cacheable) {
    std::shared_lock<std::shared_mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) hit = it->second.get();
  }
  bool pointers_ok = true;
  if (hit) {
    for (const auto* list : {&inputs, &outputs})
      for (const auto& t : *list) pointers_ok = pointers_ok && (t.data || t.rank < 0 || t.numel() == 0);
  }
  if (hit && pointers_ok) {
    Call c;
    c.problem = hit->call.problem;
    c.device = hit->call.device;
    c.stream = stream;
    c.inputs = inputs;
    c.inputs.resize(hit->call.inputs.size());  // trailing optionals left out: absent views
    c.outputs = outputs;
    c.outputs.resize(hit->call.outputs.size());
    if (op.check_call) op.check_call(c);
    check_no_overlap(op.info, c.inputs, c.outputs);
    PlanEntry* plan = hit->plan;
    if (hit->generation != tuning_generation()) plan = &plan_for(op, c.problem, c.device, nullptr, stream);
    jit::ContextGuard guard(c.device);
    DeviceLauncher launcher(*plan, c.device, stream);
    op.launch(c, plan->config, launcher);
    launcher.finish();
    return;
  }
  Call c = validate_call(op, inputs, outputs, params, stream);
  c.problem.arch = device_arch(c.device);
  PlanEntry& plan = plan_for(op, c.problem, c.device, options.config, stream);
  if (cacheable) {
    auto entry = std::make_unique<CachedCall>();
    entry->call.problem = c.problem;
    entry->call.device = c.device;
    entry->call.inputs.resize(c.inputs.size());
    entry->call.outputs.resize(c.outputs.size());
    entry->plan = &plan;
    entry->generation = plan.generation;
    std::unique_lock<std::shared_mutex> lock(mu);
    if (cache.size() < kMaxCachedCalls) cache.emplace(key, std::move(entry));
  }
  jit::ContextGuard guard(c.device);
  DeviceLauncher launcher(plan, c.device, stream);
  op.launch(c, plan.config, launcher);
  launcher.finish();
}

void prepare_call(std::string_view op_name, const std::vector<TensorView>& inputs,
                  const std::vector<TensorView>& outputs, const Params& params) {
  static std::mutex mu;
  static std::unordered_set<std::string> prepared;
  const OpDef& op = Registry::global().get(op_name);
  std::string key;
  const bool keyed = append_call_key(key, op, inputs, outputs, params);
  if (keyed) {
    std::lock_guard<std::mutex> lock(mu);
    if (prepared.count(key)) return;
  }
  Call c = validate_call(op, inputs, outputs, params, nullptr);
  c.problem.arch = device_arch(c.device);
  plan_for(op, c.problem, c.device, nullptr, nullptr);
  if (keyed) {
    std::lock_guard<std::mutex> lock(mu);
    if (prepared.size() < kMaxCachedCalls) prepared.insert(std::move(key));
  }
}

}  // namespace kspec
