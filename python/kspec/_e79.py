"""torch glue for E79: the cell over one fused projection (one forward and one backward below, on the
column blocks of the projection), and its family spec, from which kspec._surface makes the custom ops
kspec::e79_fwd / e79_bwd, their fakes, autograd and the eager path; kspec.ops.e79 puts the projection
GEMM (kspec's gemm op, kspec.ops.linear) in front."""
from __future__ import annotations

import torch

from ._core import call
from ._surface import Family, build

BIAS_MODES = ("none", "fixed", "input")
DEFAULT_CHUNK = 16


def checkpoint_bytes_per_token(n: int, chunk: int = DEFAULT_CHUNK) -> float:
    """Bytes the forward keeps for the backward per token (and sequence): (S, M) in fp32 every `chunk`
    steps, 2 * n * n * 4 / chunk. (Inputs, the projection and the output are saved as usual.)"""
    return 8.0 * n * n / chunk


def _blocks(x, n, count):
    return [x[..., j * n:(j + 1) * n] for j in range(count)]


def _rows_like(x, cols):
    """An empty [T, B, cols] tensor with x's order of its first two dims (batch-first memory when x is a
    transposed batch-first tensor), unit stride along the last dim. One allocation, not a view of one,
    so a custom op may return it; the fake kernels build their outputs with it too, so their strides
    are the real ones."""
    T, B = x.shape[0], x.shape[1]
    if x.stride(0) < x.stride(1) and T > 1 and B > 1:
        return x.new_empty_strided((T, B, cols), (cols, T * cols, 1))
    return x.new_empty((T, B, cols))


def _kernel_inputs(kvqm, b_s, b_m, n, mode):
    """k, v, q, m, b_s, b_m as e79.fwd/.bwd take them: column blocks of kvqm (the biases too with
    per-step input biases)."""
    k, v, q, m, *rest = _blocks(kvqm, n, 6 if mode == "input" else 4)
    bs, bm = rest if mode == "input" else (b_s, b_m)
    return k, v, q, m, bs, bm


def _fwd_outputs(kvqm, n, chunk, save):
    """out [T, B, n] in kvqm's layout, S, M [B, n, n] fp32, and with `save` the checkpoints
    [B, ceil(T / chunk), 2, n, n] fp32 ((S, M) before steps 0, chunk, 2 chunk, ...), else None."""
    T, B = kvqm.shape[0], kvqm.shape[1]
    S = kvqm.new_empty((B, n, n), dtype=torch.float32)
    chk = kvqm.new_empty((B, (T + chunk - 1) // chunk, 2, n, n), dtype=torch.float32) if save else None
    return _rows_like(kvqm, n), S, torch.empty_like(S), chk


def _forward(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config, save):
    """e79.fwd: (out, S, M, checkpoints or None)."""
    out, S, M, chk = _fwd_outputs(kvqm, n, chunk, save)
    call("e79.fwd", *_kernel_inputs(kvqm, b_s, b_m, n, mode), S0, M0, chunk=chunk, config=config,
         out=(out, S, M, chk))
    return out, S, M, chk


def _bwd_outputs(kvqm, b_s, b_m, S0, M0, mode):
    """(dkvqm in kvqm's layout, db_s, db_m, dS0, dM0); db_s, db_m only for fixed biases (per-step input
    biases get theirs in dkvqm's last two blocks), dS0, dM0 only with S0, M0; None otherwise."""
    fixed = mode == "fixed"
    return (_rows_like(kvqm, kvqm.shape[-1]), torch.empty_like(b_s) if fixed else None,
            torch.empty_like(b_m) if fixed else None, None if S0 is None else torch.empty_like(S0),
            None if M0 is None else torch.empty_like(M0))


def _backward(dout, kvqm, b_s, b_m, S0, M0, chk, dS, dM, n, mode, chunk, config):
    """e79.bwd: (dkvqm, db_s, db_m, dS0, dM0) as _bwd_outputs. The gradient of kvqm is written by the
    kernel straight into one tensor of kvqm's layout, ready for the projection's backward GEMMs. dout,
    dS, dM: None for zeros."""
    if dout is None:
        dout = kvqm.new_zeros(kvqm.shape[:2] + (n,))
    elif dout.stride(-1) != 1:
        dout = dout.contiguous()
    dS = None if dS is None else dS.float().contiguous()
    dM = None if dM is None else dM.float().contiguous()
    grads = _bwd_outputs(kvqm, b_s, b_m, S0, M0, mode)
    dkvqm, dbs, dbm, dS0, dM0 = grads
    dk, dv, dq, dm, *drest = _blocks(dkvqm, n, 6 if mode == "input" else 4)
    dbs, dbm = drest if mode == "input" else (dbs, dbm)
    call("e79.bwd", dout, *_kernel_inputs(kvqm, b_s, b_m, n, mode), S0, M0, chk, dS, dM, chunk=chunk,
         config=config, out=(dk, dv, dq, dm, dbs, dbm, dS0, dM0))
    return grads


# ---- the surface: custom ops kspec::e79_fwd / e79_bwd (torch.compile), autograd, the eager path ----
# The checkpoints only feed the backward (no gradient for them), and no zeros are materialized for them
# (8 n^2 / chunk bytes per token: 4 GiB at B=128, T=4096, n=128) or for an unused out, S or M: every
# gradient argument of the backward is optional.

def _fwd(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config, save_arg, save):
    return _forward(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config, save)


def _fwd_fake(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config, save):
    return _fwd_outputs(kvqm, n, chunk, save)


def _bwd_fake(dout, kvqm, b_s, b_m, S0, M0, chk, dS, dM, n, mode, chunk, config):
    return _bwd_outputs(kvqm, b_s, b_m, S0, M0, mode)


_STATES = "Tensor kvqm, Tensor? b_s, Tensor? b_m, Tensor? S0, Tensor? M0"
_CFG = "SymInt n, str mode, SymInt chunk, str? config"
cell = build(Family(
    name="e79", ops=("e79.fwd", "e79.bwd"), fwd=f"{_STATES}, {_CFG}, bool save", fwd_out=("out", "S", "M", "chk"),
    bwd=f"Tensor? dout, {_STATES}, Tensor chk, Tensor? dS, Tensor? dM, {_CFG}",
    bwd_out=("dkvqm", "db_s", "db_m", "dS0", "dM0"), forward=_fwd, backward=_backward, public=(0, 1, 2),
    save_arg="save", save_required=True, fake=_fwd_fake, bwd_fake=_bwd_fake))
e79_fwd, e79_bwd = cell.fwd_op, cell.bwd_op


def cell_torch(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config=None):
    """Casts what the op needs cast (fp32 states; biases of another dtype than kvqm to fp32), then the
    family's surface (checkpoints kept only when a gradient is wanted)."""
    if b_s is not None and b_s.dtype not in (kvqm.dtype, torch.float32):
        b_s, b_m = b_s.float(), b_m.float()
    S0 = None if S0 is None else S0.float().contiguous()
    M0 = None if M0 is None else M0.float().contiguous()
    return cell(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config, True)
