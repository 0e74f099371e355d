// Content keys: what makes a cached binary reusable, and nothing else.
#include "key.h"

#include <sys/stat.h>

#include <mutex>
#include <sstream>
#include <unordered_map>

#include "files.h"
#include "jit/base/hash.h"
#include "jit/base/log.h"
#include "nvrtc.h"
#include "sources.h"

#ifndef KSPEC_VERSION
#define KSPEC_VERSION "0.0.0"
#endif

namespace kspec::jit {

const char* kspec_version() { return KSPEC_VERSION; }

namespace {

std::mutex g_memo_mu;
std::string g_memo_dir;

struct HeaderStat {
  int64_t size = -1, mtime_ns = -1;
};

HeaderStat stat_of(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<int64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

constexpr int64_t kMaxMemoBytes = int64_t(1) << 20;

// The memo's body, if its last line ("sum <sha256 of the lines before>") matches: a flipped bit in the
// hash it keeps would otherwise silently change every key.
bool verified_memo(const std::string& text, std::string* body) {
  size_t last = text.rfind("\nsum ");
  if (last == std::string::npos) return false;
  *body = text.substr(0, last + 1);
  std::string sum = text.substr(last + 5);
  while (!sum.empty() && sum.back() == '\n') sum.pop_back();
  return sum == sha256_hex(*body);
}

}  // namespace

void set_header_memo_dir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(g_memo_mu);
  g_memo_dir = dir;
}

std::string system_headers_hash(const TemplateSource& src, const std::string& header, const std::string& memo_dir) {
  const std::string& inc = cuda_include_dir();
  std::string memo_path;
  if (!memo_dir.empty()) {
    Sha256 k;
    k.part("kspec-headers-v2").part(inc).part(nvrtc_version());
    for (const auto& name : src.system_includes(header)) k.part(name);
    memo_path = memo_dir + "/headers-" + k.hex().substr(0, 32) + ".txt";
    // Format: the hash, one "size mtime_ns name" line per header, then "sum <sha256 of those lines>".
    // Only this user's private regular file is read (jit::read_file with FileTrust::Own).
    std::string text, body, why;
    bool missing = false;
    if (read_file(memo_path, kMaxMemoBytes, FileTrust::Own, &text, &why, &missing)) {
      std::string hash;
      std::istringstream in;
      if (!verified_memo(text, &body)) {
        warn_once("memo:" + memo_path, "the CUDA header hash memo " + memo_path +
                                           " is corrupt (checksum mismatch); hashing the headers again");
      } else if (in.str(body); std::getline(in, hash) && hash.size() == 64) {
        bool fresh = true;
        int64_t size, mtime;
        std::string name;
        int count = 0;
        while (fresh && in >> size >> mtime >> name) {
          HeaderStat st = stat_of(inc + "/" + name);
          fresh = st.size == size && st.mtime_ns == mtime;
          ++count;
        }
        if (fresh && count > 0) return hash;
      }
    } else if (!missing) {
      warn_once("memo:" + memo_path, "the CUDA header hash memo is not used: " + why);
    }
  }
  Sha256 s;
  std::ostringstream memo;
  auto closure = src.system_closure(header);
  for (const auto& f : closure) s.part(f.name).part(f.content);
  std::string hash = s.hex();
  if (!memo_path.empty() && !closure.empty()) {
    memo << hash << "\n";
    for (const auto& f : closure) {
      HeaderStat st = stat_of(inc + "/" + f.name);
      memo << st.size << ' ' << st.mtime_ns << ' ' << f.name << "\n";
    }
    std::string text = memo.str(), err;
    text += "sum " + sha256_hex(text) + "\n";
    write_file_atomic(memo_path, text, &err);  // a memo that cannot be written only costs a rehash
  }
  return hash;
}

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
      std::string memo_dir;
      {
        std::lock_guard<std::mutex> memo_lock(g_memo_mu);
        memo_dir = g_memo_dir;
      }
      it = system_memo.emplace(key, system_headers_hash(src, spec.header, memo_dir)).first;
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
