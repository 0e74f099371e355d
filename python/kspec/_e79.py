"""torch glue for E79: the cell as an autograd Function over one fused projection, and the full
projection + cell path kspec.ops.e79 uses (the GEMM through kspec's gemm op, kspec.ops.linear)."""
from __future__ import annotations

import torch

from ._core import call

BIAS_MODES = ("none", "fixed", "input")
DEFAULT_CHUNK = 16


def checkpoint_bytes_per_token(n: int, chunk: int = DEFAULT_CHUNK) -> float:
    """Bytes the forward keeps for the backward per token (and sequence): (S, M) in fp32 every `chunk`
    steps, 2 * n * n * 4 / chunk. (Inputs, the projection and the output are saved as usual.)"""
    return 8.0 * n * n / chunk


def _blocks(x, n, count):
    return [x[..., j * n:(j + 1) * n] for j in range(count)]


def _like_layout(x, shape_last):
    """An empty tensor [T, B, shape_last] with x's order of its first two dims (batch-first memory when
    x is a transposed batch-first tensor), unit stride along the last dim."""
    T, B = x.shape[0], x.shape[1]
    if x.stride(0) < x.stride(1) and T > 1 and B > 1:
        return torch.empty((B, T, shape_last), dtype=x.dtype, device=x.device).transpose(0, 1)
    return torch.empty((T, B, shape_last), dtype=x.dtype, device=x.device)


class E79Function(torch.autograd.Function):
    """(kvqm [T, B, 4n or 6n], b_s, b_m, S0, M0) -> (out [T, B, n], S, M).

    kvqm: the fused projection, any strides with unit stride along the last dim; columns
    [k | v | q | m] (+ [b_s | b_m] per step in input-bias mode). b_s, b_m: (n,) in fixed mode, else
    None. S0, M0: (B, n, n) fp32 or None. The gradient of kvqm is written by the backward kernel
    straight into one tensor of kvqm's layout, ready for the projection's backward GEMMs. config: a
    tuning config for both kernels (e79.fwd and e79.bwd share their axes) or None."""

    @staticmethod
    def forward(ctx, kvqm, b_s, b_m, S0, M0, n, mode, chunk, config):
        T, B = kvqm.shape[0], kvqm.shape[1]
        k, v, q, m, *rest = _blocks(kvqm, n, 6 if mode == "input" else 4)
        bs, bm = rest if mode == "input" else (b_s, b_m)
        need = any(ctx.needs_input_grad[:5])
        out = _like_layout(kvqm, n)
        S = torch.empty((B, n, n), dtype=torch.float32, device=kvqm.device)
        M = torch.empty_like(S)
        chk = None
        if need:
            nchk = -(-T // chunk)
            chk = torch.empty((B, nchk, 2, n, n), dtype=torch.float32, device=kvqm.device)
        call("e79.fwd", k, v, q, m, bs, bm, S0, M0, chunk=chunk, config=config, out=(out, S, M, chk))
        ctx.save_for_backward(kvqm, b_s, b_m, S0, M0, chk)
        ctx.cfg = (n, mode, chunk, config)
        return out, S, M

    @staticmethod
    def backward(ctx, dout, dS, dM):
        kvqm, b_s, b_m, S0, M0, chk = ctx.saved_tensors
        n, mode, chunk, config = ctx.cfg
        if dout is None:
            dout = torch.zeros(kvqm.shape[:2] + (n,), dtype=kvqm.dtype, device=kvqm.device)
        elif dout.stride(-1) != 1:
            dout = dout.contiguous()
        dS = None if dS is None else dS.float().contiguous()
        dM = None if dM is None else dM.float().contiguous()
        count = 6 if mode == "input" else 4
        k, v, q, m, *rest = _blocks(kvqm, n, count)
        bs, bm = rest if mode == "input" else (b_s, b_m)
        dkvqm = _like_layout(kvqm, kvqm.shape[-1])
        dk, dv, dq, dm, *drest = _blocks(dkvqm, n, count)
        if mode == "input":
            dbs, dbm = drest
        elif mode == "fixed":
            dbs, dbm = torch.empty_like(b_s), torch.empty_like(b_m)
        else:
            dbs = dbm = None
        dS0 = None if S0 is None else torch.empty_like(S0)
        dM0 = None if M0 is None else torch.empty_like(M0)
        call("e79.bwd", dout, k, v, q, m, bs, bm, S0, M0, chk, dS, dM, chunk=chunk, config=config,
             out=(dk, dv, dq, dm, dbs, dbm, dS0, dM0))
        fixed = mode == "fixed"
        return dkvqm, dbs if fixed else None, dbm if fixed else None, dS0, dM0, None, None, None, None


def cell_torch(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config=None):
    """Casts what the op needs cast (fp32 states; biases of another dtype than kvqm to fp32), then the
    autograd Function."""
    if b_s is not None and b_s.dtype not in (kvqm.dtype, torch.float32):
        b_s, b_m = b_s.float(), b_m.float()
    S0 = None if S0 is None else S0.float().contiguous()
    M0 = None if M0 is None else M0.float().contiguous()
    return E79Function.apply(kvqm, b_s, b_m, S0, M0, n, mode, chunk, config)
