"""Float64 NumPy reference for the mLSTM (xLSTM's matrix-memory cell): the recurrent step, the chunkwise
form, the parallel form, and their backward.

The twin of api/ops/mlstm/reference.cpp (same maths, same layouts), vectorized over (B, NH). Shapes:
q, k (B, NH, S, DHQK); v, h (B, NH, S, DHHV); i, f (B, NH, S) gate pre-activations; states
C (B, NH, DHQK, DHHV), n (B, NH, DHQK), m (B, NH). s = DHQK^-1/2. One step, a = logsigmoid(f):
    m' = max(a + m, i)    C' = e^(a+m-m') C + e^(i-m') k v^T    n' = e^(a+m-m') n + e^(i-m') k
    nrm = max(|s q . n'|, e^(-m'))        h = (s q)^T C' / (nrm + eps)
Without initial states C = 0, n = 0, m = 0. The forward also returns nrm and m' per step, (B, NH, S),
which the backward treats as constants (as mlstm_kernels does): then h_t = (s q_t)^T Cbar_t
e^(-m_t) / (nrm_t + eps) with Cbar_t = sum_s e^(F_t - F_s + i_s) k_s v_s^T + e^(F_t + m0) C0 the
unstabilized state (F = cumsum a), the same function whatever the form. Unlike mlstm_kernels, the
upstream dC_last reaches df (through <dC_last, C_last>). exact=True differentiates everything instead.
The parallel form has no states (m0 = -inf): it differs from the recurrence only by eps e^m.
"""

import numpy as np

EPS = 1e-6
GRAD_KEYS = ("dq", "dk", "dv", "di", "df", "dC0", "dn0", "dm0")


def logsigmoid(x):
    """log(sigmoid(x)) = min(x, 0) - log1p(e^-|x|): no overflow, full relative accuracy at both ends."""
    x = np.asarray(x, dtype=np.float64)
    return np.minimum(x, 0.0) - np.log1p(np.exp(-np.abs(x)))


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _check(q, k, v, i, f, C0, n0, m0):
    if q.ndim != 4:
        raise ValueError(f"mlstm reference: q must be (B, NH, S, DHQK), got shape {q.shape}")
    B, NH, S, DK = q.shape
    if v.ndim != 4 or v.shape[:3] != (B, NH, S):
        raise ValueError(f"mlstm reference: v has shape {v.shape}, expected {(B, NH, S)} + (DHHV,)")
    DV = v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"mlstm reference: k has shape {k.shape}, expected {q.shape}")
    for name, x in (("i", i), ("f", f)):
        if x.shape != (B, NH, S):
            raise ValueError(f"mlstm reference: {name} has shape {x.shape}, expected {(B, NH, S)}")
    given = [x is not None for x in (C0, n0, m0)]
    if any(given) and not all(given):
        raise ValueError("mlstm reference: C0, n0 and m0 must be given together")
    if all(given):
        for name, x, want in (("C0", C0, (B, NH, DK, DV)), ("n0", n0, (B, NH, DK)), ("m0", m0, (B, NH))):
            if x.shape != want:
                raise ValueError(f"mlstm reference: {name} has shape {x.shape}, expected {want}")
    return B, NH, S, DK, DV


def _check_chunk(chunk):
    if chunk < 1:
        raise ValueError(f"mlstm reference: chunk must be >= 1, got {chunk}")


def _states(C0, n0, m0, B, NH, DK, DV, m_empty=0.0):
    if C0 is None:
        return np.zeros((B, NH, DK, DV)), np.zeros((B, NH, DK)), np.full((B, NH), m_empty)
    return C0.copy(), n0.copy(), m0.copy()


def _chunk_fwd(q, k, v, i, a, C, n, m, eps):
    """One chunk of length L from states (C, n, m): h (B, NH, L, DV), nrm, m per row (B, NH, L) and the
    states after it. The parallel form inside: m_t = max(b_t + m, max_s<=t (b_t - b_s + i_s))."""
    L, DK = q.shape[2], q.shape[3]
    qs = q * DK ** -0.5
    b = np.cumsum(a, axis=-1)
    causal = np.tril(np.ones((L, L), dtype=bool))
    logD = np.where(causal, b[..., :, None] - b[..., None, :] + i[..., None, :], -np.inf)
    inter = b + m[..., None]
    m_row = np.maximum(inter, logD.max(axis=-1))
    D = np.exp(logD - m_row[..., None])
    g = np.exp(inter - m_row)
    Ct = np.einsum("bhtd,bhsd->bhts", qs, k) * D
    num = g[..., None] * np.einsum("bhtd,bhde->bhte", qs, C) + np.einsum("bhts,bhse->bhte", Ct, v)
    z = g * np.einsum("bhtd,bhd->bht", qs, n) + Ct.sum(axis=-1)
    nrm = np.maximum(np.abs(z), np.exp(-m_row))
    h = num / (nrm + eps)[..., None]
    m_end = m_row[..., -1]
    w = np.exp(b[..., -1:] - b + i - m_end[..., None])  # e^(b_L - b_s + i_s - m_end)
    g_end = np.exp(b[..., -1] + m - m_end)
    C = g_end[..., None, None] * C + np.einsum("bhs,bhsd,bhse->bhde", w, k, v)
    n = g_end[..., None] * n + np.einsum("bhs,bhsd->bhd", w, k)
    return h, nrm, m_row, C, n, m_end


def mlstm_chunkwise_fwd(q, k, v, i, f, C0=None, n0=None, m0=None, chunk=64, eps=EPS):
    """The recurrence computed chunk by chunk (any chunk >= 1; the last chunk may be shorter).
    Returns (h, nrm, m, (C, n, m) after the last step)."""
    q, k, v, i, f, C0, n0, m0 = map(_f64, (q, k, v, i, f, C0, n0, m0))
    B, NH, S, DK, DV = _check(q, k, v, i, f, C0, n0, m0)
    _check_chunk(chunk)
    C, n, m = _states(C0, n0, m0, B, NH, DK, DV)
    a = logsigmoid(f)
    h, nrm, mr = np.empty((B, NH, S, DV)), np.empty((B, NH, S)), np.empty((B, NH, S))
    for t0 in range(0, S, chunk):
        t1 = min(S, t0 + chunk)
        sl = slice(t0, t1)
        h[:, :, sl], nrm[:, :, sl], mr[:, :, sl], C, n, m = _chunk_fwd(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                                                                      i[:, :, sl], a[:, :, sl], C, n, m, eps)
    return h, nrm, mr, (C, n, m)


def mlstm_recurrent_fwd(q, k, v, i, f, C0=None, n0=None, m0=None, eps=EPS):
    """The recurrence one step at a time (mlstm.step is S = 1). Returns (h, nrm, m, (C, n, m))."""
    return mlstm_chunkwise_fwd(q, k, v, i, f, C0, n0, m0, chunk=1, eps=eps)


def mlstm_parallel_fwd(q, k, v, i, f, eps=EPS):
    """The parallel form: no states (m0 = -inf), one chunk of length S. Returns (h, nrm, m)."""
    q, k, v, i, f = map(_f64, (q, k, v, i, f))
    B, NH, S, DK, DV = _check(q, k, v, i, f, None, None, None)
    C, n, m = _states(None, None, None, B, NH, DK, DV, m_empty=-np.inf)
    h, nrm, mr, _, _, _ = _chunk_fwd(q, k, v, i, logsigmoid(f), C, n, m, eps)
    return h, nrm, mr


def _chunk_bwd(q, k, v, i, a, C, m, nrm, m_row, m_end, dh, dC_end, eps):
    """Gradients of one chunk with nrm, m constants: (dq, dk, dv, di, dC before the chunk)."""
    L, DK = q.shape[2], q.shape[3]
    s = DK ** -0.5
    qs = q * s
    b = np.cumsum(a, axis=-1)
    causal = np.tril(np.ones((L, L), dtype=bool))
    D = np.exp(np.where(causal, b[..., :, None] - b[..., None, :] + i[..., None, :], -np.inf) - m_row[..., None])
    g = np.exp(b + m[..., None] - m_row)
    w = np.exp(b[..., -1:] - b + i - m_end[..., None])
    g_end = np.exp(b[..., -1] + m - m_end)
    dhn = dh / (nrm + eps)[..., None]
    dhv = np.einsum("bhte,bhse->bhts", dhn, v) * D            # D_ts (dhn_t . v_s)
    dqs = g[..., None] * np.einsum("bhde,bhte->bhtd", C, dhn) + np.einsum("bhts,bhsd->bhtd", dhv, k)
    dk = np.einsum("bhts,bhtd->bhsd", dhv, qs) + w[..., None] * np.einsum("bhde,bhse->bhsd", dC_end, v)
    dv = (np.einsum("bhts,bhtd,bhsd,bhte->bhse", D, qs, k, dhn)
          + w[..., None] * np.einsum("bhde,bhsd->bhse", dC_end, k))
    di = np.einsum("bhsd,bhsd->bhs", k, dk)
    dC = np.einsum("bht,bhtd,bhte->bhde", g, qs, dhn) + g_end[..., None, None] * dC_end
    return dqs * s, dk, dv, di, dC


def _df_from(q, dq, k, dk, f, last_term, entering_state=False):
    """df with F = cumsum(logsigmoid(f)): dF_t = q_t.dq_t - k_t.dk_t (h_t and C_last are linear in
    q_t, k_s, and scale with e^(F_t), e^(-F_s)), plus <dC_last, C_last> at the last step. The sum down
    to step 0 is <dC, C> of the entering state, which a_0 alone scales: exactly 0 without one."""
    dF = np.einsum("bhtd,bhtd->bht", q, dq) - np.einsum("bhtd,bhtd->bht", k, dk)
    dF[..., -1] += last_term
    da = np.flip(np.cumsum(np.flip(dF, -1), -1), -1)
    if not entering_state:
        da[..., 0] = 0.0
    return da * _sigmoid(-f)


def mlstm_chunkwise_bwd(dh, q, k, v, i, f, C0=None, n0=None, m0=None, dC_last=None, chunk=64, eps=EPS):
    """Gradients of sum(dh * h) + sum(dC_last * C_last) with nrm and m constants, computed chunk by chunk
    backwards (the forward recomputed for the states entering each chunk). Returns a dict with
    GRAD_KEYS; dC0 (and dn0 = dm0 = 0) only with initial states, else None."""
    q, k, v, i, f, C0, n0, m0, dh, dC_last = map(_f64, (q, k, v, i, f, C0, n0, m0, dh, dC_last))
    B, NH, S, DK, DV = _check(q, k, v, i, f, C0, n0, m0)
    if dh.shape != v.shape:
        raise ValueError(f"mlstm reference: dh has shape {dh.shape}, expected {v.shape}")
    if dC_last is not None and dC_last.shape != (B, NH, DK, DV):
        raise ValueError(f"mlstm reference: dC_last has shape {dC_last.shape}, expected {(B, NH, DK, DV)}")
    _check_chunk(chunk)
    a = logsigmoid(f)
    C, n, m = _states(C0, n0, m0, B, NH, DK, DV)
    starts, entering = list(range(0, S, chunk)), []
    nrm, m_row = np.empty((B, NH, S)), np.empty((B, NH, S))
    for t0 in starts:
        sl = slice(t0, min(S, t0 + chunk))
        entering.append((C, m))
        _, nrm[:, :, sl], m_row[:, :, sl], C, n, m = _chunk_fwd(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                                                                i[:, :, sl], a[:, :, sl], C, n, m, eps)
    C_last = C
    dC = np.zeros((B, NH, DK, DV)) if dC_last is None else dC_last.copy()
    dq, dk, dv, di = np.empty_like(q), np.empty_like(k), np.empty_like(v), np.empty_like(i)
    for t0, (Cs, ms) in reversed(list(zip(starts, entering))):
        sl = slice(t0, min(S, t0 + chunk))
        dq[:, :, sl], dk[:, :, sl], dv[:, :, sl], di[:, :, sl], dC = _chunk_bwd(
            q[:, :, sl], k[:, :, sl], v[:, :, sl], i[:, :, sl], a[:, :, sl], Cs, ms, nrm[:, :, sl],
            m_row[:, :, sl], m_row[:, :, sl.stop - 1], dh[:, :, sl], dC, eps)
    last = 0.0 if dC_last is None else np.einsum("bhde,bhde->bh", dC_last, C_last)
    with_init = C0 is not None
    df = _df_from(q, dq, k, dk, f, last, with_init)
    return dict(dq=dq, dk=dk, dv=dv, di=di, df=df, dC0=dC if with_init else None,
                dn0=np.zeros_like(n0) if with_init else None, dm0=np.zeros_like(m0) if with_init else None)


def mlstm_parallel_bwd(dh, q, k, v, i, f, eps=EPS):
    """Gradients of sum(dh * h) of the parallel form with nrm and m constants: dq, dk, dv, di, df."""
    q, k, v, i, f, dh = map(_f64, (q, k, v, i, f, dh))
    B, NH, S, DK, DV = _check(q, k, v, i, f, None, None, None)
    if dh.shape != v.shape:
        raise ValueError(f"mlstm reference: dh has shape {dh.shape}, expected {v.shape}")
    _, nrm, m_row = mlstm_parallel_fwd(q, k, v, i, f, eps)
    C, _, m = _states(None, None, None, B, NH, DK, DV, m_empty=-np.inf)
    dq, dk, dv, di, _ = _chunk_bwd(q, k, v, i, logsigmoid(f), C, m, nrm, m_row, m_row[..., -1], dh,
                                   np.zeros((B, NH, DK, DV)), eps)
    return dict(dq=dq, dk=dk, dv=dv, di=di, df=_df_from(q, dq, k, dk, f, 0.0))


def mlstm_recurrent_bwd(dh, q, k, v, i, f, C0=None, n0=None, m0=None, dC_last=None, dn_last=None,
                        dm_last=None, exact=False, eps=EPS):
    """Reverse mode through the recurrence, one step at a time.

    exact=False: nrm and m constants (the chunkwise backward's gradient; dn_last, dm_last must be None).
    exact=True: the true gradient of the forward, through nrm = max(|s q.n'|, e^-m') and m' = max(a + m, i)
    (the subgradient of the branch taken), with optional dn_last, dm_last. Returns a dict with GRAD_KEYS.
    """
    q, k, v, i, f, C0, n0, m0, dh, dC_last, dn_last, dm_last = map(
        _f64, (q, k, v, i, f, C0, n0, m0, dh, dC_last, dn_last, dm_last))
    B, NH, S, DK, DV = _check(q, k, v, i, f, C0, n0, m0)
    if dh.shape != v.shape:
        raise ValueError(f"mlstm reference: dh has shape {dh.shape}, expected {v.shape}")
    if not exact and (dn_last is not None or dm_last is not None):
        raise ValueError("mlstm reference: dn_last, dm_last need exact=True (n and m are constants otherwise)")
    s = DK ** -0.5
    a = logsigmoid(f)
    C, n, m = _states(C0, n0, m0, B, NH, DK, DV)
    saved = []
    for t in range(S):
        m_new = np.maximum(a[..., t] + m, i[..., t])
        g, e = np.exp(a[..., t] + m - m_new), np.exp(i[..., t] - m_new)
        C_new = g[..., None, None] * C + e[..., None, None] * np.einsum("bhd,bhe->bhde", k[:, :, t], v[:, :, t])
        n_new = g[..., None] * n + e[..., None] * k[:, :, t]
        saved.append((C, n, m, C_new, n_new, m_new, g, e))
        C, n, m = C_new, n_new, m_new

    dC = np.zeros((B, NH, DK, DV)) if dC_last is None else dC_last.copy()
    dn = np.zeros((B, NH, DK)) if dn_last is None else dn_last.copy()
    dm = np.zeros((B, NH)) if dm_last is None else dm_last.copy()
    dq, dk, dv, di, da = np.empty_like(q), np.empty_like(k), np.empty_like(v), np.empty_like(i), np.empty_like(i)
    for t in reversed(range(S)):
        C, n, m, C_new, n_new, m_new, g, e = saved[t]
        qs, kt, vt = q[:, :, t] * s, k[:, :, t], v[:, :, t]
        num = np.einsum("bhd,bhde->bhe", qs, C_new)
        z = np.einsum("bhd,bhd->bh", qs, n_new)
        nrm = np.maximum(np.abs(z), np.exp(-m_new))
        den = nrm + eps
        dnum = dh[:, :, t] / den[..., None]
        dqs = np.einsum("bhde,bhe->bhd", C_new, dnum)
        dC = dC + np.einsum("bhd,bhe->bhde", qs, dnum)
        if exact:
            dden = -np.einsum("bhe,bhe->bh", dnum, num) / den
            by_z = np.abs(z) >= np.exp(-m_new)
            dz = np.where(by_z, dden * np.sign(z), 0.0)
            dm = dm + np.where(by_z, 0.0, -dden * np.exp(-m_new))
            dn = dn + dz[..., None] * qs
            dqs = dqs + dz[..., None] * n_new
        dq[:, :, t] = dqs * s
        dg = np.einsum("bhde,bhde->bh", dC, C) + np.einsum("bhd,bhd->bh", dn, n)
        de = np.einsum("bhd,bhde,bhe->bh", kt, dC, vt) + np.einsum("bhd,bhd->bh", dn, kt)
        dk[:, :, t] = e[..., None] * (np.einsum("bhde,bhe->bhd", dC, vt) + dn)
        dv[:, :, t] = e[..., None] * np.einsum("bhde,bhd->bhe", dC, kt)
        da[..., t] = dg * g
        di[..., t] = de * e
        if exact:
            # g = e^(a + m - m'), e = e^(i - m'), then m' = max(a + m, i).
            dm_new = dm - dg * g - de * e
            first = a[..., t] + m >= i[..., t]
            da[..., t] += np.where(first, dm_new, 0.0)
            di[..., t] += np.where(first, 0.0, dm_new)
            dm = dg * g + np.where(first, dm_new, 0.0)
            dn = g[..., None] * dn
        dC = g[..., None, None] * dC
    with_init = C0 is not None
    return dict(dq=dq, dk=dk, dv=dv, di=di, df=da * _sigmoid(-f), dC0=dC if with_init else None,
                dn0=(dn if exact else np.zeros_like(n0)) if with_init else None,
                dm0=(dm if exact else np.zeros_like(m0)) if with_init else None)
