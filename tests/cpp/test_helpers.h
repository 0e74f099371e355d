// Shared helpers for the GoogleTest suite: temp directories, running the probe, GPU skipping, fake device
// addresses and the message of a refused call.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "kspec/check.h"
#include "kspec/error.h"

namespace kspec::testing {

// A fresh directory under the system temp dir, removed at destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "kspec-test");
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct ProcResult {
  int status = -1;
  std::string out;  // stdout and stderr together
};

// Runs a shell command (with extra "NAME=value" environment assignments prefixed).
ProcResult run(const std::string& command);

bool gpu_available();

// One EXPECT_TRUE per row of a GPU check: op, case, dtype, config, message and every output's error.
void report(const std::vector<CheckRow>& rows);

// A device address no CPU test dereferences (views for validation and planning), `offset` bytes in.
inline void* fake(uintptr_t offset = 0) { return reinterpret_cast<void*>(uintptr_t(0x7f0000000000) + offset); }

// What the kspec::Error that f throws says; "" when f throws none.
inline std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace kspec::testing

#define KSPEC_REQUIRE_GPU()                                              \
  do {                                                                   \
    if (!::kspec::testing::gpu_available()) GTEST_SKIP() << "no CUDA GPU"; \
  } while (0)
