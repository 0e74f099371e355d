// What the mhc suites (test_mhc.cpp, test_mhc_decode.cpp) share: views from shape vectors, pre.fwd's inputs
// on fake addresses, and a compile request at n, D.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kspec/kspec.h"
#include "test_helpers.h"

namespace kspec::testing {

// A view of any rank from vectors (contiguous unless strides are given).
inline TensorView view(void* p, DType dt, const std::vector<int64_t>& shape,
                       const std::vector<int64_t>& strides = {}) {
  TensorView t;
  t.data = p;
  t.dtype = dt;
  t.rank = static_cast<int>(shape.size());
  t.device = 0;
  int64_t s = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides.empty() ? s : strides[i];
    s *= shape[i];
  }
  return t;
}

// pre.fwd inputs for x [lead..., n, D] (bf16) with the given phi rows, alpha size and gamma size.
struct PreArgs {
  std::vector<int64_t> lead = {3, 5};
  int64_t n = 4, D = 40, M = 24, A = 3, G = 160;
  DType dt = DType::bf16;
  std::vector<TensorView> inputs() const {
    std::vector<int64_t> xs = lead;
    xs.insert(xs.end(), {n, D});
    return {view(fake(), dt, xs), TensorView(fake(1 << 28), DType::f32, {M, n * D}, 0),
            TensorView(fake(2 << 28), DType::f32, {A}, 0), TensorView(fake(3 << 28), DType::f32, {M}, 0),
            G ? TensorView(fake(4 << 28), DType::f32, {G}, 0) : TensorView()};
  }
};

// A request for op at n, D (bf16 on sm_90 unless given).
inline CompileRequest mhc_request(const std::string& op, int64_t n, int64_t D, DType dt = DType::bf16,
                                  const char* arch = "sm_90") {
  CompileRequest r;
  r.op = op;
  r.dtype = dt;
  r.arch = arch;
  r.params = {{"n", n}, {"D", D}};
  return r;
}

}  // namespace kspec::testing
