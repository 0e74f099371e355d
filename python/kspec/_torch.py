"""torch glue for norm_act, selective_scan and linear: each family's spec (kspec._surface.Family: the
forward and backward it runs, their arguments and outputs by name) and the code its forward and backward
need beyond one registry call. kspec._surface makes the custom ops, fakes, autograd and eager path."""
from __future__ import annotations

import sys

import torch

from . import _C, _native, ops
from ._core import call, call_some
from ._surface import _GRAD, _OUT, CeilDiv, Family, build
from .ops import ACTIVATION_ALIASES, gemm_reads_in_place

# ---- norm_act ----
# mean and rstd are outputs only where a backward will read them (save_stats): the no-grad path and a
# no-grad graph allocate y alone.

def _norm_act_fwd(x, weight, bias, norm, act, eps, save_stats, save):
    return call("norm_act.fwd", x, weight, bias, norm=norm, act=act, eps=eps, save_stats=bool(save_stats and save))


def _norm_act_bwd(dy, x, weight, bias, mean, rstd, norm, act, eps):
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    return call("norm_act.bwd", dy, x, weight, bias, mean, rstd, norm=norm, act=act, eps=eps)


norm_act = build(Family(
    name="norm_act", ops=("norm_act.fwd", "norm_act.bwd"),
    fwd="Tensor x, Tensor weight, Tensor? bias, str norm, str act, float eps, bool save_stats=True",
    fwd_out=("y", "mean", "rstd"),
    bwd="Tensor dy, Tensor x, Tensor weight, Tensor? bias, Tensor mean, Tensor rstd, str norm, str act, float eps",
    bwd_out=("dx", "dweight", "dbias"), forward=_norm_act_fwd, backward=_norm_act_bwd, save_arg="save_stats",
    save_required=True, one_call=True))


# ---- selective_scan ----
# For training the forward keeps the state entering every 16th step (`states`, [batch, dim,
# ceil(seqlen / 16), dstate] fp32), and the backward reads them instead of recomputing the forward.

_STATE_STRIDE = _C.op_info("selective_scan.fwd")["constants"]["state_stride"]


def _scan_fwd(u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus, save_states, save):
    """(out, last_state, states); states (allocated only when kept for a backward) else None. All three are
    allocated in C++ (torch.empty from Python costs ~6 us a tensor on the H100): without states by
    kspec.call itself, with them by the extension's call_some, given the states' shape (its nstates is
    no input's dim)."""
    if not save:
        return call("selective_scan.fwd", u, delta, A, B, C, D, z, delta_bias, h0, delta_softplus=delta_softplus)
    inputs = (u, delta, A, B, C, D, z, delta_bias, h0)
    if u.dim() != 3 or A.dim() != 2:  # no states' shape to make: kspec.call's validation names the input
        return call("selective_scan.fwd", *inputs, delta_softplus=delta_softplus)
    states = (u.shape[0], u.shape[1], -(-u.shape[2] // _STATE_STRIDE), A.shape[1])
    outs = call_some("selective_scan.fwd", inputs, (None, None, states), {"delta_softplus": delta_softplus})
    if outs is NotImplemented:  # the pure path (no extension), or an input the extension does not read
        outs = call("selective_scan.fwd", *inputs, delta_softplus=delta_softplus,
                    out=(torch.empty_like(u), u.new_empty((u.shape[0], u.shape[1], A.shape[1]), dtype=torch.float32),
                         u.new_empty(states, dtype=torch.float32)))
    return outs


def _scan_bwd(dout, u, delta, A, B, C, D, z, delta_bias, h0, dlast_state, states, delta_softplus):
    if states is not None and states.numel() == 0:
        states = None  # the forward kept none (the custom op's stand-in): the backward recomputes them
    if not dout.is_contiguous():
        dout = dout.contiguous()
    if dlast_state is not None and not dlast_state.is_contiguous():
        dlast_state = dlast_state.contiguous()
    return call("selective_scan.bwd", dout, u, delta, A, B, C, D, z, delta_bias, h0, dlast_state, states,
                delta_softplus=delta_softplus)


_SCAN_TENSORS = ("Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? delta_bias, "
                 "Tensor? h0")
selective_scan = build(Family(
    name="selective_scan", ops=("selective_scan.fwd", "selective_scan.bwd"),
    fwd=_SCAN_TENSORS + ", bool delta_softplus, bool save_states", fwd_out=("out", "last_state", "states"),
    bwd="Tensor dout, " + _SCAN_TENSORS + ", Tensor? dlast_state, Tensor? states, bool delta_softplus",
    bwd_out=("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "dh0"),
    forward=_scan_fwd, backward=_scan_bwd, public=(0, 1), save_arg="save_states",
    derived={"nstates": CeilDiv("seqlen", _STATE_STRIDE)}, one_call=True))


# ---- gemm / linear ----

_ACT = {"none": lambda t: t, "relu": torch.relu,
        "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


def _act(act):
    """The canonical name: the custom ops are called with an alias too (torch.ops.kspec.linear_fwd(...,
    "gelu", ...)), and the choice to keep GELU's input must see gelu_tanh (H100 run: the alias kept none)."""
    return ACTIVATION_ALIASES.get(act, act)


def _linear_fwd(x, weight, bias, act, tf32, save):
    """(y, pre): pre, GELU's input, only for gelu_tanh with a backward to run (relu's backward reads y: outputs
    of a custom op may not alias, so y is not returned twice)."""
    act = _act(act)
    if x.numel() == 0:  # no rows, or k = 0 (y = act(bias)): nothing for cuBLASLt, which needs k > 0
        pre = torch.zeros((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
        if bias is not None:
            pre = pre + bias
        y = _ACT[act](pre)
        return y, (pre if act == "gelu_tanh" and save else None)
    if act == "gelu_tanh" and save:
        if weight.shape[0] % 8 == 0:
            y, pre = call("gemm", x, weight, bias, act=act, tf32=tf32, out=(torch.empty(
                (*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device), torch.empty(
                (*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)))
            return y, pre
        # cuBLASLt saves the GELU input only with n a multiple of 8: the GEMM with its bias, then GELU.
        pre = call("gemm", x, weight, bias, act="none", tf32=tf32)[0]
        return torch.nn.functional.gelu(pre, approximate="tanh"), pre
    return call("gemm", x, weight, bias, act=act, tf32=tf32)[0], None


def _linear_bwd(dy, x, weight, saved, has_bias, act, tf32):
    act = _act(act)
    if act == "none":
        saved = None  # it reads none (the custom op passes an empty stand-in)
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


def _linear_fake(x, weight, bias, act, tf32):
    act = _act(act)
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    return y, (torch.empty_like(y) if act == "gelu_tanh" else None)


def _linear_bwd_fake(dy, x, weight, saved, has_bias, act, tf32):
    # contiguous, as _linear_bwd allocates them, whatever the strides of x and weight (a transposed view)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), (weight.new_empty(weight.shape[0]) if has_bias
                                                                  else None)


linear_surface = build(Family(
    name="linear", ops=("gemm", "gemm.bwd"),
    fwd="Tensor x, Tensor weight, Tensor? bias, str act, bool tf32", fwd_out=("y", "pre"),
    bwd="Tensor dy, Tensor x, Tensor weight, Tensor? saved, bool has_bias, str act, bool tf32",
    bwd_out=("dx", "dweight", "dbias"), forward=_linear_fwd, backward=_linear_bwd,
    extra={"saved": lambda e: e["y"] if _act(e["act"]) == "relu" else e["pre"], "has_bias": lambda e: e["bias"] is not None},
    fake=_linear_fake, bwd_fake=_linear_bwd_fake))


def _readable(t):
    """t itself when the gemm op reads it in place, else a contiguous copy (autograd sees the copy, so
    the gradient comes back to the view F.linear was given). A contiguous tensor (the common case) is
    read in place without gemm_reads_in_place's Python loop over its strides."""
    if t is None or t.is_contiguous() or gemm_reads_in_place(t.shape, t.stride()):
        return t
    return t.contiguous()


# call_grad's backward arguments (dy, x, weight, saved) per act without GELU's input: relu's backward reads y
_LINEAR_GRAD_ARGS = {"none": (_GRAD, 0, 1, -1), "relu": (_GRAD, 0, 1, _OUT)}


def linear(x, weight, bias, act, tf32):
    """The surface's linear, with its common cases taken straight (a host-bound step calls it per layer): no
    gradient wanted, one gemm call; a gradient wanted with act none or relu, one C++ call recording the
    C++ node (call_grad: the same gemm and gemm.bwd calls as the surface's forward and backward)."""
    one_row = x.dim() == 1  # nn.Linear takes (..., k); the gemm op takes (..., m, k): one row
    if one_row:
        x = x.unsqueeze(0)
    # a contiguous operand (the common case) read in place without a call
    if not x.is_contiguous():
        x = _readable(x)
    if not weight.is_contiguous():
        weight = _readable(weight)
    if bias is not None and not bias.is_contiguous():
        bias = _readable(bias)
    if torch.compiler.is_compiling() or not x.numel():
        y = linear_surface(x, weight, bias, act, tf32)
    elif not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                           or (bias is not None and bias.requires_grad))):
        y = call("gemm", x, weight, bias, act=act, tf32=tf32)[0]
    else:
        codes = _LINEAR_GRAD_ARGS.get(act) if _native.ext is not None else None
        y = NotImplemented
        if codes is not None:
            y = _native.ext.call_grad(linear_surface.node_name, "gemm", "gemm.bwd", [x, weight, bias],
                                      {"act": act, "tf32": tf32}, ("act", "tf32"), codes, (0, 1, 2))
        y = linear_surface(x, weight, bias, act, tf32) if y is NotImplemented else y[0]
    return y.squeeze(0) if one_row else y


ops._torch = sys.modules[__name__]  # the torch entries of kspec.ops read it per call (no import statement)
