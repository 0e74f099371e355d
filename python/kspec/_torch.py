"""torch glue: kspec ops as torch.library custom ops with registered fake (meta) kernels and autograd,
so loss.backward() and torch.compile work through them."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C
from ._core import call
from .ops import gemm_reads_in_place


@torch.library.custom_op("kspec::norm_act_fwd", mutates_args=(), device_types="cuda")
def norm_act_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], norm: str, act: str,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, mean, rstd = call("norm_act.fwd", x, weight, bias, norm=norm, act=act, eps=eps)
    return y, mean, rstd


@norm_act_fwd.register_fake
def _(x, weight, bias, norm, act, eps):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@torch.library.custom_op("kspec::norm_act_bwd", mutates_args=(), device_types="cuda")
def norm_act_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 mean: torch.Tensor, rstd: torch.Tensor, norm: str, act: str,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = call("norm_act.bwd", dy, x, weight, bias, mean, rstd, norm=norm, act=act, eps=eps)
    # custom ops cannot return None inside a tuple: an empty tensor stands for "no bias"
    return dx, dw, db if db is not None else weight.new_empty(0)


@norm_act_bwd.register_fake
def _(dy, x, weight, bias, mean, rstd, norm, act, eps):
    db = weight.new_empty(0) if bias is None else torch.empty_like(weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight), db


def _save(ctx, x, weight, bias, norm, act, eps, mean, rstd):
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.cfg = (norm, act, eps)


def _grads(ctx, dy, bwd):
    """(dx, dweight, dbias or None) through `bwd`: the custom op (traced by torch.compile) or the
    registry call (eager)."""
    x, weight, bias, mean, rstd = ctx.saved_tensors
    norm, act, eps = ctx.cfg
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    dx, dw, db = bwd(dy, x, weight, bias, mean, rstd, norm, act, eps)
    return dx, dw, db if bias is not None else None


def _setup(ctx, inputs, output):
    _save(ctx, *inputs, *output[1:])


def _backward(ctx, dy, dmean, drstd):
    return (*_grads(ctx, dy, norm_act_bwd), None, None, None)


norm_act_fwd.register_autograd(_backward, setup_context=_setup)


def _bwd_call(dy, x, weight, bias, mean, rstd, norm, act, eps):
    return call("norm_act.bwd", dy, x, weight, bias, mean, rstd, norm=norm, act=act, eps=eps)


class _NormAct(torch.autograd.Function):
    """The eager path: the same kernels as the custom ops without torch.library's dispatch cost (about
    60 µs of host time per call on the H100 machine); torch.compile traces the custom ops instead."""

    @staticmethod
    def forward(ctx, x, weight, bias, norm, act, eps):
        y, mean, rstd = call("norm_act.fwd", x, weight, bias, norm=norm, act=act, eps=eps)
        _save(ctx, x, weight, bias, norm, act, eps, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        return (*_grads(ctx, dy, _bwd_call), None, None, None)


def norm_act(x, weight, bias, norm, act, eps):
    if torch.compiler.is_compiling():
        return norm_act_fwd(x, weight, bias, norm, act, eps)[0]
    if not wants_grad(x, weight, bias):  # no graph to record: the op alone (autograd.Function.apply costs ~8 µs)
        return call("norm_act.fwd", x, weight, bias, norm=norm, act=act, eps=eps)[0]
    return _NormAct.apply(x, weight, bias, norm, act, eps)


# ---- selective_scan ----
# For training the forward keeps the state entering every 16th step (`states`, [batch, dim,
# ceil(seqlen / 16), dstate] fp32), and the backward reads them instead of recomputing the forward.

_STATE_STRIDE = _C.op_info("selective_scan.fwd")["constants"]["state_stride"]


def _scan_states(u, A, save):
    """The forward's states output: allocated when `save`, else None (inference)."""
    if not save:
        return None
    return u.new_empty((u.shape[0], u.shape[1], -(-u.shape[2] // _STATE_STRIDE), A.shape[1]), dtype=torch.float32)


def _scan_fwd_call(u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, save):
    out = torch.empty_like(u)
    last = u.new_empty((u.shape[0], u.shape[1], A.shape[1]), dtype=torch.float32)
    states = _scan_states(u, A, save)
    call("selective_scan.fwd", u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus=delta_softplus,
         out=(out, last, states))
    return out, last, states


@torch.library.custom_op("kspec::selective_scan_fwd", mutates_args=(), device_types="cuda")
def selective_scan_fwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
                       h0: Optional[torch.Tensor], delta_softplus: bool,
                       save_states: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, last_state, states); states empty unless `save_states`."""
    out, last, states = _scan_fwd_call(u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, save_states)
    return out, last, states if states is not None else u.new_empty(0, dtype=torch.float32)


@selective_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, save_states):
    states = _scan_states(u, A, save_states)
    return (torch.empty_like(u), u.new_empty((u.shape[0], u.shape[1], A.shape[1]), dtype=torch.float32),
            states if states is not None else u.new_empty(0, dtype=torch.float32))


_SCAN_GRADS = ("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "dh0")


@torch.library.custom_op("kspec::selective_scan_bwd", mutates_args=(), device_types="cuda")
def selective_scan_bwd(dout: torch.Tensor, u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, D: Optional[torch.Tensor], z: Optional[torch.Tensor],
                       delta_bias: Optional[torch.Tensor], h0: Optional[torch.Tensor],
                       dlast_state: Optional[torch.Tensor], states: Optional[torch.Tensor],
                       delta_softplus: bool) -> list[torch.Tensor]:
    grads = call("selective_scan.bwd", dout, u, delta, A, B, C, D, z, delta_bias, h0, dlast_state, states,
                 delta_softplus=delta_softplus)
    # custom ops cannot return None in a list: an empty tensor stands for an absent input's gradient
    return [g if g is not None else u.new_empty(0) for g in grads]


@selective_scan_bwd.register_fake
def _(dout, u, delta, A, B, C, D, z, delta_bias, h0, dlast_state, states, delta_softplus):
    like = (u, delta, A, B, C, D, z, delta_bias, h0)
    return [u.new_empty(0) if t is None else torch.empty_like(t) for t in like]


def _scan_save(ctx, u, delta, A, B, C, D, z, delta_bias, h0, states, delta_softplus):
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, h0, states)
    ctx.delta_softplus = delta_softplus


def _scan_grads(ctx, dout, dlast, bwd):
    u, delta, A, B, C, D, z, delta_bias, h0, states = ctx.saved_tensors
    if states is not None and states.numel() == 0:
        states = None  # the forward kept none: the backward recomputes them
    dout = dout.contiguous()
    dlast = None if dlast is None else dlast.contiguous()
    grads = bwd(dout, u, delta, A, B, C, D, z, delta_bias, h0, dlast, states, ctx.delta_softplus)
    present = (True, True, True, True, True, D is not None, z is not None, delta_bias is not None, h0 is not None)
    return tuple(g if p else None for g, p in zip(grads, present))


def _scan_setup(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, _save = inputs
    _scan_save(ctx, u, delta, A, B, C, D, z, delta_bias, h0, output[2], delta_softplus)
    ctx.mark_non_differentiable(output[2])


def _scan_backward(ctx, dout, dlast, _dstates):
    return (*_scan_grads(ctx, dout, dlast, selective_scan_bwd), None, None)


selective_scan_fwd.register_autograd(_scan_backward, setup_context=_scan_setup)


def _scan_bwd_call(dout, u, delta, A, B, C, D, z, delta_bias, h0, dlast, states, delta_softplus):
    return call("selective_scan.bwd", dout, u, delta, A, B, C, D, z, delta_bias, h0, dlast, states,
                delta_softplus=delta_softplus)


class _SelectiveScan(torch.autograd.Function):
    """The eager path (no torch.library dispatch cost); torch.compile traces the custom ops instead."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, save_states):
        save = save_states and any(ctx.needs_input_grad[:9])
        out, last, states = _scan_fwd_call(u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, save)
        _scan_save(ctx, u, delta, A, B, C, D, z, delta_bias, h0, states, delta_softplus)
        return out, last

    @staticmethod
    def backward(ctx, dout, dlast):
        return (*_scan_grads(ctx, dout, dlast, _scan_bwd_call), None, None)


def wants_grad(*tensors):
    """Whether autograd will want a gradient of any of these (None skipped): the custom ops' forward keeps
    what the backward needs only then."""
    return torch.is_grad_enabled() and any([t.requires_grad for t in tensors if t is not None])


def selective_scan(u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, save_states=True):
    """(out, last_state). With `save_states` (the default) and a gradient wanted, the forward keeps the
    state every 16 steps for the backward: batch * dim * ceil(seqlen / 16) * dstate * 4 bytes."""
    if torch.compiler.is_compiling():
        save = save_states and wants_grad(u, delta, A, B, C, D, z, delta_bias, h0)
        out, last, _ = selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, save)
        return out, last
    if not wants_grad(u, delta, A, B, C, D, z, delta_bias, h0):  # inference: the op alone, no states kept
        out, last, _ = _scan_fwd_call(u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, False)
        return out, last
    return _SelectiveScan.apply(u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, save_states)


# ---- gemm / linear ----

_ACT = {"none": lambda t: t, "relu": torch.relu,
        "gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


def _as_matrix(x):
    """nn.Linear takes (..., k); the gemm op takes (..., m, k): a 1-d input becomes one row."""
    return x.unsqueeze(0) if x.dim() == 1 else x


def _linear_fwd(x, weight, bias, act, tf32, need_saved):
    """(y, saved): saved is what gemm.bwd needs (gelu: the pre-activation; relu: y; none: None)."""
    if x.numel() == 0:  # no rows, or k = 0 (y = act(bias)): nothing for cuBLASLt, which needs k > 0
        pre = torch.zeros((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
        if bias is not None:
            pre = pre + bias
        return _ACT[act](pre), (pre if act != "none" and need_saved else None)
    if act == "gelu" and need_saved:
        if weight.shape[0] % 8 == 0:
            y, pre = call("gemm", x, weight, bias, act=act, tf32=tf32, out=(torch.empty(
                (*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device), torch.empty(
                (*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)))
            return y, pre
        # cuBLASLt saves the GELU input only with n a multiple of 8: the GEMM with its bias, then GELU.
        pre = call("gemm", x, weight, bias, act="none", tf32=tf32)[0]
        return torch.nn.functional.gelu(pre, approximate="tanh"), pre
    y = call("gemm", x, weight, bias, act=act, tf32=tf32)[0]
    return y, (y if act == "relu" and need_saved else None)


def _linear_bwd(dy, x, weight, saved, has_bias, act, tf32):
    # autograd's dy may be any view (y.sum() gives a broadcast one, strides 0): gemm.bwd reads rows of it
    if not dy.is_contiguous():
        dy = dy.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:  # no rows, or k = 0: dW is empty or zero; dbias sums dpre over the rows there are
        dw = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
        if not has_bias:
            return dx, dw, None
        if act == "none":
            dpre = dy
        else:
            with torch.enable_grad():
                pre = saved.detach().requires_grad_()
                dpre, = torch.autograd.grad(_ACT[act](pre), pre, dy)
        return dx, dw, dpre.reshape(-1, weight.shape[0]).sum(0, dtype=torch.float32).to(weight.dtype)
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    db = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device) if has_bias else None
    call("gemm.bwd", dy, x, weight, saved, act=act, tf32=tf32, out=(dx, dw, db))
    return dx, dw, db


@torch.library.custom_op("kspec::linear_fwd", mutates_args=(), device_types="cuda")
def linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str,
               tf32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    y, saved = _linear_fwd(x, weight, bias, act, tf32, act == "gelu")
    return y, saved if saved is not None else x.new_empty(0)  # relu's backward reads y (outputs may not alias)


@linear_fwd.register_fake
def _(x, weight, bias, act, tf32):
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    return y, (torch.empty_like(y) if act == "gelu" else x.new_empty(0))


@torch.library.custom_op("kspec::linear_bwd", mutates_args=(), device_types="cuda")
def linear_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, saved: torch.Tensor, has_bias: bool,
               act: str, tf32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _linear_bwd(dy, x, weight, saved if act != "none" else None, has_bias, act, tf32)
    return dx, dw, db if db is not None else weight.new_empty(0)


@linear_bwd.register_fake
def _(dy, x, weight, saved, has_bias, act, tf32):
    # contiguous, as _linear_bwd allocates them, whatever the strides of x and weight (a transposed view)
    db = weight.new_empty(weight.shape[0]) if has_bias else weight.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _linear_setup(ctx, inputs, output):
    x, weight, bias, act, tf32 = inputs
    ctx.save_for_backward(x, weight, output[0] if act == "relu" else output[1])
    ctx.cfg = (bias is not None, act, tf32)


def _linear_backward(ctx, dy, dsaved):
    x, weight, saved = ctx.saved_tensors
    has_bias, act, tf32 = ctx.cfg
    dx, dw, db = linear_bwd(dy, x, weight, saved, has_bias, act, tf32)
    return dx, dw, db if has_bias else None, None, None


linear_fwd.register_autograd(_linear_backward, setup_context=_linear_setup)


class _Linear(torch.autograd.Function):
    """The eager path (no torch.library dispatch cost); torch.compile traces the custom ops instead."""

    @staticmethod
    def forward(ctx, x, weight, bias, act, tf32):
        need = any(ctx.needs_input_grad[:3])
        y, saved = _linear_fwd(x, weight, bias, act, tf32, need)
        ctx.save_for_backward(x, weight, saved)
        ctx.cfg = (bias is not None, act, tf32)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, saved = ctx.saved_tensors
        has_bias, act, tf32 = ctx.cfg
        dx, dw, db = _linear_bwd(dy, x, weight, saved, has_bias, act, tf32)
        return dx, dw, db, None, None


def _readable(t):
    """t itself when the gemm op reads it in place, else a contiguous copy (autograd sees the copy, so
    the gradient comes back to the view F.linear was given)."""
    if t is None or gemm_reads_in_place(t.shape, t.stride()):
        return t
    return t.contiguous()


def linear(x, weight, bias, act, tf32):
    squeeze = x.dim() == 1
    x2 = _readable(_as_matrix(x))
    weight, bias = _readable(weight), _readable(bias)
    if torch.compiler.is_compiling():
        y = linear_fwd(x2, weight, bias, act, tf32)[0]
    elif not wants_grad(x2, weight, bias):  # no graph to record: the GEMM alone
        y = _linear_fwd(x2, weight, bias, act, tf32, False)[0]
    else:
        y = _Linear.apply(x2, weight, bias, act, tf32)
    return y.squeeze(0) if squeeze else y
