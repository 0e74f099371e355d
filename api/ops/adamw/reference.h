// Float64 CPU reference for the fused AdamW op: one torch.optim.AdamW step over a list of tensors, after
// unscaling the gradients (÷ grad_scale) and clipping them to a global L2 norm
// (coef = min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_); a non-finite gradient
// skips the step. The twin of python/kspec/reference/adamw.py.
#pragma once

#include <cstdint>
#include <vector>

namespace kspec::ref {

struct AdamwRefOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
  int64_t step = 1;
  bool maximize = false, bias_correction = true;
  double max_norm = 0.0;    // <= 0: no clipping
  double grad_scale = 1.0;
};

struct AdamwRefResult {
  bool found_inf = false;
  double grad_norm = 0.0;   // of the unscaled gradients
};

// Updates params, exp_avg, exp_avg_sq and (AMSGrad, when not null) max_exp_avg_sq in place.
AdamwRefResult adamw_ref(std::vector<std::vector<double>>& params, const std::vector<std::vector<double>>& grads,
                         std::vector<std::vector<double>>& exp_avg, std::vector<std::vector<double>>& exp_avg_sq,
                         std::vector<std::vector<double>>* max_exp_avg_sq, const AdamwRefOptions& o);

}  // namespace kspec::ref
