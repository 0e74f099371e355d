"""Float64 NumPy reference for the gemm ops: y = act(x @ W.T + b), batched, and its gradients.

The twin of api/ops/gemm/reference.cpp. act: "none", "relu" or "gelu_tanh" (what cuBLASLt's GELU
epilogue computes, i.e. torch's F.gelu(approximate="tanh"); "gelu" is accepted for it).
"""

import math

import numpy as np

ACTS = ("none", "relu", "gelu_tanh")
_GELU = ("gelu_tanh", "gelu")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def act(name, h):
    if name == "relu":
        return np.maximum(h, 0.0)
    if name in _GELU:
        return 0.5 * h * (1.0 + np.tanh(_SQRT_2_OVER_PI * (h + _CUBIC * h**3)))
    return h


def act_grad(name, h):
    if name == "relu":
        return (h > 0).astype(np.float64)
    if name in _GELU:
        t = np.tanh(_SQRT_2_OVER_PI * (h + _CUBIC * h**3))
        return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _CUBIC * h * h)
    return np.ones_like(h)


def gemm_fwd(x, w, b=None, act_name="none"):
    """x: (..., m, k); w: (n, k) or (..., n, k) like x's batch; b: (n) or None.
    Returns (y, pre): (..., m, n) each, pre = x @ w^T + b."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    pre = x @ np.swapaxes(w, -1, -2)
    if b is not None:
        pre = pre + np.asarray(b, np.float64)
    return act(act_name, pre), pre


def gemm_bwd(dy, x, w, pre=None, act_name="none", has_bias=True):
    """Gradients of sum(dy * y). Returns (dx like x, dw like w (summed over broadcast batches),
    db (n) or None)."""
    dy = np.asarray(dy, np.float64)
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    dpre = dy if act_name == "none" else dy * act_grad(act_name, np.asarray(pre, np.float64))
    dx = dpre @ w
    dw = np.swapaxes(dpre, -1, -2) @ x
    if w.ndim < dw.ndim:
        dw = dw.reshape(-1, *w.shape).sum(0)
    db = dpre.reshape(-1, dpre.shape[-1]).sum(0) if has_bias else None
    return dx, dw, db
