// Float64 CPU reference for the gemm ops: y = act(x·Wᵀ + b), batched, and its gradients. The spec
// the cuBLASLt calls and the Python twin (python/kspec/reference/gemm.py) are tested against.
// act codes: 0 = none, 1 = ReLU, 2 = GELU with the tanh approximation (cuBLASLt's GELU epilogue).
#pragma once

#include <cstdint>
#include <vector>

namespace kspec::ref {

// x: [batch, m, k]; w: [wbatch, n, k] with wbatch 1 (the same weight for every batch) or batch;
// b: [n] or null. y, pre: [batch, m, n] (pre = x·Wᵀ + b, the activation's input).
struct GemmRefFwd {
  std::vector<double> y, pre;
};
GemmRefFwd gemm_fwd_ref(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>* b,
                        int64_t batch, int64_t wbatch, int64_t m, int64_t n, int64_t k, int act);

// Gradients of sum(dy * y): dpre = dy * act'(pre); dx = dpre·W: [batch, m, k]; dw = dpreᵀ·x summed over
// the batches that share a weight: [wbatch, n, k]; db = Σ dpre over batch and m: [n].
struct GemmRefBwd {
  std::vector<double> dx, dw, db;
};
GemmRefBwd gemm_bwd_ref(const std::vector<double>& dy, const std::vector<double>& x, const std::vector<double>& w,
                        const std::vector<double>& pre, int64_t batch, int64_t wbatch, int64_t m, int64_t n,
                        int64_t k, int act);

double gelu_tanh(double h);
double gelu_tanh_grad(double h);

}  // namespace kspec::ref
