// Public cache maintenance and the doctor report, over cache/ and jit/.
#include <sys/stat.h>
#include <unistd.h>

#include <sstream>

#include "api/src/kernels.h"
#include "cache/disk_cache.h"
#include "jit/driver.h"
#include "jit/key.h"
#include "jit/nvrtc.h"
#include "jit/sources.h"
#include "kspec/cache.h"
#include "kspec/knobs.h"
#include "kspec/registry.h"

namespace kspec {

CacheStats cache_stats() {
  auto s = disk_cache().stats();
  return {s.dir, s.enabled, s.writable, s.entries, s.bytes, s.max_bytes};
}

std::vector<CacheEntryInfo> cache_entries() {
  std::vector<CacheEntryInfo> out;
  for (const auto& e : disk_cache().list()) {
    CacheEntryInfo i;
    i.key = e.key;
    i.path = e.path;
    i.bytes = e.bytes;
    i.last_used = e.last_used;
    const auto& m = e.meta;
    if (e.orphan) i.kernel = "(orphan binary without metadata: removed by verify, prune or clear)";
    if (m.is_object()) {
      i.spec = m.value("spec", std::string());
      i.kernel = m.value("kernel", std::string());
      i.arch = m.value("arch", std::string());
      i.compile_ms = m.value("compile_ms", 0.0);
      if (m.contains("resources") && m["resources"].is_object()) {
        i.registers = m["resources"].value("registers", -1);
        i.spill_bytes = m["resources"].value("spill_bytes", -1);
        i.shared_bytes = m["resources"].value("shared_bytes", -1);
      }
    }
    out.push_back(std::move(i));
  }
  return out;
}

std::pair<int64_t, std::vector<std::string>> cache_verify() {
  auto r = disk_cache().verify();
  return {r.ok, r.bad};
}

int64_t cache_prune(int64_t max_bytes) {
  auto& c = disk_cache();
  std::string failure;
  int64_t n = c.prune(max_bytes < 0 ? c.max_bytes() : max_bytes, &failure);
  KSPEC_CHECK_AS(failure.empty(), CacheError, "kspec cache prune: removed ", n, " entries from ", c.dir(),
                 " but could not remove more: ", failure);
  return n;
}

int64_t cache_clear() { return disk_cache().clear(); }

std::vector<std::pair<std::string, std::string>> doctor() {
  std::vector<std::pair<std::string, std::string>> out;
  out.emplace_back("kspec", jit::kspec_version());
  try {
    const jit::Nvrtc& api = jit::nvrtc();
    out.emplace_back("nvrtc", jit::nvrtc_version());
    out.emplace_back("nvrtc library", api.path);
  } catch (const CudaError& e) {
    out.emplace_back("nvrtc", std::string("NOT FOUND: ") + e.what());
    out.emplace_back("nvrtc library", "");
  }
  const std::string& inc = jit::cuda_include_dir();
  std::string searched;
  for (const auto& [why, dir] : jit::cuda_include_candidates()) searched += "; " + why + " " + dir;
  out.emplace_back("cuda include", inc.empty() ? "NOT FOUND (set KSPEC_CUDA_INCLUDE or CUDA_HOME; searched" +
                                                     searched.substr(1) + ")"
                                               : inc);
  out.emplace_back("templates", jit::TemplateSource::global().origin() + " (" +
                                    std::to_string(jit::TemplateSource::global().names().size()) + " files)");
  try {
    const auto& d = jit::driver();
    int v = 0;
    d.cuDriverGetVersion(&v);
    out.emplace_back("driver", "CUDA " + std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10));
    int n = jit::device_count();
    out.emplace_back("gpus", std::to_string(n));
    for (int i = 0; i < n; ++i) {
      CUdevice dev;
      char name[256] = {0};
      int major = 0, minor = 0, sms = 0;
      d.cuDeviceGet(&dev, i);
      d.cuDeviceGetName(name, sizeof(name), dev);
      d.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
      d.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
      d.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
      std::ostringstream os;
      os << name << ", sm_" << major << minor << ", " << sms << " SMs, kernels built for "
         << jit::arch_for_compute_capability(major, minor);
      out.emplace_back("gpu " + std::to_string(i), os.str());
    }
  } catch (const std::exception& e) {
    out.emplace_back("driver", std::string("unavailable: ") + e.what());
    out.emplace_back("gpus", "0");
  }
  auto s = disk_cache().stats();
  std::ostringstream cs;
  cs << s.dir << " (" << (s.enabled ? (s.writable ? "read-write" : "READ-ONLY: memory only") : "disabled") << ", "
     << s.entries << " entries, " << s.bytes << " bytes, cap " << s.max_bytes << ")";
  out.emplace_back("cache", cs.str());
  struct stat st;
  if (::stat(s.dir.c_str(), &st) == 0) {
    std::ostringstream ps;
    ps << "mode " << std::oct << (st.st_mode & 0777) << std::dec << ", owner uid " << st.st_uid
       << (st.st_uid == ::geteuid() ? " (you)" : " (NOT you: refused)")
       << ((st.st_mode & 077) ? " — group/other have access; kspec expects 0700" : " — private");
    out.emplace_back("cache permissions", ps.str());
  } else {
    out.emplace_back("cache permissions", "directory does not exist yet (created 0700 on first compile)");
  }
  for (const auto& k : knobs::all()) {
    auto v = knobs::env(k.name);
    out.emplace_back(k.name, v ? *v : std::string("(unset; default ") + k.default_value + ")");
  }
  return out;
}

}  // namespace kspec

namespace kspec {
int pointer_device(const void* ptr) {
  int ordinal = -1;
  CUresult r = jit::driver().cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                                   reinterpret_cast<CUdeviceptr>(ptr));
  KSPEC_CHECK(r == CUDA_SUCCESS, "pointer 0x", std::hex, reinterpret_cast<uintptr_t>(ptr), std::dec,
              " is not CUDA device memory (", jit::driver_error_text(r), ")");
  return ordinal;
}
}  // namespace kspec
