// Test helpers, and the suite-wide environment: this process's disk cache lives in a private temp
// directory so tests never touch ~/.cache/kspec.
#include "test_helpers.h"

#include <stdlib.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <random>

#include "jit/driver.h"

namespace kspec::testing {

void report(const std::vector<CheckRow>& rows) {
  for (const auto& r : rows) {
    std::string errs;
    for (const auto& [name, e] : r.errors) errs += name + "=" + std::to_string(e) + " ";
    EXPECT_TRUE(r.passed) << r.op << " " << r.case_name << " " << r.dtype << " config " << r.config << ": "
                          << r.message << " errors " << errs;
  }
}

TempDir::TempDir(const std::string& tag) {
  std::string tmpl = (std::filesystem::temp_directory_path() / (tag + "-XXXXXX")).string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
  path_ = buf.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::permissions(path_, std::filesystem::perms::owner_all, std::filesystem::perm_options::add, ec);
  std::filesystem::remove_all(path_, ec);
}

ProcResult run(const std::string& command) {
  ProcResult r;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  r.status = pclose(p);
  return r;
}

bool gpu_available() { return jit::driver_available(); }

namespace {
// Runs before main(): isolate the process-wide cache. KSPEC_TEST_CACHE_DIR names one cache for every test
// process instead (tools/test.sh: ctest's compile tests then fill the cache the precompile step reads, and a
// kernel two tests compile is compiled once); the tests that need an empty cache make their own.
struct IsolateCache {
  IsolateCache() {
    const char* shared = std::getenv("KSPEC_TEST_CACHE_DIR");
    if (shared && *shared) {
      setenv("KSPEC_CACHE_DIR", shared, 1);
    } else {
      static TempDir dir("kspec-suite-cache");
      setenv("KSPEC_CACHE_DIR", (dir.path() + "/cache").c_str(), 1);
    }
    unsetenv("KSPEC_TEMPLATE_DIR");
    unsetenv("KSPEC_CACHE");
  }
} isolate_cache;
}  // namespace

}  // namespace kspec::testing
