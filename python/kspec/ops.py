"""kspec.ops: the functional API, one function per op family. With torch tensors these go through
torch.library custom ops (autograd and torch.compile work); with other frameworks they call the
registry directly (forward only)."""
from __future__ import annotations

from ._core import call

_NORMS = ("layernorm", "rmsnorm")
_ACTS = ("identity", "silu", "gelu_tanh", "gelu_erf")


def _is_torch(x) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def norm_act(x, weight, bias=None, *, norm: str = "layernorm", act: str = "identity", eps: float = 1e-5):
    """Fused normalization + affine + activation over the last dim.

    y = act(norm(x) * weight + bias), norm in {layernorm, rmsnorm}, act in {identity, silu, gelu_tanh,
    gelu_erf}; statistics and arithmetic in fp32.

    x: (..., hidden) fp32/fp16/bf16, last dim contiguous; weight: (hidden) like x or fp32;
    bias: (hidden) like weight, or None. Returns y: (..., hidden) like x. Differentiable for torch
    tensors (dx, dweight, dbias from kspec's backward kernel)."""
    if _is_torch(x):
        from . import _torch

        return _torch.norm_act(x, weight, bias, norm, act, float(eps))
    return call("norm_act.fwd", x, weight, bias, norm=norm, act=act, eps=float(eps))[0]


def norm_act_fwd(x, weight, bias=None, *, norm: str = "layernorm", act: str = "identity", eps: float = 1e-5):
    """The raw forward op. Returns (y: (..., hidden), mean: (...) fp32, rstd: (...) fp32)."""
    return call("norm_act.fwd", x, weight, bias, norm=norm, act=act, eps=float(eps))


def norm_act_bwd(dy, x, weight, bias, mean, rstd, *, norm: str = "layernorm", act: str = "identity",
                 eps: float = 1e-5):
    """The raw backward op. dy, x: (..., hidden); mean, rstd from norm_act_fwd.
    Returns (dx: (..., hidden), dweight: (hidden), dbias: (hidden) or None)."""
    return call("norm_act.bwd", dy, x, weight, bias, mean, rstd, norm=norm, act=act, eps=float(eps))
