// Typed C++ entry points for the norm_act family (they call the registry like everything else).
#pragma once

#include "kspec/registry.h"

namespace kspec::ops {

struct NormActOptions {
  std::string norm = "layernorm";  // or "rmsnorm"
  std::string act = "none";  // "silu", "gelu_tanh", "gelu_erf" ("identity" is accepted for none)
  double eps = 1e-5;
};

// x: (..., hidden); weight, bias: (hidden) (bias may be TensorView()); y like x; mean, rstd: (...) fp32.
inline void norm_act_fwd(const TensorView& x, const TensorView& weight, const TensorView& bias, const TensorView& y,
                         const TensorView& mean, const TensorView& rstd, const NormActOptions& o = {},
                         Stream stream = nullptr) {
  call("norm_act.fwd", {x, weight, bias}, {y, mean, rstd}, {{"norm", o.norm}, {"act", o.act}, {"eps", o.eps}},
       stream);
}

// dy, x: (..., hidden); dx like x; dweight, dbias: (hidden) (dbias iff bias).
inline void norm_act_bwd(const TensorView& dy, const TensorView& x, const TensorView& weight, const TensorView& bias,
                         const TensorView& mean, const TensorView& rstd, const TensorView& dx,
                         const TensorView& dweight, const TensorView& dbias, const NormActOptions& o = {},
                         Stream stream = nullptr) {
  call("norm_act.bwd", {dy, x, weight, bias, mean, rstd}, {dx, dweight, dbias},
       {{"norm", o.norm}, {"act", o.act}, {"eps", o.eps}}, stream);
}

}  // namespace kspec::ops
