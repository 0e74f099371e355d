// The call path: validate → plan (cached per problem signature and device) → launch. Device attributes,
// the plan cache, the DeviceLauncher (launches, workspaces, occupancy) and kspec::call.
#include "api/src/plan.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>

#include "api/src/call_cached.h"
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

void DeviceLauncher::free_graph_owned(bool check) {
  std::vector<CUdeviceptr> owned;
  owned.swap(graph_owned_);
  for (CUdeviceptr p : owned) {
    CUresult r = jit::driver().cuMemFreeAsync(p, reinterpret_cast<CUstream>(stream_));
    if (check && r != CUDA_SUCCESS) jit::throw_cuda_error(r, "cuMemFreeAsync(workspace)", __FILE__, __LINE__);
  }
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

// A call key is written in one pass through a cursor into room asked for once (an upper bound for the
// views, the exact size of the params), instead of an append per piece, which was most of a cache hit's cost.
struct KeyWriter {
  char* at;
  template <typename T>
  void raw(const T& v) {
    std::memcpy(at, &v, sizeof(T));
    at += sizeof(T);
  }
  void bytes(const void* p, size_t n) {
    std::memcpy(at, p, n);
    at += n;
  }
};

constexpr size_t kMaxViewKeySize = 4 + sizeof(int) + 2 * sizeof(int64_t) * kMaxRank;

void write_view(KeyWriter& w, const TensorView& t) {
  const int8_t head[4] = {static_cast<int8_t>(t.rank), static_cast<int8_t>(t.dtype),
                          static_cast<int8_t>(pointer_alignment(t.data)), 0};
  w.raw(head);
  if (t.rank < 0) return;
  w.raw(t.device);
  // Element by element: fixed-size stores the compiler inlines, where a memcpy of rank * 8 bytes is a
  // libc call per array.
  for (int d = 0; d < t.rank; ++d) w.raw(t.shape[d]);
  for (int d = 0; d < t.rank; ++d) w.raw(t.strides[d]);
}

size_t param_key_size(const std::string& name, const ParamValue& v) {
  size_t n = sizeof(uint32_t) + name.size() + 1;
  if (std::holds_alternative<int64_t>(v)) return n + sizeof(int64_t);
  if (std::holds_alternative<double>(v)) return n + sizeof(double);
  if (std::holds_alternative<bool>(v)) return n + sizeof(bool);
  return n + sizeof(uint32_t) + std::get<std::string>(v).size();
}

void write_param(KeyWriter& w, const std::string& name, const ParamValue& v) {
  w.raw(static_cast<uint32_t>(name.size()));
  w.bytes(name.data(), name.size());
  w.raw(static_cast<uint8_t>(v.index()));
  if (auto i = std::get_if<int64_t>(&v)) w.raw(*i);
  else if (auto d = std::get_if<double>(&v)) w.raw(*d);
  else if (auto b = std::get_if<bool>(&v)) w.raw(*b);
  else {
    const auto& str = std::get<std::string>(v);
    w.raw(static_cast<uint32_t>(str.size()));
    w.bytes(str.data(), str.size());
  }
}

// A validated call kept for the next one with the same signature: its problem (params completed, arch
// set), device and padded argument counts, and the plan it used. Never freed (the cache is bounded), so
// a reader of the table may hold one without a lock and a thread's HitScratch may remember it by address.
struct CachedCall {
  std::string key;
  uint64_t hash = 0;  // key's CallKey::hash
  const OpDef* op = nullptr;
  Call call;
  PlanEntry* plan = nullptr;
  uint64_t generation = 0;
};

// Bounded: a process that sweeps shapes stops adding after this many (its calls validate in full).
constexpr size_t kMaxCachedCalls = 4096;

// The call cache: open addressing over twice kMaxCachedCalls slots, so a probe always ends at an empty
// slot. Entries are only ever added (under the caller's mutex) and never move or die, so a lookup reads
// without a lock: an acquire load per slot, against a shared lock's two atomic read-modify-writes and an
// unordered_map's bucket division per hit.
class CallTable {
 public:
  const CachedCall* find(uint64_t hash, std::string_view key) const {
    for (size_t i = hash & kMask;; i = (i + 1) & kMask) {
      const CachedCall* e = slots_[i].load(std::memory_order_acquire);
      if (!e) return nullptr;
      if (e->hash == hash && std::string_view(e->key) == key) return e;
    }
  }
  // Writers hold a mutex of their own. False (not added) when full or already there.
  bool add(const CachedCall* e) {
    if (size_ >= kMaxCachedCalls) return false;
    size_t i = e->hash & kMask;
    for (;; i = (i + 1) & kMask) {
      const CachedCall* o = slots_[i].load(std::memory_order_relaxed);
      if (!o) break;
      if (o->hash == e->hash && o->key == e->key) return false;
    }
    slots_[i].store(e, std::memory_order_release);
    ++size_;
    return true;
  }

 private:
  static constexpr size_t kSlots = 2 * kMaxCachedCalls, kMask = kSlots - 1;
  static_assert((kSlots & kMask) == 0, "a power of two");
  std::atomic<const CachedCall*> slots_[kSlots] = {};
  size_t size_ = 0;
};

// A thread's Call for cache hits of one entry, so that a hit copies no Problem (vectors, strings, params:
// a dozen heap allocations) and its views go into vectors that already have the room: the problem and the
// views are copied when the slot last held another entry, else only the views' addresses. A thread has kHitSlots of them,
// picked by the entry's address, so that a training step's interleaved ops keep theirs. `busy` covers a
// hit whose launch re-enters kspec::call on the same thread with the same slot (a tuner's timing
// calls): that one takes a Call of its own.
constexpr size_t kHitSlots = 16;
struct HitScratch {
  Call call;
  const CachedCall* from = nullptr;
  Params given;                  // the params of `from`'s calls as passed (as its key holds them)
  size_t given_inputs = 0, given_outputs = 0;  // the views passed (call's are padded to the schema)
  bool overlap_checked = false;  // call's views passed check_no_overlap
  bool busy = false;
};

// A thread's state for kspec::call: its key buffer, hit scratches, and its last hit per op (picked by the
// OpDef's address; an op's calls in a loop are mostly one signature).
constexpr size_t kRecentSlots = 16;
struct HitState {
  CallKey key;
  HitScratch scratches[kHitSlots];
  const CachedCall* recent[kRecentSlots] = {};
  // The op of the thread's last call, found again by comparing its name in place (the registry's lookup
  // compares against each op in turn: ~75 instructions of a hit).
  const OpDef* last_op = nullptr;
};

size_t scratch_slot(const CachedCall* e) {  // Fibonacci hashing of the entry's address: its top bits
  return (reinterpret_cast<uintptr_t>(e) * 0x9E3779B97F4A7C15ull) >> 60;
}
size_t recent_slot(const OpDef* op) { return (reinterpret_cast<uintptr_t>(op) * 0x9E3779B97F4A7C15ull) >> 60; }
static_assert(kHitSlots == 16 && kRecentSlots == 16, "the slots are a hash's top 4 bits");

// Whether `given` (a repeat's views) has the layout of `views` (its scratch slot's: this signature's) with an
// address to use in each, taking their addresses into `views` in the same pass; *same: whether those were
// the slot's already. The views pass once, where same_views, has_data and take_data passed three times.
// False at the first view that differs (the slot's addresses then partly the new ones: its caller marks its
// overlap check undone).
bool take_repeat(std::vector<TensorView>& views, ViewList given, bool* same) {
  for (size_t i = 0; i < given.size(); ++i) {
    TensorView& a = views[i];
    const TensorView& b = given[i];
    if (a.rank != b.rank || a.dtype != b.dtype || pointer_alignment(a.data) != pointer_alignment(b.data)) return false;
    if (a.rank >= 0) {
      if (a.device != b.device || (!b.data && b.numel() != 0)) return false;
      for (int d = 0; d < a.rank; ++d)
        if (a.shape[d] != b.shape[d] || a.strides[d] != b.strides[d]) return false;
    }
    *same = *same && a.data == b.data;
    a.data = b.data;
  }
  return true;
}

// The thread's last hit of `op` when this call has its signature (and an address in every view), compared in
// place with the views and params that hit's scratch slot keeps, whose views take this call's addresses: no
// key written, hashed or looked up (about half of a hit's instructions on the mock driver). *same_pointers:
// whether the addresses were the slot's already. Null otherwise (the slot since taken by another entry, or in
// use further up the stack).
const CachedCall* repeated_call(HitState& st, const OpDef& op, ViewList inputs, ViewList outputs,
                                const Params& params, bool* same_pointers) {
  const CachedCall* r = st.recent[recent_slot(&op)];
  if (!r || r->op != &op) return nullptr;
  HitScratch& s = st.scratches[scratch_slot(r)];
  if (s.from != r || s.busy || s.given_inputs != inputs.size() || s.given_outputs != outputs.size()) return nullptr;
  if (!same_params(s.given, params)) return nullptr;
  *same_pointers = true;
  if (!take_repeat(s.call.inputs, inputs, same_pointers) || !take_repeat(s.call.outputs, outputs, same_pointers)) {
    s.overlap_checked = false;
    return nullptr;
  }
  return r;
}

// The thread's HitState, reached once per call through a function: with a thread_local named in
// kspec::call, GCC computed its address again (a __tls_get_addr call in a shared library) at each of its
// eight uses, ~90 instructions of a hit. Through a plain pointer: a thread_local with a constructor is
// reached through its init guard, a second __tls_get_addr per call.
thread_local HitState* t_hit_state = nullptr;
struct HitStateOwner {
  std::unique_ptr<HitState> state;
  ~HitStateOwner() { t_hit_state = nullptr; }  // no dangling pointer left to the thread's last moments
};
[[gnu::noinline]] HitState& hit_state() {
  if (HitState* s = t_hit_state) return *s;
  thread_local HitStateOwner owner;
  owner.state = std::make_unique<HitState>();
  t_hit_state = owner.state.get();
  return *t_hit_state;
}

// Whether every view of a hit has an address to use: a null one (a tensor with elements) goes through
// full validation, which names it.
bool has_data(ViewList views) {
  for (const TensorView& t : views)
    if (!t.data && t.rank >= 0 && t.numel() != 0) return false;
  return true;
}

// `given`'s data pointers into `views` (the last call of the same signature's, padded to the schema: the
// same views but for their addresses); whether they were the same already.
bool take_data(std::vector<TensorView>& views, ViewList given) {
  bool same = true;
  for (size_t i = 0; i < given.size(); ++i) {
    same = same && views[i].data == given[i].data;
    views[i].data = given[i].data;
  }
  return same;
}

class ScratchClaim {
 public:
  explicit ScratchClaim(HitScratch& s) : s_(s.busy ? nullptr : &s) {
    if (s_) s_->busy = true;
  }
  ~ScratchClaim() {
    if (s_) s_->busy = false;
  }
  ScratchClaim(const ScratchClaim&) = delete;
  ScratchClaim& operator=(const ScratchClaim&) = delete;
  bool claimed() const { return s_ != nullptr; }

 private:
  HitScratch* s_;
};

}  // namespace

bool same_views(const std::vector<TensorView>& last, ViewList given) {
  for (size_t i = 0; i < given.size(); ++i) {
    const TensorView &a = last[i], &b = given[i];
    if (a.rank != b.rank || a.dtype != b.dtype || pointer_alignment(a.data) != pointer_alignment(b.data))
      return false;
    if (a.rank < 0) continue;
    if (a.device != b.device) return false;
    for (int d = 0; d < a.rank; ++d)
      if (a.shape[d] != b.shape[d] || a.strides[d] != b.strides[d]) return false;
  }
  return true;
}

bool same_params(const Params& last, const Params& given) {
  const auto &a = last.items(), &b = given.items();
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const ParamValue &x = a[i].second, &y = b[i].second;
    if (x.index() != y.index() || !same_string(a[i].first, b[i].first)) return false;
    bool same;
    if (auto s = std::get_if<std::string>(&x)) same = same_string(*s, *std::get_if<std::string>(&y));
    else if (auto d = std::get_if<double>(&x)) same = std::memcmp(d, std::get_if<double>(&y), sizeof(double)) == 0;
    else if (auto n = std::get_if<int64_t>(&x)) same = *n == *std::get_if<int64_t>(&y);
    else same = *std::get_if<bool>(&x) == *std::get_if<bool>(&y);
    if (!same) return false;
  }
  return true;
}

char* CallKey::extend(size_t n) {
  if (size_ + n > capacity_) {
    const size_t capacity = std::max<size_t>(2 * (size_ + n), 256);
    std::unique_ptr<char[]> data(new char[capacity]);
    if (size_) std::memcpy(data.get(), data_.get(), size_);
    data_ = std::move(data);
    capacity_ = capacity;
  }
  char* at = data_.get() + size_;
  size_ += n;
  return at;
}

uint64_t CallKey::hash() const {
  constexpr uint64_t kMul = 0xff51afd7ed558ccdull;  // MurmurHash3's finalizer constant
  uint64_t h = 0x9E3779B97F4A7C15ull ^ size_;
  const char* p = data_.get();
  size_t n = size_;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * kMul;
    h ^= h >> 32;
  }
  uint64_t tail = 0;
  for (size_t i = 0; i < n; ++i) tail |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  h = (h ^ tail) * kMul;
  return h ^ (h >> 29);
}

bool append_call_key(CallKey& key, const OpDef& op, ViewList inputs, ViewList outputs, const Params& params) {
  const OpDef* op_ptr = &op;
  const uint16_t counts[2] = {static_cast<uint16_t>(inputs.size()), static_cast<uint16_t>(outputs.size())};
  size_t size = sizeof(op_ptr) + sizeof(counts) + kMaxViewKeySize * (inputs.size() + outputs.size());
  for (const auto& [name, v] : params.items()) size += param_key_size(name, v);
  char* const begin = key.extend(size);
  KeyWriter w{begin};
  w.raw(op_ptr);
  w.raw(counts);
  for (const auto* list : {&inputs, &outputs})
    for (const auto& t : *list) {
      if (t.is_list()) {
        key.shrink(size);
        return false;
      }
      write_view(w, t);
    }
  for (const auto& [name, v] : params.items()) write_param(w, name, v);
  key.shrink(size - static_cast<size_t>(w.at - begin));
  return true;
}

// kspec::call validates a call's signature once: a later call with the same signature (see
// append_call_key) reuses the validated problem and its plan, and checks only what depends on the
// pointers — null data, overlap between outputs and inputs, the op's own check_call — each with the
// message full validation gives (a null pointer goes through full validation, which names it).
// A hit allocates nothing: a call with the signature of the thread's last hit of the op is recognised
// in place (repeated_call); any other writes its key into a per-thread buffer and looks it up in a table
// read without a lock; the call is assembled in one of the thread's HitScratch slots
// (tests/mock_cuda/test_host_path.cpp counts allocations).
namespace {

// cached_only: return false, nothing launched, unless the call is a hit that needs no plan rebuilt.
bool call_views(std::string_view op_name, ViewList inputs, ViewList outputs, const Params& params, Stream stream,
                const CallOptions& options, bool cached_only = false) {
  static std::mutex add_mu;
  static CallTable cache;
  HitState& st = hit_state();
  const OpDef* last_op = st.last_op;
  const OpDef& op = last_op && same_string(last_op->info.name, op_name) ? *last_op : Registry::global().get(op_name);
  st.last_op = &op;
  bool same_pointers = false;
  const CachedCall* hit = options.config ? nullptr : repeated_call(st, op, inputs, outputs, params, &same_pointers);
  const bool repeat = hit != nullptr;  // its views already in its scratch slot, which is free
  bool cacheable = true;
  uint64_t hash = 0;
  if (!hit) {
    // The buffer is read only up to the lookup (and copied into a new entry before anything that may
    // re-enter kspec::call on this thread: plan_for may tune, and the tuner's calls come back here).
    st.key.clear();
    cacheable = !options.config && append_call_key(st.key, op, inputs, outputs, params);
    hash = cacheable ? st.key.hash() : 0;
    hit = cacheable ? cache.find(hash, st.key.view()) : nullptr;
  }
  if (hit && (repeat || (has_data(inputs) && has_data(outputs)))) {
    HitScratch& scratch = st.scratches[scratch_slot(hit)];
    if (cached_only && hit->generation != tuning_generation()) {  // plan_for may tune: not a cached call's
      if (repeat) scratch.overlap_checked = false;  // its addresses are the slot's now, unchecked
      return false;
    }
    ScratchClaim claim(scratch);
    Call own;  // only when the thread's scratch is in use further up the stack
    Call& c = claim.claimed() ? scratch.call : own;
    if (!repeat) same_pointers = false;  // (a repeat's views were taken by repeated_call)
    if (!repeat && claim.claimed() && scratch.from == hit) {
      // The slot's views are this signature's: only the addresses may differ (no 152-byte view copied).
      same_pointers = take_data(c.inputs, inputs) & take_data(c.outputs, outputs);
    } else if (!repeat) {
      if (claim.claimed()) scratch.from = nullptr;  // until the copy is whole
      c.problem = hit->call.problem;
      c.device = hit->call.device;
      c.inputs.assign(inputs.begin(), inputs.end());
      c.inputs.resize(hit->call.inputs.size());  // trailing optionals left out: absent views
      c.outputs.assign(outputs.begin(), outputs.end());
      c.outputs.resize(hit->call.outputs.size());
      if (claim.claimed()) {
        scratch.given = params;
        scratch.given_inputs = inputs.size();
        scratch.given_outputs = outputs.size();
        scratch.from = hit;
      }
    }
    if (claim.claimed()) st.recent[recent_slot(&op)] = hit;
    // The thread's last call of this signature passed the overlap check with the very same pointers (the
    // same shapes and strides, by the signature): it would pass again.
    const bool checked = claim.claimed() && scratch.overlap_checked && same_pointers;
    if (claim.claimed()) scratch.overlap_checked = false;
    c.stream = stream;
    if (op.check_call) op.check_call(c);
    if (!checked) check_no_overlap(op.info, c.inputs, c.outputs);
    if (claim.claimed()) scratch.overlap_checked = true;
    PlanEntry* plan = hit->plan;
    if (hit->generation != tuning_generation()) plan = &plan_for(op, c.problem, c.device, nullptr, stream);
    jit::ContextGuard guard(c.device);
    DeviceLauncher launcher(*plan, c.device, stream);
    op.launch(c, plan->config, launcher);
    launcher.finish();
    return true;
  }
  if (cached_only) return false;
  std::string key = cacheable ? std::string(st.key.view()) : std::string();
  Call c = validate_call(op, inputs.to_vector(), outputs.to_vector(), params, stream);
  c.problem.arch = device_arch(c.device);
  PlanEntry& plan = plan_for(op, c.problem, c.device, options.config, stream);
  if (cacheable) {
    auto entry = std::make_unique<CachedCall>();
    entry->key = std::move(key);
    entry->call.problem = c.problem;
    entry->call.device = c.device;
    entry->call.inputs.resize(c.inputs.size());
    entry->call.outputs.resize(c.outputs.size());
    entry->hash = hash;
    entry->op = &op;
    entry->plan = &plan;
    entry->generation = plan.generation;
    std::lock_guard<std::mutex> lock(add_mu);
    if (cache.add(entry.get())) entry.release();  // the table's from now on (never freed)
  }
  jit::ContextGuard guard(c.device);
  DeviceLauncher launcher(plan, c.device, stream);
  op.launch(c, plan.config, launcher);
  launcher.finish();
  return true;
}

}  // namespace

bool call_cached(std::string_view op, const std::vector<TensorView>& inputs, const std::vector<TensorView>& outputs,
                 const Params& params, Stream stream) {
  return call_views(op, inputs, outputs, params, stream, CallOptions{}, /*cached_only=*/true);
}

void call(std::string_view op, const std::vector<TensorView>& inputs, const std::vector<TensorView>& outputs,
          const Params& params, Stream stream, const CallOptions& options) {
  call_views(op, inputs, outputs, params, stream, options);
}

void call(std::string_view op, std::initializer_list<TensorView> inputs, std::initializer_list<TensorView> outputs,
          const Params& params, Stream stream, const CallOptions& options) {
  call_views(op, ViewList(inputs.begin(), inputs.size()), ViewList(outputs.begin(), outputs.size()), params, stream,
             options);
}

void prepare_call(std::string_view op_name, const std::vector<TensorView>& inputs,
                  const std::vector<TensorView>& outputs, const Params& params) {
  static std::mutex mu;
  static std::unordered_set<std::string> prepared;
  const OpDef& op = Registry::global().get(op_name);
  CallKey key_buffer;
  const bool keyed = append_call_key(key_buffer, op, inputs, outputs, params);
  std::string key(key_buffer.view());
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
