"""Float64 NumPy reference for mHC (manifold-constrained hyper-connections): the pre op, the post op,
Sinkhorn-Knopp and their exact backward. The twin of api/ops/mhc/reference.cpp (same maths, vectorized
over tokens); the formulas are issue 34's.

x: (T, n, D), n residual streams per token; M = n*n + 2n projection rows (pre_only: M = n).
"""

import numpy as np


def proj_rows(n, pre_only=False):
    return n if pre_only else n * n + 2 * n


def _sigmoid(z):
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _check(cond, msg):
    if not cond:
        raise ValueError("mhc reference: " + msg)


def _check_sinkhorn(t_max, eps):
    _check(int(t_max) == t_max and t_max >= 1, f"t_max must be >= 1, got {t_max}")
    _check(eps >= 0, f"eps_sk must be >= 0, got {eps}")


def _sinkhorn_trace(z, t_max, eps):
    """z: (T, n, n) logits Z[t, j, k]. Returns P = softmax_k(z), the 2 t_max - 1 normalized iterates
    (the last is R) and each step's divisors (sum + eps, kept with their axis)."""
    p = np.exp(z - z.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    a = p + eps
    iters, divs = [], []
    for s in range(1, 2 * t_max):
        axis = 1 if s % 2 == 1 else 2  # odd steps: columns (sum over j); even: rows (sum over k)
        div = a.sum(axis=axis, keepdims=True) + eps
        a = a / div
        iters.append(a)
        divs.append(div)
    return p, iters, divs


def sinkhorn_fwd(logits, t_max=20, eps=1e-6):
    """logits: (T, n, n) -> R: (T, n, n). A = softmax_k(Z) + eps; A /= (sum_j A + eps); then t_max - 1
    times A /= (sum_k A + eps); A /= (sum_j A + eps). With eps = 0 every column sums to 1."""
    logits = np.asarray(logits, dtype=np.float64)
    _check(logits.ndim == 3 and logits.shape[1] == logits.shape[2], f"logits must be (T, n, n), got {logits.shape}")
    _check_sinkhorn(t_max, eps)
    return _sinkhorn_trace(logits, t_max, eps)[1][-1]


def sinkhorn_bwd(logits, dR, t_max=20, eps=1e-6):
    """d/dlogits of sum(dR * R): the iterates recomputed, each step differentiated backwards:
    Y = X / (sum X + eps): dX = (dY - sum(dY * Y)) / (sum X + eps); softmax: dZ = P * (dP - sum(dP * P))."""
    logits = np.asarray(logits, dtype=np.float64)
    _check(logits.ndim == 3 and logits.shape[1] == logits.shape[2], f"logits must be (T, n, n), got {logits.shape}")
    _check(np.shape(dR) == logits.shape, f"dR must be {logits.shape}, got {np.shape(dR)}")
    _check_sinkhorn(t_max, eps)
    p, iters, divs = _sinkhorn_trace(logits, t_max, eps)
    g = np.array(dR, dtype=np.float64)
    for s in range(len(iters), 0, -1):
        axis = 1 if s % 2 == 1 else 2
        g = (g - np.sum(g * iters[s - 1], axis=axis, keepdims=True)) / divs[s - 1]
    return p * (g - np.sum(g * p, axis=2, keepdims=True))


def _alpha_per_row(alpha, n, pre_only):
    if pre_only:
        return np.full(n, alpha[0])
    return np.concatenate([np.full(n, alpha[0]), np.full(n, alpha[1]), np.full(n * n, alpha[2])])


def _check_pre(x, phi, alpha, bias, gamma, pre_only, eps_rms, eps_pre, eps_sk, t_max):
    _check(x.ndim == 3, f"x must be (T, n, D), got {x.shape}")
    T, n, D = x.shape
    _check(n >= 1 and D >= 1, f"x must have n >= 1 and D >= 1, got {x.shape}")
    M = proj_rows(n, pre_only)
    _check(phi.shape == (M, n * D), f"phi must be {(M, n * D)}, got {phi.shape}")
    _check(alpha.shape == ((1,) if pre_only else (3,)), f"alpha must be {(1,) if pre_only else (3,)}, got {alpha.shape}")
    _check(bias.shape == (M,), f"bias must be {(M,)}, got {bias.shape}")
    _check(gamma is None or np.shape(gamma) == (n * D,), f"gamma must be {(n * D,)}, got {np.shape(gamma)}")
    _check(eps_rms >= 0 and eps_pre >= 0, "eps_rms and eps_pre must be >= 0")
    _check_sinkhorn(t_max, eps_sk)
    return T, n, D, M


def _project(x, phi, alpha, bias, gamma, pre_only, eps_rms):
    T, n, D = x.shape
    v = x.reshape(T, n * D)
    inv = 1.0 / np.sqrt(np.mean(v * v, axis=1) + eps_rms)
    u = v if gamma is None else v * gamma
    m = u @ phi.T
    a = _alpha_per_row(alpha, n, pre_only)
    h = inv[:, None] * a * m + bias
    return v, u, inv, m, a, h


def mhc_pre_fwd(x, phi, alpha, bias, gamma=None, pre_only=False, eps_rms=1e-6, eps_pre=1e-6, eps_sk=1e-6,
                t_max=20):
    """x: (T, n, D); phi: (M, nD); alpha: (3,) or (1,) pre_only; bias: (M,); gamma: (nD,) or None.
    Returns dict y (T, D), h_pre (T, n), h_post (T, n), r (T, n, n), inv (T,), h (T, M); pre_only:
    h_post and r are None."""
    x, phi, alpha, bias = (np.asarray(t, dtype=np.float64) for t in (x, phi, alpha, bias))
    gamma = None if gamma is None else np.asarray(gamma, dtype=np.float64)
    T, n, D, M = _check_pre(x, phi, alpha, bias, gamma, pre_only, eps_rms, eps_pre, eps_sk, t_max)
    _, _, inv, _, _, h = _project(x, phi, alpha, bias, gamma, pre_only, eps_rms)
    h_pre = _sigmoid(h[:, :n]) + eps_pre
    y = np.einsum("ti,tid->td", h_pre, x)
    h_post = r = None
    if not pre_only:
        h_post = 2.0 * _sigmoid(h[:, n:2 * n])
        r = sinkhorn_fwd(h[:, 2 * n:].reshape(T, n, n), t_max, eps_sk)
    return {"y": y, "h_pre": h_pre, "h_post": h_post, "r": r, "inv": inv, "h": h}


def mhc_pre_bwd(dy, x, phi, alpha, bias, gamma=None, dh_pre=None, dh_post=None, dr=None, dx_post=None,
                pre_only=False, eps_rms=1e-6, eps_pre=1e-6, eps_sk=1e-6, t_max=20):
    """Gradients of sum(dy*y) + sum(dh_pre*H_pre) + sum(dh_post*H_post) + sum(dr*R), plus dx_post
    (the post op's dx) added into dx. Returns dict dx (T, n, D), dphi (M, nD), dalpha (3,)/(1,),
    dbias (M,), dgamma (nD,) or None."""
    x, phi, alpha, bias, dy = (np.asarray(t, dtype=np.float64) for t in (x, phi, alpha, bias, dy))
    gamma = None if gamma is None else np.asarray(gamma, dtype=np.float64)
    T, n, D, M = _check_pre(x, phi, alpha, bias, gamma, pre_only, eps_rms, eps_pre, eps_sk, t_max)
    _check(dy.shape == (T, D), f"dy must be {(T, D)}, got {dy.shape}")
    for name, t, shape in (("dh_pre", dh_pre, (T, n)), ("dh_post", dh_post, (T, n)), ("dr", dr, (T, n, n)),
                           ("dx_post", dx_post, (T, n, D))):
        _check(t is None or np.shape(t) == shape, f"{name} must be {shape}, got {np.shape(t)}")
        _check(t is None or not pre_only or name in ("dh_pre", "dx_post"), f"{name} given with pre_only")
    v, u, inv, m, a, h = _project(x, phi, alpha, bias, gamma, pre_only, eps_rms)
    g = np.zeros((T, M))
    s = _sigmoid(h[:, :n])
    gh_pre = np.einsum("td,tid->ti", dy, x) + (0.0 if dh_pre is None else dh_pre)
    g[:, :n] = gh_pre * s * (1.0 - s)
    if not pre_only:
        if dh_post is not None:
            s = _sigmoid(h[:, n:2 * n])
            g[:, n:2 * n] = 2.0 * dh_post * s * (1.0 - s)
        if dr is not None:
            g[:, 2 * n:] = sinkhorn_bwd(h[:, 2 * n:].reshape(T, n, n), dr, t_max, eps_sk).reshape(T, n * n)
    dm = inv[:, None] * a * g
    dinv = np.sum(a * g * m, axis=1)
    gm = inv[:, None] * g * m
    dalpha = np.array([gm[:, :n].sum()] if pre_only else [gm[:, :n].sum(), gm[:, n:2 * n].sum(), gm[:, 2 * n:].sum()])
    du = dm @ phi
    dv = (du if gamma is None else du * gamma) - (dinv * inv**3 / (n * D))[:, None] * v
    h_pre = _sigmoid(h[:, :n]) + eps_pre
    dx = dv.reshape(T, n, D) + h_pre[:, :, None] * dy[:, None, :]
    if dx_post is not None:
        dx = dx + dx_post
    return {"dx": dx, "dphi": dm.T @ u, "dalpha": dalpha, "dbias": g.sum(axis=0),
            "dgamma": None if gamma is None else np.sum(du * v, axis=0)}


def _check_post(x, f, h_post, r):
    _check(x.ndim == 3, f"x must be (T, n, D), got {x.shape}")
    T, n, D = x.shape
    _check(f.shape == (T, D), f"f must be {(T, D)}, got {f.shape}")
    _check(h_post.shape == (T, n), f"h_post must be {(T, n)}, got {h_post.shape}")
    _check(r.shape == (T, n, n), f"h_res must be {(T, n, n)}, got {r.shape}")


def mhc_post_fwd(x, f, h_post, r):
    """out[t, k] = h_post[t, k] f[t] + sum_j r[t, j, k] x[t, j]. x: (T, n, D); f: (T, D); h_post: (T, n);
    r: (T, n, n) -> out (T, n, D)."""
    x, f, h_post, r = (np.asarray(t, dtype=np.float64) for t in (x, f, h_post, r))
    _check_post(x, f, h_post, r)
    return h_post[:, :, None] * f[:, None, :] + np.einsum("tjk,tjd->tkd", r, x)


def mhc_post_bwd(dout, x, f, h_post, r):
    """Gradients of sum(dout * out): dict dx (T, n, D), df (T, D), dh_post (T, n), dr (T, n, n)."""
    x, f, h_post, r, dout = (np.asarray(t, dtype=np.float64) for t in (x, f, h_post, r, dout))
    _check_post(x, f, h_post, r)
    _check(dout.shape == x.shape, f"dout must be {x.shape}, got {dout.shape}")
    return {"dx": np.einsum("tjk,tkd->tjd", r, dout), "df": np.einsum("tk,tkd->td", h_post, dout),
            "dh_post": np.einsum("tkd,td->tk", dout, f), "dr": np.einsum("tkd,tjd->tjk", dout, x)}


def mhc_post_pre_fwd(x, f, h_post, h_res, phi, alpha, bias, gamma=None, eps_rms=1e-6, eps_pre=1e-6, eps_sk=1e-6,
                     t_max=20):
    """Layer l's post then layer l + 1's pre (mhc.post_pre.fwd): dict x_next (T, n, D) and mhc_pre_fwd's
    y, h_pre, h_post, r, inv, h of x_next."""
    x_next = mhc_post_fwd(x, f, h_post, h_res)
    out = mhc_pre_fwd(x_next, phi, alpha, bias, gamma, eps_rms=eps_rms, eps_pre=eps_pre, eps_sk=eps_sk, t_max=t_max)
    return {"x_next": x_next, **out}


def mhc_post_pre_bwd(dx_next, dy, dh_pre, dh_post_next, dr_next, x, f, h_post, h_res, phi, alpha, bias, gamma=None,
                     eps_rms=1e-6, eps_pre=1e-6, eps_sk=1e-6, t_max=20):
    """Gradients of mhc_post_pre_fwd: the pre backward on x_next (dx_next, the gradient of x_next's other
    uses, added into its dx; None = 0), then the post backward of that. Dict dx, df, dh_post, dr (post's
    inputs) and dphi, dalpha, dbias, dgamma."""
    x_next = mhc_post_fwd(x, f, h_post, h_res)
    g = mhc_pre_bwd(dy, x_next, phi, alpha, bias, gamma, dh_pre, dh_post_next, dr_next, dx_next, eps_rms=eps_rms,
                    eps_pre=eps_pre, eps_sk=eps_sk, t_max=t_max)
    pg = mhc_post_bwd(g["dx"], x, f, h_post, h_res)
    return {**pg, "dphi": g["dphi"], "dalpha": g["dalpha"], "dbias": g["dbias"], "dgamma": g["dgamma"]}
