// From a specialization to a launchable function: the in-memory binary map, the disk cache and NVRTC
// (compile once per key, across threads and processes), then a module per device context.
#pragma once

#include <cuda.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "jit/nvrtc.h"
#include "jit/spec.h"

namespace kspec::cache {
class DiskCache;
}

namespace kspec {

// The process-wide disk cache, built on first use from KSPEC_CACHE_DIR, KSPEC_CACHE and
// KSPEC_CACHE_MAX_BYTES (a bad value throws InvalidArgument, and the next call reads the knobs again).
cache::DiskCache& disk_cache();

struct BinaryEntry {
  std::string key;
  std::string spec;          // canonical
  std::string binary;
  bool is_cubin = true;
  std::string lowered_name;
  jit::Resources resources;
  double compile_ms = 0;     // when it was compiled (this process or the one that cached it)
  std::string path;          // disk entry, "" when memory only
  std::string log;
};

struct LoadedKernel {
  CUfunction fn = nullptr;
  int device = 0;
  std::atomic<int> dynamic_smem_limit{48 * 1024};  // dynamic bytes a launch may take as is (set at load)
  std::shared_ptr<const BinaryEntry> entry;
  // The last occupancy answer, packed as (block threads << 40 | shared bytes << 8 | blocks) in one
  // atomic so concurrent callers never pair one shape's key with another's answer.
  int occupancy_for(unsigned threads, unsigned shared) const {
    uint64_t v = occupancy.load(std::memory_order_relaxed);
    return (v >> 8) == ((uint64_t(threads) << 32) | shared) ? static_cast<int>(v & 0xff) : 0;
  }
  void remember_occupancy(unsigned threads, unsigned shared, int blocks) {
    occupancy.store((uint64_t(threads) << 40) | (uint64_t(shared) << 8) | uint64_t(blocks & 0xff),
                    std::memory_order_relaxed);
  }
  std::atomic<uint64_t> occupancy{0};
};

struct Obtained {
  std::shared_ptr<const BinaryEntry> entry;
  std::string source;  // "compiled", "disk", "memory"
  double ms = 0;       // time spent obtaining it now
};

// The arch a device's kernels are compiled for ("sm_90a" on an H100); cached per device, thread-safe.
const std::string& device_arch(int device);

// Memory → disk → NVRTC, holding the per-key file lock while compiling.
Obtained obtain_binary(const jit::KernelSpec& spec);
// fn(0), ..., fn(n - 1) on up to KSPEC_COMPILE_THREADS threads (compiles: NVRTC is thread-safe and the
// cache locks per key); returns when all are done. The first exception fn throws stops the others
// taking more work and is rethrown once all threads are done.
void for_each_compile_thread(size_t n, const std::function<void(size_t)>& fn);
// The function for a spec on a device (loads its module into the device's primary context once).
LoadedKernel& load_kernel(const jit::KernelSpec& spec, int device);

void count_launch();
void count_source(const std::string& source);

}  // namespace kspec
