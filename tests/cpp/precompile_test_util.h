// The check the difflogic suites' precompile tests share: every kernel a compile request builds compiles
// without register spills and without a stack frame (CI's precompile fails on either).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kspec/kspec.h"

namespace kspec::testing {

// Compiles `r`, expects no spill and no stack frame in any of its kernels (a failure names the request and
// the kernel), and returns the reports for the caller's own counts.
inline std::vector<CompileReport> expect_compiles_without_spills(const CompileRequest& r) {
  std::vector<CompileReport> reports = compile(r);
  for (const CompileReport& rep : reports) {
    const std::string what = r.op + " " + rep.arch + " " + dtype_short(r.dtype) + ": " + rep.kernel + " " + rep.config;
    EXPECT_EQ(rep.spill_bytes, 0) << what;
    EXPECT_EQ(rep.stack_bytes, 0) << what << "\n" << rep.log;
  }
  return reports;
}

}  // namespace kspec::testing
