"""Float64 NumPy reference for the E79 coupled memory-modulation matrix RNN cell, forward and exact
reverse-mode backward.

The twin of api/ops/e79/reference.cpp (same recurrence, same gradient formulas): vectorized over
batch and the n x n states, looped over time. Per batch element, for t = 0..T-1:
    kh = k / (|k| + 1e-6)                 mh = m / (|m| + 1e-6)
    s_row = sigmoid(M kh + b_s)           s_col = sigmoid(M^T kh + b_s)
    s_delta = v - S kh
    S <- s_row[:, None] * S * s_col[None, :] + s_delta kh^T
    m_row = sigmoid(S mh + b_m)           m_col = sigmoid(S^T mh + b_m)     (with the updated S)
    m_delta = s_delta - M mh
    M <- m_row[:, None] * M * m_col[None, :] + m_delta mh^T
    Sq = S q;   out_t = Sq * silu(Sq)
Shapes: k, v, q, m, out: (T, B, n); b_s, b_m: None (no bias), (n,) fixed, or (T, B, n) per step;
S0, M0, S, M: (B, n, n), zeros when S0, M0 are None.
"""

import numpy as np

GRAD_KEYS = ("dk", "dv", "dq", "dm", "db_s", "db_m", "dS0", "dM0")
NORM_EPS = 1e-6


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _check(k, v, q, m, b_s, b_m, S0, M0):
    """Returns (T, B, n, bias_step), bias_step(t) giving the (B, n) bias rows of step t, or zeros."""
    if k.ndim != 3:
        raise ValueError(f"e79 reference: k must be (T, B, n), got shape {k.shape}")
    T, B, n = k.shape
    for name, x in (("v", v), ("q", q), ("m", m)):
        if x.shape != k.shape:
            raise ValueError(f"e79 reference: {name} has shape {x.shape}, expected {k.shape}")
    if (b_s is None) != (b_m is None):
        raise ValueError("e79 reference: b_s and b_m must be given together")
    if b_s is not None:
        if b_s.shape not in ((n,), (T, B, n)) or b_m.shape != b_s.shape:
            raise ValueError(f"e79 reference: b_s, b_m must both be ({n},) or {(T, B, n)}, "
                             f"got {b_s.shape} and {b_m.shape}")
    for name, x in (("S0", S0), ("M0", M0)):
        if x is not None and x.shape != (B, n, n):
            raise ValueError(f"e79 reference: {name} has shape {x.shape}, expected {(B, n, n)}")
    return T, B, n


def _bias_at(b, t, B, n):
    """The (B, n) bias of step t for any bias mode."""
    if b is None:
        return np.zeros((B, n))
    return np.broadcast_to(b, (B, n)) if b.ndim == 1 else b[t]


def _normalize(x):
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / (norm + NORM_EPS), norm


def _step(S, M, k, v, q, m, bs, bm):
    """One step on (B, n, n) states; returns the new states, out_t and what the backward needs."""
    kh, k_norm = _normalize(k)
    mh, m_norm = _normalize(m)
    s_row = _sigmoid(np.einsum("bij,bj->bi", M, kh) + bs)
    s_col = _sigmoid(np.einsum("bji,bj->bi", M, kh) + bs)
    s_delta = v - np.einsum("bij,bj->bi", S, kh)
    S_new = s_row[:, :, None] * S * s_col[:, None, :] + s_delta[:, :, None] * kh[:, None, :]
    m_row = _sigmoid(np.einsum("bij,bj->bi", S_new, mh) + bm)
    m_col = _sigmoid(np.einsum("bji,bj->bi", S_new, mh) + bm)
    m_delta = s_delta - np.einsum("bij,bj->bi", M, mh)
    M_new = m_row[:, :, None] * M * m_col[:, None, :] + m_delta[:, :, None] * mh[:, None, :]
    sq = np.einsum("bij,bj->bi", S_new, q)
    out = sq * sq * _sigmoid(sq)
    cache = dict(kh=kh, k_norm=k_norm, mh=mh, m_norm=m_norm, s_row=s_row, s_col=s_col,
                 s_delta=s_delta, m_row=m_row, m_col=m_col, m_delta=m_delta, sq=sq)
    return S_new, M_new, out, cache


def _normalize_bwd(x, norm, dxh):
    """Gradient through xh = x / (|x| + eps); at x = 0 only the first Jacobian term is kept."""
    inv = 1.0 / (norm + NORM_EPS)
    safe = np.where(norm > 0.0, norm, 1.0)
    radial = np.where(norm > 0.0, np.sum(x * dxh, axis=-1, keepdims=True) * inv * inv / safe, 0.0)
    return dxh * inv - x * radial


def e79_fwd(k, v, q, m, b_s=None, b_m=None, S0=None, M0=None):
    """k, v, q, m: (T, B, n); b_s, b_m: None, (n,) or (T, B, n); S0, M0: (B, n, n) or None.
    Returns (out (T, B, n), S (B, n, n), M (B, n, n)), the states after the last step."""
    k, v, q, m, b_s, b_m, S0, M0 = map(_f64, (k, v, q, m, b_s, b_m, S0, M0))
    T, B, n = _check(k, v, q, m, b_s, b_m, S0, M0)
    S = np.zeros((B, n, n)) if S0 is None else S0.copy()
    M = np.zeros((B, n, n)) if M0 is None else M0.copy()
    out = np.empty((T, B, n))
    for t in range(T):
        S, M, out[t], _ = _step(S, M, k[t], v[t], q[t], m[t], _bias_at(b_s, t, B, n),
                                _bias_at(b_m, t, B, n))
    return out, S, M


def e79_bwd(dout, k, v, q, m, b_s=None, b_m=None, S0=None, M0=None, dS=None, dM=None):
    """Gradients of sum(dout * out) + sum(dS * S_final) + sum(dM * M_final).

    dout: (T, B, n); dS, dM: (B, n, n) or None. Returns a dict with GRAD_KEYS, each in its input's
    shape (db_s, db_m summed over T and B for fixed biases); the gradient of an absent input is None.
    Keeps the cache of every step: about (2 n^2 + 11 n) * B * T doubles.
    """
    dout, k, v, q, m, b_s, b_m, S0, M0, dS, dM = map(_f64, (dout, k, v, q, m, b_s, b_m, S0, M0, dS, dM))
    T, B, n = _check(k, v, q, m, b_s, b_m, S0, M0)
    if dout.shape != k.shape:
        raise ValueError(f"e79 reference: dout has shape {dout.shape}, expected {k.shape}")
    for name, x in (("dS", dS), ("dM", dM)):
        if x is not None and x.shape != (B, n, n):
            raise ValueError(f"e79 reference: {name} has shape {x.shape}, expected {(B, n, n)}")

    # states[t] is the state before step t.
    S = np.zeros((B, n, n)) if S0 is None else S0.copy()
    M = np.zeros((B, n, n)) if M0 is None else M0.copy()
    states, caches = [], []
    for t in range(T):
        states.append((S, M))
        S, M, _, c = _step(S, M, k[t], v[t], q[t], m[t], _bias_at(b_s, t, B, n),
                           _bias_at(b_m, t, B, n))
        caches.append((c, S))

    dS_run = np.zeros((B, n, n)) if dS is None else dS.copy()
    dM_run = np.zeros((B, n, n)) if dM is None else dM.copy()
    dk, dv, dq, dm = (np.zeros((T, B, n)) for _ in range(4))
    db_s_t, db_m_t = np.zeros((T, B, n)), np.zeros((T, B, n))
    for t in reversed(range(T)):
        S_prev, M_prev = states[t]
        c, S_new = caches[t]
        kh, mh = c["kh"], c["mh"]
        sg = _sigmoid(c["sq"])
        g = dout[t] * c["sq"] * sg * (2.0 + c["sq"] * (1.0 - sg))
        dq[t] = np.einsum("bij,bi->bj", S_new, g)
        dS_run = dS_run + g[:, :, None] * q[t][:, None, :]

        # M update, then the gates on S_new and m_delta = s_delta - M_prev mh.
        d_row = np.einsum("bij,bij,bj->bi", dM_run, M_prev, c["m_col"]) * c["m_row"] * (1.0 - c["m_row"])
        d_col = np.einsum("bij,bi,bij->bj", dM_run, c["m_row"], M_prev) * c["m_col"] * (1.0 - c["m_col"])
        d_delta = np.einsum("bij,bj->bi", dM_run, mh)
        dmh = (np.einsum("bij,bi->bj", dM_run, c["m_delta"]) - np.einsum("bij,bi->bj", M_prev, d_delta)
               + np.einsum("bij,bi->bj", S_new, d_row) + np.einsum("bij,bj->bi", S_new, d_col))
        db_m_t[t] = d_row + d_col
        dS_run = dS_run + d_row[:, :, None] * mh[:, None, :] + mh[:, :, None] * d_col[:, None, :]
        dM_run = (dM_run * c["m_row"][:, :, None] * c["m_col"][:, None, :]
                  - d_delta[:, :, None] * mh[:, None, :])
        dm[t] = _normalize_bwd(m[t], c["m_norm"], dmh)

        # S update, then its gates on M_prev and s_delta = v - S_prev kh.
        d_row = np.einsum("bij,bij,bj->bi", dS_run, S_prev, c["s_col"]) * c["s_row"] * (1.0 - c["s_row"])
        d_col = np.einsum("bij,bi,bij->bj", dS_run, c["s_row"], S_prev) * c["s_col"] * (1.0 - c["s_col"])
        d_delta = d_delta + np.einsum("bij,bj->bi", dS_run, kh)
        dkh = (np.einsum("bij,bi->bj", dS_run, c["s_delta"]) - np.einsum("bij,bi->bj", S_prev, d_delta)
               + np.einsum("bij,bi->bj", M_prev, d_row) + np.einsum("bij,bj->bi", M_prev, d_col))
        dv[t] = d_delta
        db_s_t[t] = d_row + d_col
        dM_run = dM_run + d_row[:, :, None] * kh[:, None, :] + kh[:, :, None] * d_col[:, None, :]
        dS_run = (dS_run * c["s_row"][:, :, None] * c["s_col"][:, None, :]
                  - d_delta[:, :, None] * kh[:, None, :])
        dk[t] = _normalize_bwd(k[t], c["k_norm"], dkh)

    def bias_grad(b, per_step):
        if b is None:
            return None
        return per_step.sum(axis=(0, 1)) if b.ndim == 1 else per_step

    return dict(dk=dk, dv=dv, dq=dq, dm=dm, db_s=bias_grad(b_s, db_s_t), db_m=bias_grad(b_m, db_m_t),
                dS0=None if S0 is None else dS_run, dM0=None if M0 is None else dM_run)
