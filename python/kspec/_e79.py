"""torch glue for E79: the cell over one fused projection as torch.library custom ops (kspec::e79_fwd,
kspec::e79_bwd, with fake kernels and autograd: what torch.compile traces) and as an autograd Function
(the eager path, without torch.library's dispatch cost), both on one forward and one backward below;
kspec.ops.e79 puts the projection GEMM (kspec's gemm op, kspec.ops.linear) in front."""
from __future__ import annotations

from typing import Optional

import torch

from ._core import call
from ._torch import wants_grad

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


def _absent(like, dtype=None):
    """Custom ops cannot return None inside a tuple: an empty tensor stands for an absent output."""
    return like.new_empty(0, dtype=dtype)


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


# ---- the custom ops (torch.compile) ----
# Their implementations stay plain functions: the CPU tests register them for CPU tensors with the
# float64 reference standing in for the kernels, and so test this glue without a GPU.

def _fwd_op(kvqm: torch.Tensor, b_s: Optional[torch.Tensor], b_m: Optional[torch.Tensor],
            S0: Optional[torch.Tensor], M0: Optional[torch.Tensor], n: int, mode: str, chunk: int,
            config: Optional[str], save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, S, M, checkpoints); checkpoints empty unless `save` (what the backward needs)."""
    out, S, M, chk = _forward(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config, save)
    return out, S, M, chk if chk is not None else _absent(kvqm, torch.float32)


def _bwd_op(dout: Optional[torch.Tensor], kvqm: torch.Tensor, b_s: Optional[torch.Tensor],
            b_m: Optional[torch.Tensor], S0: Optional[torch.Tensor], M0: Optional[torch.Tensor],
            chk: torch.Tensor, dS: Optional[torch.Tensor], dM: Optional[torch.Tensor], n: int, mode: str,
            chunk: int, config: Optional[str]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dkvqm, db_s, db_m, dS0, dM0); an empty tensor for an absent gradient."""
    grads = _backward(dout, kvqm, b_s, b_m, S0, M0, chk, dS, dM, n, mode, chunk, config)
    return tuple(_absent(kvqm) if g is None else g for g in grads)


e79_fwd = torch.library.custom_op("kspec::e79_fwd", _fwd_op, mutates_args=(), device_types="cuda")
e79_bwd = torch.library.custom_op("kspec::e79_bwd", _bwd_op, mutates_args=(), device_types="cuda")


@e79_fwd.register_fake
def _(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config, save):
    out, S, M, chk = _fwd_outputs(kvqm, n, chunk, save)
    return out, S, M, chk if chk is not None else _absent(kvqm, torch.float32)


@e79_bwd.register_fake
def _(dout, kvqm, b_s, b_m, S0, M0, chk, dS, dM, n, mode, chunk, config):
    return tuple(_absent(kvqm) if g is None else g for g in _bwd_outputs(kvqm, b_s, b_m, S0, M0, mode))


def _setup(ctx, inputs, output):
    kvqm, b_s, b_m, S0, M0, n, mode, chunk, config, save = inputs
    ctx.save_for_backward(kvqm, b_s, b_m, S0, M0, output[3])
    ctx.cfg = (n, mode, chunk, config, save)
    # The checkpoints only feed the backward: no gradient for them, and no zeros materialized for them
    # (8 n^2 / chunk bytes per token: 4 GiB at B=128, T=4096, n=128) or for an unused out, S or M.
    ctx.mark_non_differentiable(output[3])
    ctx.set_materialize_grads(False)


def _grads(ctx, dout, dS, dM, dchk):
    kvqm, b_s, b_m, S0, M0, chk = ctx.saved_tensors
    n, mode, chunk, config, save = ctx.cfg
    if not save:
        raise RuntimeError("kspec::e79_fwd ran with save=False: it kept no checkpoints for the backward")
    dkvqm, dbs, dbm, dS0, dM0 = e79_bwd(dout, kvqm, b_s, b_m, S0, M0, chk, dS, dM, n, mode, chunk, config)
    fixed = mode == "fixed"
    return (dkvqm, dbs if fixed else None, dbm if fixed else None, None if S0 is None else dS0,
            None if M0 is None else dM0, None, None, None, None, None)


e79_fwd.register_autograd(_grads, setup_context=_setup)


# ---- the eager path ----

class E79Function(torch.autograd.Function):
    """(kvqm [T, B, 4n or 6n], b_s, b_m, S0, M0) -> (out [T, B, n], S, M).

    kvqm: the fused projection, any strides with unit stride along the last dim; columns
    [k | v | q | m] (+ [b_s | b_m] per step in input-bias mode). b_s, b_m: (n,) in fixed mode, else
    None. S0, M0: (B, n, n) fp32 or None. config: a tuning config for both kernels (e79.fwd and e79.bwd
    share their axes) or None. The same kernels as the custom ops; torch.compile traces those instead."""

    @staticmethod
    def forward(ctx, kvqm, b_s, b_m, S0, M0, n, mode, chunk, config):
        save = any(ctx.needs_input_grad[:5])
        out, S, M, chk = _forward(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config, save)
        ctx.save_for_backward(kvqm, b_s, b_m, S0, M0, chk)
        ctx.cfg = (n, mode, chunk, config)
        return out, S, M

    @staticmethod
    def backward(ctx, dout, dS, dM):
        kvqm, b_s, b_m, S0, M0, chk = ctx.saved_tensors
        n, mode, chunk, config = ctx.cfg
        dkvqm, dbs, dbm, dS0, dM0 = _backward(dout, kvqm, b_s, b_m, S0, M0, chk, dS, dM, n, mode, chunk, config)
        return dkvqm, dbs, dbm, dS0, dM0, None, None, None, None


def cell_torch(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config=None):
    """Casts what the op needs cast (fp32 states; biases of another dtype than kvqm to fp32), then the
    autograd Function, or under torch.compile the custom op (keeping checkpoints only when a gradient
    is wanted, as the Function does)."""
    if b_s is not None and b_s.dtype not in (kvqm.dtype, torch.float32):
        b_s, b_m = b_s.float(), b_m.float()
    S0 = None if S0 is None else S0.float().contiguous()
    M0 = None if M0 is None else M0.float().contiguous()
    if torch.compiler.is_compiling():
        save = wants_grad(kvqm, b_s, b_m, S0, M0)
        out, S, M, _ = e79_fwd(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config, save)
        return out, S, M
    return E79Function.apply(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config)
