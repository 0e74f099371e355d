"""Float64 NumPy reference for the fused norm+activation op, y = act(norm(x) * w + b).

The twin of api/ops/norm_act/reference.cpp (same formulas, same statistics); kernels and the torch
glue are tested against it. NumPy only: erf comes from the math module, since SciPy is not a dependency.
"""

import math

import numpy as np

NORMS = ("layernorm", "rmsnorm")
ACTS = ("none", "silu", "gelu_tanh", "gelu_erf")
ALIASES = {"identity": "none", "gelu": "gelu_tanh"}  # kspec's other spellings (kspec.ops.ACTIVATIONS)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_CUBIC = 0.044715
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

_erf_object = np.frompyfunc(math.erf, 1, 1)


def _erf(v):
    return _erf_object(v).astype(np.float64)


def _act(act, h):
    act = ALIASES.get(act, act)
    if act == "silu":
        return h / (1.0 + np.exp(-h))
    if act == "gelu_tanh":
        return 0.5 * h * (1.0 + np.tanh(_SQRT_2_OVER_PI * (h + _GELU_TANH_CUBIC * h**3)))
    if act == "gelu_erf":
        return 0.5 * h * (1.0 + _erf(h * _INV_SQRT_2))
    return h


def _act_grad(act, h):
    """dy/dh of _act(act, h)."""
    act = ALIASES.get(act, act)
    if act == "silu":
        s = 1.0 / (1.0 + np.exp(-h))
        return s * (1.0 + h * (1.0 - s))
    if act == "gelu_tanh":
        t = np.tanh(_SQRT_2_OVER_PI * (h + _GELU_TANH_CUBIC * h**3))
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_CUBIC * h * h)
        return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * du
    if act == "gelu_erf":
        return 0.5 * (1.0 + _erf(h * _INV_SQRT_2)) + h * _INV_SQRT_2PI * np.exp(-0.5 * h * h)
    return np.ones_like(h)


def _check(x, w, b, norm, act):
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if ALIASES.get(act, act) not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a non-empty last dimension, got shape {x.shape}")
    hidden = x.shape[-1]
    if w.shape != (hidden,) or (b is not None and b.shape != (hidden,)):
        raise ValueError(f"weight and bias must have shape ({hidden},)")


def _stats(x2, norm, eps):
    """mean, rstd of each row of x2: (rows, hidden); the mean first, then the centred moment."""
    if norm == "layernorm":
        mean = x2.mean(axis=1)
    else:
        mean = np.zeros(x2.shape[0])
    centred = x2 - mean[:, None]
    rstd = 1.0 / np.sqrt((centred * centred).mean(axis=1) + eps)
    return mean, rstd


def norm_act_fwd(x, w, b, norm, act, eps):
    """Forward pass in float64.

    x: (..., hidden); w, b: (hidden,); b may be None.
    Returns y: x.shape, mean: x.shape[:-1] (zeros for rmsnorm), rstd: x.shape[:-1].
    """
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    b = None if b is None else np.asarray(b, dtype=np.float64)
    _check(x, w, b, norm, act)
    lead, hidden = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, hidden)
    mean, rstd = _stats(x2, norm, eps)
    h = (x2 - mean[:, None]) * rstd[:, None] * w
    if b is not None:
        h = h + b
    y = _act(act, h)
    return y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead)


def norm_act_bwd(dy, x, w, b, norm, act, eps):
    """Gradients of sum(dy * y) in float64; the statistics are recomputed from x.

    dy, x: (..., hidden); w, b: (hidden,); b may be None.
    Returns dx: x.shape, dw: (hidden,), db: (hidden,) or None when b is None.
    """
    x = np.asarray(x, dtype=np.float64)
    dy = np.asarray(dy, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    b = None if b is None else np.asarray(b, dtype=np.float64)
    _check(x, w, b, norm, act)
    if dy.shape != x.shape:
        raise ValueError(f"dy shape {dy.shape} differs from x shape {x.shape}")
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    dy2 = dy.reshape(-1, hidden)
    mean, rstd = _stats(x2, norm, eps)
    xhat = (x2 - mean[:, None]) * rstd[:, None]
    h = xhat * w
    if b is not None:
        h = h + b
    g = dy2 * _act_grad(act, h)
    dw = (g * xhat).sum(axis=0)
    db = None if b is None else g.sum(axis=0)
    dxhat = g * w
    mean_dxhat_xhat = (dxhat * xhat).mean(axis=1, keepdims=True)
    # Only LayerNorm centres, so only it has the mean's gradient term.
    mean_dxhat = dxhat.mean(axis=1, keepdims=True) if norm == "layernorm" else 0.0
    dx = rstd[:, None] * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)
    return dx.reshape(x.shape), dw, db
