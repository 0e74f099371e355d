// The compile/load pipeline behind every op call. The steady state is a hash lookup in the plan cache
// (plan.cpp); this file runs only the first time a specialization is needed on a device.
#include "api/src/kernels.h"

#include <atomic>
#include <chrono>
#include <exception>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>

#include "cache/disk_cache.h"
#include "jit/base/log.h"
#include "jit/driver.h"
#include "jit/key.h"
#include "kspec/knobs.h"
#include "kspec/registry.h"

namespace kspec {
namespace {

std::atomic<int64_t> g_compiled{0}, g_disk{0}, g_memory{0}, g_launches{0};

struct BinaryMap {
  std::mutex mu;
  std::unordered_map<std::string, std::shared_ptr<const BinaryEntry>> by_key;
  // One in-process compile per key: other threads wait on the same mutex.
  std::unordered_map<std::string, std::shared_ptr<std::mutex>> compiling;
};

BinaryMap& binaries() {
  static BinaryMap m;
  return m;
}

std::shared_ptr<const BinaryEntry> from_disk(const std::string& key, cache::DiskCache& disk) {
  auto e = disk.load(key);
  if (!e) return nullptr;
  auto b = std::make_shared<BinaryEntry>();
  try {
    b->key = key;
    b->binary = std::move(e->binary);
    b->spec = e->meta.at("spec").get<std::string>();
    b->is_cubin = e->meta.at("is_cubin").get<bool>();
    b->lowered_name = e->meta.at("lowered_name").get<std::string>();
    const auto& r = e->meta.at("resources");
    b->resources.registers = r.at("registers").get<int>();
    b->resources.spill_bytes = r.at("spill_bytes").get<int>();
    b->resources.stack_bytes = r.at("stack_bytes").get<int>();
    b->resources.static_shared_bytes = r.at("shared_bytes").get<int>();
    b->compile_ms = e->meta.value("compile_ms", 0.0);
    b->log = e->meta.value("log", std::string());
    b->path = disk.entry_path(key);
  } catch (const std::exception& ex) {
    jit::warn_once("meta:" + key, "kernel cache entry " + key.substr(0, 16) +
                                      "… has incomplete metadata (" + ex.what() + "); recompiling");
    return nullptr;
  }
  return b;
}

}  // namespace

void count_launch() { g_launches.fetch_add(1, std::memory_order_relaxed); }

void count_source(const std::string& source) {
  if (source == "compiled") g_compiled++;
  else if (source == "disk") g_disk++;
  else g_memory++;
}

Counters counters() { return {g_compiled.load(), g_disk.load(), g_memory.load(), g_launches.load()}; }

namespace {
// The disk cache's directory also keeps the memo of the CUDA headers' hash (jit/key.h). Not
// std::call_once: an exception from the cache's set-up (a bad KSPEC_CACHE) unwinding through glibc's
// pthread_once aborted the process from Python (exit 134). Here it reaches the caller, and every later
// call tries again and throws the same.
void set_header_memo_dir_once() {
  static std::atomic<bool> done{false};
  static std::mutex mu;
  if (done.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(mu);
  if (done.load(std::memory_order_relaxed)) return;
  jit::set_header_memo_dir(disk_cache().ready_dir());
  done.store(true, std::memory_order_release);
}

}  // namespace

cache::DiskCache& disk_cache() {
  static cache::DiskCache cache(knobs::cache_dir(), knobs::cache_enabled(), knobs::cache_max_bytes());
  return cache;
}

Obtained obtain_binary(const jit::KernelSpec& spec) {
  auto t0 = std::chrono::steady_clock::now();
  knobs::validate();
  set_header_memo_dir_once();
  auto elapsed = [&] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  std::string key = jit::content_key(spec);
  BinaryMap& m = binaries();
  std::shared_ptr<std::mutex> key_mu;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    auto it = m.by_key.find(key);
    if (it != m.by_key.end()) return {it->second, "memory", elapsed()};
    auto& slot = m.compiling[key];
    if (!slot) slot = std::make_shared<std::mutex>();
    key_mu = slot;
  }
  std::lock_guard<std::mutex> key_lock(*key_mu);
  {
    std::lock_guard<std::mutex> lock(m.mu);
    auto it = m.by_key.find(key);
    if (it != m.by_key.end()) return {it->second, "memory", elapsed()};
  }
  cache::DiskCache& disk = disk_cache();
  std::shared_ptr<const BinaryEntry> entry = from_disk(key, disk);
  std::string source = "disk";
  if (!entry) {
    cache::FileLock file_lock = disk.lock(key);  // another process may be compiling it right now
    entry = from_disk(key, disk);
    if (!entry) {
      jit::info("compiling " + spec.name_expression() + " for " + spec.arch);
      jit::CompiledKernel ck = jit::compile(spec);
      if (ck.is_cubin && (ck.resources.registers < 0 || ck.resources.spill_bytes < 0))
        jit::warn_once("ptxas-figures", "NVRTC's log for " + spec.name_expression() + " (" + spec.arch +
                                            ") has no ptxas register/spill figures; resource checks see -1. Log end: " +
                                            ck.log.substr(ck.log.size() > 600 ? ck.log.size() - 600 : 0));
      auto b = std::make_shared<BinaryEntry>();
      b->key = key;
      b->spec = spec.canonical();
      b->binary = std::move(ck.binary);
      b->is_cubin = ck.is_cubin;
      b->lowered_name = ck.lowered_name;
      b->resources = ck.resources;
      b->compile_ms = ck.compile_ms;
      b->log = ck.log;
      nlohmann::json meta = {
          {"spec", b->spec},
          {"kernel", spec.name_expression()},
          {"lowered_name", b->lowered_name},
          {"arch", spec.arch},
          {"is_cubin", b->is_cubin},
          {"nvrtc", jit::nvrtc_version()},
          {"kspec", jit::kspec_version()},
          {"compile_ms", b->compile_ms},
          {"resources",
           {{"registers", b->resources.registers},
            {"spill_bytes", b->resources.spill_bytes},
            {"stack_bytes", b->resources.stack_bytes},
            {"shared_bytes", b->resources.static_shared_bytes}}},
          {"log", b->log.size() > 4096 ? b->log.substr(0, 4096) : b->log},
      };
      b->path = disk.store(key, b->binary, meta);
      entry = b;
      source = "compiled";
    }
  }
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.by_key.emplace(key, entry);
    m.compiling.erase(key);
  }
  count_source(source);
  return {entry, source, elapsed()};
}

LoadedKernel& load_kernel(const jit::KernelSpec& spec, int device) {
  static std::shared_mutex mu;
  static std::map<std::pair<int, std::string>, std::unique_ptr<LoadedKernel>> loaded;
  std::string canon = spec.canonical();
  {
    std::shared_lock<std::shared_mutex> lock(mu);
    auto it = loaded.find({device, canon});
    if (it != loaded.end()) return *it->second;
  }
  Obtained ob = obtain_binary(spec);
  std::unique_lock<std::shared_mutex> lock(mu);
  auto it = loaded.find({device, canon});
  if (it != loaded.end()) return *it->second;
  jit::ContextGuard guard(device);
  CUmodule module = nullptr;
  CU_CHECK(cuModuleLoadData(&module, ob.entry->binary.data()));
  auto k = std::make_unique<LoadedKernel>();
  CU_CHECK(cuModuleGetFunction(&k->fn, module, ob.entry->lowered_name.c_str()));
  k->device = device;
  k->entry = ob.entry;
  // Without cuFuncSetAttribute a launch may take 48 KB of shared memory in all, static and dynamic: the dynamic
  // allowance starts at 48 KB less the kernel's static bytes (the launcher raises it past that). Counted from
  // 48 KB alone, mhc.pre.bwd algo=mma_fused_ring at 16 tokens (40 KB of ring beside 12 KB static) was launched
  // without the attribute and failed with CUDA_ERROR_INVALID_VALUE (run 29, H100).
  int static_bytes = 0;
  CU_CHECK(cuFuncGetAttribute(&static_bytes, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, k->fn));
  k->dynamic_smem_limit.store(48 * 1024 - static_bytes);
  // Modules live as long as the process: a kernel may be captured in a CUDA graph that outlives any
  // scope kspec could tie them to.
  return *loaded.emplace(std::make_pair(device, canon), std::move(k)).first->second;
}

void for_each_compile_thread(size_t n, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  const int threads = std::max(1, std::min<int>(knobs::compile_threads(), static_cast<int>(n)));
  // An exception escaping a thread would terminate the process: the first one stops the work and is
  // rethrown here, after every thread has finished.
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      try {
        for (size_t i = next++; i < n; i = next++) fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
        next = n;
      }
    });
  for (auto& th : pool) th.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace kspec
