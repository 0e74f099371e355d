"""Float64 NumPy reference for the fused AdamW op: the twin of api/ops/adamw/reference.cpp.

One step of torch.optim.AdamW (decoupled weight decay, optional AMSGrad and maximize) over a list of
tensors, after unscaling the gradients by grad_scale and clipping them to a global L2 norm (as
torch.nn.utils.clip_grad_norm_ does: coef = min(1, max_norm / (norm + 1e-6))). A non-finite gradient
skips the step (found_inf), like torch's fused AdamW with a GradScaler.
"""
import math

import numpy as np


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs=None, *, lr=1e-3, beta1=0.9, beta2=0.999,
               eps=1e-8, weight_decay=1e-2, step=1, maximize=False, bias_correction=True, max_norm=0.0,
               grad_scale=None):
    """Updates params, exp_avgs, exp_avg_sqs (and max_exp_avg_sqs: AMSGrad) in place (float64 arrays).
    Returns (found_inf: bool, grad_norm: float of the unscaled gradients)."""
    scale = 1.0 if grad_scale is None else float(grad_scale)
    gs = [np.asarray(g, np.float64) / scale for g in grads]
    total = sum(float(np.sum(g * g)) for g in gs)
    found_inf = not math.isfinite(total)
    norm = math.sqrt(total) if not found_inf else float("nan")
    if found_inf:
        return True, norm
    coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    step_size = lr / bc1
    for i, g in enumerate(gs):
        g = g * coef
        if maximize:
            g = -g
        p, m, v = params[i], exp_avgs[i], exp_avg_sqs[i]
        p *= 1.0 - lr * weight_decay
        m += (1.0 - beta1) * (g - m)
        v *= beta2
        v += (1.0 - beta2) * g * g
        if max_exp_avg_sqs is not None:
            np.maximum(max_exp_avg_sqs[i], v, out=max_exp_avg_sqs[i])
            denom = np.sqrt(max_exp_avg_sqs[i]) / math.sqrt(bc2) + eps
        else:
            denom = np.sqrt(v) / math.sqrt(bc2) + eps
        p -= step_size * m / denom
    return False, norm
