// Content keys: what makes a cached binary reusable, and nothing else.
#include "key.h"

#include <mutex>
#include <unordered_map>

#include "hash.h"
#include "nvrtc.h"
#include "sources.h"

#ifndef KSPEC_VERSION
#define KSPEC_VERSION "0.0.0"
#endif

namespace kspec::jit {

const char* kspec_version() { return KSPEC_VERSION; }

std::string compute_content_key(const KernelSpec& spec, const TemplateSource& src) {
  Sha256 h;
  h.part("kspec-content-key-v1").part(kspec_version()).part(nvrtc_version()).part(spec.canonical());
  for (const auto& o : compile_options(spec)) {
    // The include directory's location does not change the binary; its headers' bytes (below) do.
    if (o.rfind("-I", 0) == 0) continue;
    h.part(o);
  }
  for (const auto& f : src.kspec_closure(spec.header)) h.part(f.name).part(f.content);
  // CUDA headers are hashed once per header set and process: they are large and never change under us.
  static std::mutex mu;
  static std::unordered_map<std::string, std::string> system_memo;
  std::string sys;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto key = src.origin() + "\n" + spec.header;
    auto it = system_memo.find(key);
    if (it == system_memo.end()) {
      Sha256 s;
      for (const auto& f : src.system_closure(spec.header)) s.part(f.name).part(f.content);
      it = system_memo.emplace(key, s.hex()).first;
    }
    sys = it->second;
  }
  h.part(sys);
  return h.hex();
}

std::string content_key(const KernelSpec& spec) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::string> memo;
  std::string canon = spec.canonical();
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = memo.find(canon);
    if (it != memo.end()) return it->second;
  }
  std::string key = compute_content_key(spec, TemplateSource::global());
  std::lock_guard<std::mutex> lock(mu);
  memo.emplace(canon, key);
  return key;
}

}  // namespace kspec::jit
