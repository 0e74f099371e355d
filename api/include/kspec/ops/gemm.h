// Typed C++ entry points for the gemm family (cuBLASLt; they call the registry like everything else).
#pragma once

#include "kspec/registry.h"

namespace kspec::ops {

struct GemmOptions {
  std::string act = "none";  // "relu", "gelu_tanh" ("gelu" is accepted for it)
  bool tf32 = false;         // fp32 inputs on TF32 tensor cores
};

// y = act(x·Wᵀ + b). x: (..., m, k), any view with one unit-stride dim of the last two; weight: (n, k) or
// (..., n, k) like x's batch; bias: (n) or TensorView(); y: (..., m, n) with unit stride along n;
// pre: TensorView(), or (act gelu_tanh, n % 8 == 0) a contiguous (..., m, n) that receives x·Wᵀ + b.
inline void gemm(const TensorView& x, const TensorView& weight, const TensorView& bias, const TensorView& y,
                 const TensorView& pre = TensorView(), const GemmOptions& o = {}, Stream stream = nullptr) {
  call("gemm", {x, weight, bias}, {y, pre}, {{"act", o.act}, {"tf32", o.tf32}}, stream);
}

// dx = dpre·W, dweight = dpreᵀ·x (summed over batches sharing W), dbias = Σ dpre (or TensorView()),
// with dpre = dy * act'(saved); saved: gelu_tanh: the forward's pre; relu: its pre or y; none: TensorView().
inline void gemm_bwd(const TensorView& dy, const TensorView& x, const TensorView& weight, const TensorView& saved,
                     const TensorView& dx, const TensorView& dweight, const TensorView& dbias,
                     const GemmOptions& o = {}, Stream stream = nullptr) {
  call("gemm.bwd", {dy, x, weight, saved}, {dx, dweight, dbias}, {{"act", o.act}, {"tf32", o.tf32}}, stream);
}

}  // namespace kspec::ops
