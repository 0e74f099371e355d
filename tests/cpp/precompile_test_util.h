// The check the precompile tests share: every kernel a compile request builds compiles without register spills
// and without a stack frame (CI's precompile fails on either); and that check over every case of some ops.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "api/src/op.h"
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

// A case's compile request: its params and inputs, no dims (the caller adds the ones it wants).
inline CompileRequest case_compile_request(const OpDef& op, const Case& cs, DType dt, const std::string& arch) {
  CompileRequest r;
  r.op = op.info.name;
  r.dtype = dt;
  r.arch = arch;
  r.without = cs.without;
  r.tensor_dtypes = cs.tensor_dtypes;
  r.alt_shapes = cs.alt_shapes;
  for (const auto& [k, v] : cs.params.items()) r.params.set(k, v);
  return r;
}

// Every case of each op compiles for sm_90 (in bf16; the base case in every dtype) with the heuristic's config,
// without spills or a stack frame; const_dims: the case dims the op takes as compile-time params.
inline void expect_every_case_compiles(const std::vector<const char*>& ops,
                                       const std::vector<std::string>& const_dims) {
  for (const char* name : ops) {
    const OpDef& op = Registry::global().get(name);
    for (const Case& cs : op.cases) {
      for (DType dt : op.dtypes) {
        if (dt != DType::bf16 && cs.name != "base") continue;
        SCOPED_TRACE(std::string(name) + " " + cs.name);
        CompileRequest r = case_compile_request(op, cs, dt, "sm_90");
        for (const auto& [k, v] : cs.dims)
          if (std::find(const_dims.begin(), const_dims.end(), k) != const_dims.end()) r.params.set(k, v);
        ASSERT_FALSE(expect_compiles_without_spills(r).empty());
      }
    }
  }
}

}  // namespace kspec::testing
