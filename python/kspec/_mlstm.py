"""torch glue for mlstm (issue 29): the family specs of the chunkwise and the parallel form (kspec._surface
makes their custom ops kspec::mlstm_chunkwise_fwd/_bwd and kspec::mlstm_parallel_fwd/_bwd, fakes, autograd
and the eager path) and the forward/backward each runs. The per-step normalizer and max (nrm, m_rows) are
kept only where a backward will run; the last states only with return_last_states. As in mlstm_kernels the
backward holds nrm and m constant, so n_last and m_last carry no gradient (dn0 = dm0 = 0)."""
from __future__ import annotations

import torch

from ._core import call
from ._surface import Family, build

EPS = 1e-6
DEFAULT_CHUNK = 128  # mlstm_kernels' chunk_size default


def _rows(q):
    """[B, NH, S] fp32 (nrm, m_rows)."""
    return q.new_empty(q.shape[:3], dtype=torch.float32)


def _states_like(q, v):
    """C [B, NH, DHQK, DHHV], n [B, NH, DHQK], m [B, NH, 1], fp32."""
    B, NH, DK, DV = q.shape[0], q.shape[1], q.shape[-1], v.shape[-1]
    f32 = torch.float32
    return (q.new_empty((B, NH, DK, DV), dtype=f32), q.new_empty((B, NH, DK), dtype=f32),
            q.new_empty((B, NH, 1), dtype=f32))


def _h(q, v):
    return v.new_empty(v.shape, dtype=q.dtype)


def _contiguous(t):
    return t if t is None or t.is_contiguous() else t.contiguous()


def _chunkwise_fwd(q, k, v, i, f, C0, n0, m0, return_last_states, eps, chunk, save):
    """(h, nrm, m_rows, C_last, n_last, m_last): nrm, m_rows only with `save`, the last states only with
    return_last_states (None otherwise)."""
    h = _h(q, v)
    nrm, m_rows = (_rows(q), _rows(q)) if save else (None, None)
    last = _states_like(q, v) if return_last_states else (None, None, None)
    call("mlstm.chunkwise.fwd", q, k, v, i, f, C0, n0, m0, eps=eps, chunk=chunk, out=(h, nrm, m_rows, *last))
    return (h, nrm, m_rows, *last)


def _chunkwise_fwd_shapes(q, v, return_last_states, save):
    nrm, m_rows = (_rows(q), _rows(q)) if save else (None, None)
    last = _states_like(q, v) if return_last_states else (None, None, None)
    return (_h(q, v), nrm, m_rows, *last)


def _grads_of(q, k, v, i, f):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(i),
            torch.empty_like(f))


def _dh(dh, q, v):
    """autograd's dh (None when only the last state had a gradient; any view) as the backward reads it."""
    if dh is None:
        return q.new_zeros(v.shape, dtype=q.dtype)
    return dh.contiguous()


def _chunkwise_bwd(dh, dC_last, q, k, v, i, f, C0, m0, nrm, m_rows, eps, chunk):
    dh = _dh(dh, q, v)
    if dC_last is not None:
        dC_last = dC_last.float().contiguous()
    grads = _grads_of(q, k, v, i, f)
    dC0 = None if C0 is None else torch.empty_like(C0)
    call("mlstm.chunkwise.bwd", q, k, v, i, f, C0, m0, nrm, m_rows, dh, dC_last, eps=eps, chunk=chunk,
         out=(*grads, dC0))
    return (*grads, dC0)


def _chunkwise_bwd_fake(dh, dC_last, q, k, v, i, f, C0, m0, nrm, m_rows, eps, chunk):
    return (*_grads_of(q, k, v, i, f), None if C0 is None else torch.empty_like(C0))


_QKVIF = "Tensor q, Tensor k, Tensor v, Tensor i, Tensor f"
chunkwise = build(Family(
    name="mlstm_chunkwise", ops=("mlstm.chunkwise.fwd", "mlstm.chunkwise.bwd"),
    fwd=_QKVIF + ", Tensor? C0, Tensor? n0, Tensor? m0, bool return_last_states, float eps, int chunk, "
    "bool save_rows",
    fwd_out=("h", "nrm", "m_rows", "C_last", "n_last", "m_last"),
    bwd="Tensor? dh, Tensor? dC_last, " + _QKVIF + ", Tensor? C0, Tensor? m0, Tensor nrm, Tensor m_rows, float eps, "
    "int chunk",
    bwd_out=("dq", "dk", "dv", "di", "df", "dC0"),
    forward=lambda *a, save: _chunkwise_fwd(*a[:-1], save=save), backward=_chunkwise_bwd,
    public=(0, 3, 4, 5), save_arg="save_rows", save_required=True,
    fake=lambda *a: _chunkwise_fwd_shapes(a[0], a[2], a[8], a[11]), bwd_fake=_chunkwise_bwd_fake))


def _parallel_fwd(q, k, v, i, f, eps, save_rows, save):
    h = _h(q, v)
    nrm, m_rows = (_rows(q), _rows(q)) if save else (None, None)
    call("mlstm.parallel.fwd", q, k, v, i, f, eps=eps, out=(h, nrm, m_rows))
    return h, nrm, m_rows


def _parallel_bwd(dh, q, k, v, i, f, nrm, m_rows, eps):
    dh = _dh(dh, q, v)
    grads = _grads_of(q, k, v, i, f)
    call("mlstm.parallel.bwd", q, k, v, i, f, nrm, m_rows, dh, eps=eps, out=grads)
    return grads


parallel = build(Family(
    name="mlstm_parallel", ops=("mlstm.parallel.fwd", "mlstm.parallel.bwd"),
    fwd=_QKVIF + ", float eps, bool save_rows", fwd_out=("h", "nrm", "m_rows"),
    bwd="Tensor? dh, " + _QKVIF + ", Tensor nrm, Tensor m_rows, float eps",
    bwd_out=("dq", "dk", "dv", "di", "df"),
    forward=_parallel_fwd, backward=_parallel_bwd, save_arg="save_rows", save_required=True,
    fake=lambda q, k, v, i, f, eps, save_rows: (_h(q, v), *((_rows(q), _rows(q)) if save_rows else (None, None))),
    bwd_fake=lambda dh, q, k, v, i, f, nrm, m_rows, eps: _grads_of(q, k, v, i, f)))


def _gates(i, f, q):
    """[B, NH, S] gates as the ops take them: q's dtype or fp32, both the same (i's)."""
    if i.dtype not in (q.dtype, torch.float32):
        i = i.to(q.dtype)
    return i, f if f.dtype == i.dtype else f.to(i.dtype)


def mlstm_chunkwise(q, k, v, i, f, c_initial=None, n_initial=None, m_initial=None, return_last_states=False,
                    eps=EPS, chunk_size=DEFAULT_CHUNK):
    given = [n for n, t in (("c_initial", c_initial), ("n_initial", n_initial), ("m_initial", m_initial))
             if t is not None]
    if 0 < len(given) < 3:
        raise ValueError("kspec.ops.mlstm_chunkwise: c_initial, n_initial and m_initial go together (all three or "
                         f"none), got {', '.join(given)} alone")
    i, f = _gates(i, f, q)
    args = [_contiguous(t) for t in (q, k, v, i, f, c_initial, n_initial, m_initial)]
    if args[7] is not None and args[7].dim() == 2:
        args[7] = args[7].unsqueeze(-1)  # m [B, NH] as mlstm_kernels' callers sometimes keep it
    h, C, n, m = chunkwise(*args, bool(return_last_states), float(eps), int(chunk_size), True)
    return (h, (C, n, m)) if return_last_states else h


def mlstm_parallel(q, k, v, i, f, eps=EPS):
    i, f = _gates(i, f, q)
    q, k, v, i, f = (_contiguous(t) for t in (q, k, v, i, f))
    return parallel(q, k, v, i, f, float(eps), True)


def mlstm_step(q, k, v, i, f, c, n, m, eps=EPS, inplace=False):
    if i.dim() == 2:
        i = i.unsqueeze(-1)
    if f.dim() == 2:
        f = f.unsqueeze(-1)
    i, f = _gates(i, f, q)
    q, k, v, i, f = (_contiguous(t) for t in (q, k, v, i, f))
    h = v.new_empty(v.shape, dtype=q.dtype)
    new = (c, n, m) if inplace else (torch.empty_like(c), torch.empty_like(n), torch.empty_like(m))
    call("mlstm.step", q, k, v, i, f, c, n, m, eps=float(eps), out=(h, *new))
    return h, new
