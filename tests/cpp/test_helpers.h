// Shared helpers for the GoogleTest suite: temp directories, running the probe, GPU skipping.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "kspec/check.h"

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

}  // namespace kspec::testing

#define KSPEC_REQUIRE_GPU()                                              \
  do {                                                                   \
    if (!::kspec::testing::gpu_available()) GTEST_SKIP() << "no CUDA GPU"; \
  } while (0)
