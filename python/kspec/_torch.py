"""torch glue: kspec ops as torch.library custom ops with registered fake (meta) kernels and autograd,
so loss.backward() and torch.compile work through them."""
from __future__ import annotations

from typing import Optional

import torch

from ._core import call


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
    return _NormAct.apply(x, weight, bias, norm, act, eps)
