"""Float64 NumPy reference for the Mamba selective scan (mamba_ssm's selective_scan_fn plus an
initial state h0), forward and exact reverse-mode backward.

The twin of api/ops/selective_scan/reference.cpp (same recurrence, same gradient formulas): vectorized
over batch, dim and dstate, looped over time. For channel d, time t and state n:
    dt      = delta + delta_bias, then softplus if delta_softplus
    x_t[n]  = exp(dt_t * A[d, n]) * x_{t-1}[n] + dt_t * B_t[n] * u_t,   x_{-1} = h0 (or 0)
    out_t   = (sum_n C_t[n] * x_t[n] + D * u_t) * silu(z_t)            (each factor only if given)
Shapes: u, delta, z: (batch, dim, seqlen); A: (dim, dstate); B, C: (dim, dstate) fixed,
(batch, dstate, seqlen) one group, or (batch, groups, dstate, seqlen) with channel d in group
d // (dim // groups); D, delta_bias: (dim,); h0, last_state: (batch, dim, dstate).
"""

import numpy as np

GRAD_KEYS = ("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "dh0")


def _softplus(x):
    """log1p(exp(x)) without overflow for large x."""
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _check(name, a, shape):
    if a is not None and a.shape != shape:
        raise ValueError(f"selective_scan reference: {name} has shape {a.shape}, expected {shape}")


def _expand_bc(name, M, batch, dim, dstate, seqlen):
    """B or C as (batch, dim, dstate, seqlen) per channel, or (dim, dstate) when fixed; also returns
    the group count (None when fixed) so gradients can be folded back into M's layout."""
    if M.ndim == 2:
        _check(name, M, (dim, dstate))
        return M, None
    if M.ndim == 3:
        M = M[:, None]
    if M.ndim != 4:
        raise ValueError(f"selective_scan reference: {name} must have 2, 3 or 4 dimensions, got {M.ndim}")
    groups = M.shape[1]
    if groups < 1 or dim % groups != 0:
        raise ValueError(f"selective_scan reference: {name} has {groups} groups, which must divide dim={dim}")
    _check(name, M, (batch, groups, dstate, seqlen))
    return np.repeat(M, dim // groups, axis=1), groups


def _fold_bc(dM, groups, ndim, batch, dim, dstate, seqlen):
    """Sums a per-channel gradient (batch, dim, dstate, seqlen) over each group's channels, back into
    the layout B or C was given in."""
    if groups is None:
        return dM
    folded = dM.reshape(batch, groups, dim // groups, dstate, seqlen).sum(axis=2)
    return folded[:, 0] if ndim == 3 else folded


def _prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus, h0):
    u, delta, A, B, C = (_f64(a) for a in (u, delta, A, B, C))
    D, z, delta_bias, h0 = (_f64(a) for a in (D, z, delta_bias, h0))
    if u.ndim != 3 or A.ndim != 2:
        raise ValueError("selective_scan reference: u must be (batch, dim, seqlen) and A (dim, dstate)")
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    _check("delta", delta, u.shape)
    _check("A", A, (dim, dstate))
    _check("D", D, (dim,))
    _check("z", z, u.shape)
    _check("delta_bias", delta_bias, (dim,))
    _check("h0", h0, (batch, dim, dstate))
    Bx, b_groups = _expand_bc("B", B, batch, dim, dstate, seqlen)
    Cx, c_groups = _expand_bc("C", C, batch, dim, dstate, seqlen)
    pre = delta if delta_bias is None else delta + delta_bias[:, None]
    dt = _softplus(pre) if delta_softplus else pre
    return {
        "u": u, "A": A, "B": B, "C": C, "D": D, "z": z, "h0": h0,
        "Bx": Bx, "Cx": Cx, "b_groups": b_groups, "c_groups": c_groups,
        "pre": pre, "dt": dt, "dims": (batch, dim, seqlen, dstate),
    }


def _at(M, t):
    """B_t or C_t for all channels: (batch, dim, dstate) when variable, (dim, dstate) when fixed (it
    broadcasts against the state)."""
    return M[..., t] if M.ndim == 4 else M


def _scan(p, keep_states):
    """Runs the recurrence; returns y (batch, dim, seqlen), the last state and, if asked, all states
    x_{-1..seqlen-1} as (seqlen + 1, batch, dim, dstate)."""
    batch, dim, seqlen, dstate = p["dims"]
    u, dt, A = p["u"], p["dt"], p["A"]
    x = np.zeros((batch, dim, dstate)) if p["h0"] is None else p["h0"].copy()
    states = np.empty((seqlen + 1, batch, dim, dstate)) if keep_states else None
    if keep_states:
        states[0] = x
    y = np.empty((batch, dim, seqlen))
    for t in range(seqlen):
        dt_t = dt[:, :, t, None]
        x = np.exp(dt_t * A) * x + dt_t * _at(p["Bx"], t) * u[:, :, t, None]
        y[:, :, t] = np.sum(_at(p["Cx"], t) * x, axis=-1)
        if keep_states:
            states[t + 1] = x
    return y, x, states


def _gate(p, y):
    out = y if p["D"] is None else y + p["D"][:, None] * p["u"]
    return out, (out if p["z"] is None else out * p["z"] * _sigmoid(p["z"]))


def selective_scan_fwd(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, h0=None,
                       state_stride=0):
    """Returns (out: (batch, dim, seqlen), last_state: (batch, dim, dstate)), both float64; with
    state_stride k > 0 also states (batch, dim, ceil(seqlen / k), dstate): the state entering steps 0, k,
    2k, ... (selective_scan.fwd's `states` output for k = 16)."""
    p = _prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus, h0)
    y, last, states = _scan(p, keep_states=state_stride > 0)
    if state_stride > 0:
        return _gate(p, y)[1], last, np.ascontiguousarray(states[:-1:state_stride].transpose(1, 2, 0, 3))
    return _gate(p, y)[1], last


def selective_scan_bwd(dout, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       h0=None, dlast_state=None):
    """Gradients of sum(dout * out) + sum(dlast_state * last_state), each in its input's shape, as a
    dict with keys GRAD_KEYS; None for an absent optional input. Stores all states of the forward:
    (seqlen + 1) * batch * dim * dstate doubles."""
    p = _prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus, h0)
    batch, dim, seqlen, dstate = p["dims"]
    dout = _f64(dout)
    _check("dout", dout, (batch, dim, seqlen))
    dlast_state = _f64(dlast_state)
    _check("dlast_state", dlast_state, (batch, dim, dstate))
    u, dt, A, Bx, Cx = p["u"], p["dt"], p["A"], p["Bx"], p["Cx"]

    y, _, states = _scan(p, keep_states=True)
    pre_gate, _ = _gate(p, y)
    gy = dout
    dz = None
    if p["z"] is not None:
        sg = _sigmoid(p["z"])
        dz = dout * pre_gate * sg * (1.0 + p["z"] * (1.0 - sg))
        gy = dout * p["z"] * sg
    du = np.zeros_like(u)
    dD = None
    if p["D"] is not None:
        dD = np.sum(gy * u, axis=(0, 2))
        du += gy * p["D"][:, None]

    # hx is the adjoint of x_t: the gradient of the loss through x_t and everything after it.
    hx = np.zeros((batch, dim, dstate)) if dlast_state is None else dlast_state.copy()
    ddt = np.empty_like(u)
    dA = np.zeros_like(A)
    dBx = np.zeros(Bx.shape)
    dCx = np.zeros(Cx.shape)
    for t in range(seqlen - 1, -1, -1):
        gy_t = gy[:, :, t, None]
        u_t = u[:, :, t, None]
        dt_t = dt[:, :, t, None]
        x_cur, x_prev = states[t + 1], states[t]
        B_t = _at(Bx, t)
        hx += gy_t * _at(Cx, t)
        dC_t = gy_t * x_cur
        a = np.exp(dt_t * A)
        ddt[:, :, t] = np.sum(hx * (A * a * x_prev + B_t * u_t), axis=-1)
        dA += np.sum(hx * dt_t * a * x_prev, axis=0)
        dB_t = hx * dt_t * u_t
        du[:, :, t] += np.sum(hx * dt_t * B_t, axis=-1)
        if dBx.ndim == 4:
            dBx[..., t] = dB_t
        else:
            dBx += dB_t.sum(axis=0)
        if dCx.ndim == 4:
            dCx[..., t] = dC_t
        else:
            dCx += dC_t.sum(axis=0)
        hx *= a  # now the adjoint of x_{t-1}

    ddelta = ddt * _sigmoid(p["pre"]) if delta_softplus else ddt
    return {
        "du": du,
        "ddelta": ddelta,
        "dA": dA,
        "dB": _fold_bc(dBx, p["b_groups"], p["B"].ndim, batch, dim, dstate, seqlen),
        "dC": _fold_bc(dCx, p["c_groups"], p["C"].ndim, batch, dim, dstate, seqlen),
        "dD": dD,
        "dz": dz,
        "ddelta_bias": None if delta_bias is None else ddelta.sum(axis=(0, 2)),
        "dh0": None if h0 is None else hx,
    }
